"""A GGUF file's metadata as the Hugging Face config a ModelConfig is made from: its
architecture's keys, the fields llama.cpp fixes per architecture, and rope scaling."""
from __future__ import annotations

import numpy as np

from saguaro.models.config import UnsupportedModelError
from saguaro.models.gguf_file import GGUFFile


def gguf_value(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


# Mistral has no GGUF architecture of its own: llama.cpp writes it as "llama".
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3")


_HF_MODEL_TYPES = {"gemma3": "gemma3_text"}  # where Hugging Face's name differs


def gguf_hf_config(reader: GGUFFile) -> dict:
    """The GGUF metadata expressed as a Hugging Face config.json dictionary."""
    arch = gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}: saguaro reads {', '.join(GGUF_ARCHITECTURES)} "
            "(llama.cpp writes Mistral models as 'llama')")
    get = lambda key, default=None: gguf_value(reader, f"{arch}.{key}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError("GGUF value heads differ in width from key heads: not supported")
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim and arch != "phi3":
        raise UnsupportedModelError(
            f"GGUF rope covers {rotary} of {head_dim} head dimensions: partial rope is not supported for {arch!r}")
    vocab = get("vocab_size") or len(gguf_value(reader, "tokenizer.ggml.tokens"))
    config = {
        "model_type": _HF_MODEL_TYPES.get(arch, arch), "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"), "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim, "rope_theta": get("rope.freq_base", 10000.0),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": get("context_length", 8192),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_value(reader, "tokenizer.ggml.eos_token_id"),
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
    get = lambda key, default=None: gguf_value(reader, f"{arch}.{key}", default)  # noqa: E731
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
