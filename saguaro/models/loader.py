"""Loads checkpoints: local Hugging Face folders (safetensors), GGUF files (dequantized) and
saguaro's own folders (config.json with ModelConfig fields + model.safetensors), which drafts
use and which may leave out the embedding table they share with their target."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from saguaro.models.config import ModelConfig, UnsupportedModelError
from saguaro.models.eagle import model_class
from saguaro.models.llama import LlamaModel, rope_inv_freq
from saguaro.models.packed import pack_linears

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
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

    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return config, state


# --- GGUF -----------------------------------------------------------------------------------

def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# Mistral has no GGUF architecture of its own: llama.cpp writes it as "llama".
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def gguf_hf_config(reader) -> dict:
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
    if get("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(
            f"GGUF rope covers {get('rope.dimension_count')} of {head_dim} head dimensions: partial rope is not supported")
    vocab = get("vocab_size") or len(_gguf_value(reader, "tokenizer.ggml.tokens"))
    config = {
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
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
    rope_scaling = gguf_rope_scaling(reader, arch, head_dim)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def gguf_rope_scaling(reader, arch: str, head_dim: int) -> dict | None:
    """Rope scaling as llama.cpp applies it: inverse frequencies divided by a linear factor and
    by the per-dimension divisors of a `rope_freqs` tensor, where Llama 3's scaling is baked in
    (its `rope.scaling.*` keys are not written). Any other scaling type raises."""
    get = lambda key, default=None: _gguf_value(reader, f"{arch}.{key}", default)  # noqa: E731
    kind = get("rope.scaling.type", "linear")  # llama.cpp's default when only a factor is given
    if kind not in ("none", "linear"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
    factor = (get("rope.scaling.factor") or get("rope.scale_linear") or 1.0) if kind == "linear" else 1.0
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None if factor == 1.0 else {"rope_type": "linear", "factor": float(factor)}
    divisors = np.asarray(dequantize_gguf(freqs), dtype=np.float64).reshape(-1)
    if divisors.size != head_dim // 2:
        raise UnsupportedModelError(f"GGUF rope_freqs has {divisors.size} entries, {head_dim // 2} expected")
    return {"rope_type": "divisors", "divisors": (divisors * factor).tolist()}


def dequantize_gguf(tensor) -> np.ndarray:
    """A GGUF tensor as a float array in PyTorch's dimension order."""
    from gguf.quants import dequantize

    return dequantize(tensor.data, tensor.tensor_type).reshape([int(n) for n in reversed(tensor.shape)])


def _unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of q/k rows (interleaved rope) back to rotate-half order."""
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for rope_freqs, which the config carries."""
    prefix, _, kind = gguf_name.rpartition(".")
    if prefix == "rope_freqs":
        return None
    if prefix in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[prefix]}.{kind}"
    if prefix.startswith("blk."):
        _, layer, part = prefix.split(".", 2)
        if part in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name}")


def read_gguf(file: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(file))
    config = ModelConfig.from_hf(gguf_hf_config(reader))
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = gguf_tensor_name(tensor.name)
        if name is None:
            continue
        weight = dequantize_gguf(tensor)
        # Only the "llama" architecture stores q/k rows in llama.cpp's interleaved order.
        if config.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            weight = _unpermute_rope(weight, config.num_heads if ".q_proj." in name else config.num_kv_heads)
        state[name] = torch.from_numpy(np.array(weight, dtype=np.float32))
    return config, state


# --- our module ------------------------------------------------------------------------------

def fuse_hf_state(config: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Maps Hugging Face parameter names onto LlamaModel's fused qkv and gate/up projections."""
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
                state[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
        state[f"{p}mlp.gate_up_proj.weight"] = torch.cat(
            [state.pop(f"{p}mlp.gate_proj.weight"), state.pop(f"{p}mlp.up_proj.weight")])
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


def build_model(config: ModelConfig, hf_state: dict[str, torch.Tensor], dtype: torch.dtype,
                device: str | torch.device) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config)
    state = {k: v.to(dtype) for k, v in fuse_hf_state(config, hf_state).items()}
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config)
    return frozen(model.to(device))


def frozen(model: LlamaModel) -> LlamaModel:
    """An inference model: eval mode, no gradients, CPU weights in oneDNN's layout."""
    model.eval().requires_grad_(False)
    return pack_linears(model, model.device, model.dtype)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    return names[dtype]


def read_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    folder, gguf_file = checkpoint_files(Path(path))
    return read_gguf(gguf_file) if gguf_file else read_hf_folder(folder)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> LlamaModel:
    if is_saguaro_checkpoint(path):
        return load_checkpoint(path, dtype, device)
    config, hf_state = read_checkpoint(path)
    return build_model(config, hf_state, dtype, device)


# --- saguaro checkpoints (drafts) -------------------------------------------------------------

SHARED_EMBEDDING = "embed_tokens.weight"


class IncompatibleDraftError(ValueError):
    """The draft cannot run with this target: different vocabularies or embedding widths."""


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
                    device: str | torch.device = "cpu",
                    embeddings: torch.Tensor | None = None) -> LlamaModel:
    """A saguaro checkpoint; `embeddings` supplies the table when the checkpoint omits it."""
    from safetensors.torch import load_file

    folder = Path(folder)
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
    model.inv_freq = rope_inv_freq(config)
    return frozen(model.to(device))


def load_draft(path: str | Path, target: LlamaModel, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None) -> LlamaModel:
    """A draft for `target`: a saguaro checkpoint (embeddings borrowed from the target when the
    draft omits them) or any other checkpoint load_model reads. Vocabularies must match."""
    dtype, device = dtype or target.dtype, device or target.device
    if not is_saguaro_checkpoint(path):
        draft = load_model(path, dtype, device)
        _check_vocab(draft.config, target.config, path)
        return draft
    config = ModelConfig.load(Path(path) / "config.json")
    _check_vocab(config, target.config, path)
    embeddings = target.embed_tokens.weight.detach()
    if config.hidden_size != target.config.hidden_size and not _has_own_embeddings(path):
        raise IncompatibleDraftError(
            f"draft {path} borrows the target's embeddings but its width {config.hidden_size} "
            f"differs from the target's {target.config.hidden_size}")
    return load_checkpoint(path, dtype, device, embeddings=embeddings)


def _check_vocab(draft: ModelConfig, target: ModelConfig, path) -> None:
    if draft.vocab_size != target.vocab_size:
        raise IncompatibleDraftError(
            f"draft {path} has a vocabulary of {draft.vocab_size} tokens, the target {target.vocab_size}: "
            "speculative decoding needs the same tokenizer")


def _has_own_embeddings(folder: str | Path) -> bool:
    from safetensors import safe_open

    with safe_open(Path(folder) / "model.safetensors", "pt") as f:
        return SHARED_EMBEDDING in f.keys()


def load_tokenizer(path: str | Path):
    """A Hugging Face tokenizer, chat template included, from a folder or a GGUF file."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    folder, gguf_file = checkpoint_files(Path(path))
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        if gguf_file is not None:
            return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf_file.name)
        return AutoTokenizer.from_pretrained(str(folder))
    finally:
        logging.set_verbosity(verbosity)
