"""Runs a model over token chunks of different lengths, one chunk per cache row."""
from __future__ import annotations

import torch

from saguaro.engine.tree import depths, tree_mask
from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel
from saguaro.models.prefix_cache import PrefixCache


def forward_chunks(model: LlamaModel, cache: KVCache, rows: list[int], chunks: list[list[int]] | torch.Tensor,
                   starts: list[int], features: list[torch.Tensor] | None = None,
                   parents: list[list[int]] | None = None) -> torch.Tensor:
    """Appends chunk i to cache row rows[i] at positions starts[i], starts[i]+1, ...

    Chunks are right-padded to one length; padding is written to the cache's last slot,
    which is kept as scratch and never attended to. Returns hidden states [B, T, hidden];
    row i's real tokens are the first len(chunks[i]). Chunks of one length may come as a
    tensor [B, T] where they were drawn (a draft's step: no trip to the host). A model that
    reads features (an EAGLE draft) takes features[i], [len(chunks[i]), hidden], with chunk i.
    A model with captured passes (saguaro.models.graphs) runs those it takes replayed.

    parents: each chunk is a token tree instead (saguaro.engine.tree): token j's parent is
    token parents[i][j] of its chunk (-1: none, the chunk's first token). Token j still goes to
    slot starts[i] + j, but sits at position starts[i] + its depth and sees the row's earlier
    slots, its ancestors and itself only.
    """
    device = model.device
    lengths = [chunks.shape[1]] * len(chunks) if isinstance(chunks, torch.Tensor) else [len(c) for c in chunks]
    B, T = len(chunks), max(lengths)
    scratch = cache.num_slots - 1
    span = max(s + n for s, n in zip(starts, lengths))
    if span > scratch:
        raise IndexError(f"sequence of {span} tokens does not fit a KV cache of {scratch} slots")
    # built in Python and made one tensor: after a pass has streamed the weights through the
    # caches, every small torch operation runs cold (~15 us against 1 us warm), and a decode
    # step's bookkeeping was ~0.3 ms of it
    tokens, positions, slots = [], [], []
    for i, (length, start) in enumerate(zip(lengths, starts)):
        padding = T - length
        if not isinstance(chunks, torch.Tensor):
            tokens += chunks[i] + [0] * padding
        positions += range(start, start + length) if parents is None else [start + d for d in depths(parents[i])]
        positions += [0] * padding
        slots += range(start, start + length)
        slots += [scratch] * padding
    if isinstance(chunks, torch.Tensor):
        tokens, (positions, slots) = chunks, torch.tensor([positions, slots]).view(2, B, T)
    else:
        tokens, positions, slots = torch.tensor([tokens, positions, slots]).view(3, B, T)
    mask = torch.arange(span) <= slots[..., None] if parents is None else tree_mask(parents, starts, T, span)
    if model.reads_features:
        padded = torch.zeros(B, T, model.config.hidden_size, dtype=model.dtype, device=device)
        for i, f in enumerate(features):
            padded[i, :len(f)] = f
        return run_pass(model, cache, rows, tokens, positions, slots, mask, padded)
    if sum(lengths) < RAGGED_BELOW * B * T and not pads_chunks(model):
        return ragged_pass(model, cache, rows, lengths, tokens, positions, slots, mask)
    return run_pass(model, cache, rows, tokens, positions, slots, mask)


RAGGED_BELOW = 0.9  # a pass whose chunks' tokens fill less of its B x T positions runs them without padding


def pads_chunks(model: LlamaModel) -> bool:
    """Whether a pass over chunks of different lengths computes their padding: everywhere but
    on saguaro's kernels (ragged_pass)."""
    return model.native_layers is None


def ragged_pass(model: LlamaModel, cache: KVCache, rows: list[int], lengths: list[int], tokens: torch.Tensor,
                positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """run_pass over the real tokens only, each its own row of one token (the inputs [B, T] as
    forward_chunks pads them; the hidden states come back so padded, zeros at the padding).
    Each token keeps its cache row, slot, position and mask, and every layer writes all tokens'
    KV entries before any attends, so a chunk's tokens still see each other; saguaro's kernels
    compute each token alone and attend each run of one row's tokens together, so the result
    is the padded pass's (torch's attention would gather each token's cache row alone: only on
    the kernels). Chunks of a forced run beside one-token chunks (a batch's jump-forward)
    compute their tokens and no padding."""
    B, T = tokens.shape
    real = torch.tensor([i * T + j for i, n in enumerate(lengths) for j in range(n)])
    flat_rows = [row for row, n in zip(rows, lengths) for _ in range(n)]
    hidden = run_pass(model, cache, flat_rows, *(t.reshape(B * T, 1, *t.shape[2:])[real]
                                                 for t in (tokens, positions, slots, mask)))
    padded = hidden.new_zeros(B * T, hidden.shape[-1])
    padded[real] = hidden[:, 0]
    return padded.view(B, T, -1)


def run_pass(model: LlamaModel, cache: KVCache, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, mask: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
    """The model over cache rows `rows`, its inputs as LlamaModel.forward takes them, on any
    device; replayed where the model has the pass captured (saguaro.models.graphs)."""
    graphs = model.step_graphs
    if graphs is not None and features is None and graphs.takes(tokens.shape[1]):
        return graphs.run(cache, rows, tokens, positions, slots, mask)
    device = model.device
    if device.type != "cpu":  # on the CPU each call, even one that moves nothing, runs cold after a pass
        tokens, positions, slots, mask = (t.to(device, non_blocking=True) for t in (tokens, positions, slots, mask))
    rows_t = None if rows == list(range(len(rows))) else torch.tensor(rows).to(device, non_blocking=True)
    extra = {} if features is None else {"features": features}
    return model(tokens, positions, cache, rows=rows_t, slots=slots, mask=mask, **extra)


def last_hidden(hidden: torch.Tensor, chunks: list[list[int]]) -> torch.Tensor:
    """Each row's hidden state at its last real token: [B, hidden]."""
    lengths = {len(c) for c in chunks}
    if len(lengths) == 1:  # one operation (a decode step's usual case) instead of three
        return hidden[:, lengths.pop() - 1]
    last = torch.tensor([len(c) - 1 for c in chunks]).to(hidden.device, non_blocking=True)
    return hidden[torch.arange(len(chunks), device=hidden.device), last]


PADDING_WASTE = 0.25  # a prefill pass may run this share of padding beyond its real tokens ...
PADDING_ROWS = 16  # ... or this many rows: about what one more pass costs (it reads every weight again)


def length_groups(lengths: list[int], indices: list[int]) -> list[list[int]]:
    """indices split into passes of similar chunk lengths, longest first. A pass pads its chunks
    to its longest, so one long prompt beside short ones would run them all at its length (4
    chat prompts of 49 to 351 tokens: 1,404 rows for 724 tokens)."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted(indices, key=lambda i: -lengths[i]):
        padding = lengths[groups[-1][0]] * (len(groups[-1]) + 1) - real - lengths[i] if groups else None
        if padding is not None and padding <= max(PADDING_WASTE * (real + lengths[i]), PADDING_ROWS):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def prefill_chunks(model: LlamaModel, cache: KVCache, rows: list[int], chunks: list[list[int]],
                   prefix_cache: PrefixCache | None = None, features: list[torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, list[int]]:
    """Runs each chunk (a prompt) into its row from position 0, after copying in the KV entries
    of its longest prefix that the prefix cache holds; then caches the chunks' blocks.

    Chunks that share uncached blocks with an earlier chunk of the same call run in a second
    pass, after the first has cached those blocks (n samples of one prompt, requests with one
    system prompt arriving together compute it once); chunks of very different lengths run in
    passes of their own (`length_groups`). Returns the hidden states of the tokens that ran,
    [B, T, hidden], row i's first len(chunks[i]) - starts[i] being chunk i's tail, and the
    starts: how many tokens of each chunk came from the cache. A model that reads features (an
    EAGLE draft) runs whole chunks, without a prefix cache."""
    first, second, computed = list(range(len(chunks))), [], set()
    if prefix_cache is not None:
        first = []
        for i, chunk in enumerate(chunks):
            keys = prefix_cache.block_keys(chunk[:-1])
            uncached = keys[prefix_cache.cached_blocks(chunk[:-1]):]
            (second if computed.intersection(uncached) else first).append(i)
            computed.update(uncached)
    starts = [0] * len(chunks)
    tails: dict[int, torch.Tensor] = {}
    for group in (first, second):
        if prefix_cache is not None:
            for i in group:
                starts[i] = prefix_cache.restore(cache, rows[i], chunks[i])
        for part in length_groups([len(c) - s for c, s in zip(chunks, starts)], group):
            hidden = forward_chunks(model, cache, [rows[i] for i in part], [chunks[i][starts[i]:] for i in part],
                                    [starts[i] for i in part], None if features is None else [features[i] for i in part])
            for j, i in enumerate(part):
                tails[i] = hidden[j, :len(chunks[i]) - starts[i]]
        if prefix_cache is not None:
            for i in group:
                prefix_cache.store(cache, rows[i], chunks[i])
    width = max(len(t) for t in tails.values())
    hidden = tails[0].new_zeros(len(chunks), width, tails[0].shape[-1])
    for i, tail in tails.items():
        hidden[i, :len(tail)] = tail
    return hidden, starts
