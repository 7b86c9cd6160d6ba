"""Prefix caching and n > 1: prompts that start like earlier ones reuse their KV entries, the n
samples of one prompt run it once, and neither changes a token.

Unit tests on a tiny model; greedy equality and the distribution of n samples on the default
model (bf16, batch-invariant), each with a control that must fail."""
from __future__ import annotations

import math

import pytest
import torch
from stats import ks_pvalue, teacher_forced_pit
from test_invariance import torch_products_change_below
from test_kv_cache import VOCAB, model  # noqa: F401 (a fixture)

from saguaro import LLM, SamplingParams
from saguaro.engine import runner
from saguaro.engine.runner import (
    PADDING_WASTE,
    forward_chunks,
    length_groups,
    prefill_chunks,
)
from saguaro.models.kv_cache import new_cache
from saguaro.models.llama import LlamaModel
from saguaro.models.prefix_cache import BLOCK_SIZE, PrefixCache


@pytest.fixture(scope="module")
def tiny(model) -> LlamaModel:
    """test_kv_cache's tiny model, batch-invariant: a chunk's entries do not depend on its length."""
    model.set_batch_invariant(True)
    return model


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_prompt_restored_from_the_cache_gives_what_running_it_whole_gives(tiny):
    shared = tokens(3 * BLOCK_SIZE + 5, 1)
    prompts = [shared + tokens(7, 2), shared[:2 * BLOCK_SIZE] + tokens(9, 3), tokens(40, 4)]
    cache = new_cache(tiny, len(prompts), 128)
    whole = forward_chunks(tiny, cache, [0, 1, 2], prompts, [0, 0, 0])
    expected_keys = cache.keys.clone()

    prefix_cache = PrefixCache(1 << 30)
    warm = new_cache(tiny, 1, 128)
    prefill_chunks(tiny, warm, [0], [shared], prefix_cache)  # caches the 3 full blocks of `shared`
    cache = new_cache(tiny, len(prompts), 128)
    hidden, starts = prefill_chunks(tiny, cache, [0, 1, 2], prompts, prefix_cache)
    assert starts == [3 * BLOCK_SIZE, 2 * BLOCK_SIZE, 0]
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        assert torch.equal(cache.keys[:, i, :, :n], expected_keys[:, i, :, :n])
        assert torch.equal(hidden[i, :n - starts[i]], whole[i, starts[i]:n])
    assert prefix_cache.stats.hit_tokens == 5 * BLOCK_SIZE


def prefill_rows_run(model, prompts: list[list[int]], monkeypatch) -> tuple[list[int], torch.Tensor, object]:
    """Prefills the prompts, recording the rows (chunks x padded length) of each pass."""
    rows_run = []
    run = runner.forward_chunks
    monkeypatch.setattr(runner, "forward_chunks",
                        lambda model, cache, rows, chunks, *a: rows_run.append(len(chunks) * max(map(len, chunks)))
                        or run(model, cache, rows, chunks, *a))
    cache = new_cache(model, len(prompts), 128)
    hidden, _ = prefill_chunks(model, cache, list(range(len(prompts))), prompts)
    monkeypatch.setattr(runner, "forward_chunks", run)
    return rows_run, hidden, cache


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, where this CPU's fp32 products round alike whatever the rows beside a row
    (the tiny model runs torch's kernels); else equal to fp32 rounding (tests/test_invariance.py)."""
    if torch_products_change_below(128):
        return torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    return torch.equal(a, b)


def test_prompts_of_very_different_lengths_run_in_passes_of_their_own(tiny, monkeypatch):
    """A long prompt no longer pads short ones to its length: the padding run stays within
    PADDING_WASTE, and the hidden states and KV entries are those of running each prompt alone.
    Control: with the bound lifted (one pass, what prefill did before) the same check fails."""
    assert length_groups([265, 59, 49, 351], [0, 1, 2, 3]) == [[3, 0], [1, 2]]
    assert length_groups([20, 10, 5], [0, 1, 2]) == [[0, 1], [2]]  # short ones share a pass
    prompts = [tokens(n, 10 + n) for n in (70, 15, 12, 100)]
    real = sum(map(len, prompts))
    rows_run, hidden, cache = prefill_rows_run(tiny, prompts, monkeypatch)
    assert len(rows_run) == 2 and sum(rows_run) <= (1 + PADDING_WASTE) * real
    for i, prompt in enumerate(prompts):
        alone = new_cache(tiny, 1, 128)
        expected = forward_chunks(tiny, alone, [0], [prompt], [0])
        assert same_bits(hidden[i, :len(prompt)], expected[0])
        assert same_bits(cache.keys[:, i, :, :len(prompt)], alone.keys[:, 0, :, :len(prompt)])
    monkeypatch.setattr(runner, "PADDING_WASTE", float("inf"))
    rows_run, _, _ = prefill_rows_run(tiny, prompts, monkeypatch)
    assert len(rows_run) == 1 and sum(rows_run) > (1 + PADDING_WASTE) * real


def test_a_block_matches_only_after_the_same_whole_prefix(tiny):
    prefix_cache = PrefixCache(1 << 30)
    a, b = tokens(BLOCK_SIZE, 5), tokens(BLOCK_SIZE, 6)
    cache = new_cache(tiny, 1, 128)
    prefill_chunks(tiny, cache, [0], [a + b + [1]], prefix_cache)
    assert prefix_cache.cached_blocks(a + b) == 2
    assert prefix_cache.cached_blocks(b + a) == 0  # b is cached, but after a
    assert prefix_cache.cached_blocks(a + a) == 1


def test_one_call_runs_a_shared_prompt_once_and_the_others_reuse_it(tiny):
    prompt = tokens(4 * BLOCK_SIZE + 3, 7)
    prefix_cache = PrefixCache(1 << 30)
    cache = new_cache(tiny, 4, 128)
    hidden, starts = prefill_chunks(tiny, cache, [0, 1, 2, 3], [prompt] * 4, prefix_cache)
    assert starts == [0] + [4 * BLOCK_SIZE] * 3
    # The cached blocks are copies; the 3 tokens after them ran in a pass of 3 rows, against 67 in
    # the first: bit-identical where this CPU's fp32 products round alike at both row counts.
    for row in (1, 2, 3):
        assert torch.equal(cache.keys[:, row, :, :4 * BLOCK_SIZE], cache.keys[:, 0, :, :4 * BLOCK_SIZE])
        assert same_bits(cache.keys[:, row, :, :len(prompt)], cache.keys[:, 0, :, :len(prompt)])
        assert same_bits(hidden[row, :3], hidden[0, 4 * BLOCK_SIZE:len(prompt)])


def test_eviction_keeps_the_budget_and_drops_the_deepest_blocks_first(tiny):
    cache = new_cache(tiny, 1, 256)
    block_bytes = 2 * cache.keys[:, 0, :, :BLOCK_SIZE].numel() * cache.keys.element_size()
    prefix_cache = PrefixCache(5 * block_bytes)
    first, second = tokens(4 * BLOCK_SIZE, 8), tokens(4 * BLOCK_SIZE, 9)
    prefill_chunks(tiny, cache, [0], [first + [0]], prefix_cache)
    prefill_chunks(tiny, cache, [0], [second + [0]], prefix_cache)
    assert prefix_cache.bytes <= 5 * block_bytes and len(prefix_cache.blocks) == 5
    assert prefix_cache.cached_blocks(second) == 4  # the newest prompt whole
    assert prefix_cache.cached_blocks(first) == 1  # the oldest lost its deepest blocks, not its first
    assert prefix_cache.stats.evicted_blocks == 3
    assert PrefixCache(0).cached_blocks(first) == 0
    with pytest.raises(ValueError):
        PrefixCache(-1)


# --- the default model --------------------------------------------------------------------------

SYSTEM = ("You are a careful assistant for a hardware store. Answer in two short sentences, name the "
          "aisle where the item is kept, and never invent prices. Aisles: 1 paint, 2 plumbing, 3 "
          "electrical, 4 garden, 5 tools, 6 fasteners, 7 lumber.")
QUESTIONS = ["Where are the wood screws?", "I need a new garden hose.", "Do you sell light switches?",
             "What do I use to paint a fence?", "Where can I find a hammer?", "I need PVC pipe."]


def chats() -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]


@pytest.fixture(scope="module")
def bf16() -> LLM:
    return LLM("smollm2", method="ar")


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("smollm2", method="ar", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def uncached(plain) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24)
    return [o.token_ids for o in plain.generate(chats(), params, use_tqdm=False)]


def test_greedy_output_is_the_same_with_cached_prefixes(bf16, uncached):
    params = SamplingParams(temperature=0, max_tokens=24)
    first = bf16.generate(chats()[:1], params, use_tqdm=False)[0]  # caches the system prompt
    rest = bf16.generate(chats()[1:], params, use_tqdm=False)
    assert [first.token_ids] + [o.token_ids for o in rest] == uncached
    assert first.metrics.num_cached_tokens == 0
    assert all(o.metrics.num_cached_tokens >= len(bf16.encode(SYSTEM)) for o in rest)
    assert bf16.metrics()["prefix_cache_hit_tokens"] > 0


def test_a_chat_s_next_turn_starts_from_the_cached_conversation(bf16, plain):
    params = SamplingParams(temperature=0, max_tokens=40)
    first = chats()[4]
    reply = bf16.generate(first, params, use_tqdm=False)[0]
    second = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And nails?"}]
    out = bf16.generate(second, params, use_tqdm=False)[0]
    expected = plain.generate(second, params, use_tqdm=False)[0]
    assert out.token_ids == expected.token_ids
    assert out.metrics.num_cached_tokens >= len(reply.prompt_token_ids) + len(reply.token_ids) - 2 * BLOCK_SIZE


def test_control_corrupted_cached_entries_change_the_output(bf16, uncached):
    params = SamplingParams(temperature=0, max_tokens=24)
    bf16.generate(chats()[:1], params, use_tqdm=False)
    blocks = bf16.decoder.verifier.prefix_cache.blocks
    saved = {key: (k.clone(), v.clone()) for key, (k, v) in blocks.items()}
    try:
        # an off-by-one copy of the values: each slot's value next to its neighbour's key (shifting
        # keys and values together would change nothing: attention is a sum over the slots)
        for _, v in blocks.values():
            v.copy_(v.roll(1, dims=2))
        got = [o.token_ids for o in bf16.generate(chats()[1:], params, use_tqdm=False)]
    finally:
        for key, (k, v) in saved.items():
            blocks[key][0].copy_(k)
            blocks[key][1].copy_(v)
    assert got != uncached[1:]


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_greedy_samples_of_one_prompt_all_equal_the_single_greedy_output(method, bf16, uncached):
    llm = bf16 if method == "ar" else LLM("smollm2", method=method)
    out = llm.generate(chats()[2], SamplingParams(temperature=0, max_tokens=24, n=4), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [uncached[2]] * 4
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.token_ids == out.outputs[0].token_ids
    cached = [c.metrics.num_cached_tokens for c in out.outputs]
    assert cached[1:] == [(len(out.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE] * 3


def sample_pits(llm: LLM, outputs, prompt_ids: list[int], params: SamplingParams, seed: int) -> torch.Tensor:
    """[samples, tokens] PIT values of every sample's tokens under the target."""
    tokens = [c.token_ids for c in outputs]
    pits = teacher_forced_pit(llm.target, [prompt_ids] * len(tokens), tokens, [params] * len(tokens), seed=seed)
    return pits.view(len(tokens), -1)


N, NEW_TOKENS = 48, 6


@pytest.fixture(scope="module")
def n_samples(bf16):
    params = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=N, seed=11)
    out = bf16.generate(chats()[3], params, use_tqdm=False)[0]
    return out, params


def first_token_repeats_pvalue(llm: LLM, prompt_ids: list[int], samples: list[list[int]]) -> float:
    """Samples j and j + n/2 agree on their first token with probability q = sum p(x)^2 when
    they are independent draws from the target p (T = 1); the chance of at least as many
    agreeing pairs as seen, from the binomial tail. Copies of one stream all agree."""
    hidden = forward_chunks(llm.target, new_cache(llm.target, 1, len(prompt_ids)), [0], [prompt_ids], [0])
    q = (torch.softmax(llm.target.logits(hidden[0, -1:]).double(), -1) ** 2).sum().item()
    half = len(samples) // 2
    agree = sum(a[0] == b[0] for a, b in zip(samples[:half], samples[half:2 * half]))
    return sum(math.comb(half, k) * q ** k * (1 - q) ** (half - k) for k in range(agree, half + 1))


def test_n_samples_follow_the_target_and_are_independent(bf16, n_samples):
    out, params = n_samples
    assert len(out.outputs) == N and all(len(c.token_ids) == NEW_TOKENS for c in out.outputs)
    pits = sample_pits(bf16, out.outputs, out.prompt_token_ids, params, seed=0)
    assert ks_pvalue(pits) > 1e-3
    assert first_token_repeats_pvalue(bf16, out.prompt_token_ids, [c.token_ids for c in out.outputs]) > 1e-3
    again = bf16.generate(chats()[3], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]  # the seed reproduces


def test_control_samples_sharing_one_seed_fail_the_independence_test(bf16, monkeypatch):
    params = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=N, seed=11)
    monkeypatch.setattr(SamplingParams, "samples", lambda self: [SamplingParams(
        temperature=self.temperature, max_tokens=self.max_tokens, ignore_eos=True, seed=self.seed)] * self.n)
    out = bf16.generate(chats()[3], params, use_tqdm=False)[0]
    assert first_token_repeats_pvalue(bf16, out.prompt_token_ids, [c.token_ids for c in out.outputs]) < 1e-3


def test_sample_seeds_are_distinct_and_reproducible():
    seeds = [p.seed for p in SamplingParams(n=6, seed=5).samples()]
    assert seeds[0] == 5 and len(set(seeds)) == 6
    assert seeds == [p.seed for p in SamplingParams(n=6, seed=5).samples()]
    assert all(p.n == 1 for p in SamplingParams(n=3).samples())
    with pytest.raises(ValueError):
        SamplingParams(n=0)


def test_streaming_several_samples_is_refused(bf16):
    with pytest.raises(ValueError, match="n = 1"):
        bf16.generate("Hi", SamplingParams(n=2), use_tqdm=False, on_token=lambda i, t: None)

