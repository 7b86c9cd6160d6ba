"""Runs a model over token chunks of different lengths, one chunk per cache row."""
from __future__ import annotations

import torch

from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel


def forward_chunks(model: LlamaModel, cache: KVCache, rows: list[int], chunks: list[list[int]],
                   starts: list[int], features: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Appends chunk i to cache row rows[i] at positions starts[i], starts[i]+1, ...

    Chunks are right-padded to one length; padding is written to the cache's last slot,
    which is kept as scratch and never attended to. Returns hidden states [B, T, hidden];
    row i's real tokens are the first len(chunks[i]). A model that reads features (an EAGLE
    draft) takes features[i], [len(chunks[i]), hidden], with chunk i.
    """
    device = model.device
    B, T = len(chunks), max(len(c) for c in chunks)
    scratch = cache.num_slots - 1
    offsets = torch.arange(T)
    real = offsets < torch.tensor([len(c) for c in chunks])[:, None]
    tokens = torch.tensor([c + [0] * (T - len(c)) for c in chunks])
    positions = torch.where(real, torch.tensor(starts)[:, None] + offsets, 0)
    slots = torch.where(real, positions, scratch)
    span = max(s + len(c) for s, c in zip(starts, chunks))
    if span > scratch:
        raise IndexError(f"sequence of {span} tokens does not fit a KV cache of {scratch} slots")
    mask = torch.arange(span) <= slots[..., None]
    rows_t = None if rows == list(range(B)) else torch.tensor(rows, device=device)
    extra = {}
    if model.reads_features:
        padded = torch.zeros(B, T, model.config.hidden_size, dtype=model.dtype, device=device)
        for i, f in enumerate(features):
            padded[i, :len(f)] = f
        extra["features"] = padded
    return model(tokens.to(device), positions.to(device), cache, rows=rows_t,
                 slots=slots.to(device), mask=mask.to(device), **extra)


def last_hidden(hidden: torch.Tensor, chunks: list[list[int]]) -> torch.Tensor:
    """Each row's hidden state at its last real token: [B, hidden]."""
    last = torch.tensor([len(c) - 1 for c in chunks], device=hidden.device)
    return hidden[torch.arange(len(chunks), device=hidden.device), last]
