"""Loads a checkpoint as a frozen model, whatever its format: a local Hugging Face folder
(safetensors), a GGUF file (its repacked weights kept in the weight cache) or a saguaro
checkpoint (checkpoint.py)."""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

from saguaro.models import weight_cache
from saguaro.models.native import bindings
from saguaro.models.build import build_model
from saguaro.models.checkpoint import is_saguaro_checkpoint, load_checkpoint
from saguaro.models.config import ModelConfig
from saguaro.models.gguf_weights import read_gguf
from saguaro.models.hf_folder import read_hf_folder
from saguaro.models.hub import cache_dir, checkpoint_files
from saguaro.models.llama import LlamaModel
from saguaro.models.quantized import GroupCodes


def read_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor | GroupCodes]]:
    """A Hugging Face folder's or a GGUF file's config and weights, as they are stored."""
    folder, gguf_file = checkpoint_files(Path(path))
    return read_gguf(gguf_file) if gguf_file else read_hf_folder(folder)


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", quantization: str | None = None) -> LlamaModel:
    """A checkpoint as a frozen model; see build_model for `quantization`."""
    folder, gguf_file = checkpoint_files(Path(path))
    if is_saguaro_checkpoint(path):
        return load_checkpoint(path, dtype, device)
    config, hf_state = read_gguf(gguf_file) if gguf_file else read_hf_folder(folder)
    if gguf_file is None or not bindings.available() or torch.device(device).type != "cpu":
        return build_model(config, hf_state, dtype, device, quantization)
    stat = gguf_file.stat()
    where = zlib.crc32(str(gguf_file.resolve()).encode())
    key = (f"{gguf_file.stem}-{where:08x}-{stat.st_size}-{stat.st_mtime_ns}-{str(dtype).removeprefix('torch.')}-"
           f"{quantization or 'default'}-{bindings.build_key()}")
    with weight_cache.kept(cache_dir() / "weights", key):
        return build_model(config, hf_state, dtype, device, quantization)
