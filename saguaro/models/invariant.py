"""Batch-invariant numerics: a position's logits do not depend on what shares its pass.

Greedy SD and SSD equal AR token for token only if verifying K + 1 tokens computes each of them
bit for bit as a one-token AR step does. Library kernels do not promise that: they pick their
blocking, and so the order in which they add, from the shapes. Measured on this project's CPU
(oneDNN bf16, avx512_bf16): projections round one way for 1-32 rows and another beyond 32;
fp16 and fp32 products round one way for a single row and another for 2-200 rows; the fused
attention kernel's result depends on the query length and on how many masked slots follow.
In bf16, the default, they made greedy SD leave AR on 4 of 8 held-out prompts and SSD on 6 of
8 within 128 tokens (docs/benchmarks-log.md).

So, where invariance is on, every projection runs on slices of at most ROW_BLOCK rows (in fp16
and fp32 a single row is paired with a copy of itself), and attention is computed in fp32 from
two plain products over at least MIN_QUERY_ROWS query rows, where masked slots add exact zeros.
tests/test_invariance.py checks the claim on the kernels of the machine it runs on.
"""
from __future__ import annotations

import torch
from torch import nn

ROW_BLOCK = 32  # the most rows oneDNN's bf16 kernel takes before it changes its blocking
MIN_QUERY_ROWS = 3  # fp32 batched products with 1-2 rows round differently from 3 or more


def min_rows(dtype: torch.dtype) -> int:
    """fp16 / fp32 products of one row take a matrix-vector path that rounds differently from
    2 rows or more; bf16's one row already runs the 2-32 row kernel."""
    return 1 if dtype == torch.bfloat16 else 2


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """linear(x), each row computed by the same kernel however many rows x has."""
    if getattr(linear, "row_invariant", False):  # its kernel computes each row alone (quantized.py)
        return linear(x)
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] < min_rows(x.dtype):
        out = linear(rows.repeat(min_rows(x.dtype), 1))[:rows.shape[0]]
    elif rows.shape[0] <= ROW_BLOCK:
        out = linear(rows)
    else:
        out = torch.cat([project(linear, block) for block in rows.split(ROW_BLOCK)])
    return out.reshape(*x.shape[:-1], out.shape[-1])


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor | None,
              scale: float | None = None, cap: float | None = None) -> torch.Tensor:
    """softmax(cap(q k^T * scale)) v over [B, H, rows, D] queries, in fp32, rounded once at the
    end; scale defaults to 1/sqrt(D), cap (Gemma 2's soft-capping) to none."""
    rows = q.shape[2]
    if rows < MIN_QUERY_ROWS:
        q = torch.cat([q, q[:, :, -1:].expand(-1, -1, MIN_QUERY_ROWS - rows, -1)], dim=2)
        if attn_mask is not None:
            attn_mask = torch.cat([attn_mask, attn_mask[:, :, -1:].expand(-1, -1, MIN_QUERY_ROWS - rows, -1)], dim=2)
    scores = (q.float() @ keys.float().transpose(-1, -2)).mul_(scale or q.shape[-1] ** -0.5)
    if cap is not None:
        scores = torch.tanh(scores / cap).mul_(cap)
    if attn_mask is not None:
        scores.masked_fill_(~attn_mask, float("-inf"))
    out = scores.softmax(dim=-1) @ values.float()
    return out[:, :, :rows].to(q.dtype)
