"""Weights in saguaro's tiles, the layout its kernels read: 16 outputs by 32 inputs a tile, in
the order group_matmul.c streams them, each kind at its own density (Q4_1's 0.625 and Q8_0's 1.06
bytes a weight), packed from codes in torch or repacked from a GGUF file's blocks by repack.c,
into buffers of the weight cache's."""
from __future__ import annotations

import math
import zlib
from typing import Callable

import torch

from saguaro.models import weight_cache
from saguaro.models.native.bindings import library

GROUP = 32  # inputs per group: the block of Q4_0 / Q4_1 / Q8_0 and the sub-block of Q4_K
TILE_OUT = 16  # outputs per tile; a tile covers GROUP inputs


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE_OUT == 0 and in_features % GROUP == 0


def _halves(values: torch.Tensor) -> torch.Tensor:
    """[out, groups] -> [columns, groups, 16 fp16 as 32 bytes]."""
    out_features, groups = values.shape
    tiles = values.reshape(out_features // TILE_OUT, TILE_OUT, groups).transpose(1, 2).to(torch.float16)
    return tiles.contiguous().view(torch.uint8)


def in_chunks(bits: int, tiles: torch.Tensor) -> torch.Tensor:
    """Tiles [columns, groups, bytes] -> [columns x groups, bytes] in group_matmul.c's order:
    chunk by chunk of inputs, column by column within a chunk (saguaro_tile_offset), in a fresh
    buffer on 2 MB pages (weight_cache.fresh_buffer), where a draft's tiles stream faster."""
    columns, groups, tile_bytes = tiles.shape
    chunk = library().saguaro_chunk_groups(bits, groups)
    out = weight_cache.fresh_buffer(tiles.numel()).view(columns * groups, tile_bytes)
    for g in range(0, groups, chunk):
        part = tiles[:, g:g + chunk]
        out[columns * g:columns * (g + part.shape[1])].view(part.shape).copy_(part)
    return out


def pack4(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    """codes [out, in] 0..15, scales and lows [out, in / 32] -> tiles of 320 bytes."""
    return in_chunks(4, _tiles4(codes, scales, lows))


def _tiles4(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    """pack4's tiles as [columns, groups, 320 bytes]."""
    out_features, in_features = codes.shape
    # [column, output j, group, half (inputs 0-15 / 16-31), chunk u, t] -> [column, group, u, j, t, half]
    c = codes.reshape(out_features // TILE_OUT, TILE_OUT, in_features // GROUP, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
    chunks = (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8).reshape(*c.shape[:2], 256)
    return torch.cat([chunks, _halves(scales), _halves(lows)], dim=-1).contiguous()


def pack8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int8, scales [out, in / 32] -> tiles of 544 bytes."""
    out_features, in_features = codes.shape
    # [column, output j, group, chunk k, t] -> [column, group, k, j, t], offset to unsigned
    c = codes.reshape(out_features // TILE_OUT, TILE_OUT, in_features // GROUP, 8, 4).permute(0, 2, 3, 1, 4)
    chunks = (c.to(torch.int16) + 128).to(torch.uint8).reshape(*c.shape[:2], 512)
    return in_chunks(8, torch.cat([chunks, _halves(scales)], dim=-1))


def pack16(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 weights [out, in] (or weights rounded to bf16) -> tiles of 1024 bytes (group_matmul.c),
    into `out` if given, else into a buffer of the weight cache's, as repacked GGUF blocks are:
    on 2 MB pages, from which tiles stream faster than from the heap's 4 KB pages (fresh_buffer),
    and kept on disk with the file's other tiles. Each chunk of inputs is copied straight from
    the weights, without an intermediate."""
    out_features, in_features = weight.shape
    columns, groups = out_features // TILE_OUT, in_features // GROUP
    filled = False
    if out is None:
        out, filled = weight_cache.take(f"bf16 {out_features}x{in_features}", columns * groups * 1024)
    tiles = out.view(torch.bfloat16)
    if not filled:
        # [column, output j, group, chunk k, pair] -> [column, group, k, j, pair], chunk by chunk of groups
        w = weight.reshape(columns, TILE_OUT, groups, 16, 2).permute(0, 2, 3, 1, 4)
        chunk, at = library().saguaro_chunk_groups(16, groups), 0
        for g in range(0, groups, chunk):
            part = w[:, g:g + chunk]
            tiles[at:at + part.numel()].view(part.shape).copy_(part)  # rounded to bf16 here (to nearest even)
            at += part.numel()
    return out.view(columns * groups, 1024)


def pack5(codes: torch.Tensor, scales: torch.Tensor, lows: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1 / Q5_K: codes [out, in] 0..31, scales and lows [out, in / 32] -> tiles of 384
    bytes (group_matmul.c): pack4's record of the low four bits, with the top bits inserted."""
    out_features, in_features = codes.shape
    columns, groups = out_features // TILE_OUT, in_features // GROUP
    low4 = _tiles4(codes & 15, scales, lows)
    # [column, output j, group, half s, chunk u, t] -> [column, group, j, t, u, s]: bit 2u + s
    top = (codes >> 4).reshape(columns, TILE_OUT, groups, 2, 4, 4).permute(0, 2, 1, 5, 4, 3).to(torch.uint8)
    shifts = (2 * torch.arange(4)[:, None] + torch.arange(2)).to(torch.uint8)
    tops = (top << shifts).sum((4, 5), dtype=torch.uint8).reshape(columns, groups, 64)
    return in_chunks(5, torch.cat([low4[..., :256], tops, low4[..., 256:]], dim=-1))


def pack6(codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q6_K: codes [out, in] -32..31, scales [out, in / 16] int8 (one per half group), d [out,
    in / 256] fp16 -> tiles of 448 bytes (group_matmul.c)."""
    out_features, in_features = codes.shape
    columns, groups = out_features // TILE_OUT, in_features // GROUP
    c = (codes.to(torch.int16) + 32).to(torch.uint8)
    # [column, output j, group, half s, triple h, v, t] -> [column, group, h, s, v, j, t]: input 16s + 8h + 4v + t
    c = c.reshape(columns, TILE_OUT, groups, 2, 2, 2, 4).permute(0, 2, 4, 3, 5, 1, 6)
    fourth = c[:, :, :, 1, 1]  # its two bits atop each of the triple's chunks
    triples = torch.stack([c[:, :, :, 0, 0] | (fourth & 3) << 6, c[:, :, :, 0, 1] | (fourth >> 2 & 3) << 6,
                           c[:, :, :, 1, 0] | (fourth >> 4) << 6], dim=3).reshape(columns, groups, 384)
    halves = scales.to(torch.int8).reshape(columns, TILE_OUT, groups, 2).permute(0, 2, 3, 1)
    per_group = d.repeat_interleave(256 // GROUP, dim=1)  # [out, groups]
    return in_chunks(6, torch.cat([triples, halves.contiguous().view(torch.uint8).reshape(columns, groups, 32),
                                   _halves(per_group)], dim=-1))


# ggml's type ids of the blocks repack.c reads, and the tiles' kind for each: its width or a kind
# of group_matmul.c's
NL4 = 104  # 4-bit codes into IQ4's table of non-linear values
SYM4 = 100  # Q4_0's 4-bit codes offset by 8: the 4-bit record without its lows
# Q2_K's, Q3_K's, Q4_K's, Q5_K's and Q6_K's records of a 256-input block, its scales held once as the file holds them
K2, K3, K4, K5, K6 = 122, 123, 124, 125, 126
FOUR_BIT_KINDS = (4, SYM4, K4)  # the kinds torch's int4 kernel also runs, where saguaro's do not
TYPE_BITS = {2: SYM4, 3: 4, 12: K4, 6: 5, 7: 5, 13: K5, 14: K6, 8: 8,  # Q4_0 Q4_1 Q4_K, Q5_0 Q5_1 Q5_K, Q6_K, Q8_0
             10: K2, 11: K3, 20: NL4, 23: NL4}  # Q2_K, Q3_K, IQ4_NL, IQ4_XS
# bytes per 16 outputs x 32 inputs (K2 to K6: their record's over its 8 groups)
TILE_BYTES = {4: 320, 5: 384, 6: 448, 8: 544, 16: 1024, NL4: 288, SYM4: 288, K2: 168, K3: 228, K4: 296, K5: 360, K6: 420}


def type_bits(type_id: int) -> int:
    """The tiles' width for a GGUF block type; 0 where the kernels do not read it."""
    return TYPE_BITS.get(type_id, 0)


def _tag(what: str, type_id: int, shape: tuple[int, int], order: torch.Tensor | None) -> str:
    """What a buffer holds, for the weight cache: a GGUF tensor's type, shape and row order."""
    rows = "" if order is None else f" rows {zlib.crc32(order.to(torch.int64).numpy().tobytes()):08x}"
    return f"{what} {type_id} {tuple(shape)}{rows}"


def _row_order(order: torch.Tensor | None, rows: int) -> torch.Tensor:
    return (torch.arange(rows) if order is None else order).to(torch.int64).contiguous()


def repack(type_id: int, blocks, shape: tuple[int, int], order: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF blocks ([rows, bytes per row] uint8, e.g. a view of the mapped file) -> tiles (into
    `out` if given), output row r from the blocks' row order[r]. Threads over tile columns."""
    out_features, in_features = shape
    size = (out_features // TILE_OUT * (in_features // GROUP), TILE_BYTES[type_bits(type_id)])  # in_chunks' shape
    if out is None:
        out, filled = weight_cache.take(_tag("repack", type_id, shape, order), math.prod(size))
        if filled:
            return out.view(size)
    tiles = out.view(size)
    rows = _row_order(order, out_features)
    status = library().saguaro_repack(type_id, blocks.ctypes.data, blocks.strides[0], out_features, in_features,
                                      rows.data_ptr(), tiles.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"saguaro_repack: GGUF type {type_id} of shape {tuple(shape)} does not fit the tiles")
    return tiles


def dequantize_rows(type_id: int, blocks, shape: tuple[int, int], order: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGUF blocks -> the weights in fp32 or bf16 (rounded to nearest even), rows in `order`."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"saguaro_dequantize_rows writes fp32 or bf16, not {dtype}")
    rows = _row_order(order, shape[0])
    buffer, filled = weight_cache.take(_tag(f"rows {dtype}", type_id, shape, order), len(rows) * shape[1] * dtype.itemsize)
    out = buffer.view(dtype).view(len(rows), shape[1])
    if filled:
        return out
    status = library().saguaro_dequantize_rows(type_id, blocks.ctypes.data, blocks.strides[0], shape[1], rows.data_ptr(),
                                               len(rows), out.data_ptr(), int(dtype == torch.bfloat16),
                                               torch.get_num_threads())
    if status != 0:
        raise ValueError(f"saguaro_dequantize_rows: GGUF type {type_id} of shape {tuple(shape)} is not one it reads")
    return out


def float_rows(type_id: int, shape: tuple[int, int], order: torch.Tensor | None, dtype: torch.dtype,
               values: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A float GGUF tensor (an embedding table) in `dtype`, in a buffer of the weight cache's: once
    the cache holds it, a mapping whose pages become resident only for the rows read. values()
    gives the rows, in order, where the cache does not hold them."""
    buffer, filled = weight_cache.take(_tag(f"rows {dtype}", type_id, shape, order), math.prod(shape) * dtype.itemsize)
    out = buffer.view(dtype).view(shape)
    if not filled:
        out.copy_(values())
    return out


HEADER_BYTES, MAX_PARTS = 64, 3


def stack_parts(parts: list[tuple[int, int, int, Callable[[torch.Tensor | None], torch.Tensor]]]) -> torch.Tensor:
    """Projections stacked along the outputs as one (bits = 0 in group_matmul): a 64-byte header
    of the parts' (bits, outputs), then their tiles. Each part is (bits, outputs, inputs, fill),
    fill(out) writing the part's tiles into `out` (a slice of the whole), so nothing is copied."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"{len(parts)} parts: saguaro's kernels stack 1 to {MAX_PARTS}")
    sizes = [out_features // TILE_OUT * (in_features // GROUP) * TILE_BYTES[bits] for bits, out_features, in_features, _ in parts]
    tag = "stack " + ", ".join(f"{bits} {out_features}x{in_features}" for bits, out_features, in_features, _ in parts)
    stacked, filled = weight_cache.take(tag, HEADER_BYTES + sum(sizes))
    if filled:
        return stacked
    header = torch.zeros(HEADER_BYTES // 8, dtype=torch.int64)
    header[0] = len(parts)
    at = HEADER_BYTES
    for i, ((bits, out_features, _, fill), size) in enumerate(zip(parts, sizes)):
        header[1 + 2 * i], header[2 + 2 * i] = bits, out_features
        fill(stacked[at:at + size])
        at += size
    stacked[:HEADER_BYTES] = header.view(torch.uint8)
    return stacked
