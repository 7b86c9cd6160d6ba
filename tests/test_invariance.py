"""Batch invariance: a position's logits are bit-identical however many tokens and requests share
the target's pass, so greedy SD and SSD commit exactly AR's tokens in bf16 and fp16 too, not only
in fp32 (where near-ties rarely flip). The control shows the harness finds the differences the
library kernels make when invariance is off."""
from __future__ import annotations

import pytest
import torch

from saguaro import LLM, SamplingParams
import saguaro.engine.runner as runner_module
from saguaro.engine.runner import forward_chunks
from saguaro.models import hub
from saguaro.models.kv_cache import new_cache
from saguaro.models.loader import load_model

STEPS = 18  # one-token AR steps, then the same positions re-run as K + 1 = 6 token chunks
CHUNK = 6
OTHER_ROWS = 8  # a batch of 9 x 6 = 54 rows: past the 32 rows where oneDNN's bf16 kernel changes


# (dtype, quantization): the default (int4 from the GGUF's Q4_1 blocks, in bf16), int8, and the
# dequantized weights in bf16, fp16 and fp32.
MODES = [(torch.bfloat16, "auto"), (torch.bfloat16, "int8"), (torch.bfloat16, "none"), (torch.float16, "none"),
         (torch.float32, "none")]


@pytest.fixture(scope="module")
def models(smollm2_path):
    return {(dtype, q): load_model(smollm2_path, dtype, quantization=q) for dtype, q in MODES}


def greedy_steps(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """The greedy continuation one token at a time at batch 1, and each step's logits."""
    cache = new_cache(model, 1, len(prompt) + STEPS + CHUNK)
    forward_chunks(model, cache, [0], [prompt[:-1]], [0])
    tokens, logits = list(prompt), []
    for _ in range(STEPS):
        hidden = forward_chunks(model, cache, [0], [[tokens[-1]]], [len(tokens) - 1])
        logits.append(model.logits(hidden[:, -1])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def chunked_in_a_batch(model, prompt: list[int], tokens: list[int], others: list[list[int]]) -> torch.Tensor:
    """The same positions' logits, computed CHUNK tokens at a time next to other requests whose
    chunks and lengths differ (so the pass also attends over masked slots)."""
    rows = 1 + len(others)
    longest = max(len(tokens), *(len(o) + STEPS for o in others)) + CHUNK
    cache = new_cache(model, rows, longest)
    forward_chunks(model, cache, list(range(rows)), [prompt[:-1]] + [o[:-1] for o in others],
                   [0] * rows)
    logits, start = [], len(prompt) - 1
    for step in range(0, STEPS, CHUNK):
        chunks = [tokens[start + step:start + step + CHUNK]]
        starts = [start + step]
        for o in others:
            chunks.append([(t * 7 + step) % 1000 for t in o[-CHUNK:]])
            starts.append(len(o) - 1 + step)
        hidden = forward_chunks(model, cache, list(range(rows)), chunks, starts)
        logits.append(model.logits(hidden[0]))
    return torch.cat(logits)


def positions_that_differ(model, prompts: list[list[int]], count: int = 2) -> int:
    """How many of the first `count` prompts' positions get other logits chunked in a batch."""
    differ = 0
    for prompt in prompts[:count]:
        tokens, step_logits = greedy_steps(model, prompt)
        others = [p[:len(p) - i] for i, p in enumerate(prompts[2:2 + OTHER_ROWS])]
        batch_logits = chunked_in_a_batch(model, prompt, tokens, others)
        differ += int((step_logits != batch_logits).any(dim=-1).sum())
    return differ


def torch_products_change_below(rows: int) -> bool:
    """Whether fp32 products of 2 to `rows` rows round a row differently from one another on
    this CPU. saguaro/models/invariant.py takes them to round alike (measured on the Intel CPU it
    was written on); on an AMD EPYC, 1-3 rows round one way and 4 or more another, and the torch
    path (quantization none / int8) is then not batch-invariant. saguaro's own kernels, the
    default, compute each row alone on any CPU (the "auto" mode below, and tests/test_native.py)."""
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, 576, generator=generator), torch.randn(1536, 576, generator=generator)
    first = torch.nn.functional.linear(x[:2], w)[:1]
    return any(not torch.equal(torch.nn.functional.linear(x[:n], w)[:1], first) for n in range(3, rows + 1))


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_logits_do_not_depend_on_what_shares_the_pass(models, prompts, mode):
    if mode[1] != "auto" and torch_products_change_below(CHUNK * (OTHER_ROWS + 1)):
        # Known to fail here, and a test that may fail is no test: skipped, not run as an
        # expected failure (on a CPU without avx512_bf16 these runs took minutes).
        pytest.skip("this CPU's torch products change rounding with the row count below the blocks "
                    "invariant.py assumes")
    model = models[mode]
    model.set_batch_invariant(True)
    assert positions_that_differ(model, prompts) == 0


def test_invariant_kernels_compute_what_the_library_kernels_do(models, prompts):
    """Same model, same numbers up to rounding: the fp32 logits of a batched, masked prefill and of
    one-token steps agree with invariance off (which test_parity holds to transformers)."""
    model = models[torch.float32, "none"]
    logits = {}
    for on in (False, True):
        model.set_batch_invariant(on)
        tokens, step_logits = greedy_steps(model, prompts[0])
        cache = new_cache(model, 2, 1024)
        hidden = forward_chunks(model, cache, [0, 1], [prompts[0], prompts[1]], [0, 0])
        logits[on] = torch.cat([step_logits, model.logits(hidden[0, :len(prompts[0])])])
    model.set_batch_invariant(True)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)


def test_control_library_kernels_round_by_shape(models, prompts):
    model = models[torch.bfloat16, "none"]
    model.set_batch_invariant(False)
    try:
        assert positions_that_differ(model, prompts, count=1) > 0  # one prompt is plenty (and bf16 slow on some CPUs)
    finally:
        model.set_batch_invariant(True)


@pytest.fixture(scope="module")
def heldout(prompts) -> list[list[int]]:
    return prompts[:8]


# (dtype, prompts, SD's (batch, prompts) runs): bf16, the default, in full; fp16 (no int4 kernel:
# dequantized weights, slow without AVX512-FP16) on two prompts
HALF_PRECISION = {"bfloat16": (8, [(1, 4), (4, 8)]), "float16": (2, [(2, 2)])}


@pytest.mark.parametrize("dtype", list(HALF_PRECISION))
def test_sd_and_ssd_greedy_equal_ar_in_half_precision(heldout, dtype):
    count, sd_runs = HALF_PRECISION[dtype]
    prompts, params = heldout[:count], SamplingParams(temperature=0, max_tokens=48)
    ar = LLM(hub.DEFAULT_MODEL, method="ar", dtype=dtype)
    expected = [o.token_ids for o in ar.generate(prompts, params, use_tqdm=False)]  # one batch
    sd = LLM(hub.DEFAULT_MODEL, method="sd", dtype=dtype, num_speculative_tokens=5)
    for batch, n in sd_runs:
        got = []
        for i in range(0, n, batch):
            got += [o.token_ids for o in sd.generate(prompts[i:i + batch], params, use_tqdm=False)]
        assert [i for i, (g, e) in enumerate(zip(got, expected)) if g != e] == [], f"SD at batch {batch}"
    with LLM(hub.DEFAULT_MODEL, method="ssd", dtype=dtype, num_speculative_tokens=5) as ssd:
        got = [o.token_ids for o in ssd.generate(prompts, params, use_tqdm=False)]
        assert [i for i, (g, e) in enumerate(zip(got, expected)) if g != e] == [], f"SSD at batch {count}"
        assert ssd.metrics()["cache_hit_rate"] > 0


RAGGED_PASS = runner_module.ragged_pass


def ragged_pass_losing_the_tree_mask(model, cache, rows, lengths, tokens, positions, slots, mask):
    """Control: a ragged pass that rebuilds each token's mask from its slot, as a chain's, so a
    tree's siblings see each other."""
    return RAGGED_PASS(model, cache, rows, lengths, tokens, positions, slots,
                       torch.arange(mask.shape[-1]) <= slots[..., None])


@pytest.mark.parametrize("broken", [False, True])
def test_a_ragged_pass_computes_what_the_padded_pass_does(models, prompts, monkeypatch, broken):
    """Chunks of different lengths (a batch's jump-forward: a forced run beside one-token chunks;
    a tree beside them) run without padding, each token its own row, on saguaro's kernels: the
    hidden states and the KV entries written are bit for bit the padded pass's."""
    model = models[torch.bfloat16, "auto"]
    assert model.native_layers is not None
    if broken:
        monkeypatch.setattr(runner_module, "ragged_pass", ragged_pass_losing_the_tree_mask)
    chunks = [[t % 1000 + 5 for t in p[-6:]] for p in prompts[2:6]]
    chunks[0], chunks[2] = chunks[0][:1], chunks[2][:2]  # 1 + 6 + 2 + 6 of 24 positions
    parents = [list(range(-1, len(c) - 1)) for c in chunks]
    parents[1] = [-1, 0, 0, 1, 1, 2]  # a tree: siblings must not see each other
    results = {}
    for ragged in (True, False):
        monkeypatch.setattr(runner_module, "RAGGED_BELOW", 1.0 if ragged else 0.0)
        cache = new_cache(model, 4, 512)
        forward_chunks(model, cache, [0, 1, 2, 3], [p[:40] for p in prompts[2:6]], [0] * 4)
        hidden = forward_chunks(model, cache, [0, 1, 2, 3], chunks, [40] * 4, parents=parents)
        results[ragged] = ([hidden[i, :len(c)] for i, c in enumerate(chunks)],
                           [cache.keys[:, i, :, 40:40 + len(c)] for i, c in enumerate(chunks)])
    same = all(torch.equal(a, b) for part in (0, 1) for a, b in zip(results[True][part], results[False][part]))
    assert same != broken
