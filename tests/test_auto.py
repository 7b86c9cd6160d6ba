"""method="auto": the controller's cost model and choices, and exactness when K changes
between rounds (greedy equality with AR on real prompts, and the distribution test with a
control that must fail)."""
from __future__ import annotations

import itertools

import pytest

from conftest import NEW_TOKENS
from saguaro import LLM, SamplingParams
from saguaro.bench import plan
from saguaro.config import SpeculativeConfig
from saguaro.engine import decoders
from saguaro.models import hub
from saguaro.speculation.auto import AutoDecoder, Controller, RowCosts
from saguaro.speculation.build import sd_drafter
from stats import ks_pvalue, teacher_forced_pit
from test_exactness import (ALPHA, TINY_K, draft, residual_is_p, sampled, target, tiny_outputs,  # noqa: F401
                             tiny_prompts)


def test_row_costs_interpolate_between_measured_row_counts():
    costs = RowCosts()
    assert costs(4) is None
    costs.add(2, 0.010)
    costs.add(10, 0.030)
    assert costs(1) == 0.010  # never cheaper than the smallest measured pass
    assert costs(6) == pytest.approx(0.020)
    assert costs(20) == pytest.approx(0.060)  # proportional past the largest


def measured(controller: Controller, batch: int, target_s, step_s: float, acceptance: float) -> None:
    """Feeds the controller rounds as they would run: AR and every K at this batch size."""
    for k in range(controller.max_k + 1):
        accepted = int(acceptance * k)
        controller.record(batch, k, target_s(batch * (k + 1)), k * step_s, [accepted] * batch, batch * (accepted + 1))


def test_controller_speculates_where_it_pays_and_not_where_it_does_not():
    flat = lambda rows: 0.030 + 0.0002 * rows  # noqa: E731  a pass barely grows with rows: memory-bound
    steep = lambda rows: 0.004 * rows  # noqa: E731  compute-bound: every row costs
    cheap_draft = Controller(max_k=5)
    measured(cheap_draft, 1, flat, 0.003, 0.8)
    assert cheap_draft.choose(1) >= 3
    no_pay = Controller(max_k=5)
    measured(no_pay, 12, steep, 0.010, 0.5)
    assert no_pay.choose(12) == 0
    assert no_pay.summary()["auto_rounds_by_k"] == {0: 1}


def test_controller_keeps_its_choice_within_the_hysteresis():
    controller = Controller(max_k=2)
    measured(controller, 1, lambda rows: 0.030, 0.003, 0.8)
    first = controller.choose(1)
    for _ in range(5):
        assert controller.choose(1) == first
    assert controller.switches == 0


def test_controller_measures_ar_and_speculation_before_choosing():
    controller = Controller(max_k=4)
    assert controller.choose(3) == 0  # nothing measured: AR
    controller.record(3, 0, 0.03, 0.0, [], 3)
    assert controller.choose(3) == 4  # then the most speculation, for the draft's cost
    assert controller.switches == 1


def auto_outputs(target, draft, params, schedule) -> list[list[int]]:
    """Decoded by AutoDecoder with K forced to follow `schedule` round after round."""
    decoder = AutoDecoder(target, sd_drafter(draft, SpeculativeConfig(num_speculative_tokens=TINY_K, prompt_lookup=0)))
    ks = itertools.cycle(schedule)
    decoder.controller.choose = lambda batch: next(ks)
    return tiny_outputs(decoder, params)


def auto_pvalue(target, draft, params) -> float:
    outputs = auto_outputs(target, draft, params, [TINY_K, 0, 1])
    return ks_pvalue(teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params))


def test_switching_k_between_rounds_is_exact(target, draft):
    assert auto_pvalue(target, draft, sampled(1.0)) > ALPHA


def test_switching_check_catches_a_broken_acceptance_rule(target, draft, monkeypatch):
    monkeypatch.setattr(decoders, "verify", residual_is_p)
    assert auto_pvalue(target, draft, sampled(1.0)) < ALPHA


@pytest.fixture(scope="module")
def auto() -> LLM:
    return LLM(hub.DEFAULT_MODEL, method="auto", dtype="float32")


def test_auto_greedy_equals_ar_on_real_prompts(auto, prompts, ar_greedy):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = []
    for i in range(0, 8, 4):
        outputs += auto.generate(prompts[i:i + 4], params, use_tqdm=False)
    outputs += [auto.generate(prompts[8], params, use_tqdm=False)[0]]
    assert [out.token_ids for out in outputs] == ar_greedy[:9]
    rounds = auto.metrics()["auto_rounds_by_k"]
    assert rounds.get(0) and sum(n for k, n in rounds.items() if k) > 0  # it ran AR and speculated


def test_plan_forecasts_each_batch_size_from_the_others_then_measures_it(auto, prompts):
    rows = plan.plan(auto, prompts[:2], [1, 2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    k_max = auto.decoder.controller.max_k
    assert [(r.batch, r.k) for r in rows] == [(b, k) for b in (1, 2) for k in range(k_max + 1)]
    assert all(r.measured_tok_s > 0 for r in rows)
    assert [sum(r.chosen for r in rows if r.batch == b) for b in (1, 2)] == [1, 1]
    assert all(r.predicted_tok_s is not None for r in rows if r.batch == 2)  # forecast from batch 1
    assert "| 2 | 0 |" in plan.markdown(rows)
