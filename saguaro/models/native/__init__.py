"""saguaro's own CPU kernels (group_matmul.c, decoder_layer.c), compiled with the system C
compiler at first use.

A decode step streams every weight once, so its speed is the bytes it reads per token. torch's
int4 kernel reads a GGUF's 4-bit weights with bf16 scales and zeros, and no torch kernel reads
8-bit blocks, so a Q8_0 head (the tied embedding of most GGUF files) ran as a bf16 matrix twice
its size. group_matmul.c reads both at their own density (Q4_1's 0.625 and Q8_0's 1.06 bytes a
weight) and multiplies as llama.cpp does: activations rounded to 8 bits per group of 32, integer
dot products (AVX512-VNNI, or AVX2's byte pair products), fp32 sums. Each row is computed alone
(batch-invariant).

decoder_layer.c runs a whole decoder layer of such a model in one call (every architecture
LlamaModel runs: Gemma's norms, GeGLU and soft caps, sliding windows, partial or absent rope):
in Python a layer was ~90 small torch operations, half of a decode step's time.

It needs x86-64 with AVX512-VNNI, or AVX2 with FMA (a second build of the same sources,
`-DSAGUARO_AVX2`: group_matmul_avx2.h, decoder_layer_avx2.h), and a C compiler (`$CC`, else
`cc`) with OpenMP. Without them saguaro says so once and runs torch's kernels: the same weights, with bf16 activations. The
library is cached under saguaro's cache folder, keyed by the source and the compiler, so later
starts load it in milliseconds. SAGUARO_NATIVE=0 turns it off; SAGUARO_NATIVE_BUILD=avx2 runs the
AVX2 build on a CPU that has AVX-512 too.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Callable

import torch

from saguaro.models import weight_cache

SOURCES = ("group_matmul.c", "decoder_layer.c", "repack.c")
HEADERS = ("group_matmul_avx2.h", "decoder_layer_avx2.h")
# the builds tried in turn, the widest first: (name, compiler flags)
BUILDS = (("avx512", ()), ("avx2", ("-DSAGUARO_AVX2",)))
GROUP = 32  # inputs per group: the block of Q4_0 / Q4_1 / Q8_0 and the sub-block of Q4_K
TILE_OUT = 16  # outputs per tile; a tile covers GROUP inputs


class NativeUnavailable(RuntimeError):
    pass


class LayerWeights(ctypes.Structure):
    """decoder_layer.c's LayerWeights: shapes, then pointers into the layer's tensors."""
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float)] + [(name, ctypes.c_void_p) for name in (
            "input_norm", "post_norm", "q_norm", "k_norm", "qkv_bias", "qkv", "o", "gate_up", "down")] + [
        (name, ctypes.c_int) for name in ("qkv_bits", "o_bits", "gate_up_bits", "down_bits", "rope", "rotary_dim")] + [
        ("norm_offset", ctypes.c_float), ("activation", ctypes.c_int), ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p), ("attn_scale", ctypes.c_float), ("attn_softcap", ctypes.c_float),
        ("sliding", ctypes.c_int)]


def library_path(build: str, flags: tuple[str, ...], folder: Path = Path(__file__).parent) -> Path:
    """The build compiled from the sources in folder (benchmarks/tile_rows.py compares other folders')."""
    from saguaro.models.hub import cache_dir

    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise NativeUnavailable(f"no C compiler ({compiler!r} not found; set $CC)")
    sources = [folder / name for name in SOURCES]
    source = b"".join(path.read_bytes() for path in sources + [folder / name for name in HEADERS])
    key = hashlib.sha256(source + compiler.encode()).hexdigest()[:16]
    path = cache_dir() / "native" / f"saguaro-{build}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            result = subprocess.run([compiler, "-O3", "-shared", "-fPIC", "-fopenmp", *flags, *map(str, sources),
                                     "-o", str(built), "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeUnavailable(f"{compiler} failed: {result.stderr.strip()[-500:]}")
            os.replace(built, path)  # atomic: a concurrent start sees the whole file or none
    return path


def _supported_build() -> ctypes.CDLL:
    """The widest build whose instructions this CPU has (each compiled the first time it is tried),
    or the one SAGUARO_NATIVE_BUILD names (the AVX2 build runs on AVX-512 CPUs too: tests compare them)."""
    wanted = os.environ.get("SAGUARO_NATIVE_BUILD")
    names = [build for build, _ in BUILDS]
    if wanted is not None and wanted not in names:
        raise ValueError(f"SAGUARO_NATIVE_BUILD={wanted!r}: the builds are {', '.join(names)}")
    for build, flags in BUILDS:
        if wanted not in (None, build):
            continue
        lib = ctypes.CDLL(str(library_path(build, flags)))
        if lib.saguaro_cpu_supported():
            lib.build = build
            return lib
    raise NativeUnavailable(f"this CPU lacks the {wanted} build's instructions" if wanted else
                            "this CPU has neither AVX512-VNNI nor AVX2 with FMA")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one warning saying why) where they cannot run."""
    if os.environ.get("SAGUARO_NATIVE", "1") == "0":
        return None
    try:
        lib = _supported_build()
    except (NativeUnavailable, OSError) as error:
        warnings.warn(f"saguaro's CPU kernels are off ({error}); quantized layers run torch's kernels, "
                      "and a Q8_0 head runs dequantized to bf16 (slower)", stacklevel=2)
        return None
    lib.saguaro_group_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.saguaro_group_matmul.restype = ctypes.c_int
    lib.saguaro_repack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.saguaro_repack.restype = ctypes.c_int
    lib.saguaro_dequantize_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                            ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.saguaro_dequantize_rows.restype = ctypes.c_int
    lib.saguaro_decoder_layer.argtypes = [ctypes.POINTER(LayerWeights), ctypes.c_void_p, ctypes.c_int64,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int64, ctypes.c_int]
    lib.saguaro_decoder_layer.restype = ctypes.c_int
    lib.saguaro_attention.argtypes = [ctypes.POINTER(LayerWeights), ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int]
    lib.saguaro_attention.restype = ctypes.c_int
    lib.saguaro_decoder_layers.argtypes = [ctypes.POINTER(LayerWeights), ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.saguaro_decoder_layers.restype = ctypes.c_int
    lib.saguaro_chunk_groups.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.saguaro_chunk_groups.restype = ctypes.c_int64
    return lib


def build_key() -> str:
    """The compiled kernels' name: their build and a hash of their sources (so of the tiles' layout)."""
    return Path(library()._name).stem


def available() -> bool:
    return library() is not None


def build() -> str | None:
    """Which build of the kernels runs here: "avx512", "avx2", or None (torch's kernels)."""
    return library().build if available() else None


def bf16_available() -> bool:
    """Whether bf16 weights run on the kernels too (AVX512-BF16 pair dots)."""
    return available() and bool(library().saguaro_bf16_supported())


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
    on 2 MB pages, and kept on disk with the file's other tiles (with small buffers sharing 2 MB
    pages, fresh_buffer, a BF16 file's 135M model decoded 1.13x faster on two threads, 1.14x on
    one, than from the heap's 4 KB pages). Each chunk of inputs is copied straight from the
    weights, without an intermediate."""
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


def group_matmul(bits: int, tiles: torch.Tensor, x: torch.Tensor, out_features: int,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [rows, in] bf16 @ the packed weights' transpose -> [rows, out] in bf16 or fp32."""
    x = x.contiguous()
    if x.dtype != torch.bfloat16:
        raise TypeError(f"saguaro's kernels take bf16 activations, got {x.dtype}")
    rows, in_features = x.shape
    out = torch.empty(rows, out_features, dtype=out_dtype)
    if rows and library().saguaro_group_matmul(bits, tiles.data_ptr(), x.data_ptr(), out.data_ptr(), rows, in_features,
                                               out_features, int(out_dtype == torch.float32),
                                               torch.get_num_threads()) != 0:
        raise MemoryError("saguaro_group_matmul: out of memory")
    return out


class NativeLayers:
    """A model's decoder layers as decoder_layer.c runs them (see `attach`)."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.weights = []
        self.kept = []  # tensors the structs point into
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fields = dict(hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
                          head_dim=config.head_dim, intermediate=config.intermediate_size, eps=config.rms_norm_eps,
                          rope=int(attn.rope), rotary_dim=config.rotary_dim, norm_offset=config.norm_offset,
                          activation=ACTIVATIONS[config.mlp_activation], attn_scale=config.attn_scale or 0.0,
                          attn_softcap=config.attn_softcap or 0.0, sliding=int(layer.sliding))
            tensors = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                       "q_norm": attn.q_norm.weight if attn.q_norm is not None else None,
                       "k_norm": attn.k_norm.weight if attn.k_norm is not None else None,
                       "qkv_bias": attn.qkv_proj.bias, "attn_out_norm": None, "mlp_out_norm": None}
            if layer.pre_feedforward_layernorm is not None:  # Gemma: norms around the attention's and MLP's outputs
                tensors |= {"post_norm": layer.pre_feedforward_layernorm.weight,
                            "attn_out_norm": layer.post_attention_layernorm.weight,
                            "mlp_out_norm": layer.post_feedforward_layernorm.weight}
            for name, projection in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                     ("down", mlp.down_proj)):
                tensors[name] = projection.packed
                fields[f"{name}_bits"] = projection.bits
            for name, tensor in tensors.items():
                if tensor is not None:
                    tensor = tensor.detach().contiguous()
                    self.kept.append(tensor)
                fields[name] = None if tensor is None else tensor.data_ptr()
            self.weights.append(LayerWeights(**fields))
        self.all_weights = (LayerWeights * len(self.weights))(*self.weights)
        self.final_norm = model.norm.weight.detach().contiguous()

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, rows, slots: torch.Tensor,
            mask: torch.Tensor, span: int, local: tuple | None = None) -> torch.Tensor:
        """The layers and the final norm over x [B, T, hidden]; cos and sin [B, T, rotary_dim / 2],
        the other arguments as LlamaModel.run_layers has them; local: the sliding layers' (window
        mask, cos, sin), cos and sin None where they turn as the others do."""
        B, T, hidden = x.shape
        x = x.to(torch.bfloat16, copy=True).contiguous()
        if rows is None:
            rows = torch.arange(B)
        elif isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop)
        row_of = (rows if T == 1 else rows.repeat_interleave(T)).to(torch.int64).contiguous()
        slot_of = slots.to(torch.int64).reshape(-1).contiguous()
        visible = _visible(mask, B * T, span)
        cos, sin = cos.reshape(B * T, -1).contiguous(), sin.reshape(B * T, -1).contiguous()
        window, cos_local, sin_local = local or (None, None, None)
        window = None if window is None else _visible(window, B * T, span)
        if cos_local is not None:
            cos_local, sin_local = cos_local.reshape(B * T, -1).contiguous(), sin_local.reshape(B * T, -1).contiguous()
        if cache.keys.dtype != torch.bfloat16 or not cache.keys.is_contiguous():
            raise TypeError("saguaro's kernels take a contiguous bf16 KV cache")
        status = library().saguaro_decoder_layers(
            self.all_weights, len(self.weights), x.data_ptr(), B * T, cos.data_ptr(), sin.data_ptr(),
            cache.keys.data_ptr(), cache.values.data_ptr(), cache.keys[0].numel(), cache.num_slots,
            row_of.data_ptr(), slot_of.data_ptr(), _pointer(visible), span, self.final_norm.data_ptr(),
            _pointer(cos_local), _pointer(sin_local), _pointer(window), torch.get_num_threads())
        if status == -1:
            raise MemoryError("saguaro_decoder_layer: out of memory")
        if status != 0:  # attach() admits only the head sizes the layer takes
            raise RuntimeError(f"saguaro_decoder_layer refused a layer ({status})")
        return x


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # decoder_layer.c's activation codes


def _visible(mask: torch.Tensor, rows: int, span: int) -> torch.Tensor | None:
    """A [.., span] bool mask as the uint8 rows decoder_layer.c reads; None where all is visible."""
    return None if bool(mask.all()) else mask.reshape(rows, span).to(torch.uint8).contiguous()


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def attach(model: torch.nn.Module) -> None:
    """Runs a bf16 CPU model's layers natively where every projection is held in saguaro's tiles."""
    model.native_layers = None
    head_dim = model.config.head_dim
    if not available() or model.dtype != torch.bfloat16 or model.device.type != "cpu" or head_dim % 16 or head_dim > 256:
        return
    for layer in model.layers:
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if not all(getattr(p, "native", False) for p in projections):
            return
        if any(p.bias is not None for p in projections[1:]):  # decoder_layer.c adds a bias to qkv only
            return
    model.native_layers = NativeLayers(model)
