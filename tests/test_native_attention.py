"""decoder_layer.c's attention alone (saguaro_attention) against a float64 reference on the same
bf16 queries, keys and values: within half a bf16 step of the exact value, less fp32's own error;
each query's result bit-identical whatever shares the call. Controls: the same check rejects a
result that misses one slot, or weighs two slots' values by each other's scores (a wrong lane
of a summing tree), and the bit-for-bit comparison sees a change of rounding order."""
from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import pytest
import torch

from saguaro.models.native import bindings

pytestmark = pytest.mark.skipif(not bindings.available(), reason="saguaro's CPU kernels are not available here")

# (query heads, kv heads, head size): SmolLM2-135M's, its 1.7B-cost twin's (issue 53), and a
# head of 128 with groups of 4
SHAPES = {"135m": (9, 3, 64), "twin": (30, 10, 64), "head 128": (8, 2, 128)}
# fp32's error on a result, relative to its row's rms: 1.9e-6 of the row's norm measured at up
# to 2,000 slots (2026-12-05), the norm 8 to 11 times the rms at these head sizes
FP32_SLACK = 2.0 ** -13


@dataclass
class Attention:
    """One call's inputs: queries [n, H, D], a cache [rows, Hkv, slots, D] and each token's row and
    visible slots [n, span] (None: every slot)."""
    q: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    row_of: torch.Tensor
    mask: torch.Tensor | None
    scale: float = 0.0
    cap: float = 0.0

    @property
    def span(self) -> int:
        return self.keys.shape[2]

    def take(self, tokens: torch.Tensor) -> Attention:
        """The same attention for some of the tokens, in the given order."""
        mask = None if self.mask is None else self.mask[tokens]
        return Attention(self.q[tokens], self.keys, self.values, self.row_of[tokens], mask, self.scale, self.cap)


def make(shape: str, tokens: int, span: int, seed: int, rows: int = 1, holes: bool = False, query_scale: float = 2.0,
         **options) -> Attention:
    """Random queries, keys and values; the tokens causal over the last `tokens` slots of their row
    (a verification of tokens - 1 drafts), with random masked slots where `holes`."""
    heads, kv_heads, head_dim = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    n = tokens * rows
    q = (torch.randn(n, heads, head_dim, generator=g) * query_scale).to(torch.bfloat16)
    keys = torch.randn(rows, kv_heads, span, head_dim, generator=g).to(torch.bfloat16)
    values = torch.randn(rows, kv_heads, span, head_dim, generator=g).to(torch.bfloat16)
    position = torch.arange(tokens).repeat(rows)
    mask = torch.arange(span)[None, :] <= (span - tokens + position)[:, None]
    if holes:
        mask &= torch.rand(n, span, generator=g) > 0.2
        mask[:, 0] = True
    row_of = torch.arange(rows).repeat_interleave(tokens)
    return Attention(q, keys, values, row_of, mask, **options)


def kernel(a: Attention, threads: int = 1) -> torch.Tensor:
    """saguaro_attention's bf16 result [n, H, D]."""
    n, heads, head_dim = a.q.shape
    kv_heads = a.keys.shape[1]
    qkv = torch.zeros(n, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    qkv[:, :heads * head_dim] = a.q.reshape(n, -1)
    weights = bindings.LayerWeights(heads=heads, kv_heads=kv_heads, head_dim=head_dim, attn_scale=a.scale,
                                  attn_softcap=a.cap)
    mask = None if a.mask is None else a.mask.to(torch.uint8).contiguous()
    row_of = a.row_of.to(torch.int64).contiguous()
    out = torch.empty(n, heads, head_dim, dtype=torch.bfloat16)
    status = bindings.library().saguaro_attention(
        ctypes.byref(weights), qkv.data_ptr(), n, a.keys.contiguous().data_ptr(), a.values.contiguous().data_ptr(),
        a.span, row_of.data_ptr(), None if mask is None else mask.data_ptr(), a.span, out.data_ptr(), threads)
    assert status == 0
    return out


def reference(a: Attention, scores_of=None) -> torch.Tensor:
    """softmax(cap(q k^T scale)) v in float64 [n, H, D]; scores_of(scores, visible) may change the
    scores first (the controls)."""
    n, heads, head_dim = a.q.shape
    kv_heads = a.keys.shape[1]
    q = a.q.double().reshape(n, kv_heads, heads // kv_heads, head_dim)
    scores = torch.empty(n, kv_heads, heads // kv_heads, a.span, dtype=torch.float64)
    for row in a.row_of.unique().tolist():
        tokens = a.row_of == row
        scores[tokens] = torch.einsum("nkgd,ksd->nkgs", q[tokens], a.keys[row].double())
    scores = scores.reshape(n, heads, a.span) * (a.scale or 1 / math.sqrt(head_dim))
    if a.cap:
        scores = a.cap * torch.tanh(scores / a.cap)
    visible = torch.ones(n, a.span, dtype=torch.bool) if a.mask is None else a.mask
    visible = visible[:, None, :].expand_as(scores)
    if scores_of is not None:
        scores = scores_of(scores, visible)
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1).reshape(n, kv_heads, -1, a.span)
    out = torch.empty(n, kv_heads, heads // kv_heads, head_dim, dtype=torch.float64)
    for row in a.row_of.unique().tolist():
        tokens = a.row_of == row
        out[tokens] = torch.einsum("nkgs,ksd->nkgd", weights[tokens], a.values[row].double())
    return out.reshape(n, heads, head_dim)


def misfit(result: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest error of a bf16 result over what rounding the exact value to bf16 and fp32's own
    error allow: at most 1 for a correct kernel."""
    step = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)  # bf16's, at the value
    rms = exact.pow(2).mean(-1, keepdim=True).sqrt()
    return ((result.double() - exact).abs() / (step / 2 + FP32_SLACK * rms)).max().item()


# one token (a step) and 6 (a verification) over 1 to 2,000 slots, and 16 (past one batch of 32
# queries at 3 a kv head), each shape
CASES = [(shape, tokens, span, holes) for shape in SHAPES for tokens in (1, 6)
         for span, holes in ((1, False), (17, True), (256, False), (1000, True), (2000, False)) if span >= tokens]
CASES += [(shape, 16, span, holes) for shape in SHAPES for span, holes in ((17, True), (700, False))]


@pytest.mark.parametrize("shape, tokens, span, holes", CASES)
def test_attention_is_the_float64_value_rounded_to_bf16(shape, tokens, span, holes):
    a = make(shape, tokens, span, seed=span + tokens, holes=holes)
    assert misfit(kernel(a), reference(a)) <= 1


@pytest.mark.parametrize("options", [dict(scale=0.07), dict(cap=5.0), dict(scale=0.2, cap=3.0)], ids=str)
def test_scale_and_soft_cap_are_the_float64_values(options):
    a = make("135m", 6, 300, seed=3, holes=True, **options)
    assert misfit(kernel(a), reference(a)) <= 1


def test_tokens_of_several_cache_rows_read_their_own_rows():
    a = make("twin", 6, 200, seed=4, rows=3)
    assert misfit(kernel(a, threads=2), reference(a)) <= 1


def _without_last_visible_slot(scores, visible):
    last = visible.cumsum(-1).argmax(-1, keepdim=True)  # each row's last visible slot
    return scores.scatter(-1, last, -math.inf)


def _two_slots_swapped(scores, visible):
    order = torch.arange(scores.shape[-1])
    order[[16, 17]] = order[[17, 16]]  # slots 16 and 17: two lanes of one block of 16
    return scores[..., order]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("broken", [_without_last_visible_slot, _two_slots_swapped], ids=lambda f: f.__name__[1:])
def test_control_the_check_rejects_a_missing_or_misplaced_slot(shape, broken):
    for tokens, span in ((1, 1000), (6, 256)):
        a = make(shape, tokens, span, seed=span + tokens)
        assert misfit(kernel(a), reference(a, broken)) > 2


def test_a_querys_result_does_not_depend_on_what_shares_the_call():
    """Each token alone, in every run of 6 and 16 tokens at any position, shuffled, on 1 or 2
    threads (which part a kv head's queries differently), and with another row's tokens."""
    a = make("135m", 16, 500, seed=5, holes=True)
    full = kernel(a)
    for t in range(16):
        assert torch.equal(kernel(a.take(torch.tensor([t])))[0], full[t])
    for start in range(11):
        assert torch.equal(kernel(a.take(torch.arange(start, start + 6))), full[start:start + 6])
    order = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kernel(a.take(order), threads=2), full[order])
    other = make("135m", 16, 500, seed=6, holes=True)
    two_rows = Attention(torch.cat([other.q, a.q]), torch.cat([other.keys, a.keys]), torch.cat([other.values, a.values]),
                         torch.tensor([0] * 16 + [1] * 16), torch.cat([other.mask, a.mask]))
    assert torch.equal(kernel(two_rows, threads=2)[16:], full)


def test_control_bit_equality_sees_another_rounding_order():
    """The float64 reference rounded through fp32 in torch's order differs from the kernel in some
    bits, as any other order of sums would: equality above is not equality by construction."""
    a = make("135m", 16, 500, seed=5, holes=True)
    visible = a.mask[:, None, :].expand(-1, a.q.shape[1], -1)
    keys = a.keys[a.row_of].float().repeat_interleave(3, dim=1)
    scores = torch.einsum("nhd,nhsd->nhs", a.q.float(), keys) / 8
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
    other = torch.einsum("nhs,nhsd->nhd", weights, a.values[a.row_of].float().repeat_interleave(3, dim=1))
    assert not torch.equal(other.to(torch.bfloat16), kernel(a))
