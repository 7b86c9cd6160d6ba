"""Frozen linear layers in oneDNN's blocked weight layout, for decoding on CPU.

Small-batch decoding reads every weight once per step, so its speed is the speed at which the
matrix kernels stream weights. Each weight is reordered once, at load, into oneDNN's blocked
layout, the order its kernels compute in, instead of being read in the plain one every call;
the results are bit-identical. No library kernel streams a single fp32 row near the memory
bandwidth, but a batched product over blocks of 16 output columns, each block's weight stored
input-major, does, so fp32 layers keep that copy too, for single rows.
"""
from __future__ import annotations

import torch
from torch import nn


BLOCK = 16  # outputs per block of the fp32 single-row copy: a SmolLM2 step's fastest of 8, 16 and 32


def output_blocks(weight: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """[out, in] -> [out / block, in, block]: each block of outputs stored input-major."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // block, block, in_features).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """An inference-only nn.Linear; `weight` and the state dict still give the plain matrix."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.bias = linear.bias
        self.single_row = None  # fp32: [out / BLOCK, in, BLOCK], see the module docstring
        if weight.dtype == torch.float32 and self.out_features % BLOCK == 0:
            self.single_row = output_blocks(weight)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("PackedLinear is for inference: train the unpacked model")
        if self.single_row is not None and x.numel() == self.in_features:
            blocks = self.single_row.shape[0]
            out = torch.bmm(x.reshape(1, 1, -1).expand(blocks, 1, -1), self.single_row)
            out = out.reshape(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Replaces every nn.Linear of a frozen CPU model by a PackedLinear (in place)."""
    if not can_pack(device, dtype):
        return model
    linears = [name for name, child in model.named_modules() if isinstance(child, nn.Linear)]
    for name in linears:  # by name: each replaced layer's weight is freed before the next is packed
        model.set_submodule(name, PackedLinear(model.get_submodule(name)))
    return model
