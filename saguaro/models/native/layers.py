"""A model's decoder layers run by decoder_layer.c: each layer in one call, every architecture
LlamaModel runs (Gemma's norms, GeGLU and soft caps, sliding windows, partial or absent rope). In
Python a layer is ~90 small torch operations, which at decode take as long as the weights'
streaming itself; in C they cost little beside it."""
from __future__ import annotations

import torch

from saguaro.models.native import bindings
from saguaro.models.native.bindings import LayerWeights, library


class NativeLayers:
    """A model's decoder layers as decoder_layer.c runs them (see `native_layers`)."""

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.weights = []
        self.kept = []  # tensors the structs point into
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fields = dict(hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
                          head_dim=config.head_dim, intermediate=config.intermediate_size, eps=config.rms_norm_eps,
                          rope=int(attn.rope), rotary_dim=config.rotary_dim, norm_offset=config.norm_offset,
                          activation=ACTIVATIONS[config.mlp_activation], attn_scale=config.attn_scale or 0.0,
                          attn_softcap=config.attn_softcap or 0.0, sliding=int(layer.sliding))
            tensors = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                       "q_norm": attn.q_norm.weight if attn.q_norm is not None else None,
                       "k_norm": attn.k_norm.weight if attn.k_norm is not None else None,
                       "qkv_bias": attn.qkv_proj.bias, "attn_out_norm": None, "mlp_out_norm": None}
            if layer.pre_feedforward_layernorm is not None:  # Gemma: norms around the attention's and MLP's outputs
                tensors |= {"post_norm": layer.pre_feedforward_layernorm.weight,
                            "attn_out_norm": layer.post_attention_layernorm.weight,
                            "mlp_out_norm": layer.post_feedforward_layernorm.weight}
            for name, projection in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                     ("down", mlp.down_proj)):
                tensors[name] = projection.packed
                fields[f"{name}_bits"] = projection.bits
            for name, tensor in tensors.items():
                if tensor is not None:
                    tensor = tensor.detach().contiguous()
                    self.kept.append(tensor)
                fields[name] = None if tensor is None else tensor.data_ptr()
            self.weights.append(LayerWeights(**fields))
        self.all_weights = (LayerWeights * len(self.weights))(*self.weights)
        self.final_norm = model.norm.weight.detach().contiguous()

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, rows, slots: torch.Tensor,
            mask: torch.Tensor, span: int, local: tuple | None = None) -> torch.Tensor:
        """The layers and the final norm over x [B, T, hidden]; cos and sin [B, T, rotary_dim / 2],
        the other arguments as LlamaModel.run_layers has them; local: the sliding layers' (window
        mask, cos, sin), cos and sin None where they turn as the others do."""
        B, T, hidden = x.shape
        x = x.to(torch.bfloat16, copy=True).contiguous()
        if rows is None:
            rows = torch.arange(B)
        elif isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop)
        row_of = (rows if T == 1 else rows.repeat_interleave(T)).to(torch.int64).contiguous()
        slot_of = slots.to(torch.int64).reshape(-1).contiguous()
        visible = _visible(mask, B * T, span)
        cos, sin = cos.reshape(B * T, -1).contiguous(), sin.reshape(B * T, -1).contiguous()
        window, cos_local, sin_local = local or (None, None, None)
        window = None if window is None else _visible(window, B * T, span)
        if cos_local is not None:
            cos_local, sin_local = cos_local.reshape(B * T, -1).contiguous(), sin_local.reshape(B * T, -1).contiguous()
        if cache.keys.dtype != torch.bfloat16 or not cache.keys.is_contiguous():
            raise TypeError("saguaro's kernels take a contiguous bf16 KV cache")
        status = library().saguaro_decoder_layers(
            self.all_weights, len(self.weights), x.data_ptr(), B * T, cos.data_ptr(), sin.data_ptr(),
            cache.keys.data_ptr(), cache.values.data_ptr(), cache.keys[0].numel(), cache.num_slots,
            row_of.data_ptr(), slot_of.data_ptr(), _pointer(visible), span, self.final_norm.data_ptr(),
            _pointer(cos_local), _pointer(sin_local), _pointer(window), torch.get_num_threads())
        if status == -1:
            raise MemoryError("saguaro_decoder_layer: out of memory")
        if status != 0:  # native_layers() admits only the head sizes the layer takes
            raise RuntimeError(f"saguaro_decoder_layer refused a layer ({status})")
        return x


ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # decoder_layer.c's activation codes


def _visible(mask: torch.Tensor, rows: int, span: int) -> torch.Tensor | None:
    """A [.., span] bool mask as the uint8 rows decoder_layer.c reads; None where all is visible."""
    return None if bool(mask.all()) else mask.reshape(rows, span).to(torch.uint8).contiguous()


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def native_layers(model: torch.nn.Module) -> NativeLayers | None:
    """A bf16 CPU model's layers as saguaro's kernels run them, where every projection is held
    in saguaro's tiles; None where they cannot."""
    head_dim = model.config.head_dim
    if not bindings.available() or model.dtype != torch.bfloat16 or model.device.type != "cpu" or head_dim % 16 or head_dim > 256:
        return None
    for layer in model.layers:
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if not all(getattr(p, "native", False) for p in projections):
            return None
        if any(p.bias is not None for p in projections[1:]):  # decoder_layer.c adds a bias to qkv only
            return None
    return NativeLayers(model)
