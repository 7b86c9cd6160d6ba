"""Weight-only quantized projections for CPU decoding: int4 and int8 in groups of 32, int8 per channel.

A decode step reads every weight once, so its cost is the bytes it streams; a step's
projections read a quarter of bf16's bytes in int4. saguaro's own kernels
(saguaro.models.native) read int4 and int8 groups at their GGUF density and, as llama.cpp does,
round the activations to 8 bits per group of 32 for integer dot products. torch ships kernels
for int4 groups and per-channel int8 that keep bf16 activations; their fp16 and fp32 paths are
scalar (measured here, one 1536 x 576 int4 product: 0.09 ms in bf16, 8.4 ms in fp16). Either
way quantized layers run in bf16 only, with fp32 sums.

int4 is held as llama.cpp's Q4_0 / Q4_1 / Q4_K hold it: a code 0..15 per weight and, per group
of 32 weights along the input, a scale and an offset (w = code * scale + low), and int8 groups as
Q8_0 holds them (w = code * scale), so those GGUF blocks load code for code. Scales and offsets
round to fp16 in saguaro's kernels (Q4_0, Q4_1 and Q8_0 store them so: exact) and to bf16 in
torch's int4 kernel.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Callable

import numpy as np
import torch
from torch import nn

from saguaro.models.native import bindings, packing
from saguaro.models.gguf_file import forget_pages
from saguaro.models.native.packing import GROUP

MODES = ("auto", "none", "int8", "int4")


@dataclass
class GroupCodes:
    """Weights [out, in] as integer codes with a scale (and, for GroupInt4, a low value) per
    group of GROUP inputs."""
    codes: torch.Tensor  # [out, in]
    scales: torch.Tensor  # [out, in / GROUP] fp32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        out_features = self.codes.shape[0]
        return (self.codes.reshape(out_features, -1, GROUP).float() * self.scales[..., None]).reshape(self.shape)

    def rows(self, index: torch.Tensor):
        return type(self)(*(getattr(self, f.name)[index] for f in fields(self)))

    @classmethod
    def cat(cls, parts: list):
        return cls(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)))


@dataclass
class GroupInt8(GroupCodes):
    """Codes -128..127 (int8), w = code * scale: Q8_0."""

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> GroupInt8:
        """Each group's largest magnitude as 127 steps (round to nearest), as Q8_0 does."""
        groups = weight.float().reshape(weight.shape[0], -1, GROUP)
        scales = (groups.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (groups / scales[..., None]).round_().clamp_(-127, 127)
        return cls(codes.to(torch.int8).reshape(weight.shape), scales)


@dataclass
class GroupAffine(GroupCodes):
    """Unsigned codes, w = code * scale + low."""
    lows: torch.Tensor  # [out, in / GROUP] fp32

    def dequantize(self) -> torch.Tensor:
        return super().dequantize() + self.lows.repeat_interleave(GROUP, dim=1)


@dataclass
class GroupInt5(GroupAffine):
    """Codes 0..31 (uint8): Q5_0, Q5_1, Q5_K."""


@dataclass
class GroupInt4(GroupAffine):
    """Codes 0..15 (uint8): Q4_0, Q4_1, Q4_K."""

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> GroupInt4:
        """Each group's range split into 15 equal steps (round to nearest)."""
        groups = weight.float().reshape(weight.shape[0], -1, GROUP)
        lows, highs = groups.amin(-1), groups.amax(-1)
        scales = ((highs - lows) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = ((groups - lows[..., None]) / scales[..., None]).round_().clamp_(0, 15)
        return cls(codes.to(torch.uint8).reshape(weight.shape), scales, lows)


@dataclass
class GroupInt6(GroupCodes):
    """Codes -32..31 (int8), w = code * sub_scale * scale, an int8 sub-scale per 16 inputs and an
    fp16 scale per 256: Q6_K (the v, down and head of Q4_K_M files)."""
    sub_scales: torch.Tensor  # [out, in / 16] int8; scales: [out, in / 256] fp32 (fp16 values)

    def dequantize(self) -> torch.Tensor:
        per_input = self.sub_scales.float().repeat_interleave(16, dim=1) * self.scales.repeat_interleave(256, dim=1)
        return self.codes.float() * per_input


# ggml's float types (F32, F16, BF16), which saguaro's kernels run as bf16 tiles
FILE_FLOATS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}


@dataclass
class FileBlocks:
    """A GGUF tensor's blocks where the file holds them (mapped, not copied): saguaro's kernels
    repack them into tiles straight from there (native/repack.c), so a load never holds a
    model's codes twice; `groups` decodes them (numpy) where torch's kernels need codes. A float
    tensor (FILE_FLOATS) is tiled as bf16 from the map too, with no fp32 copy of the model."""
    type_id: int  # ggml's type
    data: np.ndarray  # a view of the mapped file: [rows, bytes per row] uint8, or a float tensor's [rows, inputs]
    shape: torch.Size  # [out, in]
    groups_of_file: Callable[[], GroupCodes]  # the whole tensor's codes, in the file's row order
    order: torch.Tensor | None = None  # output row r is the file's row order[r]

    @property
    def bits(self) -> int:
        return 16 if self.type_id in FILE_FLOATS else packing.type_bits(self.type_id)

    def rows(self, index: torch.Tensor) -> FileBlocks:
        return replace(self, order=index if self.order is None else self.order[index])

    def groups(self) -> GroupCodes:
        codes = self.groups_of_file()
        return codes if self.order is None else codes.rows(self.order)

    def values(self) -> torch.Tensor:
        """A float tensor's [out, in] in its own type: a view of the map (read, never written),
        or where rows are reordered a copy."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            raw = torch.from_numpy(self.data)
        values = raw.view(torch.uint8).view(FILE_FLOATS[self.type_id]).view(self.shape)
        return values if self.order is None else values[self.order]

    def tiles(self, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.bits == 16:
            tiles = packing.pack16(self.values(), out)
        else:
            tiles = packing.repack(self.type_id, self.data, self.shape, self.order, out)
        forget_pages(self.data)
        return tiles

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.bits == 16:
            weights = packing.float_rows(self.type_id, tuple(self.shape), self.order, dtype, self.values)
        elif not bindings.available():
            return self.groups().dequantize().to(dtype)
        else:
            written = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32  # what the kernel writes
            weights = packing.dequantize_rows(self.type_id, self.data, self.shape, self.order, written).to(dtype)
        forget_pages(self.data)
        return weights


@dataclass
class StackedCodes:
    """Projections stacked along the outputs whose kinds differ (a fused qkv whose v is Q6_K and
    its q and k Q4_K, as in Q4_K_M files) or that stay in the file: saguaro's kernels run them as
    one."""
    parts: list[GroupCodes | FileBlocks]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]))

    @property
    def bits(self) -> int:
        """The parts' width where it is one, else 0."""
        widths = {part_bits(p) for p in self.parts}
        return widths.pop() if len(widths) == 1 else 0

    def groups(self) -> GroupCodes | torch.Tensor:
        """Codes of one kind, or the dequantized weights where the kinds differ."""
        parts = [p.groups() if isinstance(p, FileBlocks) else p for p in self.parts]
        kinds = {type(p) for p in parts}
        return kinds.pop().cat(parts) if len(kinds) == 1 else self.dequantize()

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


def part_bits(weights: GroupCodes | FileBlocks | torch.Tensor) -> int:
    if isinstance(weights, torch.Tensor):
        return 16
    if isinstance(weights, FileBlocks):
        return weights.bits
    return {GroupInt4: 4, GroupInt5: 5, GroupInt6: 6, GroupInt8: 8}[type(weights)]


def fill_tiles(weights: GroupCodes | FileBlocks, out: torch.Tensor) -> None:
    """weights' tiles written into `out` (from the file where they are still there)."""
    if isinstance(weights, FileBlocks):
        weights.tiles(out)
    else:
        out.copy_(native_tiles(weights)[1].reshape(-1))


def native_tiles(weights: GroupCodes | FileBlocks | StackedCodes) -> tuple[int, torch.Tensor]:
    """(bits, tiles) as group_matmul.c reads them; bits 0 for stacked parts."""
    if isinstance(weights, StackedCodes):
        return 0, packing.stack_parts([(part_bits(p), *p.shape, partial(fill_tiles, p)) for p in weights.parts])
    if isinstance(weights, FileBlocks):
        return weights.bits, weights.tiles()
    if isinstance(weights, torch.Tensor):
        return 16, packing.pack16(weights)
    if isinstance(weights, GroupInt4):
        return 4, packing.pack4(weights.codes, weights.scales, weights.lows)
    if isinstance(weights, GroupInt5):
        return 5, packing.pack5(weights.codes, weights.scales, weights.lows)
    if isinstance(weights, GroupInt6):
        return 6, packing.pack6(weights.codes, weights.sub_scales, weights.scales)
    return 8, packing.pack8(weights.codes, weights.scales)


def fits_int4(out_features: int, in_features: int) -> bool:
    """The shapes torch's int4 CPU kernel takes."""
    return out_features % 16 == 0 and in_features % GROUP == 0


class QuantizedLinear(nn.Module):
    """What the int4 and int8 layers share. Like PackedLinear, an inference-only nn.Linear whose
    `weight` and state dict still give the plain matrix (dequantized, as the kernel reads it),
    which draft initialization and the transformers peer copy."""

    row_invariant = True  # each row's sums in the same order however many rows (tests/test_quantized.py)

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("bias", bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    @property
    def weight(self) -> torch.Tensor:
        """[out, in] in the compute dtype: the kernel applied to the identity, so exactly the weights
        it multiplies by."""
        return self.matmul(torch.eye(self.in_features, dtype=self.compute_dtype)).T.to(self.compute_dtype).contiguous()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(QuantizedLinear):
    """4-bit weights (GroupInt4, or Q4 blocks of the file), computed by saguaro's kernel where it
    runs, else torch's."""

    def __init__(self, weights: GroupInt4 | FileBlocks | StackedCodes, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(*weights.shape, bias)
        self.compute_dtype = dtype
        self.native = bindings.available() and packing.fits(*weights.shape)
        self.bits = None  # what decoder_layer.c reads (saguaro.models.native): a FOUR_BIT_KINDS kind, or 0 for parts
        if self.native:
            self.bits, packed = native_tiles(weights)
            self.register_buffer("packed", packed, persistent=False)
            return
        if not isinstance(weights, GroupInt4):
            weights = weights.groups()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.codes.int(), 2),
                             persistent=False)
        # The kernel computes (code - 8) * scale + zero: the zero is the weight at code 8.
        zeros = weights.lows + 8 * weights.scales
        self.register_buffer("scales_and_zeros", torch.stack([weights.scales, zeros], -1).transpose(0, 1)
                             .contiguous().to(dtype), persistent=False)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.native:
            return bindings.group_matmul(self.bits, self.packed, rows, self.out_features)
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_and_zeros)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={GROUP}"


class GroupLinear(QuantizedLinear):
    """Weights held as Q5, Q6_K or Q8_0 groups, as bf16, or stacked parts of several types
    (saguaro's kernels only). A head's logits come out in fp32."""

    native = True

    def __init__(self, weights: GroupCodes | FileBlocks | StackedCodes, bias: torch.Tensor | None, dtype: torch.dtype,
                 out_dtype: torch.dtype | None = None):
        super().__init__(*weights.shape, bias)
        self.compute_dtype, self.out_dtype = dtype, out_dtype or dtype
        self.bits, packed = native_tiles(weights)
        self.register_buffer("packed", packed, persistent=False)

    def matmul(self, rows: torch.Tensor, legal: np.ndarray | None = None) -> torch.Tensor:
        """legal: a grammar's masks a row (bindings.group_matmul; a head's fp32 logits only)."""
        return bindings.group_matmul(self.bits, self.packed, rows, self.out_features, self.out_dtype, legal)


class Int8Linear(QuantizedLinear):
    """Weights held as int8 with one scale per output (symmetric)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__(*weight.shape, bias)
        scales = (weight.float().abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.register_buffer("codes", (weight.float() / scales[:, None]).round_().to(torch.int8), persistent=False)
        self.register_buffer("scales", scales.to(dtype), persistent=False)

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.scales.dtype

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.codes, self.scales)


def check_mode(quantization: str | None, dtype: torch.dtype, device: torch.device) -> str:
    """The mode to load with: 'auto' keeps a checkpoint's int4 blocks as int4 where the kernels
    run fast (CPU, bf16) and dequantizes the rest; 'none' dequantizes everything."""
    mode = quantization or "auto"
    if mode not in MODES:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {', '.join(MODES)}")
    runnable = device.type == "cpu" and dtype == torch.bfloat16
    if mode == "auto":
        return "auto" if runnable else "none"
    if mode in ("int8", "int4") and not runnable:
        raise ValueError(f"quantization={mode!r} runs on CPU in bf16 (torch's fast kernels); "
                         f"got {device.type} / {str(dtype).removeprefix('torch.')}")
    return mode


def quantized_linear(weight: torch.Tensor | GroupCodes | FileBlocks | StackedCodes, bias: torch.Tensor | None,
                     mode: str, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> nn.Module | None:
    """The quantized layer for one projection, or None where it stays a plain linear layer."""
    out_features, in_features = weight.shape
    if mode == "int8":
        return Int8Linear(weight if isinstance(weight, torch.Tensor) else weight.dequantize(), bias, dtype)
    four_bit = isinstance(weight, GroupInt4) or isinstance(weight, (FileBlocks, StackedCodes)) and \
        weight.bits in packing.FOUR_BIT_KINDS
    if four_bit:
        if mode in ("auto", "int4") and fits_int4(out_features, in_features):
            return Int4Linear(weight, bias, dtype)
    elif not isinstance(weight, torch.Tensor):  # 5, 6 and 8 bits, and parts of several widths
        parts = weight.parts if isinstance(weight, StackedCodes) else [weight]
        if mode == "auto" and bindings.available() and all(packing.fits(*p.shape) for p in parts):
            return GroupLinear(weight, bias, dtype, out_dtype)
    if not isinstance(weight, torch.Tensor):
        weight = weight.dequantize()
    if mode == "int4" and fits_int4(out_features, in_features):
        return Int4Linear(GroupInt4.from_float(weight), bias, dtype)
    if mode == "auto" and bindings.bf16_available() and packing.fits(out_features, in_features):
        return GroupLinear(weight, bias, dtype, out_dtype)  # bf16 weights on the kernels (bindings.bf16_available)
    return None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]
