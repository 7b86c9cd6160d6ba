"""Autoregressive greedy decoding equals Hugging Face transformers' greedy `generate`, token for
token, on real prompts in fp32. saguaro decodes all prompts as one batch (padding, per-row
positions), transformers one prompt at a time: the reference needs no padding."""
from __future__ import annotations

import torch

from conftest import NEW_TOKENS

HF_PROMPTS = 8  # of the 20 (4 code, 4 chat): transformers decodes one prompt at a time, ~3 s each


def hf_greedy(model, prompt: list[int], eos_token_ids: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                         eos_token_id=eos_token_ids, pad_token_id=eos_token_ids[0])
    return out[0, len(prompt):].tolist()


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_prompts_are_real_and_varied(prompts):
    assert len(prompts) >= 20
    assert len({len(p) for p in prompts}) > 10  # different lengths: the batch really pads


def test_ar_greedy_matches_transformers(llm, hf_model, prompts, ar_greedy):
    mismatches = {}
    for i, (prompt, ours) in enumerate(zip(prompts[:HF_PROMPTS], ar_greedy)):
        theirs = hf_greedy(hf_model, prompt, llm.eos_token_ids)
        if ours != theirs:
            mismatches[i] = first_difference(ours, theirs)
    assert not mismatches, f"prompt index -> first differing token: {mismatches}"
    assert sum(len(t) for t in ar_greedy) >= len(prompts) * NEW_TOKENS // 2


def test_ar_output_ends_at_eos_or_max_tokens(llm, ar_greedy):
    for tokens in ar_greedy:
        stopped = tokens[-1] in llm.eos_token_ids
        assert stopped or len(tokens) == NEW_TOKENS
        assert not set(tokens[:-1]) & set(llm.eos_token_ids)
