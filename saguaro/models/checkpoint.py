"""saguaro's own checkpoints (config.json with ModelConfig's fields + model.safetensors), which
drafts use and which may leave out the embedding table they share with their target."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from saguaro.models.build import assemble, quantized_projections
from saguaro.models.config import ModelConfig
from saguaro.models.hub import ModelNotFoundError
from saguaro.models.llama import LlamaModel
from saguaro.models.quantized import check_mode


SHARED_EMBEDDING = "embed_tokens.weight"


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
    `quantization`, its projections are quantized as `quantized_projections` says. config: its
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
    modules = {}
    if quantization is not None:
        quantization = check_mode(quantization, dtype, torch.device(device))
        modules = quantized_projections(config, state, quantization, dtype)
    return assemble(config, state, modules, quantization, device)


def has_own_embeddings(folder: str | Path) -> bool:
    from safetensors import safe_open

    with safe_open(Path(folder) / "model.safetensors", "pt") as f:
        return SHARED_EMBEDDING in f.keys()


def draft_embeddings(target: LlamaModel) -> torch.Tensor:
    """The embedding table a draft that omits its own borrows from `target`: the target's, or a
    twin's source's (saguaro.models.twin: its first columns), as the draft was made for the source."""
    width = target.config.source_hidden_size or target.config.hidden_size
    return target.embed_tokens.weight.detach()[:, :width].contiguous()
