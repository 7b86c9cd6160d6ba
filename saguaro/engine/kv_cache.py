"""A static KV cache: one row per sequence, one slot per token.

The cache keeps no lengths of its own. Callers know how many slots of a row hold committed
tokens; rolling back rejected tokens is just using a smaller length, and the stale slots are
overwritten by the next write.
"""
from __future__ import annotations

import torch

from saguaro.models.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_rows: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (config.num_layers, num_rows, config.num_kv_heads, num_slots, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_rows(self) -> int:
        return self.keys.shape[1]

    @property
    def num_slots(self) -> int:
        return self.keys.shape[3]

    def write(self, layer: int, rows: torch.Tensor | None, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v ([B, T, Hkv, D]) at `slots` ([B, T]) of `rows` and returns the first
        `span` slots of those rows as [B, Hkv, span, D]."""
        B = k.shape[0]
        keys, values = self.keys[layer], self.values[layer]
        row_index = (torch.arange(B, device=k.device) if rows is None else rows)[:, None]
        keys[row_index, :, slots] = k
        values[row_index, :, slots] = v
        if rows is None:
            return keys[:B, :, :span], values[:B, :, :span]
        return keys[rows, :, :span], values[rows, :, :span]
