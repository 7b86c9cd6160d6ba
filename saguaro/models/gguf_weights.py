"""A GGUF file read whole: its config, and its tensors under Hugging Face's names (q/k rows
back in rotate-half order, Gemma's norms without llama.cpp's offset)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from saguaro.models.config import ModelConfig, UnsupportedModelError
from saguaro.models.gguf_blocks import file_blocks
from saguaro.models.gguf_config import gguf_value, dequantize_gguf, gguf_hf_config
from saguaro.models.gguf_file import read_gguf_file
from saguaro.models.quantized import FileBlocks, GroupCodes


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


# Architectures whose q/k rows llama.cpp's converter reorders for interleaved rope.
_PERMUTED_QK = ("llama", "smollm3")


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
    arch = gguf_value(reader, "general.architecture")
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
