"""Weight-only quantization: the int4 / int8 kernels compute what their dequantized weights say,
one row's result does not depend on the rows beside it, and every common GGUF type loads into
the same network as its dequantized weights (4-bit blocks kept code for code)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from saguaro.models import build, gguf_blocks, gguf_config, loader
from saguaro.models.native import bindings, packing
from saguaro.models.quantized import (GROUP, GroupInt4, GroupInt6, GroupLinear, Int4Linear, Int8Linear, check_mode,
                                      native_tiles)
from test_gguf import gguf_tensors, max_diff, saguaro_logits, write_gguf

SHAPES = [(960, 576), (576, 1536), (64, 32)]  # SmolLM2's qkv and down projections, and a tiny one


def random_int4(out_features: int, in_features: int, seed: int = 0) -> GroupInt4:
    gen = torch.Generator().manual_seed(seed)
    groups = in_features // GROUP
    return GroupInt4(torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8),
                     torch.rand(out_features, groups, generator=gen) * 0.02 + 1e-3,
                     -torch.rand(out_features, groups, generator=gen) * 0.2)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return ((out.double() - reference).abs().max() / reference.abs().max()).item()


def int4_linear(weights: GroupInt4, kernel: str, monkeypatch) -> Int4Linear:
    """An Int4Linear on saguaro's kernel (where it runs) or on torch's."""
    if kernel == "saguaro" and not bindings.available():
        pytest.skip("saguaro's CPU kernels do not run here")
    if kernel == "torch":
        monkeypatch.setattr(bindings, "available", lambda: False)
    layer = Int4Linear(weights, None, torch.bfloat16)
    monkeypatch.undo()
    assert layer.native == (kernel == "saguaro")
    return layer


@pytest.mark.parametrize("kernel", ["saguaro", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int4_linear_computes_its_dequantized_weights(shape, kernel, monkeypatch):
    weights = random_int4(*shape)
    x = torch.randn(6, shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    out = int4_linear(weights, kernel, monkeypatch)(x)
    reference = x.double() @ weights.dequantize().double().T
    # torch: bf16 rounding of the output, scales and offsets; saguaro: 8-bit activations
    # (tests/test_native.py checks its arithmetic exactly).
    assert relative_error(out, reference) < (1e-2 if kernel == "torch" else 3e-2)
    # Control: the kernel reads code 8 as zero; an offset taken as the weight at code 0 is caught.
    shifted = GroupInt4(weights.codes, weights.scales, weights.lows - 8 * weights.scales)
    assert relative_error(out, x.double() @ shifted.dequantize().double().T) > 0.1


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_linear_computes_its_dequantized_weights(shape):
    weight = torch.randn(shape) * 0.05
    layer = Int8Linear(weight, None, torch.bfloat16)
    x = torch.randn(6, shape[1]).bfloat16()
    dequantized = layer.codes.double() * layer.scales.double()[:, None]
    assert relative_error(layer(x), x.double() @ dequantized.T) < 1e-2
    assert relative_error(layer(x), x.double() @ weight.double().T) < 3e-2  # 8 bits per channel


@pytest.mark.parametrize("layer", ["int4 saguaro", "int4 torch", "int8"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(layer, monkeypatch):
    """What batch invariance needs from the kernels: row i of an M-row product is bit-identical
    to row i computed alone, for every M (torch's int4 kernel works in blocks of 4 rows), so
    batch invariance runs them on all rows at once (`row_invariant`)."""
    weights = random_int4(960, 576)
    module = int4_linear(weights, layer.split()[1], monkeypatch) if layer.startswith("int4") else \
        Int8Linear(weights.dequantize(), None, torch.bfloat16)
    assert module.row_invariant
    x = torch.randn(300, 576).bfloat16()
    alone = torch.cat([module(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 6, 7, 9, 16, 33, 64, 300):
        assert torch.equal(module(x[:rows]), alone[:rows]), f"{rows} rows"


def test_from_float_rounds_each_weight_to_its_groups_nearest_step():
    weight = torch.randn(64, 128)
    weights = GroupInt4.from_float(weight)
    step = weights.scales.repeat_interleave(GROUP, dim=1)
    assert ((weights.dequantize() - weight).abs() <= step / 2 + 1e-6).all()
    assert int(weights.codes.min()) == 0 and int(weights.codes.max()) == 15


def test_modes_are_checked():
    cpu = torch.device("cpu")
    assert check_mode(None, torch.bfloat16, cpu) == "auto"
    assert check_mode("auto", torch.float32, cpu) == check_mode("auto", torch.float16, cpu) == "none"
    with pytest.raises(ValueError, match="in bf16"):
        check_mode("int4", torch.float16, cpu)
    with pytest.raises(ValueError, match="unknown quantization 'q3'"):
        check_mode("q3", torch.bfloat16, cpu)


# --- GGUF types -------------------------------------------------------------------------------

# hidden 256 and intermediate 512: the K-quants' 256-weight blocks run along every input.
KQUANT_SIZE = dict(vocab_size=96, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TYPES = [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
NATIVE_BITS = {Q.Q5_0: 5, Q.Q5_1: 5, Q.Q5_K: packing.K5, Q.Q6_K: packing.K6,  # types only saguaro's kernels run undequantized
               Q.Q2_K: packing.K2, Q.Q3_K: packing.K3, Q.IQ4_NL: packing.NL4, Q.IQ4_XS: packing.NL4}
K_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)  # gguf-py cannot quantize to these
DECODED_TYPES = INT4_TYPES + (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)  # gguf_groups decodes these to codes (numpy)
RECORD_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # in records of a 256-input block, which no Python packer writes
TOKENS = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()


def random_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator, size: float = 1.0) -> np.ndarray:
    """K-quant blocks with random codes and sub-scales (gguf-py cannot quantize to them): the
    fp16 super-block scales are set so the weights come out of order 0.1 * size."""
    blocks = rows * cols // 256
    if kind in (Q.Q4_K, Q.Q5_K):  # d, dmin (fp16), 12 bytes of six-bit scales and mins, (Q5_K: 32 bytes
        # of top bits,) 128 bytes of codes
        raw = rng.integers(0, 256, (blocks, 144 if kind == Q.Q4_K else 176), dtype=np.uint8)
        d = 2e-4 * size if kind == Q.Q4_K else 1e-4 * size
        raw[:, 0:4] = np.array([d, d], dtype=np.float16).view(np.uint8)
    elif kind == Q.Q6_K:  # 128 + 64 bytes of codes, 16 int8 scales, d (fp16)
        raw = rng.integers(0, 256, (blocks, 210), dtype=np.uint8)
        raw[:, 208:210] = np.array([2e-5 * size], dtype=np.float16).view(np.uint8)
    elif kind == Q.Q2_K:  # 16 bytes of four-bit scales and mins, 64 of two-bit codes, d and dmin (fp16)
        raw = rng.integers(0, 256, (blocks, 84), dtype=np.uint8)
        # dmin = 1.5 d: the mins take off what the codes (1.5 on average) add, as a real file's do
        raw[:, 80:84] = np.array([2e-3 * size, 3e-3 * size], dtype=np.float16).view(np.uint8)
    elif kind == Q.Q3_K:  # 32 bytes of top bits, 64 of two-bit codes, 12 of six-bit scales, d (fp16)
        raw = rng.integers(0, 256, (blocks, 110), dtype=np.uint8)
        raw[:, 108:110] = np.array([2e-3 * size], dtype=np.float16).view(np.uint8)
    elif kind == Q.IQ4_NL:  # per 32 weights: d (fp16), 16 bytes of codes
        raw = rng.integers(0, 256, (blocks * 8, 18), dtype=np.uint8)
        raw[:, 0:2] = np.array([1e-3 * size], dtype=np.float16).view(np.uint8)
    else:  # IQ4_XS: d (fp16), 2 + 4 bytes of six-bit sub-scales, 128 bytes of codes
        raw = rng.integers(0, 256, (blocks, 136), dtype=np.uint8)
        raw[:, 0:2] = np.array([5e-5 * size], dtype=np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def q3_k_groups(tensor) -> GroupInt6:
    """A Q3_K tensor's codes (-4..3), sub-scales and d, decoded in numpy as ggml lays them out:
    per block 32 bytes of top bits, 64 of two-bit codes, 12 of six-bit sub-scales, fp16 d."""
    rows = tensor.shape[1] if len(tensor.shape) > 1 else 1
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, 110)
    hmask, qs, scales = raw[:, :32], raw[:, 32:96], raw[:, 96:108].astype(np.int32)
    codes = np.empty((len(raw), 256), dtype=np.int8)
    for sb in range(8):
        n, j = divmod(sb, 4)
        low2 = (qs[:, 32 * n:32 * n + 32] >> (2 * j)) & 3
        top = (hmask >> (4 * n + j)) & 1
        codes[:, 32 * sb:32 * sb + 32] = low2.astype(np.int8) - 4 * (1 - top.astype(np.int8))
    k = np.arange(16)
    low4 = np.where(k < 8, scales[:, k % 8] & 15, scales[:, k % 8] >> 4)
    top2 = (scales[:, 8 + k % 4] >> (2 * (k // 4))) & 3
    subs = (low4 | (top2 << 4)) - 32
    d = raw[:, 108:110].copy().view(np.float16).astype(np.float32)
    return GroupInt6(torch.from_numpy(codes.reshape(rows, -1)), torch.from_numpy(d.reshape(rows, -1)),
                     torch.from_numpy(subs.astype(np.int8).reshape(rows, -1)))


def q2_k_arithmetic(x: torch.Tensor, tensor) -> torch.Tensor:
    """group_matmul.c's K2 arithmetic in float64, from a Q2_K tensor's blocks decoded in numpy:
    x ~ d q per group of 32, then per half group d * scale * sum(code q) - dmin * min * sum(q)."""
    rows = tensor.shape[1]
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, 84)
    scales, qs = raw[:, :16], raw[:, 16:80]
    d, dmin = (raw[:, 80 + 2 * i:82 + 2 * i].copy().view(np.float16).astype(np.float64) for i in range(2))
    codes = np.concatenate([(qs[:, 32 * (sb // 4):32 * (sb // 4) + 32] >> (2 * (sb % 4))) & 3 for sb in range(8)], axis=1)
    codes = torch.from_numpy(codes.astype(np.float64).reshape(rows, -1, 16))  # [out, half groups, 16]
    scale = torch.from_numpy((d * (scales & 15)).reshape(rows, -1))
    low = torch.from_numpy((-dmin * (scales >> 4)).reshape(rows, -1))
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    top = groups.abs().amax(-1, keepdim=True)
    q = torch.round(groups * torch.where(top > 0, torch.full_like(top, 127).div(top), 0)).double().reshape(x.shape[0], -1, 16)
    dx = (top / 127).double()[..., 0].repeat_interleave(2, dim=1)
    return (torch.einsum("rhi,ohi,oh,rh->ro", q, codes, scale, dx) + torch.einsum("rh,oh,rh->ro", q.sum(-1), low, dx))


def projection_blocks(source, kind: Q) -> dict[str, tuple[np.ndarray, Q]]:
    """Every projection of `source` (as llama.cpp lays it out) quantized to `kind`."""
    rng = np.random.default_rng(0)
    out = {}
    for name, array in gguf_tensors(source, "llama").items():
        if array.ndim == 2 and name.startswith("blk."):
            blocks = random_blocks(kind, *array.shape, rng) if kind in K_TYPES else \
                gguf.quants.quantize(array, kind)
            out[name] = (blocks, kind)
    return out


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**KQUANT_SIZE, initializer_range=0.05)
    return transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)


@pytest.fixture(scope="module", params=TYPES, ids=lambda kind: kind.name)
def files(request, source, tmp_path_factory):
    """(type, its file, the same network written as its dequantized fp32 weights)."""
    kind, folder = request.param, tmp_path_factory.mktemp(request.param.name)
    quantized = projection_blocks(source, kind)
    dequantized = {name: gguf.quants.dequantize(blocks, kind) for name, (blocks, kind) in quantized.items()}
    return (kind, write_gguf(folder / "q.gguf", source, "llama", "tiny", tensors=quantized),
            write_gguf(folder / "f32.gguf", source, "llama", "tiny", tensors=dequantized))


def test_every_gguf_type_loads_as_its_dequantized_weights(files, source):
    kind, file, reference = files
    expected = saguaro_logits(loader.load_model(reference), TOKENS)
    assert max_diff(saguaro_logits(loader.load_model(file, quantization="none"), TOKENS), expected) < 1e-4
    if kind in (Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1):  # control: the quantization is visible in the logits
        unquantized = saguaro_logits(loader.load_model(write_gguf(file.with_name("src.gguf"), source, "llama", "tiny")),
                                     TOKENS)
        assert max_diff(unquantized, expected) > 1e-3


def test_4_5_and_6_bit_blocks_run_with_their_own_codes(files):
    kind, file, reference = files
    model = loader.load_model(file, torch.bfloat16)
    projections = [m for name, m in model.named_modules() if name.endswith("_proj")]
    assert all(isinstance(m, Int4Linear) for m in projections) == (kind in INT4_TYPES)
    native_bits = bindings.available() and kind in NATIVE_BITS
    # (fused projections read their parts from the file's blocks: bits 0, a stack of parts)
    assert all(isinstance(m, GroupLinear) and m.bits in (0, NATIVE_BITS.get(kind)) for m in projections) == native_bits
    if kind in INT4_TYPES or native_bits:
        expected = saguaro_logits(loader.load_model(reference), TOKENS)
        assert max_diff(saguaro_logits(model, TOKENS), expected) < 0.05 * expected.abs().max()


def q4_k_m_kind(name: str) -> Q:
    """llama.cpp's Q4_K_M: Q4_K, but Q6_K for attn_v, ffn_down and the head."""
    return Q.Q6_K if name.split(".")[-2] in ("attn_v", "ffn_down", "output") else Q.Q4_K


def q4_k_m_files(source, folder, seed: int = 0) -> tuple:
    """A Q4_K_M file of `source`'s shape with random blocks (weights of order 0.02, where bf16
    stays well conditioned), and the same weights dequantized to fp32."""
    rng = np.random.default_rng(seed)
    tensors = {name: (random_blocks(q4_k_m_kind(name), *array.shape, rng, size=0.2), q4_k_m_kind(name))
               for name, array in gguf_tensors(source, "llama").items()
               if array.ndim == 2 and (name.startswith("blk.") or name == "output.weight")}
    dequantized = {name: gguf.quants.dequantize(blocks, kind) for name, (blocks, kind) in tensors.items()}
    return (write_gguf(folder / f"q4_k_m-{seed}.gguf", source, "llama", "tiny", tensors=tensors),
            write_gguf(folder / f"f32-{seed}.gguf", source, "llama", "tiny", tensors=dequantized))


@pytest.mark.skipif(not bindings.available(), reason="saguaro's CPU kernels do not run here")
def test_a_q4_k_m_file_runs_entirely_on_saguaros_kernels(source, tmp_path):
    """v in Q6_K beside q and k in Q4_K: one stacked qkv; down and the head in Q6_K."""
    file, reference = q4_k_m_files(source, tmp_path)
    model = loader.load_model(file, torch.bfloat16)
    assert model.native_layers is not None
    assert model.layers[0].self_attn.qkv_proj.bits == 0 and model.layers[0].mlp.down_proj.bits == packing.K6
    assert isinstance(model.lm_head, GroupLinear) and model.lm_head.bits == packing.K6
    expected = saguaro_logits(loader.load_model(reference), TOKENS)
    tolerance = 0.02 * expected.abs().max()
    assert max_diff(saguaro_logits(model, TOKENS), expected) < tolerance
    # Control: other weights of the same types are seen at this tolerance.
    other = saguaro_logits(loader.load_model(q4_k_m_files(source, tmp_path, seed=1)[1]), TOKENS)
    assert max_diff(other, expected) > tolerance


@pytest.mark.skipif(not bindings.available(), reason="saguaro's CPU kernels do not run here")
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q4_0", "Q5_K", "Q3_K", "Q2_K", "BF16"])
def test_greedy_sd_and_ssd_equal_ar_on_a_quantized_file(kind, source, tmp_path):
    """Batch invariance on the kernels' kinds (Q4_K_M: Q4_K's and Q6_K's block records; Q4_0:
    its own tiles; Q5_K, Q3_K, Q2_K: their records; BF16: bf16 tiles from the map): K + 1 = 4
    tokens verified in one pass give AR's."""
    if kind == "BF16" and not bindings.bf16_available():
        pytest.skip("bf16 tiles need AVX512-BF16")
    from drafts import InProcessDraft, sd_decoder, ssd_decoder, worker_config
    from saguaro import SamplingParams
    from saguaro.engine.sequence import Sequence
    from saguaro.speculation.build import ar_decoder

    target_file = q4_k_m_files(source, tmp_path)[0] if kind == "Q4_K_M" else \
        write_gguf(tmp_path / f"{kind}.gguf", source, "llama", "tiny", tensors=projection_blocks(source, Q[kind]))
    target = loader.load_model(target_file, torch.bfloat16)
    assert {m.bits for name, m in target.named_modules() if name.endswith("_proj")} <= \
        ({0, packing.K4, packing.K6} if kind == "Q4_K_M" else {0, 16} if kind == "BF16" else {0, packing.type_bits(Q[kind])})
    draft_file = q4_k_m_files(source, tmp_path, seed=1)[0]
    draft = loader.load_model(draft_file, torch.bfloat16)

    def greedy(decoder) -> list[list[int]]:
        seqs = [Sequence(i, TOKENS[i:i + 8], SamplingParams(temperature=0, max_tokens=24), []) for i in range(4)]
        decoder.reserve(len(seqs), 8 + 24 + decoder.lookahead)
        decoder.prefill(seqs)
        while active := [s for s in seqs if not s.finished]:
            decoder.step(active)
        return [s.output_ids for s in seqs]

    reference = greedy(ar_decoder(target))
    assert greedy(sd_decoder(target, draft, 3)) == reference
    client = InProcessDraft(worker_config(str(draft_file), "bfloat16", 3, [1, 1, 1, 1]), None)
    assert greedy(ssd_decoder(target, client, "neural")) == reference


@pytest.mark.skipif(not bindings.available(), reason="saguaro's CPU kernels do not run here")
@pytest.mark.parametrize("kind", [k for k in DECODED_TYPES + (Q.Q8_0,) if k not in RECORD_TYPES],
                         ids=lambda kind: kind.name)
def test_tiles_repacked_from_the_file_are_those_of_the_decoded_codes(kind, source, tmp_path):
    """repack.c reads the blocks where the file maps them; the same bytes as packing the codes
    gguf_groups decodes (checked against gguf-py below), also in another row order; its
    dequantized rows are gguf-py's."""
    file = write_gguf(tmp_path / "q.gguf", source, "llama", "tiny", tensors=projection_blocks(source, kind))
    tensor = next(t for t in gguf.GGUFReader(str(file)).tensors if t.tensor_type == kind)
    blocks, groups = gguf_blocks.file_blocks(tensor), gguf_blocks.gguf_groups(tensor)
    tile_bytes = packing.TILE_BYTES[blocks.bits]  # Q4_0's record: the 4-bit one's without its lows
    assert torch.equal(blocks.tiles(), native_tiles(groups)[1][..., :tile_bytes])
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(blocks.rows(order).tiles(), native_tiles(groups.rows(order))[1][..., :tile_bytes])
    expected = torch.from_numpy(np.asarray(gguf_config.dequantize_gguf(tensor), dtype=np.float32))
    torch.testing.assert_close(blocks.dequantize(), expected, rtol=1e-6, atol=0)
    assert torch.equal(blocks.dequantize(torch.bfloat16), blocks.dequantize().bfloat16())  # rounded as torch rounds
    # Control: the tiles of the rows in file order are not those of the reordered rows.
    assert not torch.equal(blocks.tiles(), native_tiles(groups.rows(order))[1][..., :tile_bytes])


@pytest.mark.skipif(not bindings.available(), reason="saguaro's CPU kernels do not run here")
@pytest.mark.parametrize("kind", RECORD_TYPES, ids=lambda kind: kind.name)
def test_k_quant_records_multiply_as_the_documented_arithmetic_of_their_codes(kind, source, tmp_path):
    """Q2_K to Q6_K in records of a whole block (their scales held once, as the file holds
    them): the products are group_matmul.c's arithmetic on the codes gguf_groups (Q3_K:
    q3_k_groups) decodes (checked against gguf-py), in the file's row order and another; the
    dequantized rows are gguf-py's."""
    from test_native import kernel_arithmetic, q6_arithmetic

    file = write_gguf(tmp_path / "q.gguf", source, "llama", "tiny", tensors=projection_blocks(source, kind))
    tensor = next(t for t in gguf.GGUFReader(str(file)).tensors if t.tensor_type == kind)
    blocks = gguf_blocks.file_blocks(tensor)
    x = torch.randn(5, blocks.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    x[3] = 0
    expected = torch.from_numpy(np.asarray(gguf_config.dequantize_gguf(tensor), dtype=np.float32))
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(0))
    if kind == Q.Q2_K:  # its arithmetic read from the blocks (per half group: a scale and a min)
        groups = None
        products = {False: q2_k_arithmetic(x, tensor)}
        products[True] = products[False][:, order]
    else:
        groups = q3_k_groups(tensor) if kind == Q.Q3_K else gguf_blocks.gguf_groups(tensor)
        torch.testing.assert_close(groups.dequantize(), expected, rtol=0, atol=0)  # the codes are the file's
        products = {reordered: q6_arithmetic(x, codes) if isinstance(codes, GroupInt6) else
                    kernel_arithmetic(x, codes.codes, codes.scales, codes.lows)
                    for reordered, codes in ((False, groups), (True, groups.rows(order)))}

    for reordered, weights in ((False, blocks), (True, blocks.rows(order))):
        bits, tiles = native_tiles(weights)
        assert bits == packing.type_bits(kind)  # the file's density: 16 outputs x 32 inputs in TILE_BYTES
        assert tiles.numel() == weights.shape[0] // 16 * (weights.shape[1] // 32) * packing.TILE_BYTES[bits]
        out = bindings.group_matmul(bits, tiles, x, weights.shape[0], torch.float32)
        assert relative_error(out, products[reordered]) < 1e-5
    torch.testing.assert_close(blocks.dequantize(), expected, rtol=1e-6, atol=0)
    # Control: the file's rows against the reordered codes are other products.
    out = bindings.group_matmul(bits, blocks.tiles(), x, blocks.shape[0], torch.float32)
    assert relative_error(out, products[True]) > 0.1


@pytest.mark.skipif(not bindings.available(), reason="saguaro's CPU kernels do not run here")
def test_parts_of_a_projection_in_blocks_and_in_plain_weights_stack_dequantized(source, tmp_path):
    """A fused projection whose parts are blocks the kernels read and weights they do not (a
    type without kernels beside K-quants, as once Q2_K's q beside Q3_K's v) loads dequantized."""
    file = write_gguf(tmp_path / "q.gguf", source, "llama", "tiny", tensors=projection_blocks(source, Q.Q4_K))
    blocks = gguf_blocks.file_blocks(next(t for t in gguf.GGUFReader(str(file)).tensors if t.tensor_type == Q.Q4_K))
    plain = torch.randn(16, blocks.shape[1])
    assert torch.equal(build._cat([blocks, plain]), torch.cat([blocks.dequantize(), plain]))


@pytest.mark.skipif(not bindings.available(), reason="saguaro's CPU kernels do not run here")
@pytest.mark.parametrize("kind", [Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS], ids=lambda kind: kind.name)
def test_blocks_only_repack_decodes_multiply_as_their_dequantized_weights(kind, source, tmp_path):
    """Q3_K (its codes in two planes) and IQ4 (codes indexing a table of non-linear values): repack.c
    dequantizes them as gguf-py does, and the products are those weights' up to the 8-bit
    activations."""
    file = write_gguf(tmp_path / "q.gguf", source, "llama", "tiny", tensors=projection_blocks(source, kind))
    tensor = next(t for t in gguf.GGUFReader(str(file)).tensors if t.tensor_type == kind)
    blocks = gguf_blocks.file_blocks(tensor)
    expected = torch.from_numpy(np.asarray(gguf_config.dequantize_gguf(tensor), dtype=np.float32))
    torch.testing.assert_close(blocks.dequantize(), expected, rtol=1e-6, atol=0)
    x = torch.randn(5, blocks.shape[1], generator=torch.Generator().manual_seed(0)).bfloat16()
    bits, tiles = native_tiles(blocks)
    out = bindings.group_matmul(bits, tiles, x, blocks.shape[0], torch.float32)
    assert bits == NATIVE_BITS[kind] and 1e-4 < relative_error(out, x.double() @ expected.double().T) < 3e-2
    # Control: the rows in another order are other products.
    order = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(0))
    wrong = bindings.group_matmul(bits, blocks.rows(order).tiles(), x, blocks.shape[0], torch.float32)
    assert relative_error(wrong, x.double() @ expected.double().T) > 0.1


@pytest.mark.parametrize("kind", DECODED_TYPES, ids=lambda kind: kind.name)
def test_grouped_codes_reproduce_the_gguf_dequantization_exactly(kind, source, tmp_path):
    file = write_gguf(tmp_path / "q.gguf", source, "llama", "tiny", tensors=projection_blocks(source, kind))
    for tensor in gguf.GGUFReader(str(file)).tensors:
        if tensor.tensor_type == kind:
            expected = torch.from_numpy(np.asarray(gguf_config.dequantize_gguf(tensor), dtype=np.float32))
            torch.testing.assert_close(gguf_blocks.gguf_groups(tensor).dequantize(), expected, rtol=1e-6, atol=0)


def test_explicit_modes_quantize_every_projection(files):
    kind, file, _ = files
    if kind != Q.Q8_0:
        pytest.skip("one file is enough")
    for mode, layer in (("int8", Int8Linear), ("int4", Int4Linear)):
        model = loader.load_model(file, torch.bfloat16, quantization=mode)
        assert all(isinstance(m, layer) for name, m in model.named_modules() if name.endswith("_proj"))
    plain = loader.load_model(file, torch.bfloat16, quantization="none")
    assert not any(isinstance(m, (Int4Linear, Int8Linear)) for m in plain.modules())


def test_the_command_line_takes_the_modes():
    import argparse

    from saguaro.llm import add_llm_arguments

    parser = argparse.ArgumentParser()
    add_llm_arguments(parser)
    assert parser.parse_args([]).quantization == "auto"
    assert parser.parse_args(["--quantization", "int8"]).quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q3"])


@pytest.mark.parametrize("layer", ["int4", "int8"])
def test_the_state_dict_gives_the_weights_the_kernel_multiplies_by(layer):
    weights = random_int4(192, 64)
    module = Int4Linear(weights, None, torch.bfloat16) if layer == "int4" else \
        Int8Linear(weights.dequantize(), None, torch.bfloat16)
    state = module.state_dict()
    assert set(state) == {"weight"} and state["weight"].shape == (192, 64)
    reference = weights.dequantize() if layer == "int4" else module.codes.float() * module.scales.float()[:, None]
    assert relative_error(state["weight"], reference.double()) < 1e-2
    x = torch.randn(5, 64).bfloat16()
    assert relative_error(module(x), x.double() @ state["weight"].double().T) < 1e-2


def test_a_draft_initializes_from_an_int4_target(files):
    """`saguaro distill` copies target layers into the draft through the state dict."""
    from saguaro.distill.draft import DraftSpec, init_draft

    kind, file, _ = files
    if kind != Q.Q4_0:
        pytest.skip("one file is enough")
    target = loader.load_model(file, torch.bfloat16)
    draft = init_draft(target, DraftSpec(layers=(1,), head_vocab=16), torch.arange(16))
    expected = target.layers[1].mlp.down_proj.weight.float()
    assert isinstance(target.layers[1].mlp.down_proj, Int4Linear)
    assert torch.equal(draft.layers[0].mlp.down_proj.weight, expected)
