"""PackedLinear: the CPU decoding layout must compute what nn.Linear computes and still give
the plain weights to whoever reads them (state dicts, draft initialisation, peers)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from saguaro.models.packed import PackedLinear, can_pack, pack_linears


def linear(dtype: torch.dtype, bias: bool = False, shape=(48, 32)) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(shape[1], shape[0], bias=bias).to(dtype).requires_grad_(False)


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16")
@pytest.mark.parametrize("rows", [1, 6, 16])
def test_bf16_packed_is_bit_identical(rows):
    plain = linear(torch.bfloat16, bias=True)
    x = torch.randn(2, rows, 32).to(torch.bfloat16)
    assert torch.equal(PackedLinear(plain)(x), plain(x))


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="no oneDNN")
@pytest.mark.parametrize("shape", [(48, 32), (32, 48), (40, 32)])  # 40 outputs: not whole blocks
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_packed_matches(rows, shape, bias):
    plain = linear(torch.float32, bias=bias, shape=shape)
    x = torch.randn(1, rows, shape[1])
    torch.testing.assert_close(PackedLinear(plain)(x), plain(x), rtol=1e-5, atol=1e-5)


def test_weights_and_state_dict_stay_plain():
    model = nn.Sequential(linear(torch.float32, bias=True)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pack_linears(model, torch.device("cpu"), torch.float32)
    assert isinstance(model[0], PackedLinear) == can_pack(torch.device("cpu"), torch.float32)
    assert model.state_dict().keys() == before.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    assert torch.equal(model[0].weight, before["0.weight"])


def test_training_through_a_packed_layer_is_refused():
    packed = PackedLinear(linear(torch.float32))
    with pytest.raises(RuntimeError, match="inference"):
        packed(torch.randn(3, 32, requires_grad=True))
