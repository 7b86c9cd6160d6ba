"""method="auto": the controller's cost model and choices, and exactness when K and the method
(AR, SD, SSD) change between rounds (greedy equality with AR on real prompts, and the
distribution test with a control that must fail)."""
from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import time
import types
from concurrent.futures import Future

import pytest
import torch

from conftest import NEW_TOKENS
from drafts import InProcessDraft, drafter_of, worker_config
from saguaro import LLM, SamplingParams
from saguaro.bench import plan
from saguaro.config import SpeculativeConfig
import saguaro.engine.verifier as verification
from saguaro.engine.decoder import Decoder
from saguaro.engine.round import CacheHits, RowRecord
from saguaro.engine.sequence import Sequence
from saguaro.models import hub
from saguaro.models.checkpoint import save_checkpoint
from saguaro.speculation.policy import auto as auto_module
from saguaro.speculation.policy import estimates as estimates_module
from saguaro.speculation import build
from saguaro.speculation.local.drafters import sd_drafter
from saguaro.speculation.policy.auto import REFRESH_ROUNDS, SSD, SSD_MIN_ROUNDS, Controller, SSDLauncher
from saguaro.speculation.policy.estimates import Estimates, batch_bucket
from saguaro.speculation.policy.planning import RowCosts
from saguaro.speculation.remote.pool import DraftPool
from saguaro.speculation.remote.proposer import RemoteProposer
from saguaro.system import CorePlacement, CoreShare, usable_cores, use_cores
from stats import ks_pvalue, teacher_forced_pit
from test_exactness import (ALPHA, TINY_K, TINY_V, draft, residual_is_p, sampled, target, tiny_outputs,  # noqa: F401
                             tiny_prompts)


def test_row_costs_interpolate_between_measured_row_counts():
    costs = RowCosts()
    assert costs(4) is None
    costs.add(2, 0.100)
    assert costs(2) is None  # a warm-up: the first pass at a row count is not counted
    costs.add(2, 0.010)
    costs.add(10, 0.300)
    costs.add(10, 0.030)
    assert costs(1) == 0.010  # never cheaper than the smallest measured pass
    assert costs(6) == pytest.approx(0.020)
    assert costs(20) == pytest.approx(0.060)  # proportional past the largest


def measured(controller: Controller, batch: int, target_s, step_s: float, acceptance: float) -> None:
    """Feeds the controller rounds as they would run: AR and every K at this batch size, twice
    (the first round of each is a warm-up)."""
    for k in [k for k in range(controller.max_k + 1) for _ in range(2)]:
        accepted = int(acceptance * k)
        controller.estimates.record(batch, k, target_s(batch * (k + 1)), k * step_s, [accepted] * batch, batch * (accepted + 1))


def test_controller_speculates_where_it_pays_and_not_where_it_does_not():
    flat = lambda rows: 0.030 + 0.0002 * rows  # noqa: E731  a pass barely grows with rows: memory-bound
    steep = lambda rows: 0.004 * rows  # noqa: E731  compute-bound: every row costs
    cheap_draft = Controller(max_k=5)
    measured(cheap_draft, 1, flat, 0.003, 0.8)
    assert cheap_draft.choose(1) >= 3
    no_pay = Controller(max_k=5)
    measured(no_pay, 12, steep, 0.010, 0.5)
    assert no_pay.choose(12) == 0
    assert no_pay.summary()["auto_rounds_by_k"] == {"0": 1}


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
    controller.estimates.record(3, 0, 0.3, 0.0, [], 3)
    assert controller.choose(3) == 0  # a first round is a warm-up: AR again
    controller.estimates.record(3, 0, 0.03, 0.0, [], 3)
    assert controller.choose(3) == 4  # then the most speculation, for the draft's cost
    assert controller.switches == 1
    controller.estimates.record(3, 4, 0.5, 0.2, [4, 4, 4], 15)
    assert controller.choose(3) == 4  # its cost is measured from its second round on
    controller.estimates.record(3, 4, 0.05, 0.02, [0, 0, 0], 3)
    assert controller.estimates.draft_step(3) == pytest.approx(0.005) and controller.estimates.target(15) == pytest.approx(0.05)


def test_a_measured_rate_takes_over_from_a_biased_prediction(monkeypatch):
    """`saguaro plan` (about 25 rounds a choice at batch 1) marked chosen a choice measured a
    quarter slower than the best: here K = 1, measured at 123 tok/s and predicted at half that,
    against K = 2, measured at 95 and predicted at twice that. The prediction counted as 4
    rounds against the decayed sum of the 25 (14), and kept K = 2 ahead."""
    controller = Controller(2, Estimates(2, target=RowCosts.of({1: 0.02, 3: 0.025}), draft_step=RowCosts.of({1: 0.002})))
    measured_tok_s, predicted_tok_s = {0: 50.0, 1: 123.0, 2: 95.0}, {0: 50.0, 1: 61.5, 2: 190.0}
    monkeypatch.setattr(controller, "predicted_rate", lambda batch, choice: predicted_tok_s[choice])
    for choice, rate in measured_tok_s.items():
        for _ in range(26):  # the first is a warm-up
            controller.estimates._measure(1, choice, 3, 3 / rate)
    assert controller.choose(1) == 1


def test_nearby_batch_sizes_share_measured_rates():
    assert [batch_bucket(b) for b in (1, 4, 5, 7, 8, 27, 32, 38)] == [1, 4, 6, 8, 8, 32, 32, 32]
    controller = Controller(max_k=3)
    measured(controller, 30, lambda rows: 0.004 * rows, 0.010, 0.5)
    assert all(controller.rate(28, k) != controller.predicted_rate(28, k) for k in range(4))  # measured at 30
    assert controller.choose(28) == 0  # no exploring anew: AR measured fastest


def test_a_choice_that_stays_behind_is_refreshed_ever_more_rarely():
    """K = 1 runs at about 0.6x AR: close enough to be measured again when stale, and each
    refresh finds it behind, so the next comes after twice as many rounds."""
    flat = lambda rows: 0.010 + 0.001 * rows  # noqa: E731
    controller = Controller(max_k=1)
    measured(controller, 4, flat, 0.004, 0.0)
    refreshes = []
    for i in range(8 * REFRESH_ROUNDS):
        choice = controller.choose(4)
        if choice:
            refreshes.append(i)
        controller.estimates.record(4, choice, flat(4 * (choice + 1)), choice * 0.004, [0] * 4, 4)
    gaps = [b - a for a, b in zip(refreshes, refreshes[1:])]
    assert len(refreshes) == 3 and gaps[1] > 1.8 * gaps[0]


def test_greedy_and_sampling_rounds_keep_their_own_acceptance_and_rates():
    """Greedy requests accept most drafts, sampled ones few: one table for both would speculate
    on the sampled ones for what the greedy ones measured (and the other way round)."""
    flat = lambda rows: 0.010 + 0.0005 * rows  # noqa: E731
    controller = Controller(max_k=4)
    measured(controller, 1, flat, 0.001, 1.0)  # greedy: every draft accepted
    controller.estimates.sampling = True
    measured(controller, 1, flat, 0.001, 0.0)  # sampling: none
    assert controller.estimates.expected_tokens(4) < 1.5 and controller.choose(1) == 0
    controller.estimates.sampling = False
    assert controller.estimates.expected_tokens(4) > 4.5 and controller.choose(1) == 4


def test_the_acceptance_follows_recent_rounds():
    """After 300 rounds accepting every draft, 200 accepting none: the acceptance is about the
    recent rounds' (all counts pooled, it would still read 0.6)."""
    controller = Controller(max_k=1)
    for accepted in [1] * 300 + [0] * 200:
        controller.estimates.record(1, 1, 0.01, 0.001, [accepted], accepted + 1)
    assert controller.estimates.acceptance()[0] < 0.2


def test_a_restored_profile_spares_a_new_process_its_first_measurements():
    """A controller that starts from another's profile predicts the same rates at once and
    chooses the best without first running AR and K_max; its acceptance counts as at most
    PROFILE_WEIGHT drafts a position. Control: a fresh controller runs AR first."""
    flat = lambda rows: 0.010 + 0.0005 * rows  # noqa: E731
    measured_one = Controller(max_k=4)
    for _ in range(50):
        measured(measured_one, 1, flat, 0.001, 1.0)
    restored = Controller(max_k=4)
    restored.estimates.start_from(json.loads(json.dumps(measured_one.estimates.profile())))
    assert [restored.predicted_rate(1, k) for k in range(5)] == \
        pytest.approx([measured_one.predicted_rate(1, k) for k in range(5)], rel=0.02)
    assert max(restored.estimates.tried) <= estimates_module.PROFILE_WEIGHT < max(measured_one.estimates.tried)
    assert restored.choose(1) == 4
    assert Controller(max_k=4).choose(1) == 0  # control


def test_restored_costs_stand_until_a_pass_here_contradicts_them():
    """A profile's cost stands until this process measures its row count: a pass within
    RESTORED_WITHIN of it replaces it alone, one further off drops every restored cost. Control:
    costs measured in this process move by EMA a pass."""
    costs = RowCosts()
    costs.restore([1, 2, 4], [0.010, 0.030, 0.014])
    assert not costs.add(1, 0.005)  # a warm-up, as in any process
    assert costs(1) == 0.010
    assert not costs.add(1, 0.009)  # within RESTORED_WITHIN: replaces that row count's cost
    assert (costs(1), costs(2), costs(4)) == pytest.approx((0.009, 0.030, 0.014))
    costs.add(4, 0.007)
    assert costs.add(4, 0.007)  # half the restored cost: the restored costs go
    assert costs.rows == [1, 4] and costs(2) == pytest.approx(0.009 - 0.002 / 3)  # measured ones interpolate
    assert not costs.add(4, 0.0035)
    assert costs(4) == pytest.approx(0.007 + 0.2 * (0.0035 - 0.007))  # measured here: EMA from now on
    fresh = RowCosts()
    for seconds in (0.010, 0.010, 0.005):
        fresh.add(1, seconds)
    assert fresh(1) == pytest.approx(0.009)  # control


def test_a_round_that_waited_counts_for_its_rate_not_for_its_passes_costs():
    """A round whose thread waited (RoundRecord.waited) adds to its choice's measured rate, but
    leaves the costs its passes were measured at; where none is known yet it sets them (a
    machine whose every round waits still gets costs). Control: the same rounds unwaited move
    the costs."""
    waited, control = Controller(max_k=1), Controller(max_k=1)
    for controller, flag in ((waited, True), (control, False)):
        for _ in range(2):  # a warm-up, then a measurement
            controller.estimates.record(1, 1, 0.004, 0.001, [1], 2)
        for _ in range(3):
            controller.estimates.record(1, 1, 0.012, 0.004, [1], 2, waited=flag)
    assert waited.estimates.target(2) == pytest.approx(0.004) and waited.estimates.draft_step(1) == pytest.approx(0.001)
    assert waited.estimates.was_measured(1, 1) and waited.estimates.measured[(1, False, 1)][2] > 3
    assert control.estimates.target(2) > 0.006 and control.estimates.draft_step(1) > 0.002
    fresh = Controller(max_k=1)
    for _ in range(3):
        fresh.estimates.record(1, 1, 0.012, 0.004, [1], 2, waited=True)
    assert fresh.estimates.target(2) == pytest.approx(0.012) and fresh.estimates.draft_step(1) == pytest.approx(0.004)


def test_a_round_whose_thread_did_not_run_throughout_is_marked_waited(target, monkeypatch):
    """A round is marked waited when its thread ran for less than 1 / WAITED of it on a CPU
    target (a spinning Python thread beside the engine, as a busy server's HTTP thread, made
    rounds take 12 ms of wall time where their thread ran 3). The thread's clock stands still
    here (all waiting); control: it runs with the wall clock (no waiting)."""
    import saguaro.engine.decoder as decoder_module

    def marks(thread_time) -> list[bool]:
        monkeypatch.setattr(decoder_module, "time", types.SimpleNamespace(perf_counter=time.perf_counter,
                                                                        thread_time=thread_time))
        decoder = build.ar_decoder(target)
        seqs = [Sequence(0, [3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), [])]
        decoder.reserve(1, 4 + 6 + decoder.lookahead)
        decoder.prefill(seqs)
        return [decoder.step(seqs).waited for _ in range(4)]

    assert marks(lambda: 0.0) == [True] * 4
    assert marks(time.perf_counter) == [False] * 4  # control


def inflated_profile(true_cost, slowdown: dict[int, float], acceptance: float) -> dict:
    """The profile a busy server leaves: pass costs measured slow (some row counts more than
    others), the drafts' acceptance as it was."""
    source = Controller(max_k=3)
    for _ in range(20):
        measured(source, 1, lambda rows: true_cost(rows) * slowdown.get(rows, 1.0), 0.0005, acceptance)
    return json.loads(json.dumps(source.estimates.profile()))


@pytest.mark.parametrize("sd_pays", [True, False])
def test_a_process_started_from_slow_costs_finds_sd_again(sd_pays):
    """Started from a server's profile whose passes were measured 1.6-2.5x slow, a batch-1 stream
    of rounds runs AR at the true costs: the first AR passes rescale the restored ones, SD is
    tried and wins where it pays (the true costs barely grow with rows and half the drafts are
    accepted). Control: where it does not (every row costs as much as a step), AR stays."""
    true_cost = (lambda rows: 0.004 + 0.0001 * rows) if sd_pays else (lambda rows: 0.004 * rows)  # noqa: E731
    controller = Controller(max_k=3)
    controller.estimates.start_from(inflated_profile(true_cost, {1: 1.6, 2: 2.5, 3: 2.5, 4: 2.5}, 0.5))
    choices = []
    for _ in range(200):
        k = controller.choose(1)
        choices.append(k)
        accepted = [min(k, 1)] if k else []  # about half of a K's drafts accepted
        controller.estimates.record(1, k, true_cost(k + 1), 0.0005 * k, accepted, 1 + (accepted[0] if accepted else 0))
    late = choices[100:]
    assert (sum(k > 0 for k in late) > 90) == sd_pays, late


def test_auto_leaves_its_profile_for_the_next_decoder(target, draft, tmp_path):
    path = tmp_path / "profile.json"
    drafter = lambda: sd_drafter(draft, SpeculativeConfig(num_speculative_tokens=TINY_K, prompt_lookup=0))  # noqa: E731
    first = build.auto_decoder(target, drafter(), profile=path)
    tiny_outputs(first, sampled(0.0, rows=2))
    costs = first.policy.controller.estimates.target.rows
    del first
    gc.collect()  # the profile is written when the decoder goes (and every PROFILE_ROUNDS rounds)
    second = build.auto_decoder(target, drafter(), profile=path)
    assert costs and second.policy.controller.estimates.target.rows == costs
    path.write_text("{not json")
    assert estimates_module.read_profile(path) is None and not build.auto_decoder(target, drafter(), profile=path).policy.controller.estimates.target.rows


def test_a_draft_catching_up_on_ar_rounds_does_not_set_the_draft_steps_cost(target, draft):
    """After AR rounds the draft first runs the tokens it missed: that round's draft time is
    not what a step costs. The other SD rounds' are (a request's first, after its prompt ran
    through the draft, included)."""
    decoder = auto_decoder(target, draft, [1, 0, 0, 0] + [1] * 30)
    flags = []
    controller = decoder.policy.controller
    record = controller.estimates.record
    controller.estimates.record = lambda *args: (flags.append((args[1], args[7])), record(*args))
    tiny_outputs(decoder, sampled(0.0, rows=2))
    sd_rounds = [steady for k, steady in flags if k]
    assert len(sd_rounds) >= 3 and sd_rounds[0] and sd_rounds[1] == 0 and all(sd_rounds[2:])
    assert all(steady for k, steady in flags if not k)


def test_a_round_where_lookup_proposed_for_some_sequences_sets_the_step_cost_of_the_others():
    """Prompt lookup proposed for one of two sequences, the model drafted for the other: the
    round's draft time is one sequence's K steps. Control: a round where lookup proposed for
    both (no model step) sets nothing."""
    controller = Controller(max_k=3)
    for _ in range(2):  # the first round at a row count is a warm-up
        controller.estimates.record(2, 3, 0.01, 0.003, [0], 5, steady_rows=1, lookup_lens=[3])
    assert controller.estimates.draft_step.rows == [1] and controller.estimates.draft_step(1) == pytest.approx(0.001)
    control = Controller(max_k=3)
    for _ in range(2):
        control.estimates.record(2, 3, 0.01, 0.0, [], 8, steady_rows=0, lookup_lens=[3, 3])
    assert control.estimates.draft_step(1) is None


def test_prompt_lookups_proposals_are_counted_apart_from_the_draft_models():
    """Half the sequences' tokens came from prompt lookup and were all accepted, the draft
    model's none: the model's acceptance stays low, E_K is the mixture, and a round where lookup
    proposed for everyone would cost no draft step."""
    controller = Controller(max_k=3)
    for _ in range(100):
        controller.estimates.record(2, 3, 0.01, 0.003, [0], 5, lookup_lens=[3])
    assert controller.estimates.acceptance()[0] < 0.05 and min(controller.estimates.acceptance(lookup=True)) > 0.95
    assert controller.estimates.looked_up() == pytest.approx(0.5)
    assert controller.estimates.expected_tokens(3) == pytest.approx(1 + 0.5 * 3, abs=0.1)
    controller.estimates.lookup_share[False] = [1.0, 1.0]
    controller.estimates._expected.clear()
    assert controller.predicted_rate(1, 3) == pytest.approx(controller.estimates.expected_tokens(3) / controller.estimates.target(4))


def test_a_stale_measurement_is_taken_again():
    """AR measured in a bad moment (three times its real cost): SD wins meanwhile, but once AR's
    rate is REFRESH_ROUNDS rounds old AR is measured again and takes over. Control: a choice far
    below the best is not retried however old its rate."""
    flat = lambda rows: 0.010 + 0.001 * rows  # noqa: E731  AR 286 tok/s, K = 1 (nothing accepted) 182
    controller = Controller(max_k=1)
    measured(controller, 4, flat, 0.004, 0.0)
    for _ in range(3):
        controller.estimates.record(4, 0, 3 * flat(4), 0.0, [], 4)  # AR's rounds while the machine was busy
    choices = []
    for _ in range(4 * REFRESH_ROUNDS):
        choice = controller.choose(4)
        choices.append(choice)
        controller.estimates.record(4, choice, flat(4 * (choice + 1)), choice * 0.004, [0] * 4, 4)
    assert choices[:REFRESH_ROUNDS] == [1] * REFRESH_ROUNDS  # AR's rate is not yet stale
    assert choices[REFRESH_ROUNDS + 1] == 0  # measured again, AR takes over ...
    assert choices[REFRESH_ROUNDS + 1:].count(1) <= 3  # ... but for SD's own refresh rounds
    far_behind = Controller(max_k=1)
    measured(far_behind, 4, lambda rows: 0.004 * rows, 0.020, 0.0)  # SD: nothing accepted, a costly draft
    for _ in range(3 * REFRESH_ROUNDS):
        assert far_behind.choose(4) == 0
        far_behind.estimates.record(4, 0, 0.016, 0.0, [], 4)


def test_no_try_while_the_batch_holds_requests_the_draft_has_not_seen():
    """AR is best and K = 1 untried but rated close: a batch whose prompts the draft has not run
    would pay their prefill for the try, so it is not made then; with every prompt drafted, it
    is (control)."""
    flat = lambda rows: 0.010 + 0.001 * rows  # noqa: E731
    controller = Controller(max_k=1)
    for _ in range(2):  # half the drafts accepted: K = 1 predicted at ~0.9 of AR
        controller.estimates.record(4, 0, flat(4), 0.0, [], 4)
        controller.estimates.record(4, 1, flat(8), 0.0053, [0, 1, 0, 1], 6)
    controller.estimates.measured = {key: value for key, value in controller.estimates.measured.items() if key[2] == 0}
    assert not controller.estimates.was_measured(4, 1)
    assert controller.rate(4, 1) >= auto_module.EXPLORE_WITHIN * controller.rate(4, 0)
    assert controller.choose(4, can_try=False) == 0
    assert controller.choose(4) == 1


def test_a_try_may_take_up_a_lone_request_new_to_the_draft():
    """auto lets a round try a choice on a lone request new to the draft (a server's always is
    while AR runs: with none allowed, auto never measured SD there again), not in a batch of
    several holding one."""
    class Draft:
        drafter = dataclasses.make_dataclass("Drafter", [("k", int)])(2)

        def knows(self, seq) -> bool:
            return seq.seq_id == 0

    policy = auto_module.AutoPolicy(Draft())
    asked = []
    policy.controller.choose = lambda batch, can_try=True: asked.append(can_try) or 0
    seqs = [Sequence(i, [1, 2, 3], SamplingParams(temperature=0, max_tokens=4), []) for i in range(3)]
    for batch in (seqs[:1], seqs[1:2], seqs[:2], seqs):  # known; new; one new of two; two new of three
        policy.choose(batch)
    assert asked == [True, True, False, False]


def tried_at_batch_16() -> set:
    """The choices a controller that measured everything at batch 4 (every draft token
    accepted, every row costing the same) tries over 100 rounds at batch 16, where AR is best
    but K = 5 is predicted within EXPLORE_WITHIN of it: its round runs 96 rows to AR's 16."""
    steep = lambda rows: 0.001 * rows  # noqa: E731
    controller = Controller(max_k=5)
    measured(controller, 4, steep, 0.0005, 1.0)
    assert controller.rate(16, 5) >= auto_module.EXPLORE_WITHIN * controller.rate(16, 0)
    tried = set()
    for _ in range(100):
        choice = controller.choose(16)
        tried.add(choice)
        controller.estimates.record(16, choice, steep(16 * (choice + 1)), choice * 0.0005, [choice] * 16, 16 * (choice + 1))
    return tried


def test_a_choice_whose_round_costs_several_of_the_best_is_not_tried(monkeypatch):
    assert 5 not in tried_at_batch_16()
    monkeypatch.setattr(auto_module, "TRY_COST", 100.0)
    assert 5 in tried_at_batch_16()  # control: without the bound it is


def test_the_drafters_first_run_of_a_prompt_is_charged_to_sds_rate_and_not_to_its_step():
    charged, free = Controller(max_k=2), Controller(max_k=2)
    for controller, prefill_s in ((charged, 0.5), (free, 0.0)):
        for prefill in [0.0, prefill_s] + [0.0] * 8:  # a warm-up round, then the new request's first
            controller.estimates.record(1, 2, 0.02, 0.004, [2], 3, prefill)
    assert charged.estimates.draft_step(1) == free.estimates.draft_step(1) == pytest.approx(0.002)
    assert charged.rate(1, 2) < 0.8 * free.rate(1, 2)


def ssd_rounds(controller: Controller, batch: int, verify_s: float, hit_rate: float, tokens_on_hit: int) -> None:
    """Ten SSD rounds, their hits counted as the SSD proposer counts them."""
    cache = CacheHits()
    controller.take_ssd(controller.ssd_cores_ratio, controller.ssd_branches)
    controller.estimates.read_hits(cache)
    for i in range(10):
        rows = [RowRecord(tokens_on_hit - 1 if hit else 0, tokens_on_hit if hit else 1, hit)
                for hit in ((i * batch + j) % 10 < 10 * hit_rate for j in range(batch))]
        for row in rows:
            cache.add(row)
        controller.estimates.record_ssd(batch, verify_s, 0.0, sum(row.committed for row in rows))


def test_controller_takes_ssd_where_its_measured_rate_beats_sd_on_all_cores():
    flat = lambda rows: 0.020 + 0.0002 * rows  # noqa: E731
    controller = Controller(max_k=4, ssd_cores_ratio=2.0)
    measured(controller, 1, flat, 0.004, 0.8)
    assert controller.predicted_rate(1, SSD) is not None
    ssd_rounds(controller, 1, verify_s=0.022, hit_rate=0.9, tokens_on_hit=4)  # draft hidden, pass 1.1x slower
    assert controller.estimates.ssd_slowdown == pytest.approx(0.022 / flat(5), rel=0.01)
    assert controller.choose(1) == SSD
    for _ in range(SSD_MIN_ROUNDS - 1):
        assert controller.choose(1) == SSD  # a stint is not cut short
    slow = Controller(max_k=4, ssd_cores_ratio=2.0)
    measured(slow, 1, flat, 0.004, 0.8)
    ssd_rounds(slow, 1, verify_s=0.045, hit_rate=0.5, tokens_on_hit=4)  # one core: twice as slow
    assert slow.choose(1) != SSD


def test_controller_expects_no_gain_from_ssd_when_its_fill_outlasts_the_verification():
    controller = Controller(max_k=4, ssd_cores_ratio=2.0)
    for _ in range(2):  # a warm-up round, then a measured one
        controller.estimates.record(16, 0, 0.050, 0.0, [], 16)
        controller.estimates.record(16, 4, 0.200, 4 * 0.010, [2] * 16, 48)  # a draft step over 16 rows: 10 ms
        controller.estimates.draft_step.add(16 * 16, 0.120)  # ... over 16 branches of 16 requests: 120 ms
    few, many = (dataclasses.replace(controller, ssd_branches=f) for f in (1, 16))
    assert many.predicted_rate(16, SSD) < few.predicted_rate(16, SSD) / 2
    assert many.choose(16) != SSD


GEOMETRIC_08 = [0, 0, 1, 1, 2, 3, 4, 4, 4, 4]  # accepted lengths, P(>= i) = 0.8^i for i = 1..4


def rounds_at_batch_1(controller: Controller, target_s, step_s: float, accepted_lens: list[int]) -> None:
    """One batch-1 round per accepted length, for AR and every K."""
    for k in range(controller.max_k + 1):
        for n in accepted_lens:
            controller.estimates.record(1, k, target_s(k + 1), k * step_s, [min(n, k)] if k else [], min(n, k) + 1)


def test_a_worker_on_the_targets_cores_starts_only_once_ssd_is_predicted_to_pay():
    flat = lambda rows: 0.030 + 0.0002 * rows  # noqa: E731
    pays = Controller(max_k=4)  # a draft step at 1/4 of a pass, one branch per request
    assert not pays.ssd_would_pay(1, cores_ratio=1.1)  # nothing measured yet
    rounds_at_batch_1(pays, flat, 0.008, GEOMETRIC_08[:4])
    assert sum(pays.estimates.tried) < 32 and not pays.ssd_would_pay(1, cores_ratio=1.1)  # the acceptance is unknown
    rounds_at_batch_1(pays, flat, 0.008, GEOMETRIC_08)
    assert pays.ssd_would_pay(1, cores_ratio=1.1)  # hides the draft at a 5% slower pass
    assert not pays.ssd_would_pay(1, cores_ratio=4.0)  # the worker would take 3/4 of the target's cores
    assert not pays.ssd_would_pay(1, cores_ratio=2.0)  # half the cores: the pass taken as twice as slow ...
    best = max(pays.rate(1, k) for k in range(5))
    assert pays._predicted_ssd(1, flat(5), pays.estimates.draft_step(1), 2 ** 0.5) > 1.05 * best  # ... not sqrt(2)
    cheap = Controller(max_k=4)  # draft steps at 1/20 of a pass: SD on both cores wins
    rounds_at_batch_1(cheap, flat, 0.0015, GEOMETRIC_08 * 2)
    assert not cheap.ssd_would_pay(1, cores_ratio=2.0)


def test_controller_offers_ssd_only_with_a_worker():
    controller = Controller(max_k=2)
    assert SSD not in controller.choices()
    controller.offer_ssd(2.0)
    assert controller.choices()[-1] == SSD


def test_core_share_gives_the_worker_its_core():
    share = CoreShare.of("1") if len(CoreShare.of(None).all[0]) > 1 else None
    if share is None:
        pytest.skip("one usable core")
    assert 1 not in share.ssd[0] and share.ssd[1] >= 1 and share.ratio >= 1


def ready(result) -> Future:
    future = Future()
    future.set_result(result)
    return future


def auto_decoder(target, draft, schedule, ssd: RemoteProposer | None = None, k: int = TINY_K,
                 placement: CorePlacement | None = None) -> Decoder:
    """auto whose choices follow `schedule` round after round (SSD from `ssd`, the target's cores
    shared out by `placement`, by default none taken from it)."""
    launcher = None
    if ssd is not None:
        launcher = SSDLauncher(lambda: ready(ssd), placement or CorePlacement(CoreShare.of(None)), sum(ssd.fan_out))
    decoder = build.auto_decoder(target, sd_drafter(draft, SpeculativeConfig(num_speculative_tokens=k, prompt_lookup=0)),
                                 launcher)
    choices = itertools.cycle(schedule)
    controller = decoder.policy.controller
    controller.choose = lambda batch, can_try=True: controller.pick(next(choices))
    return decoder


@pytest.fixture(scope="module")
def draft_dir(draft, tmp_path_factory):
    """The tiny draft as a checkpoint folder, which is what SSD's worker loads."""
    folder = tmp_path_factory.mktemp("auto-draft")
    save_checkpoint(draft, folder, dtype=torch.float32, share_embeddings=False)
    return folder


def in_process_ssd(target, draft_dir, fan_out: list[int], placement: CorePlacement | None = None) -> RemoteProposer:
    client = InProcessDraft(worker_config(str(draft_dir), "float32", TINY_K, fan_out), None)
    return RemoteProposer(DraftPool([client]), "neural", vocab_size=target.config.vocab_size, placement=placement)


SWITCHING = [TINY_K, SSD, SSD, 0, SSD, 1]  # into SSD, on in SSD, out to AR, back into SSD, out to SD


def auto_pvalue(target, draft, params, draft_dir=None) -> float:
    ssd = in_process_ssd(target, draft_dir, [2] * (TINY_K + 1)) if draft_dir else None
    outputs = tiny_outputs(auto_decoder(target, draft, SWITCHING if ssd else [0, TINY_K, 1], ssd), params)
    return ks_pvalue(teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params))


def test_switching_k_between_rounds_is_exact(target, draft):
    assert auto_pvalue(target, draft, sampled(1.0)) > ALPHA


def test_switching_check_catches_a_broken_acceptance_rule(target, draft, monkeypatch):
    monkeypatch.setattr(verification, "verify", residual_is_p)
    assert auto_pvalue(target, draft, sampled(1.0)) < ALPHA


def test_switching_between_ar_sd_and_ssd_is_exact(target, draft, draft_dir):
    assert auto_pvalue(target, draft, sampled(1.0, rows=4_000), draft_dir) > ALPHA


def test_switching_with_ssd_check_catches_a_broken_acceptance_rule(target, draft, draft_dir, monkeypatch):
    monkeypatch.setattr(verification, "verify", residual_is_p)
    assert auto_pvalue(target, draft, sampled(1.0, rows=4_000), draft_dir) < ALPHA


def test_the_drafter_runs_a_prompt_only_before_its_first_sd_round(target, draft):
    decoder = auto_decoder(target, draft, [0])
    drafted = []
    drafter_of(decoder).prefill = lambda seqs: drafted.append([s.seq_id for s in seqs])
    tiny_outputs(decoder, sampled(0.0, rows=3))
    assert drafted == []  # AR throughout: the draft never ran
    decoder = auto_decoder(target, draft, [0, 0, 1])
    prefill = drafter_of(decoder).prefill
    drafter_of(decoder).prefill = lambda seqs: (drafted.append([s.seq_id for s in seqs]), prefill(seqs))
    tiny_outputs(decoder, sampled(0.0, rows=3))
    assert drafted == [[0, 1, 2]]  # once, at the third round


def test_a_loading_worker_keeps_the_target_off_its_core_and_its_rounds_are_forgotten(target, draft, machine_threads):
    """While SSD's worker starts on one of the target's cores, the target runs on the others
    (its threads would each wait for the one sharing that core), and the costs measured
    meanwhile are dropped once the start ends: they say little about later rounds."""
    everything = CoreShare.of(None).all
    if everything[1] < 2:
        pytest.skip("one thread: the worker shares nothing")
    starting = Future()
    try:
        decoder = build.auto_decoder(target, sd_drafter(draft, SpeculativeConfig(num_speculative_tokens=TINY_K,
                                                                                 prompt_lookup=0)),
                                     SSDLauncher(lambda: starting,
                                                 CorePlacement(CoreShare(everything, (everything[0], 1))), 8))
        auto, controller = decoder.policy, decoder.policy.controller
        assert torch.get_num_threads() == everything[1]  # no worker yet: it starts when SSD would pay
        auto.wait_for_ssd(start=False)
        assert auto.ssd_starting is None
        controller.ssd_would_pay = lambda batch, ratio: True
        tiny_outputs(decoder, sampled(0.0, rows=2))  # its first round starts the worker
        assert auto.ssd_starting is starting and auto.launcher is None
        assert torch.get_num_threads() == 1  # the rounds after it ran while the worker loads
        assert controller.estimates.measured and controller.estimates.target(1) is not None
        assert torch.get_num_threads() == 1
        starting.set_exception(RuntimeError("no worker here"))  # the start ends (here: it failed)
        with pytest.warns(RuntimeWarning, match="without SSD"):
            auto._adopt_ssd()
        assert torch.get_num_threads() == everything[1]
        assert not controller.estimates.measured and controller.estimates.target(1) is None
        assert sum(controller.estimates.tried) > 0  # the acceptance measured meanwhile is kept
    finally:
        use_cores(*everything)


def test_ssd_stints_hand_the_worker_what_it_lacks_and_give_the_cores_back(target, draft, draft_dir):
    cores = CoreShare.of(None)
    placement = CorePlacement(CoreShare(cores.all, (cores.all[0], 1)))
    ssd = in_process_ssd(target, draft_dir, [TINY_V - 1] * (TINY_K + 1), placement)  # every bonus cached: hits
    decoder = auto_decoder(target, draft, [SSD, SSD, SSD, 1], ssd, placement=placement)
    decoder.wait_for_ssd(start=True)  # a worker on the target's cores starts when asked
    rounds, prefilled = [], []  # per round: the torch threads it ran on; the round of each worker prefill
    client = ssd.pool.lanes[0].client
    send_prefill = client.prefill
    client.prefill = lambda ids, *args: (prefilled.append((len(rounds), list(ids))), send_prefill(ids, *args))
    step = decoder.step

    def counted_step(seqs):
        step(seqs)
        rounds.append((torch.get_num_threads(), dict(ssd.outcomes)))
    decoder.step = counted_step
    seqs = [Sequence(i, prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), [])
            for i, prompt in enumerate(tiny_prompts(3))]
    decoder.reserve(3, len(seqs[0].prompt_ids) + 40 + decoder.lookahead)
    decoder.prefill(seqs)
    while active := [s for s in seqs if not s.finished]:
        decoder.step(active)
    assert [threads for threads, _ in rounds[:4]] == [1, 1, 1, cores.all[1]]  # SSD's cores, then all
    assert not rounds[3][1]  # leaving SSD: the worker forgot the sequences
    assert prefilled[0] == (0, [0, 1, 2])
    assert {at % 4 for at, _ in prefilled} == {0}  # only when a stint begins
    assert len(prefilled) > 1 and ssd.stats.hit_lengths  # later stints had the worker's cache serve rounds


@pytest.fixture(scope="module")
def auto() -> LLM:
    """auto on the real model, with its SSD worker on the last core (where there are two)."""
    with LLM(hub.DEFAULT_MODEL, method="auto", dtype="float32") as llm:
        llm.wait_for_ssd(start=True)
        yield llm


needs_two_cores = pytest.mark.skipif(len(usable_cores()) < 2, reason="SSD's worker needs a core of its own")


def test_auto_greedy_equals_ar_on_real_prompts(auto, prompts, ar_greedy):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = []
    for i in range(0, 8, 4):
        outputs += auto.generate(prompts[i:i + 4], params, use_tqdm=False)
    outputs += [auto.generate(prompts[8], params, use_tqdm=False)[0]]
    assert [out.token_ids for out in outputs] == ar_greedy[:9]
    rounds = auto.metrics()["auto_rounds_by_k"]
    assert rounds.get("0") and sum(n for k, n in rounds.items() if k != "0") > 0  # it ran AR and speculated


@needs_two_cores
def test_plan_forecasts_each_batch_size_from_the_others_then_measures_it(auto, prompts):
    rows = plan.plan(auto, prompts[:2], [1, 2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    choices = auto.decoder.policy.controller.choices()
    assert SSD in choices  # its worker holds a core of its own (the plan waits for it)
    assert [(r.batch, r.choice) for r in rows] == [(b, c) for b in (1, 2) for c in choices]
    assert all(r.measured_tok_s > 0 for r in rows)
    assert [sum(r.chosen for r in rows if r.batch == b) for b in (1, 2)] == [1, 1]
    assert all(r.predicted_tok_s is not None for r in rows if r.batch == 2)  # forecast from batch 1
    assert "| 2 | 0 |" in plan.markdown(rows) and "| 2 | ssd |" in plan.markdown(rows)


@needs_two_cores
def test_auto_greedy_equals_ar_when_it_switches_into_and_out_of_ssd(auto, prompts, ar_greedy):
    controller = auto.decoder.policy.controller
    schedule = itertools.cycle([5] + [SSD] * SSD_MIN_ROUNDS + [0] + [SSD] * 3 + [2])
    controller.choose = lambda batch, can_try=True: controller.pick(next(schedule))
    try:
        outputs = auto.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    finally:
        del controller.choose
    assert [out.token_ids for out in outputs] == ar_greedy[:4]
    assert auto.metrics()["cache_hits"] > 0  # SSD rounds ran, and the worker's cache served some
