"""The KV cache and LlamaModel.forward's explicit rows / slots / mask: what every decoder relies
on to roll back rejected drafts, keep sequences in arbitrary rows and decode token trees."""
from __future__ import annotations

import pytest
import torch

from saguaro.engine.runner import forward_chunks
from saguaro.models.config import ModelConfig
from saguaro.models.kv_cache import KVCache, as_slice
from saguaro.models.llama import LlamaModel

VOCAB = 64


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    model = LlamaModel(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(20)  # spread the logits so that differences show
    return model


def tokens_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """Logits of a forward pass over `tokens` from an empty cache: [T, V]."""
    cache = KVCache(model.config, 1, len(tokens), model.dtype)
    return model.logits(model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache))[0]


def chunk_logits(model: LlamaModel, cache: KVCache, tokens: list[int], start: int, row: int = 0) -> torch.Tensor:
    """Writes `tokens` at slots start.. of cache row `row`; their logits [T, V]."""
    positions = torch.arange(start, start + len(tokens))[None]
    rows = None if row == 0 else torch.tensor([row])
    return model.logits(model(torch.tensor([tokens]), positions, cache, rows=rows))[0]


def test_rollback_by_overwriting(model):
    prefix, rejected, corrected = tokens_of(12, 1), tokens_of(6, 2), tokens_of(4, 3)
    assert rejected[:4] != corrected
    cache = KVCache(model.config, 1, 32, model.dtype)
    chunk_logits(model, cache, prefix, 0)
    chunk_logits(model, cache, rejected, 12)  # slots 12..17, then only 12 are kept
    ours = chunk_logits(model, cache, corrected, 12)  # stale slots 16, 17 lie beyond the span
    torch.testing.assert_close(ours, fresh_logits(model, prefix + corrected)[12:], atol=1e-5, rtol=1e-5)


def test_rollback_without_overwrite_would_differ(model):
    """Control: the stale entries matter when attended to, so the test above can fail."""
    prefix, rejected, corrected = tokens_of(12, 1), tokens_of(6, 2), tokens_of(4, 3)
    cache = KVCache(model.config, 1, 32, model.dtype)
    chunk_logits(model, cache, prefix + rejected, 0)
    positions = torch.arange(12, 16)[None]
    mask = torch.ones(1, 4, 18, dtype=torch.bool)  # sees the stale slots 16, 17 too
    hidden = model(torch.tensor([corrected]), positions, cache, mask=mask)
    assert not torch.allclose(model.logits(hidden)[0], fresh_logits(model, prefix + corrected)[12:], atol=1e-3)


def test_sequences_in_arbitrary_rows(model):
    seqs = [tokens_of(9, 4), tokens_of(5, 5)]
    cache = KVCache(model.config, 5, 16, model.dtype)
    untouched = [0, 2, 4]
    cache.keys[:, untouched] = 7.0
    hidden = forward_chunks(model, cache, [3, 1], seqs, [0, 0])
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(model.logits(hidden[i, :len(seq)]), fresh_logits(model, seq), atol=1e-5, rtol=1e-5)
    assert (cache.keys[:, untouched] == 7.0).all()
    # Decoding continues in those rows: one more token each, at different offsets.
    nxt = [[tokens_of(1, 6)[0]], [tokens_of(1, 7)[0]]]
    hidden = forward_chunks(model, cache, [3, 1], nxt, [9, 5])
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(model.logits(hidden[i, 0]), fresh_logits(model, seq + nxt[i])[-1],
                                   atol=1e-5, rtol=1e-5)


def test_tree_mask_equals_linear_forwards(model):
    """Two branches after a shared prefix, decoded in one pass: tokens at scattered slots,
    each attending to the prefix and its own ancestors only."""
    prefix, left, right = tokens_of(7, 8), tokens_of(3, 9), tokens_of(2, 10)
    cache = KVCache(model.config, 1, 16, model.dtype)
    chunk_logits(model, cache, prefix, 0)
    # Branch tokens interleaved over slots 7..11, not in branch order.
    slots = {("L", 0): 10, ("L", 1): 7, ("L", 2): 11, ("R", 0): 9, ("R", 1): 8}
    branch = {"L": left, "R": right}
    nodes = list(slots)
    tokens = torch.tensor([[branch[b][i] for b, i in nodes]])
    positions = torch.tensor([[7 + i for _, i in nodes]])
    mask = torch.zeros(1, len(nodes), 12, dtype=torch.bool)
    mask[0, :, :7] = True
    for n, (b, i) in enumerate(nodes):
        for j in range(i + 1):
            mask[0, n, slots[(b, j)]] = True
    slot_t = torch.tensor([[slots[node] for node in nodes]])
    logits = model.logits(model(tokens, positions, cache, slots=slot_t, mask=mask))[0]
    for b in "LR":
        expected = fresh_logits(model, prefix + branch[b])[7:]
        ours = torch.stack([logits[nodes.index((b, i))] for i in range(len(branch[b]))])
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_cache_too_small_is_an_error(model):
    cache = KVCache(model.config, 1, 8, model.dtype)
    with pytest.raises(IndexError):
        chunk_logits(model, cache, tokens_of(9, 11), 0)


def test_consecutive_rows_are_read_as_views():
    assert as_slice(torch.tensor([2, 3, 4])) == slice(2, 5)
    assert torch.equal(as_slice(torch.tensor([3, 2])), torch.tensor([3, 2]))
    assert torch.equal(as_slice(torch.tensor([0, 2])), torch.tensor([0, 2]))
    assert as_slice(None) is None


@pytest.mark.parametrize("rows", [[1, 2], [2, 1]])
def test_rows_as_slice_or_index_give_the_same_logits(model, rows):
    """[1, 2] takes the view path, [2, 1] the indexing path: both must match fresh passes."""
    texts = [tokens_of(7, 11), tokens_of(5, 12)]
    cache = KVCache(model.config, 3, 16, model.dtype)
    padded = torch.tensor([t + [0] * (7 - len(t)) for t in texts])
    hidden = model(padded, torch.arange(7).expand(2, 7), cache, rows=torch.tensor(rows))
    for i, text in enumerate(texts):
        torch.testing.assert_close(model.logits(hidden[i, :len(text)]), fresh_logits(model, text))
    step = torch.tensor([[3], [4]])
    positions = torch.tensor([[len(texts[0])], [len(texts[1])]])
    mask = torch.arange(8)[None, None] <= positions[..., None]
    last = model.logits(model(step, positions, cache, rows=torch.tensor(rows), mask=mask))[:, 0]
    for i, text in enumerate(texts):
        torch.testing.assert_close(last[i], fresh_logits(model, text + [3 + i])[-1])
