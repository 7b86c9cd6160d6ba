"""Speculative decoding at temperature 0 commits exactly the AR greedy tokens, at batch 1 and 4,
with the draft shipped for the default model: right often but not always, so both the accept
and the reject paths of verification run."""
from __future__ import annotations

import pytest

from conftest import NEW_TOKENS
from saguaro import LLM, SamplingParams
from saguaro.models import hub

K = 4


@pytest.fixture(scope="module")
def sd_llm() -> LLM:
    assert hub.default_draft(hub.DEFAULT_MODEL) is not None
    return LLM(hub.DEFAULT_MODEL, method="sd", num_speculative_tokens=K, dtype="float32")


@pytest.mark.parametrize("batch, count", [(1, 6), (4, 12)])
def test_sd_greedy_equals_ar(sd_llm, prompts, ar_greedy, batch, count):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = []
    for i in range(0, count, batch):
        outputs += sd_llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    mismatches = [i for i, out in enumerate(outputs) if out.token_ids != ar_greedy[i]]
    assert not mismatches, f"SD differs from AR on prompts {mismatches}"
    rounds = sum(o.metrics.num_rounds for o in outputs)
    committed = sum(o.metrics.mean_acceptance_length * o.metrics.num_rounds for o in outputs)
    assert 1 < committed / rounds < K + 1  # some drafts accepted, some rejected
    for out in outputs:
        assert len(out.metrics.per_position_acceptance) == K


def test_sd_with_prompt_lookup_equals_ar(prompts, ar_greedy):
    llm = LLM(hub.DEFAULT_MODEL, method="sd", num_speculative_tokens=K, dtype="float32", prompt_lookup=2)
    outputs = []
    for i in range(0, 8, 4):
        outputs += llm.generate(prompts[i:i + 4], SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    mismatches = [i for i, out in enumerate(outputs) if out.token_ids != ar_greedy[i]]
    assert not mismatches, f"SD with prompt lookup differs from AR on prompts {mismatches}"
