"""Hugging Face folders: config.json as a ModelConfig and the safetensors weights (of an
image-text checkpoint, its language model's)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from saguaro.models.config import ModelConfig
from saguaro.models.hub import ModelNotFoundError


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
