"""GGUF quantized blocks as saguaro's codes: ggml's block layouts decoded into GroupInt4 /
GroupInt5 / GroupInt6 / GroupInt8, or left in the mapped file for the kernels to repack."""
from __future__ import annotations

import numpy as np
import torch

from saguaro.models.native import bindings, packing
from saguaro.models.quantized import FILE_FLOATS, GROUP, FileBlocks, GroupCodes, GroupInt4, GroupInt5, GroupInt6, GroupInt8


def _halves(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of each block, as fp32."""
    return blocks[:, offset:offset + 2].copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[..., n bytes] -> [..., 2, n] codes: the low nibbles hold the first n weights, the high the next n."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-2)


def _q6_k(blocks: np.ndarray, out_features: int, in_features: int) -> GroupInt6:
    """Q6_K, 210 bytes per 256 weights: per half of 128, 64 bytes of low nibbles and 32 of top
    bit pairs (llama.cpp's order: weight 32i + l of the half from byte l or 32 + l, the low or
    high nibble, and bit pair i of top byte l); then 16 int8 sub-scales, then fp16 d."""
    halves = []
    for n in range(2):
        low, top = blocks[:, 64 * n:64 * n + 64], blocks[:, 128 + 32 * n:160 + 32 * n]
        nibbles = [low[:, :32] & 15, low[:, 32:] & 15, low[:, :32] >> 4, low[:, 32:] >> 4]
        halves += [nibbles[i] | (((top >> (2 * i)) & 3) << 4) for i in range(4)]
    codes = (np.concatenate(halves, axis=1).astype(np.int16) - 32).astype(np.int8)
    sub_scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
    return GroupInt6(torch.from_numpy(codes.reshape(out_features, in_features)),
                     torch.from_numpy(_halves(blocks, 208).reshape(out_features, in_features // 256)),
                     torch.from_numpy(sub_scales.reshape(out_features, in_features // 16).copy()))


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's per-32 scales and lows: fp16 d and dmin, then 8 six-bit scales and mins in
    12 bytes. [blocks, 8] each."""
    d, dmin, packed = _halves(blocks, 0), _halves(blocks, 2), blocks[:, 4:16].astype(np.uint16)
    low6 = packed[:, 0:4] & 0x3F, packed[:, 4:8] & 0x3F
    high = (packed[:, 8:12] & 0x0F) | ((packed[:, 0:4] >> 6) << 4), (packed[:, 8:12] >> 4) | ((packed[:, 4:8] >> 6) << 4)
    sub_scales = np.concatenate([low6[0], high[0]], axis=1).astype(np.float32)
    sub_mins = np.concatenate([low6[1], high[1]], axis=1).astype(np.float32)
    return d[:, None] * sub_scales, -(dmin[:, None] * sub_mins)


def _top_bits(bits: np.ndarray, count: int) -> np.ndarray:
    """Q5_0 / Q5_1's 32-bit field of top bits (bit e for weight e) -> [blocks, count] of 0 or 16."""
    return ((np.ascontiguousarray(bits).view(np.uint32)[:, :1] >> np.arange(count, dtype=np.uint32)) & 1).astype(
        np.uint8) << 4


DECODED = (2, 3, 6, 7, 8, 12, 13, 14)  # ggml type ids gguf_groups decodes: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_0": 22, "Q5_1": 24, "Q5_K": 176}


def gguf_groups(tensor) -> GroupCodes | None:
    """A Q4_0 / Q4_1 / Q4_K / Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 tensor's own codes, scales and
    offsets (ggml's block layouts); None for other types."""
    from gguf import GGMLQuantizationType as Q

    kind = tensor.tensor_type
    out_features, in_features = (int(n) for n in reversed(tensor.shape))
    if kind == Q.Q8_0:  # 32 weights: fp16 d, 32 signed codes
        blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, 34)
        codes = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
        return GroupInt8(torch.from_numpy(codes.reshape(out_features, in_features)),
                         torch.from_numpy(_halves(blocks, 0).reshape(out_features, in_features // GROUP)))
    if kind == Q.Q6_K:
        return _q6_k(np.asarray(tensor.data, dtype=np.uint8).reshape(-1, 210), out_features, in_features)
    if kind.name not in BLOCK_BYTES:
        return None
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, BLOCK_BYTES[kind.name])
    if kind == Q.Q4_K:  # 256 weights: scales (12 bytes after d, dmin), 128 bytes of codes
        scales, lows = _k_scales(blocks)
        codes = _nibbles(blocks[:, 16:].reshape(-1, 4, 32))  # 4 chunks of 64 weights
    elif kind == Q.Q5_K:  # as Q4_K, with 32 bytes of top bits (bit 2c + h of byte l: chunk c, half h)
        scales, lows = _k_scales(blocks)
        top = (blocks[:, 16:48, None, None] >> (2 * np.arange(4)[:, None] + np.arange(2)).astype(np.uint8)) & 1
        codes = _nibbles(blocks[:, 48:].reshape(-1, 4, 32)) | (top.transpose(0, 2, 3, 1) << 4)
    else:  # 32 weights: fp16 d (Q4_1 / Q5_1: and fp16 m), Q5: 4 bytes of top bits; 16 bytes of codes
        scales = _halves(blocks, 0)[:, None]
        offset = -(16 if kind == Q.Q5_0 else 8) * scales
        lows = _halves(blocks, 2)[:, None] if kind in (Q.Q4_1, Q.Q5_1) else offset
        codes = _nibbles(blocks[:, -16:]).reshape(-1, 32)
        if kind in (Q.Q5_0, Q.Q5_1):
            codes = codes | _top_bits(blocks[:, -20:-16], 32)
    groups = in_features // GROUP
    group_type = GroupInt5 if kind in (Q.Q5_0, Q.Q5_1, Q.Q5_K) else GroupInt4
    return group_type(torch.from_numpy(np.ascontiguousarray(codes.reshape(out_features, in_features))),
                      torch.from_numpy(np.ascontiguousarray(scales.reshape(out_features, groups))),
                      torch.from_numpy(np.ascontiguousarray(lows.reshape(out_features, groups))))


def file_blocks(tensor) -> FileBlocks | None:
    """A tensor of a type saguaro's kernels read, left in the mapped file (see FileBlocks)."""
    kind = int(tensor.tensor_type)
    if kind in FILE_FLOATS:
        if len(tensor.shape) != 2 or not bindings.bf16_available():
            return None  # (without AVX512-BF16 float weights run on torch's kernels, dequantized)
    elif not packing.type_bits(kind) or kind not in DECODED and not bindings.available():
        return None  # (IQ4's and Q3_K's codes have no decoder besides repack.c's: gguf-py dequantizes them)
    out_features, in_features = (int(n) for n in reversed(tensor.shape))
    return FileBlocks(kind, np.asarray(tensor.data).reshape(out_features, -1), torch.Size((out_features, in_features)),
                      lambda: gguf_groups(tensor))
