"""Loads checkpoints: local Hugging Face folders (safetensors), GGUF files (the blocks saguaro's
kernels read kept as codes, repacked from the mapped file; other types dequantized) and
saguaro's own folders (config.json with ModelConfig fields + model.safetensors), which drafts
use and which may leave out the embedding table they share with their target."""
from __future__ import annotations

import json
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from saguaro.models import native, weight_cache
from saguaro.models.config import ModelConfig, UnsupportedModelError
from saguaro.models.eagle import model_class
from saguaro.models.gguf_file import GGUFFile, read_gguf_file
from saguaro.models.hub import cache_dir
from saguaro.models.llama import LlamaModel
from saguaro.models.packed import PackedLinear, pack_linears
from saguaro.models.quantized import (FILE_FLOATS, GROUP, FileBlocks, GroupCodes, GroupInt4, GroupInt5, GroupInt6, GroupInt8,
                                      StackedCodes, check_mode, quantized_linear)
from saguaro.models.tokenizer import FolderTokenizer

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's llama.cpp names mean other Hugging Face tensors: Phi-3's fused
# projections (ffn_up holds gate and up), Gemma's sandwich norms (ffn_norm is the pre-MLP norm).
_GGUF_ARCH_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
}
_GGUF_ARCH_LAYER_NAMES["gemma3"] = _GGUF_ARCH_LAYER_NAMES["gemma2"]
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class ModelNotFoundError(FileNotFoundError):
    """No checkpoint at the given path or name."""


def checkpoint_files(path: Path) -> tuple[Path, Path | None]:
    """Returns (folder, gguf file or None) for a GGUF file, a folder with one, or a HF folder."""
    if not path.exists():
        raise ModelNotFoundError(f"no model at {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise UnsupportedModelError(f"{path} is neither a .gguf file nor a model folder")
        return path.parent, path
    if (path / "config.json").exists():
        return path, None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return path, ggufs[0]
    raise ModelNotFoundError(f"{path} has no config.json and no single .gguf file")


# --- Hugging Face folders -------------------------------------------------------------------

def read_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf = json.loads((folder / "config.json").read_text())
    image_text = hf.get("model_type") == "gemma3"
    config = hf_model_config(hf)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return config, language_model_weights(state) if image_text else state


def hf_model_config(hf: dict) -> ModelConfig:
    """A Hugging Face config.json's ModelConfig (an image-text Gemma 3's: its language model's)."""
    return ModelConfig.from_hf(gemma3_language_config(hf) if hf.get("model_type") == "gemma3" else hf)


def gemma3_language_config(hf: dict) -> dict:
    """The language model's config of a Gemma 3 image-text checkpoint (the 4B to 27B models),
    its defaults filled in: older files write only what differs from them."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**hf.get("text_config", {})).to_dict() | {
        "tie_word_embeddings": hf.get("tie_word_embeddings", True)}


# Where image-text checkpoints keep their language model's weights (transformers has written both).
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def language_model_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's weights under a text model's names; the vision tower's are left out."""
    weights = {}
    for name, value in state.items():
        for old, new in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(old):
                weights[new + name.removeprefix(old)] = value
                break
    return weights


# --- GGUF -----------------------------------------------------------------------------------

def _gguf_value(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


# Mistral has no GGUF architecture of its own: llama.cpp writes it as "llama".
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3")
_HF_MODEL_TYPES = {"gemma3": "gemma3_text"}  # where Hugging Face's name differs
# Architectures whose q/k rows llama.cpp's converter reorders for interleaved rope.
_PERMUTED_QK = ("llama", "smollm3")


def gguf_hf_config(reader: GGUFFile) -> dict:
    """The GGUF metadata expressed as a Hugging Face config.json dictionary."""
    arch = _gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}: saguaro reads {', '.join(GGUF_ARCHITECTURES)} "
            "(llama.cpp writes Mistral models as 'llama')")
    get = lambda key, default=None: _gguf_value(reader, f"{arch}.{key}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError("GGUF value heads differ in width from key heads: not supported")
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim and arch != "phi3":
        raise UnsupportedModelError(
            f"GGUF rope covers {rotary} of {head_dim} head dimensions: partial rope is not supported for {arch!r}")
    vocab = get("vocab_size") or len(_gguf_value(reader, "tokenizer.ggml.tokens"))
    config = {
        "model_type": _HF_MODEL_TYPES.get(arch, arch), "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"), "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim, "rope_theta": get("rope.freq_base", 10000.0),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": get("context_length", 8192),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_value(reader, "tokenizer.ggml.eos_token_id"),
    }
    rope_scaling = gguf_rope_scaling(reader, arch, rotary)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config | _gguf_arch_config(arch, get, config, rotary)


def _gguf_arch_config(arch: str, get, config: dict, rotary: int) -> dict:
    """Hugging Face config fields of the newer architectures, as llama.cpp's loader derives
    them: some from keys, some fixed for the architecture (no key carries them)."""
    layers, head_dim = config["num_hidden_layers"], config["head_dim"]
    if arch == "smollm3":
        return {"no_rope_layer_interval": 4}  # llama.cpp: rope skipped on every 4th layer
    if arch == "phi3":
        return {"partial_rotary_factor": rotary / head_dim,
                "sliding_window": get("attention.sliding_window") or None}  # 0: none (Phi-4)
    if arch not in ("gemma2", "gemma3"):
        return {}
    # The 27B models scale queries by hidden / heads, the others by the head width.
    large = layers == (46 if arch == "gemma2" else 62)
    gemma = {"hidden_activation": "gelu_pytorch_tanh",
             "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if large else head_dim,
             "final_logit_softcapping": get("final_logit_softcapping", 30.0 if arch == "gemma2" else None)}
    if arch == "gemma2":
        return gemma | {"sliding_window": get("attention.sliding_window", 4096),
                        "attn_logit_softcapping": get("attn_logit_softcapping", 50.0)}
    return gemma | {"sliding_window": get("attention.sliding_window") or None, "sliding_window_pattern": 6,
                    "rope_local_base_freq": 10000.0}


def gguf_rope_scaling(reader: GGUFFile, arch: str, rotary_dim: int) -> dict | None:
    """Rope scaling as llama.cpp applies it: inverse frequencies divided by a linear factor and
    by the per-dimension divisors of a `rope_freqs` tensor, where Llama 3's scaling is baked in
    (its `rope.scaling.*` keys are not written), or Phi-3's longrope (`rope_factors_short`, in
    contexts up to the original one; see ModelConfig). Any other scaling type raises."""
    get = lambda key, default=None: _gguf_value(reader, f"{arch}.{key}", default)  # noqa: E731
    kind = get("rope.scaling.type", "linear")  # llama.cpp's default when only a factor is given
    if kind not in ("none", "linear"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
    factor = (get("rope.scaling.factor") or get("rope.scale_linear") or 1.0) if kind == "linear" else 1.0
    short = next((t for t in reader.tensors if t.name == "rope_factors_short.weight"), None)
    if short is not None and arch == "phi3":
        return {"rope_type": "longrope", "short_factor": dequantize_gguf(short).reshape(-1).tolist(),
                "attention_factor": float(get("rope.scaling.attn_factor", 1.0)),
                "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    if any(t.name.startswith("rope_factors_") for t in reader.tensors):
        raise UnsupportedModelError(
            f"GGUF rope scaling 'longrope' (rope_factors_long/short) is not supported for {arch!r}")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None if factor == 1.0 else {"rope_type": "linear", "factor": float(factor)}
    divisors = np.asarray(dequantize_gguf(freqs), dtype=np.float64).reshape(-1)
    if divisors.size != rotary_dim // 2:
        raise UnsupportedModelError(f"GGUF rope_freqs has {divisors.size} entries, {rotary_dim // 2} expected")
    return {"rope_type": "divisors", "divisors": (divisors * factor).tolist()}


def dequantize_gguf(tensor) -> np.ndarray:
    """A GGUF tensor as a float array in PyTorch's dimension order."""
    from gguf.quants import dequantize

    return dequantize(tensor.data, tensor.tensor_type).reshape([int(n) for n in reversed(tensor.shape)])


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
        if len(tensor.shape) != 2 or not native.bf16_available():
            return None  # (without AVX512-BF16 float weights run on torch's kernels, dequantized)
    elif not native.type_bits(kind) or kind not in DECODED and not native.available():
        return None  # (IQ4's and Q3_K's codes have no decoder besides repack.c's: gguf-py dequantizes them)
    out_features, in_features = (int(n) for n in reversed(tensor.shape))
    return FileBlocks(kind, np.asarray(tensor.data).reshape(out_features, -1), torch.Size((out_features, in_features)),
                      lambda: gguf_groups(tensor))


def _unpermute_rope(weight: torch.Tensor | GroupCodes | FileBlocks, n_head: int) -> torch.Tensor | GroupCodes | FileBlocks:
    """Undoes llama.cpp's reordering of q/k rows (interleaved rope) back to rotate-half order."""
    rows = weight.shape[0]
    order = torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)
    return weight.rows(order) if isinstance(weight, (GroupCodes, FileBlocks)) else weight[order]


def gguf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor; None for rope_freqs and rope_factors_*, which the
    config carries."""
    prefix, _, kind = gguf_name.rpartition(".")
    if prefix in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
        return None
    if prefix in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[prefix]}.{kind}"
    if prefix.startswith("blk."):
        _, layer, part = prefix.split(".", 2)
        names = _GGUF_LAYER_NAMES | _GGUF_ARCH_LAYER_NAMES.get(arch, {})
        if part in names:
            return f"model.layers.{layer}.{names[part]}.{kind}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name}")


def read_gguf(file: Path) -> tuple[ModelConfig, dict[str, torch.Tensor | GroupCodes]]:
    """Config and weights; the projections', head's and embedding's 4-bit and Q8_0 blocks as
    GroupInt4 / GroupInt6 / GroupInt8, everything else dequantized to fp32."""
    reader = read_gguf_file(file)
    arch = _gguf_value(reader, "general.architecture")
    config = ModelConfig.from_hf(gguf_hf_config(reader))
    state: dict[str, torch.Tensor | GroupCodes] = {}
    for tensor in reader.tensors:
        name = gguf_tensor_name(tensor.name, arch)
        if name is None:
            continue
        grouped = name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight")
        weight = file_blocks(tensor) if grouped else None
        if weight is None:
            weight = torch.from_numpy(np.array(dequantize_gguf(tensor), dtype=np.float32))
        if arch in _PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
            weight = _unpermute_rope(weight, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        if config.norm_offset and name.endswith("norm.weight"):  # llama.cpp stores Gemma's as offset + weight
            weight = weight - config.norm_offset
        state[name] = weight
    return config, state


# --- our module ------------------------------------------------------------------------------

def fuse_hf_state(config: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Maps Hugging Face parameter names onto LlamaModel's fused qkv and gate/up projections
    (Phi-3's come fused)."""
    state = {}
    for name, value in hf_state.items():
        name = name.removeprefix("model.")
        if ".rotary_emb." in name:
            continue
        state[name] = value
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{p}self_attn.{n}_proj.{kind}", None) for n in "qkv"]
            if all(t is not None for t in parts):
                state[f"{p}self_attn.qkv_proj.{kind}"] = _cat(parts)
        if f"{p}mlp.gate_up_proj.weight" not in state:  # Phi-3 checkpoints hold them fused already
            state[f"{p}mlp.gate_up_proj.weight"] = _cat(
                [state.pop(f"{p}mlp.gate_proj.weight"), state.pop(f"{p}mlp.up_proj.weight")])
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


def _cat(parts: list) -> torch.Tensor | GroupCodes | StackedCodes:
    """Stacks projections' rows, keeping their codes where every part has them (as one kind, or
    as stacked parts of several, which blocks still in the file always are)."""
    for kind in (GroupInt4, GroupInt5, GroupInt6, GroupInt8):
        if all(type(p) is kind for p in parts):
            return kind.cat(parts)
    if all(isinstance(p, (GroupCodes, FileBlocks)) for p in parts):
        merged = [parts[0]]  # neighbours of one kind become one part
        for part in parts[1:]:
            same = type(part) is type(merged[-1]) and not isinstance(part, FileBlocks)
            merged[-1:] = [type(part).cat([merged[-1], part])] if same else [merged[-1], part]
        return StackedCodes(merged)
    return torch.cat([p.dequantize() if isinstance(p, (GroupCodes, FileBlocks)) else p for p in parts])


def native_head(weight) -> bool:
    """Codes of 5 to 8 bits, or bf16 where the kernels take it: a head saguaro's kernels
    run with fp32 logits (a 4-bit head is dequantized)."""
    if isinstance(weight, torch.Tensor):
        return native.bf16_available()
    return isinstance(weight, (GroupInt5, GroupInt6, GroupInt8)) or isinstance(weight, FileBlocks) and weight.bits > 4


def plain_weights(weight: torch.Tensor | GroupCodes | FileBlocks | StackedCodes, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, FileBlocks):
        return weight.dequantize(dtype)
    return (weight if isinstance(weight, torch.Tensor) else weight.dequantize()).to(dtype)


def build_model(config: ModelConfig, hf_state: dict[str, torch.Tensor | GroupCodes], dtype: torch.dtype,
                device: str | torch.device, quantization: str | None = None) -> LlamaModel:
    """The model; `quantization` (saguaro.models.quantized.MODES) says which decoder projections
    run quantized. The embeddings stay in `dtype`, and so does the head, except that "auto" keeps
    a Q8_0 head's codes where saguaro's kernels run."""
    mode = check_mode(quantization, dtype, torch.device(device))
    with torch.device("meta"):
        model = LlamaModel(config)
    state = fuse_hf_state(config, hf_state)
    quantized = {}
    head = ["lm_head.weight"] if mode == "auto" and native_head(state.get("lm_head.weight")) else []
    names = [n for n in state if n.startswith("layers.") and n.endswith("_proj.weight")] + head
    for name in tqdm(names, desc="loading weights", unit="tensor", delay=1.0, leave=False):  # shown after 1 s
        module = name.removesuffix(".weight")
        bias = state.get(f"{module}.bias")
        out_dtype = torch.float32 if name == "lm_head.weight" else dtype  # logits are wanted in fp32
        layer = quantized_linear(state[name], None if bias is None else bias.to(dtype), mode, dtype, out_dtype)
        if layer is not None:
            quantized[module] = layer
            del state[name]
            state.pop(f"{module}.bias", None)
    state = {k: plain_weights(v, dtype) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {f"{m}.{kind}" for m in quantized for kind in ("weight", "bias")}:
        raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    for module, layer in quantized.items():
        model.set_submodule(module, layer)
    if config.tie_word_embeddings and "lm_head" not in quantized:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope()
    model.quantization = mode
    return frozen(model.to(device))


def frozen(model: LlamaModel) -> LlamaModel:
    """An inference model: eval mode, no gradients, CPU weights in oneDNN's layout."""
    model.eval().requires_grad_(False)
    model = pack_linears(model, model.device, model.dtype)
    native.attach(model)
    return model


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]


def read_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor | GroupCodes]]:
    folder, gguf_file = checkpoint_files(Path(path))
    return read_gguf(gguf_file) if gguf_file else read_hf_folder(folder)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", quantization: str | None = None) -> LlamaModel:
    """A checkpoint as a frozen model; see build_model for `quantization`."""
    if is_saguaro_checkpoint(path):
        return load_checkpoint(path, dtype, device)
    config, hf_state = read_checkpoint(path)
    gguf_file = checkpoint_files(Path(path))[1]
    if gguf_file is None or not native.available() or torch.device(device).type != "cpu":
        return build_model(config, hf_state, dtype, device, quantization)
    stat = gguf_file.stat()
    where = zlib.crc32(str(gguf_file.resolve()).encode())
    key = (f"{gguf_file.stem}-{where:08x}-{stat.st_size}-{stat.st_mtime_ns}-{str(dtype).removeprefix('torch.')}-"
           f"{quantization or 'default'}-{native.build_key()}")
    with weight_cache.kept(cache_dir() / "weights", key):
        return build_model(config, hf_state, dtype, device, quantization)


# --- saguaro checkpoints (drafts) -------------------------------------------------------------

SHARED_EMBEDDING = "embed_tokens.weight"


class IncompatibleDraftError(ValueError):
    """The draft cannot run with this target: different tokenizers, vocabularies or embedding widths."""


def is_saguaro_checkpoint(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and "num_layers" in json.loads(config.read_text())


def save_checkpoint(model: LlamaModel, folder: str | Path, dtype: torch.dtype = torch.bfloat16,
                    share_embeddings: bool = True) -> None:
    """Writes config.json and model.safetensors. With `share_embeddings` the embedding table is
    left out (a draft borrows its target's: see load_draft), which keeps drafts small."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save(folder / "config.json")
    state = {}
    for name, value in model.state_dict().items():
        if (share_embeddings and name == SHARED_EMBEDDING) or (
                model.config.tie_word_embeddings and name == "lm_head.weight"):
            continue
        state[name] = (value.to(dtype) if value.is_floating_point() else value).contiguous()
    save_file(state, folder / "model.safetensors")


def load_checkpoint(folder: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu", embeddings: torch.Tensor | None = None,
                    quantization: str | None = None, config: ModelConfig | None = None) -> LlamaModel:
    """A saguaro checkpoint; `embeddings` supplies the table when the checkpoint omits it. With
    `quantization`, its projections are quantized as `quantize_checkpoint` says. config: its
    config.json where the caller has read it already."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if config is None:
        if not is_saguaro_checkpoint(folder):
            raise ModelNotFoundError(f"{folder} is not a saguaro checkpoint (config.json + model.safetensors)")
        config = ModelConfig.load(folder / "config.json")
    state = load_file(folder / "model.safetensors")
    if SHARED_EMBEDDING not in state:
        if embeddings is None:
            raise ModelNotFoundError(f"{folder} shares its target's embeddings: load it with load_draft")
        state[SHARED_EMBEDDING] = embeddings
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state[SHARED_EMBEDDING]
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    with torch.device("meta"):
        model = model_class(config)(config)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_rope()
    model = model.to(device)
    if quantization is not None:
        model.quantization = check_mode(quantization, dtype, torch.device(device))
        quantize_checkpoint(model, model.quantization)
    return frozen(model)


def quantize_checkpoint(model: LlamaModel, mode: str) -> None:
    """Quantizes a float checkpoint's projections in place: "int8" / "int4" as build_model does;
    "auto", where saguaro's kernels run, int4 groups and an int8-group head (a draft's
    precision decides only how often its proposals are accepted, never what is sampled, and a
    draft step reads about a third of bf16's bytes so). EAGLE drafts stay as they are."""
    if mode == "none" or (mode == "auto" and (not native.available() or model.reads_features)):
        return
    for layer in model.layers:
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            linear = getattr(parent, name)
            weight = linear.weight.detach()
            quantized = quantized_linear(GroupInt4.from_float(weight) if mode == "auto" else weight,
                                         linear.bias, mode, model.dtype)
            if quantized is not None:
                setattr(parent, name, quantized)
    head = model.lm_head.weight.detach()
    if mode == "auto" and not model.config.tie_word_embeddings and native.fits(*head.shape):
        model.lm_head = quantized_linear(GroupInt8.from_float(head), None, mode, model.dtype, torch.float32)


def load_draft(path: str | Path, target: LlamaModel, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None, tokens: int | None = None,
               config: ModelConfig | None = None) -> LlamaModel:
    """A draft for `target`: a saguaro checkpoint (embeddings borrowed from the target when the
    draft omits them) or any other checkpoint load_model reads. Vocabularies must match, or be
    one tokenizer's of `tokens` tokens (pairing.match_tokenizers') padded to different numbers
    of rows (fit_vocabulary). It is quantized as the target was (`quantize_checkpoint`), where
    it runs in the target's dtype. config: a saguaro checkpoint's config.json, where the caller
    has read it (pairing.DraftPairing)."""
    dtype, device = dtype or target.dtype, device or target.device
    quantization = target.quantization if dtype == target.dtype else None
    if config is None and not is_saguaro_checkpoint(path):
        draft = load_model(path, dtype, device, quantization)
        if tokens is not None:
            return fit_vocabulary(draft, target.config.vocab_size, tokens)
        _check_vocab(draft.config, target.config, path)
        return draft
    config = config or ModelConfig.load(Path(path) / "config.json")
    _check_vocab(config, target.config, path)
    embeddings = target.embed_tokens.weight.detach()
    if config.hidden_size != target.config.hidden_size and not _has_own_embeddings(path):
        raise IncompatibleDraftError(
            f"draft {path} borrows the target's embeddings but its width {config.hidden_size} "
            f"differs from the target's {target.config.hidden_size}")
    return load_checkpoint(path, dtype, device, embeddings=embeddings, quantization=quantization, config=config)


def fit_vocabulary(draft: LlamaModel, rows: int, tokens: int) -> LlamaModel:
    """A draft whose vocabulary is padded to other than the target's `rows`, both of one
    tokenizer's `tokens` tokens (Qwen 2.5's small models have 151,936 rows, its large ones
    152,064, for 151,665 tokens), made to speak the target's: its embedding padded with zero
    rows or cut to `rows`, and its head predicting the token ids below both (a reduced head: its
    distributions are widened to the target's vocabulary with zeros, so verification stays
    exact)."""
    config = draft.config
    if config.vocab_size == rows:
        return draft
    if min(config.vocab_size, rows) < tokens:
        raise IncompatibleDraftError(f"the draft's vocabulary has {config.vocab_size} rows and the target's {rows}, "
                                     f"for a tokenizer of {tokens} tokens")
    if config.head_vocab_size is not None:
        head_ids = draft.head_token_ids
        if int(head_ids.max()) >= rows:
            raise IncompatibleDraftError(f"the draft's head predicts token ids up to {int(head_ids.max())}, past "
                                         f"the target's {rows} rows")
    else:
        shared = min(config.vocab_size, rows)
        head_ids = torch.arange(shared, device=draft.device)
        if shared < config.vocab_size:  # the head's rows past the target's vocabulary are cut
            packed = isinstance(draft.lm_head, PackedLinear)
            if not packed and type(draft.lm_head) is not torch.nn.Linear:
                raise IncompatibleDraftError(
                    f"the draft's vocabulary ({config.vocab_size} rows) is padded beyond the target's ({rows}) and "
                    "its quantized head cannot be cut: load it with quantization 'none'")
            head = torch.nn.Linear(config.hidden_size, shared, bias=False, device="meta")
            head.weight = torch.nn.Parameter(draft.lm_head.weight[:shared], requires_grad=False)
            draft.lm_head = PackedLinear(head) if packed else head
    table = draft.embed_tokens.weight
    padded = torch.cat((table, table.new_zeros(rows - len(table), table.shape[1]))) if rows > len(table) else table[:rows]
    draft.embed_tokens.weight = torch.nn.Parameter(padded, requires_grad=False)
    draft.embed_tokens.num_embeddings = rows
    draft.config = replace(config, vocab_size=rows, head_vocab_size=len(head_ids), tie_word_embeddings=False)
    draft.register_buffer("head_token_ids", head_ids)
    return draft


def _check_vocab(draft: ModelConfig, target: ModelConfig, path) -> None:
    if draft.vocab_size != target.vocab_size:
        raise IncompatibleDraftError(
            f"draft {path} has a vocabulary of {draft.vocab_size} tokens, the target {target.vocab_size}: "
            "speculative decoding needs the same tokenizer")


def tokenizer_identity(path: str | Path, tokenizer=None) -> tuple[list[str], int | None, int | None] | None:
    """(token strings by id, BOS id, EOS id) of a checkpoint's tokenizer: a GGUF file's
    `tokenizer.ggml.*` metadata or a Hugging Face folder's tokenizer (`tokenizer`, where the
    caller has loaded it); None for a checkpoint without a tokenizer of its own (saguaro's
    drafts, weights saved alone)."""
    if is_saguaro_checkpoint(path):
        return None
    folder, gguf_file = checkpoint_files(Path(path))
    if gguf_file is not None:
        fields = read_gguf_file(gguf_file).fields
        if "tokenizer.ggml.tokens" not in fields:
            return None
        return (list(fields["tokenizer.ggml.tokens"]), fields.get("tokenizer.ggml.bos_token_id"),
                fields.get("tokenizer.ggml.eos_token_id"))
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    tokenizer = tokenizer or load_tokenizer(path)
    return tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))), tokenizer.bos_token_id, tokenizer.eos_token_id


def _has_own_embeddings(folder: str | Path) -> bool:
    from safetensors import safe_open

    with safe_open(Path(folder) / "model.safetensors", "pt") as f:
        return SHARED_EMBEDDING in f.keys()


def load_tokenizer(path: str | Path):
    """A tokenizer, chat template included, from a folder or a GGUF file.

    Building one from a GGUF file's vocabulary takes seconds (transformers converts it anew),
    so the result is kept in the cache as a tokenizer folder, keyed by the file's name, size
    and modification time, and read from there, without transformers, next time."""
    folder, gguf_file = checkpoint_files(Path(path))
    if gguf_file is None:
        return _transformers_tokenizer(folder)
    stat = gguf_file.stat()
    cached = cache_dir() / "tokenizers" / f"{gguf_file.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not cached.is_dir():
        tokenizer = _transformers_tokenizer(folder, gguf_file.name)
        if not _save_atomically(tokenizer, cached):
            return tokenizer
    return FolderTokenizer(cached)


def _transformers_tokenizer(folder: Path, gguf_name: str | None = None):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        try:
            return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_name)
        except ValueError:  # an architecture transformers' GGUF reader lacks (SmolLM3): its tokenizer alone
            if gguf_name is None:
                raise
            return PreTrainedTokenizerFast.from_pretrained(str(folder), gguf_file=gguf_name)
    finally:
        logging.set_verbosity(verbosity)


def _save_atomically(tokenizer, folder: Path) -> bool:
    """Writes next to `folder` and renames, so a reader never sees half a tokenizer. False where
    the cache cannot be written (which only costs the next load its speed)."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent))
        tokenizer.save_pretrained(str(staging))
        try:
            staging.rename(folder)
        except OSError:  # another process got there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        return False
    return True
