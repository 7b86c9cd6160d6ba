"""saguaro's kernels as Python calls them: the library of the widest build this CPU runs,
each function's C signature, and the matrix product.

It needs x86-64 with AVX512-VNNI, or AVX2 with FMA (a second build of the same sources,
`-DSAGUARO_AVX2`: group_matmul_avx2.h, decoder_layer_avx2.h). Without them, or without a C
compiler, saguaro says so once and runs torch's kernels: the same weights, with bf16
activations. SAGUARO_NATIVE=0 turns them off; SAGUARO_NATIVE_BUILD=avx2 runs the AVX2 build on a
CPU that has AVX-512 too.
"""
from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path

import numpy
import torch

from saguaro.models.native.compiler import BUILDS, NativeUnavailable, library_path


class LayerWeights(ctypes.Structure):
    """decoder_layer.c's LayerWeights: shapes, then pointers into the layer's tensors."""
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float)] + [(name, ctypes.c_void_p) for name in (
            "input_norm", "post_norm", "q_norm", "k_norm", "qkv_bias", "qkv", "o", "gate_up", "down")] + [
        (name, ctypes.c_int) for name in ("qkv_bits", "o_bits", "gate_up_bits", "down_bits", "rope", "rotary_dim")] + [
        ("norm_offset", ctypes.c_float), ("activation", ctypes.c_int), ("attn_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p), ("attn_scale", ctypes.c_float), ("attn_softcap", ctypes.c_float),
        ("sliding", ctypes.c_int)]


class Kernels(ctypes.CDLL):
    """The compiled library of one build, its functions' signatures declared."""

    def __init__(self, path: Path, build: str):
        super().__init__(str(path))
        self.build = build
        self.saguaro_group_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                              ctypes.c_void_p, ctypes.c_int64]
        self.saguaro_group_matmul.restype = ctypes.c_int
        self.saguaro_repack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.saguaro_repack.restype = ctypes.c_int
        self.saguaro_dequantize_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self.saguaro_dequantize_rows.restype = ctypes.c_int
        self.saguaro_decoder_layer.argtypes = [ctypes.POINTER(LayerWeights), ctypes.c_void_p, ctypes.c_int64,
                                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                               ctypes.c_int64, ctypes.c_int]
        self.saguaro_decoder_layer.restype = ctypes.c_int
        self.saguaro_attention.argtypes = [ctypes.POINTER(LayerWeights), ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        self.saguaro_attention.restype = ctypes.c_int
        self.saguaro_decoder_layers.argtypes = [ctypes.POINTER(LayerWeights), ctypes.c_int64, ctypes.c_void_p,
                                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self.saguaro_decoder_layers.restype = ctypes.c_int
        self.saguaro_chunk_groups.argtypes = [ctypes.c_int, ctypes.c_int64]
        self.saguaro_chunk_groups.restype = ctypes.c_int64
        self.saguaro_mask_logits.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                             ctypes.c_int64, ctypes.c_void_p]
        self.saguaro_mask_logits.restype = None
        self.saguaro_head_bits.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        self.saguaro_head_bits.restype = None


def _supported_build() -> Kernels:
    """The widest build whose instructions this CPU has (each compiled the first time it is tried),
    or the one SAGUARO_NATIVE_BUILD names (the AVX2 build runs on AVX-512 CPUs too: tests compare them)."""
    wanted = os.environ.get("SAGUARO_NATIVE_BUILD")
    names = [build for build, _ in BUILDS]
    if wanted is not None and wanted not in names:
        raise ValueError(f"SAGUARO_NATIVE_BUILD={wanted!r}: the builds are {', '.join(names)}")
    for build, flags in BUILDS:
        if wanted not in (None, build):
            continue
        lib = Kernels(library_path(build, flags), build)
        if lib.saguaro_cpu_supported():
            return lib
    raise NativeUnavailable(f"this CPU lacks the {wanted} build's instructions" if wanted else
                            "this CPU has neither AVX512-VNNI nor AVX2 with FMA")


@functools.cache
def library() -> Kernels | None:
    """The compiled kernels, or None (with one warning saying why) where they cannot run."""
    if os.environ.get("SAGUARO_NATIVE", "1") == "0":
        return None
    try:
        return _supported_build()
    except (NativeUnavailable, OSError) as error:
        warnings.warn(f"saguaro's CPU kernels are off ({error}); quantized layers run torch's kernels, "
                      "and a Q8_0 head runs dequantized to bf16 (slower)", stacklevel=2)
        return None


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


def group_matmul(bits: int, tiles: torch.Tensor, x: torch.Tensor, out_features: int,
                 out_dtype: torch.dtype = torch.bfloat16, legal: numpy.ndarray | None = None) -> torch.Tensor:
    """x [rows, in] bf16 @ the packed weights' transpose -> [rows, out] in bf16 or fp32. legal
    [rows, words] int32 (a grammar's masks, fp32 out only): -inf at each row's illegal outputs,
    and no work on tile columns that no row allows (group_matmul.c)."""
    x = x.contiguous()
    if x.dtype != torch.bfloat16:
        raise TypeError(f"saguaro's kernels take bf16 activations, got {x.dtype}")
    rows, in_features = x.shape
    words = 0
    if legal is not None:
        legal = numpy.ascontiguousarray(legal)
        # the kernel reads a mask row per row of x
        if legal.dtype != numpy.int32 or legal.ndim != 2 or len(legal) != rows or out_dtype != torch.float32:
            raise ValueError(f"group_matmul: legal {legal.shape} {legal.dtype} for {rows} rows out in {out_dtype}: "
                             f"want one int32 mask row a row and fp32 out")
        words = legal.shape[1]
    out = torch.empty(rows, out_features, dtype=out_dtype)
    if rows and library().saguaro_group_matmul(bits, tiles.data_ptr(), x.data_ptr(), out.data_ptr(), rows, in_features,
                                               out_features, int(out_dtype == torch.float32),
                                               torch.get_num_threads(), None if legal is None else legal.ctypes.data,
                                               words) != 0:
        raise MemoryError("saguaro_group_matmul: out of memory")
    return out


def mask_logits(logits: torch.Tensor, bits: numpy.ndarray, skip: numpy.ndarray) -> None:
    """-inf in place at the tokens whose bit is clear: logits [T, width] contiguous fp32 on the CPU,
    bits [T, words] int32 (a grammar's masks), skip [T] bool (rows left alone)."""
    bits = numpy.ascontiguousarray(bits)
    skip = numpy.ascontiguousarray(skip, dtype=numpy.uint8)
    # the kernel reads as many mask rows as there are logit rows, in place: a mismatch would read past them
    if logits.dtype != torch.float32 or not logits.is_contiguous() or logits.device.type != "cpu" \
            or bits.dtype != numpy.int32 or bits.ndim != 2 or len(bits) != len(logits) or len(skip) != len(logits):
        raise ValueError(f"mask_logits: logits [{tuple(logits.shape)}] {logits.dtype}, bits {bits.shape} {bits.dtype}, "
                         f"skip {skip.shape}: want contiguous fp32 CPU logits and one int32 mask row and skip byte a row")
    library().saguaro_mask_logits(logits.data_ptr(), logits.shape[0], logits.shape[1], bits.ctypes.data,
                                  bits.shape[1], skip.ctypes.data)


def head_bits(bits: numpy.ndarray, ids: numpy.ndarray, out: numpy.ndarray) -> None:
    """Into out [T, out words] int32 (contiguous): bit k of row j set where token ids[k] is legal
    in bits [T, words] int32 (a grammar's masks over the vocabulary): the masks of a head whose
    row k predicts token ids[k]."""
    bits = numpy.ascontiguousarray(bits, dtype=numpy.int32)
    ids = numpy.ascontiguousarray(ids, dtype=numpy.int64)
    if out.dtype != numpy.int32 or not out.flags.c_contiguous or out.ndim != 2 or bits.ndim != 2 \
            or len(out) != len(bits) or 32 * out.shape[1] < len(ids):
        raise ValueError(f"head_bits: bits {bits.shape} {bits.dtype}, {len(ids)} ids, out {out.shape} {out.dtype}: "
                         "want one contiguous int32 row of at least len(ids) bits a mask row")
    library().saguaro_head_bits(bits.ctypes.data, bits.shape[0], bits.shape[1], ids.ctypes.data, len(ids),
                                out.ctypes.data, out.shape[1])
