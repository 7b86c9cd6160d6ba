"""A static KV cache: one row per sequence, one slot per token.

The cache keeps no lengths of its own. Callers know how many slots of a row hold committed
tokens; rolling back rejected tokens is just using a smaller length, and the stale slots are
overwritten by the next write.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from saguaro.models.config import ModelConfig

if TYPE_CHECKING:
    from saguaro.models.llama import LlamaModel


class KVCache:
    def __init__(self, config: ModelConfig, num_rows: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (config.num_layers, num_rows, config.num_kv_heads, num_slots, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    def grow(self, num_rows: int, num_slots: int) -> None:
        """At least num_rows rows of num_slots slots, keeping what it holds."""
        rows, slots = self.num_rows, self.num_slots
        shape = (self.keys.shape[0], max(num_rows, rows), self.keys.shape[2], max(num_slots, slots), self.keys.shape[4])
        keys, values = self.keys.new_zeros(shape), self.values.new_zeros(shape)
        keys[:, :rows, :, :slots] = self.keys
        values[:, :rows, :, :slots] = self.values
        self.keys, self.values = keys, values

    @property
    def num_rows(self) -> int:
        return self.keys.shape[1]

    @property
    def num_slots(self) -> int:
        return self.keys.shape[3]

    def write(self, layer: int, rows: torch.Tensor | slice | None, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v ([B, T, Hkv, D]) at `slots` ([B, T]) of `rows` (default 0..B-1; see
        `as_slice`) and returns the first `span` slots of those rows as [B, Hkv, span, D]."""
        keys, values = self.keys[layer], self.values[layer]
        read = rows
        if rows is None or isinstance(rows, slice):
            if rows is not None:
                keys, values = keys[rows], values[rows]
            rows, read = torch.arange(k.shape[0], device=k.device), slice(0, k.shape[0])
        keys[rows[:, None], :, slots] = k
        values[rows[:, None], :, slots] = v
        return keys[read, :, :span], values[read, :, :span]

    def move(self, row: int, sources: list[int], targets: list[int]) -> None:
        """Copies a row's entries at slots `sources` to slots `targets` in every layer: a token
        tree's accepted path, to where the text it joins continues."""
        if sources == targets:
            return
        sources, targets = torch.tensor(sources), torch.tensor(targets)
        for entries in (self.keys, self.values):
            entries[:, row, :, targets] = entries[:, row, :, sources]


def as_slice(rows: torch.Tensor | None) -> torch.Tensor | slice | None:
    """Consecutive rows as a slice: reading them is then a view, where indexing with a tensor
    copies every row's keys and values in every layer (at batch 1 and 250 cached tokens, about
    5% of an fp32 decode step)."""
    if rows is None or rows.numel() == 0:
        return rows
    first = int(rows[0])
    if rows.tolist() == list(range(first, first + rows.numel())):
        return slice(first, first + rows.numel())
    return rows


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """What one token's keys and values take in a KVCache of this model, over all its layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


def new_cache(model: LlamaModel, num_rows: int, num_slots: int) -> KVCache:
    """A cache with one extra slot per row: the scratch slot that padding writes to."""
    return KVCache(model.config, num_rows, num_slots + 1, model.dtype, model.device)


def ensure_cache(cache: KVCache | None, model: LlamaModel, num_rows: int, num_slots: int) -> KVCache:
    """A cache with at least num_rows rows of num_slots usable slots. A cache grows in place,
    keeping what it held, so sequences in flight survive a larger batch joining them (and a
    tensor-parallel target's other ranks know it as the same cache)."""
    if cache is not None and cache.num_rows >= num_rows and cache.num_slots > num_slots:
        return cache
    if cache is None:
        return new_cache(model, num_rows, num_slots)
    cache.grow(num_rows, num_slots + 1)  # the scratch slot, as new_cache adds it
    return cache


class CacheRows:
    """Which cache row each live sequence holds."""

    def __init__(self):
        self.of: dict[int, int] = {}  # seq_id -> row

    def assign(self, seq_ids: list[int], num_rows: int) -> list[int]:
        """Gives each new sequence the lowest free row of a cache with num_rows rows."""
        free = sorted(set(range(num_rows)) - set(self.of.values()))
        if len(free) < len(seq_ids):
            raise RuntimeError(f"no free KV cache row ({num_rows} rows, {len(self.of)} taken)")
        for seq_id, row in zip(seq_ids, free):
            self.of[seq_id] = row
        return [self.of[s] for s in seq_ids]

    def free(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.of.pop(seq_id, None)

    def __getitem__(self, seq_ids: list[int]) -> list[int]:
        return [self.of[s] for s in seq_ids]

    def __len__(self) -> int:
        return len(self.of)
