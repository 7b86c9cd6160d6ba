"""A wider twin of a Llama-family model: the same function at a bigger model's cost.

Speculative decoding pays when the target costs many times its draft; the small models saguaro
ships and tests with do not, and a real large target brings its own draft and downloads. A twin
keeps the small model's function and its draft's acceptance, at a chosen shape: every width is
zero-padded (hidden size, query and kv heads, FFN), each query head kept with its kv head and
the head size kept (so rope and attention are unchanged), extra layers all zero (a residual
block that adds nothing), and every norm weight and the norms' epsilon scaled by
old_hidden / new_hidden (the weights by its square root), so that an RMS norm over the padded
vector returns what it returned over the original one. In exact arithmetic the twin's logits are
the source's; in floating point only the norms round differently.

Two forms: `write_twin_gguf` copies a GGUF file's blocks into a wider file (a zero block of any
of llama.cpp's block types is exact zeros, so the twin runs what the source runs on the same
quantization), and `load_twin` builds the twin in memory on a device from the source's weights
(nothing to carry to a lent GPU but the small file).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from saguaro.models.config import ModelConfig
from saguaro.models.gguf_weights import _GGUF_LAYER_NAMES, _GGUF_TOP_NAMES

# Where each tensor's rows and columns live ("hidden", "q", "kv", "ffn"; None: kept as it is),
# by the suffix of its Hugging Face name.
_AXES = {
    "embed_tokens.weight": (None, "hidden"), "lm_head.weight": (None, "hidden"),
    "q_proj.weight": ("q", "hidden"), "k_proj.weight": ("kv", "hidden"), "v_proj.weight": ("kv", "hidden"),
    "o_proj.weight": ("hidden", "q"), "q_proj.bias": ("q",), "k_proj.bias": ("kv",), "v_proj.bias": ("kv",),
    "gate_proj.weight": ("ffn", "hidden"), "up_proj.weight": ("ffn", "hidden"), "down_proj.weight": ("hidden", "ffn"),
    "input_layernorm.weight": ("norm",), "post_attention_layernorm.weight": ("norm",), "norm.weight": ("norm",),
    "q_norm.weight": (None,), "k_norm.weight": (None,),
}
# The same by GGUF name, through the loader's name tables (rope_freqs has no Hugging Face tensor).
_GGUF_AXES = {f"{short}.{kind}": _AXES[f"{hf.rsplit('.', 1)[-1]}.{kind}"]
              for short, hf in {**_GGUF_LAYER_NAMES, **_GGUF_TOP_NAMES}.items() for kind in ("weight", "bias")
              if f"{hf.rsplit('.', 1)[-1]}.{kind}" in _AXES} | {"rope_freqs.weight": (None,)}
TWIN_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class TwinShape:
    """The twin's widths; num_layers None keeps the source's."""
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    num_layers: int | None = None

    @classmethod
    def parse(cls, text: str) -> TwinShape:
        """"HIDDEN,HEADS,KV_HEADS,FFN[,LAYERS]", as the command line gives it."""
        try:
            widths = [int(n) for n in text.split(",")]
        except ValueError:
            widths = []
        if len(widths) not in (4, 5):
            raise ValueError(f"a twin's shape is HIDDEN,HEADS,KV_HEADS,FFN[,LAYERS], not {text!r}")
        return cls(*widths)


@dataclass(frozen=True)
class TwinLayout:
    """Where each of the source's indices lands in the twin, per kind of width."""
    source: ModelConfig
    twin: ModelConfig
    places: dict[str, torch.Tensor]  # kind -> twin index of each source index
    norm_scale: float  # sqrt(old hidden / new hidden)

    def size(self, kind: str | None, source_size: int) -> int:
        sizes = {"hidden": self.twin.hidden_size, "norm": self.twin.hidden_size, "ffn": self.twin.intermediate_size,
                 "q": self.twin.num_heads * self.twin.head_dim, "kv": self.twin.num_kv_heads * self.twin.head_dim}
        return sizes.get(kind, source_size)

    def place(self, kind: str | None, source_size: int) -> torch.Tensor:
        return self.places["hidden" if kind == "norm" else kind] if kind else torch.arange(source_size)


def layout(config: ModelConfig, shape: TwinShape, head_placement: str = "grouped",
           rescale_norms: bool = True) -> TwinLayout:
    """The twin's config and index maps. Query head h of kv group j = h // g goes to twin head
    j * g' + h % g, so it keeps its kv head j (g, g': query heads per kv head). The tests'
    controls: head_placement "contiguous" (query head h to twin head h, which moves it to
    another kv head where g' > g) and rescale_norms=False (norms only zero-padded)."""
    if config.architecture not in TWIN_ARCHITECTURES or config.norm_offset or config.post_norms or \
            config.embed_scale is not None:
        raise ValueError(f"twins are made of Llama-family models ({', '.join(TWIN_ARCHITECTURES)}), "
                         f"not {config.architecture!r}")
    layers = shape.num_layers or config.num_layers
    for name, old, new in (("hidden_size", config.hidden_size, shape.hidden_size),
                           ("num_heads", config.num_heads, shape.num_heads),
                           ("num_kv_heads", config.num_kv_heads, shape.num_kv_heads),
                           ("intermediate_size", config.intermediate_size, shape.intermediate_size),
                           ("num_layers", config.num_layers, layers)):
        if new < old:
            raise ValueError(f"twin {name} {new} is smaller than the source's {old}")
    if shape.num_heads % shape.num_kv_heads:
        raise ValueError(f"twin num_heads {shape.num_heads} is not a multiple of num_kv_heads {shape.num_kv_heads}")
    group, twin_group = config.num_heads // config.num_kv_heads, shape.num_heads // shape.num_kv_heads
    if twin_group < group:
        raise ValueError(f"twin has {twin_group} query heads per kv head, fewer than the source's {group}: "
                         f"a query head could not keep its kv head")
    heads = torch.arange(config.num_heads)
    if head_placement == "grouped":
        twin_heads = heads // group * twin_group + heads % group
    elif head_placement == "contiguous":
        twin_heads = heads
    else:
        raise ValueError(f"head_placement is 'grouped' or 'contiguous', not {head_placement!r}")
    dim = torch.arange(config.head_dim)
    twin = dataclasses.replace(
        config, hidden_size=shape.hidden_size, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        intermediate_size=shape.intermediate_size, num_layers=layers,
        source_hidden_size=config.source_hidden_size or config.hidden_size,
        rms_norm_eps=config.rms_norm_eps * (config.hidden_size / shape.hidden_size if rescale_norms else 1.0))
    places = {"hidden": torch.arange(config.hidden_size), "ffn": torch.arange(config.intermediate_size),
              "q": (twin_heads[:, None] * config.head_dim + dim).reshape(-1),
              "kv": torch.arange(config.num_kv_heads * config.head_dim)}
    return TwinLayout(config, twin, places, math.sqrt(config.hidden_size / shape.hidden_size) if rescale_norms else 1.0)


def axes_of(name: str, table: dict[str, tuple]) -> tuple:
    for suffix, axes in table.items():
        if name == suffix or name.endswith("." + suffix):
            return axes
    raise ValueError(f"tensor {name!r} is not one a twin knows how to widen")


def widened(value: torch.Tensor, axes: tuple, plan: TwinLayout, dtype: torch.dtype,
            device: str | torch.device) -> torch.Tensor:
    """One tensor at the twin's widths: zeros, the source's values at their places."""
    if axes == ("norm",):
        value = value.float() * plan.norm_scale
    out = torch.zeros([plan.size(kind, n) for kind, n in zip(axes, value.shape)], dtype=dtype, device=device)
    index = [plan.place(kind, n).to(device) for kind, n in zip(axes, value.shape)]
    if len(index) == 2:
        index = [index[0][:, None], index[1][None, :]]
    out[tuple(index)] = value.to(device=device, dtype=dtype)
    return out


def twin_state(config: ModelConfig, state: dict[str, torch.Tensor], shape: TwinShape, dtype: torch.dtype,
               device: str | torch.device, **controls) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A source's float weights (Hugging Face names) -> the twin's config and weights on `device`;
    controls: layout's."""
    plan = layout(config, shape, **controls)
    out = {name: widened(value, axes_of(name, _AXES), plan, dtype, device) for name, value in state.items()}
    for layer in range(config.num_layers, plan.twin.num_layers):  # residual blocks that add nothing
        for name, value in state.items():
            if name.startswith("model.layers.0."):
                extra = name.replace("model.layers.0.", f"model.layers.{layer}.")
                out[extra] = widened(value, axes_of(name, _AXES), plan, dtype, device)
                out[extra].copy_(torch.ones_like(out[extra]) if "norm" in name else torch.zeros_like(out[extra]))
    return plan.twin, out


def load_twin(path: str | Path, shape: TwinShape, dtype: torch.dtype = torch.bfloat16,
              device: str | torch.device = "cpu", quantization: str | None = None, **controls):
    """The twin of the checkpoint at `path`, built on `device` from its dequantized weights (the
    source is dequantized on the CPU, small; the twin is laid out on the device); controls:
    layout's."""
    from saguaro.models.build import build_model, plain_weights
    from saguaro.models.loader import read_checkpoint

    config, state = read_checkpoint(path)
    config, state = twin_state(config, {k: plain_weights(v, torch.float32) for k, v in state.items()}, shape,
                               dtype, device, **controls)
    return build_model(config, state, dtype, device, quantization)


# --- the GGUF file ----------------------------------------------------------------------------

def _units(tensor) -> tuple[np.ndarray, int]:
    """A GGUF tensor's data as [rows, units, bytes a unit] uint8, a unit being one block of a
    quantized type or one value of a float type, and the values a unit holds."""
    import gguf

    block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    data = np.ascontiguousarray(tensor.data).view(np.uint8)
    rows = int(np.prod([int(n) for n in tensor.shape[1:]], dtype=np.int64))
    return data.reshape(rows, -1, block_bytes), block


def _unit_places(place: np.ndarray, block: int, name: str) -> np.ndarray:
    """Column places -> block places; every source block must land whole on a twin block."""
    starts = place[::block]
    if len(place) % block or np.any(starts % block) or np.any(place.reshape(-1, block) - starts[:, None] != np.arange(block)):
        raise ValueError(f"{name}: its blocks of {block} values cannot be moved whole to the twin's widths "
                         f"(choose widths and a head size that are multiples of {block})")
    return starts // block


def _widen_gguf_tensor(tensor, axes: tuple, plan: TwinLayout) -> np.ndarray:
    import gguf

    if axes == ("norm",):
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{tensor.name}: a norm weight in {tensor.tensor_type.name}, not F32")
        out = np.zeros(plan.twin.hidden_size, np.float32)
        out[plan.place("hidden", len(tensor.data)).numpy()] = np.asarray(tensor.data, np.float32) * plan.norm_scale
        return out
    units, block = _units(tensor)
    columns = int(tensor.shape[0])
    rows_kind, columns_kind = (None, axes[0]) if len(axes) == 1 else axes
    row_places = plan.place(rows_kind, units.shape[0]).numpy()
    column_places = _unit_places(plan.place(columns_kind, columns).numpy(), block, tensor.name)
    out = np.zeros((plan.size(rows_kind, units.shape[0]), plan.size(columns_kind, columns) // block, units.shape[2]),
                   np.uint8)
    out[row_places[:, None], column_places[None, :]] = units
    return out.reshape(out.shape[0], -1) if len(axes) == 2 else out.reshape(-1)


def write_twin_gguf(source: str | Path, destination: str | Path, shape: TwinShape, progress: bool = True,
                    **controls) -> Path:
    """The twin of a GGUF file as a GGUF file: metadata copied (the shape's keys changed), every
    tensor's blocks copied to their places among zero blocks, in the source's types; controls:
    layout's."""
    import gguf
    from tqdm import tqdm

    from saguaro.models.loader import read_checkpoint

    config, _ = read_checkpoint(source)
    plan = layout(config, shape, **controls)
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    changed = {f"{arch}.embedding_length": shape.hidden_size, f"{arch}.feed_forward_length": shape.intermediate_size,
               f"{arch}.attention.head_count": shape.num_heads, f"{arch}.attention.head_count_kv": shape.num_kv_heads,
               f"{arch}.block_count": plan.twin.num_layers, f"{arch}.attention.key_length": config.head_dim,
               f"{arch}.attention.value_length": config.head_dim,
               f"{arch}.attention.layer_norm_rms_epsilon": plan.twin.rms_norm_eps}
    destination = Path(destination)
    writer = gguf.GGUFWriter(str(destination), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in changed:
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype, field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", config.head_dim)
    for key in ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv", "block_count"):
        writer.add_uint32(f"{arch}.{key}", changed[f"{arch}.{key}"])
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", plan.twin.rms_norm_eps)
    first_layer = []
    for tensor in tqdm(reader.tensors, desc=f"widening {Path(source).name}", unit="tensor", disable=not progress):
        name = tensor.name
        data = _widen_gguf_tensor(tensor, axes_of(name, _GGUF_AXES), plan)
        writer.add_tensor(name, data, raw_dtype=tensor.tensor_type)
        if name.startswith("blk.0."):
            first_layer.append((name, tensor.tensor_type, data))
    for layer in range(config.num_layers, plan.twin.num_layers):  # residual blocks that add nothing
        for name, kind, data in first_layer:
            norm = axes_of(name, _GGUF_AXES) == ("norm",)
            writer.add_tensor(name.replace("blk.0.", f"blk.{layer}.", 1),
                              np.ones_like(data) if norm else np.zeros_like(data), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=progress)
    writer.close()
    return destination
