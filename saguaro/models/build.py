"""A model built from a checkpoint's weights: Hugging Face names onto LlamaModel's fused
projections, the projections quantized as the mode says, frozen for inference."""
from __future__ import annotations

import torch
from tqdm import tqdm

from saguaro.models.native import bindings, layers, packing
from saguaro.models.config import ModelConfig
from saguaro.models.eagle import model_class
from saguaro.models.llama import Execution, LlamaModel
from saguaro.models.packed import pack_linears
from saguaro.models.quantized import (FileBlocks, GroupCodes, GroupInt4, GroupInt5, GroupInt6, GroupInt8, StackedCodes,
                                      check_mode, quantized_linear)


def fuse_hf_state(config: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Maps Hugging Face parameter names onto LlamaModel's fused qkv and gate/up projections
    (Phi-3's come fused). Takes the tensors out of hf_state, so that each fused part is freed
    once fused (a 2-billion-weight twin in bf16 peaked at 11 GB when they were kept)."""
    state = {}
    while hf_state:
        name, value = hf_state.popitem()
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
        return bindings.bf16_available()
    return isinstance(weight, (GroupInt5, GroupInt6, GroupInt8)) or isinstance(weight, FileBlocks) and weight.bits > 4


def plain_weights(weight: torch.Tensor | GroupCodes | FileBlocks | StackedCodes, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(weight, FileBlocks):
        return weight.dequantize(dtype)
    return (weight if isinstance(weight, torch.Tensor) else weight.dequantize()).to(dtype)


def build_model(config: ModelConfig, hf_state: dict[str, torch.Tensor | GroupCodes], dtype: torch.dtype,
                device: str | torch.device, quantization: str | None = None) -> LlamaModel:
    """The model; `quantization` (saguaro.models.quantized.MODES) says which decoder projections
    run quantized. The embeddings stay in `dtype`, and so does the head, except that "auto" keeps
    a Q8_0 head's codes where saguaro's kernels run. hf_state is emptied (fuse_hf_state)."""
    mode = check_mode(quantization, dtype, torch.device(device))
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
    plain = {}
    while state:
        name, value = state.popitem()
        plain[name] = plain_weights(value, dtype)
    return assemble(config, plain, quantized, mode, device)


def assemble(config: ModelConfig, state: dict[str, torch.Tensor], modules: dict[str, torch.nn.Module] | None = None,
             quantization: str | None = None, device: str | torch.device = "cpu") -> LlamaModel:
    """The inference model holding `state` and `modules` (LlamaModel.with_weights), of the
    class its config names (EAGLE or not), on `device`: eval mode, no gradients, CPU weights in
    oneDNN's layout, its layers run by saguaro's kernels where they take them. quantization:
    the mode its projections were built in. Every loader (checkpoints of each format, a
    tensor-parallel shard) ends here, so a model is put together one way."""
    model = model_class(config).with_weights(config, state, modules).to(device)
    model.eval().requires_grad_(False)
    model = pack_linears(model, model.device, model.dtype)
    model.use(Execution(quantization=quantization, native_layers=layers.native_layers(model)))
    return model


def quantized_projections(config: ModelConfig, state: dict[str, torch.Tensor], mode: str,
                          dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """A float checkpoint's projections quantized, by name, their weights taken out of `state`:
    "int8" / "int4" as build_model does; "auto", where saguaro's kernels run, int4 groups and an
    int8-group head (a draft's precision decides only how often its proposals are accepted,
    never what is sampled, and a draft step reads about a third of bf16's bytes so). EAGLE
    drafts stay as they are."""
    if mode == "none" or (mode == "auto" and (not bindings.available() or config.eagle)):
        return {}
    modules = {}
    for i in range(config.num_layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            module = f"layers.{i}.{name}"
            weight = state[f"{module}.weight"]
            quantized = quantized_linear(GroupInt4.from_float(weight) if mode == "auto" else weight,
                                         state.get(f"{module}.bias"), mode, dtype)
            if quantized is not None:
                modules[module] = quantized
                del state[f"{module}.weight"]
                state.pop(f"{module}.bias", None)
    head = state["lm_head.weight"]
    if mode == "auto" and not config.tie_word_embeddings and packing.fits(*head.shape):
        modules["lm_head"] = quantized_linear(GroupInt8.from_float(head), None, mode, dtype, torch.float32)
        del state["lm_head.weight"]
    return modules
