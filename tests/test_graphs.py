"""Captured passes (saguaro.models.graphs) and device-side rounds, tested on the CPU.

CI has no GPU, so the captured path runs here in its "emulated" mode: the same static buffers,
slot buckets and masks, the same device-side verification with one transfer to the host, only
replayed by calling the model instead of a CUDA graph. Greedy AR, SD and SSD through it equal
plain AR on real prompts; sampled SD through it is exact (PIT) on tiny models. The controls
break what the captured path adds: the masking of a bucket's extra slots, and the device-side
greedy comparison.
"""
from __future__ import annotations

import pytest
import torch

import saguaro.engine.verifier as verification
import saguaro.models.graphs as graphs_module
from conftest import NEW_TOKENS
from drafts import sd_decoder
from saguaro import LLM, SamplingParams
from saguaro.engine.rejection import verify_argmax, verify_greedy
from saguaro.models import graphs
from saguaro.models.kv_cache import new_cache
from stats import ks_pvalue, teacher_forced_pit
from test_exactness import ALPHA, TINY_K, sampled, tiny_model, tiny_outputs, tiny_prompts
from test_trees import peaked_model

PROMPTS = 6


def greedy_outputs(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("method", ["ar", "sd", "ssd"])
def test_captured_passes_keep_greedy_equal_to_ar(method, prompts, ar_greedy):
    """fp32, as the `llm` fixture that decoded ar_greedy: the same tokens through static buffers
    and slot buckets, and the draft's (SD's, and the SSD worker's) passes captured too."""
    with LLM("smollm2", method=method, dtype="float32", cuda_graphs="emulated") as llm:
        assert greedy_outputs(llm, prompts[:PROMPTS]) == ar_greedy[:PROMPTS]
        target = llm.target.step_graphs
        assert target.mode == "emulated" and target.replays > target.captures > 0
        if method == "sd":
            draft = llm.decoder.policy.choice.proposer.drafter
            while not hasattr(draft, "model"):  # behind prompt lookup
                draft = draft.fallback
            assert draft.model.step_graphs.replays > 0


def test_sampled_sd_through_captured_passes_is_exact():
    target, draft = peaked_model(), tiny_model(1, 1)  # attention as peaked as a trained model's
    params = sampled(0.8, rows=3000)
    outputs = tiny_outputs(sd_decoder(graphs.attach(target, "emulated"), graphs.attach(draft, "emulated"), TINY_K),
                           params)
    assert target.step_graphs.replays > 0 and draft.step_graphs.replays > 0
    assert ks_pvalue(teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params)) > ALPHA


def test_check_catches_a_bucket_whose_extra_slots_are_seen(monkeypatch):
    """Control: the slots a bucket adds beyond a pass's span left visible (stale entries of
    rejected drafts, and zeros) must fail the same test."""
    run = graphs.StepGraphs.run

    def unmasked(self, cache, rows, tokens, positions, slots, mask):
        wide = torch.ones(*mask.shape[:2], self.slots_for(mask.shape[-1], cache), dtype=torch.bool)
        wide[..., :mask.shape[-1]] = mask
        return run(self, cache, rows, tokens, positions, slots, wide)

    monkeypatch.setattr(graphs.StepGraphs, "run", unmasked)
    target, draft = peaked_model(), tiny_model(1, 1)  # attention as peaked as a trained model's
    params = sampled(0.8, rows=3000)
    outputs = tiny_outputs(sd_decoder(graphs.attach(target, "emulated"), graphs.attach(draft, "emulated"), TINY_K),
                           params)
    graphs.attach(target, "off")
    assert ks_pvalue(teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params)) < ALPHA


def test_device_side_greedy_verification_matches_the_lists():
    generator = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, 2, (500, 5), generator=generator)
    argmax = torch.randint(0, 2, (500, 6), generator=generator)
    accepted_len, bonus = verify_argmax(drafts, argmax)
    expected = verify_greedy(drafts.tolist(), argmax.tolist())
    assert [(a, b) for a, b in zip(accepted_len.tolist(), bonus.tolist())] == [tuple(o) for o in expected]
    assert len(set(accepted_len.tolist())) == 6  # every accepted length occurs


def test_check_catches_device_side_greedy_verification_accepting_one_more(monkeypatch, prompts, ar_greedy):
    """Control: the device-side comparison accepting the first rejected draft too must leave AR."""
    def one_more(draft_tokens, argmax):
        accepted_len, _ = verify_argmax(draft_tokens, argmax)
        accepted_len = (accepted_len + 1).clamp(max=draft_tokens.shape[1])
        return accepted_len, argmax.gather(1, accepted_len[:, None])[:, 0]

    monkeypatch.setattr(verification, "verify_argmax", one_more)
    with LLM("smollm2", method="sd", dtype="float32", cuda_graphs="emulated") as llm:
        assert greedy_outputs(llm, prompts[:PROMPTS]) != ar_greedy[:PROMPTS]


def test_buckets_and_what_runs_eagerly():
    model = graphs.attach(tiny_model(0, 1), "emulated")
    captured = model.step_graphs
    cache = new_cache(model, 4, 300)
    assert [captured.slots_for(span, cache) for span in (1, 64, 65, 129, 300)] == [64, 64, 128, 256, 301]
    assert captured.takes(6) and not captured.takes(graphs_module.MAX_TOKENS + 1)  # a prefill runs eagerly
    tokens = torch.tensor([[1, 2]])
    first = captured.run(cache, [0], tokens, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]),
                         torch.tensor([[[True, False], [True, True]]]))
    again = captured.run(cache, [0], tokens, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]),
                         torch.tensor([[[True, False], [True, True]]]))
    assert captured.captures == 1 and captured.replays == 2 and torch.equal(first, again)
    captured.run(new_cache(model, 4, 300), [0], tokens, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]),
                 torch.tensor([[[True, False], [True, True]]]))
    assert captured.captures == 2 and len(captured.passes) == 1  # a new cache: the old one's graphs went
    other = captured.run(cache, [2], tokens, torch.tensor([[0, 1]]), torch.tensor([[0, 1]]),
                         torch.tensor([[[True, False], [True, True]]]))
    assert captured.captures == 3 and torch.equal(other, first)  # row 2 by index: the same text, the same states


def test_cuda_graphs_setting_is_checked():
    with pytest.raises(ValueError, match="cuda_graphs must be one of"):
        graphs.attach(tiny_model(0, 1), "always")
    with pytest.raises(ValueError, match="need a model on a CUDA device"):
        graphs.StepGraphs(tiny_model(0, 1), "cuda")
    assert graphs.attach(tiny_model(0, 1), "auto").step_graphs is None  # auto: CUDA devices only
