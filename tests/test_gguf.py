"""GGUF files as llama.cpp writes them load into the model they were converted from.

Each case converts a tiny random-weight transformers model to GGUF here, the way llama.cpp's
convert_hf_to_gguf.py does (q/k rows permuted for the "llama" and "smollm3" architectures,
Llama 3's rope scaling baked into a `rope_freqs` tensor of per-dimension divisors, Mistral
written as "llama", Phi-3's fused projections kept fused, Gemma's norm weights stored with the
1 its norm adds), then compares saguaro's logits on the file with the source model's and, where
transformers' own GGUF reader reads the file faithfully, with that reader's.
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.utils import logging

from saguaro.engine.sampler import SamplingParams
from saguaro.models.config import UnsupportedModelError
from saguaro.models.gguf_file import read_gguf_file
from saguaro.models.kv_cache import KVCache
from saguaro.models.loader import load_model
from saguaro.models.tokenizer import load_tokenizer

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256)
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary

# name: (GGUF architecture, general.name, transformers config, extra GGUF keys). With head_dim
# 16 and a 64-token original context, Llama 3's divisors fall in all three bands (1,
# interpolated, the factor).
CASES = {
    "llama3": ("llama", "Llama 3.1 tiny", lambda: transformers.LlamaConfig(
        **SMALL, head_dim=16, rope_parameters=LLAMA3_ROPE), {}),
    "linear": ("llama", "Llama 2 tiny", lambda: transformers.LlamaConfig(**SMALL, rope_parameters=LINEAR_ROPE),
               {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}),
    # Older files: no scaling type (llama.cpp then assumes linear) and the factor's old key.
    "linear, old key": ("llama", "Llama 2 tiny", lambda: transformers.LlamaConfig(**SMALL, rope_parameters=LINEAR_ROPE),
                        {"rope.scale_linear": 4.0}),
    "qwen2": ("qwen2", "Qwen2 tiny", lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True), {}),
    # head_dim 128 as in every Qwen3, not hidden / heads: read from attention.key_length
    "qwen3": ("qwen3", "Qwen3 tiny", lambda: transformers.Qwen3Config(**SMALL, head_dim=128), {}),
    # transformers reads this as Llama (the same network); a general.name of exactly "mistral"
    # would send it to a Mistral path that today's gguf-py cannot serve.
    "mistral": ("llama", "Mistral tiny", lambda: transformers.MistralConfig(**SMALL), {}),
    # llama.cpp skips rope on every 4th layer of a "smollm3" file (no key says so): layer 3 here.
    "smollm3": ("smollm3", "SmolLM3 tiny", lambda: transformers.SmolLM3Config(
        **SMALL | TOKEN_IDS | dict(num_hidden_layers=4), no_rope_layer_interval=4), {}),
    # Rope over 12 of 16 head dimensions, a window of 8 on every layer.
    "phi3": ("phi3", "Phi 3 tiny", lambda: transformers.Phi3Config(
        **SMALL | TOKEN_IDS, sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
        {"rope.dimension_count": 12, "attention.sliding_window": 8, "rope.scaling.original_context_length": 256}),
    # Phi-4-mini's longrope: rope_factors_long/short tensors, the attention factor and the original
    # context as keys (convert_hf_to_gguf.py computes the factor as transformers does).
    "phi3 longrope": ("phi3", "Phi 4 mini tiny", lambda: transformers.Phi3Config(
        **SMALL | TOKEN_IDS | dict(max_position_embeddings=512), original_max_position_embeddings=128,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "original_max_position_embeddings": 128, "short_factor": [1.0, 1.3, 1.9, 2.6, 4.0, 7.5],
                         "long_factor": [2.0, 3.0, 5.0, 9.0, 17.0, 30.0]}),
        {"rope.dimension_count": 12, "rope.scaling.original_context_length": 128,
         "rope.scaling.attn_factor": math.sqrt(1 + math.log(512 / 128) / math.log(128))}),
    # llama.cpp fixes what no key carries: windows on even layers, queries scaled by the head width.
    "gemma2": ("gemma2", "Gemma 2 tiny", lambda: transformers.Gemma2Config(
        **SMALL | dict(num_hidden_layers=4), head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
        attn_logit_softcapping=1.0, final_logit_softcapping=2.0, attn_implementation="eager"),
        {"attention.sliding_window": 4, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0}),
    # Windows on 5 layers of 6 with a rope base of 10000, linear scaling on the sixth.
    "gemma3": ("gemma3", "Gemma 3 tiny", lambda: transformers.Gemma3TextConfig(
        **SMALL | dict(num_hidden_layers=6), head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
        final_logit_softcapping=2.0, attn_implementation="eager",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        {"attention.sliding_window": 4, "final_logit_softcapping": 2.0, "rope.scaling.type": "linear",
         "rope.scaling.factor": 2.0}),
}
# transformers' GGUF reader drops rope scaling for "llama" files (rope_freqs and the linear
# keys alike); for Gemma files it keeps its own soft caps, query scale and Gemma 3 rope in place
# of the file's and llama.cpp's; it reads no "smollm3" file and builds no tiny "phi3" one (its
# default pad token lies outside the vocabulary). Those files are compared with their source
# model only.
READ_RIGHT_BY_TRANSFORMERS = ("qwen2", "qwen3", "mistral")

_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_ARCH_LAYER_NAMES = {
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "gemma2": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def permute_for_llama_cpp(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for the "llama" architecture (interleaved rope pairs)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_divisors(config) -> np.ndarray:
    """Per-dimension divisors of the inverse frequencies: what convert_hf_to_gguf.py stores as
    rope_freqs for a Llama 3 rope_scaling, computed from the same formula."""
    rope = config.rope_parameters
    dim = config.head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_ctx, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    divisors = []
    for wavelen in 2 * math.pi / inv_freq:
        if wavelen < old_ctx / high:
            divisors.append(1.0)
        elif wavelen > old_ctx / low:
            divisors.append(rope["factor"])
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(divisors, dtype=np.float32)


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    config = model.config
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, kind = name.rpartition(".")
        array = value.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1
        if base in _TOP_NAMES:
            tensors[f"{_TOP_NAMES[base]}.{kind}"] = array
            continue
        layer, part = base.removeprefix("model.layers.").split(".", 1)
        if arch in ("llama", "smollm3") and part in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if part == "self_attn.q_proj" else config.num_key_value_heads
            array = permute_for_llama_cpp(array, heads)
        tensors[f"blk.{layer}.{(_LAYER_NAMES | _ARCH_LAYER_NAMES.get(arch, {}))[part]}.{kind}"] = array
    if (config.rope_parameters or {}).get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_divisors(config)
    if (config.rope_parameters or {}).get("rope_type") == "longrope":
        for kind in ("long", "short"):
            factors = config.rope_parameters[f"{kind}_factor"]
            tensors[f"rope_factors_{kind}.weight"] = np.array(factors, dtype=np.float32)
    return tensors


# GGUFWriter's method for each tokenizer key a test may copy from a real file
TOKENIZER_WRITERS = {
    "tokenizer.ggml.model": "add_tokenizer_model", "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list", "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges", "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id", "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id", "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.chat_template": "add_chat_template",
}


def write_gguf(path: Path, model, arch: str, name: str, keys: dict | None = None,
               tensors: dict[str, np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
               tokenizer: dict | None = None) -> Path:
    """`model` as a GGUF file with llama.cpp's metadata. `keys` (named without the architecture
    prefix) and `tensors` are added to, or replace, what the conversion writes; a tensor given as
    (blocks, type) is written as those quantized blocks. `tokenizer` (GGUF keys, TOKENIZER_WRITERS')
    replaces the placeholder token list with a real tokenizer."""
    config = model.config
    head_dim = getattr(config, "head_dim", None)
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base
    metadata = {
        "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
        "block_count": config.num_hidden_layers, "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads, "attention.head_count_kv": config.num_key_value_heads,
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "rope.dimension_count": head_dim or config.hidden_size // config.num_attention_heads,
    }
    if head_dim is not None:  # as convert_hf_to_gguf.py: only when the config names one
        metadata |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    tokenizer = tokenizer or {"tokenizer.ggml.tokens": [f"<t{i}>" for i in range(config.vocab_size)]}
    for key, value in tokenizer.items():
        getattr(writer, TOKENIZER_WRITERS[key])(value)
    for key, value in (metadata | (keys or {})).items():
        add = {str: writer.add_string, int: writer.add_uint32, float: writer.add_float32}[type(value)]
        add(f"{arch}.{key}", value)
    for tensor_name, array in (gguf_tensors(model, arch) | (tensors or {})).items():
        if isinstance(array, tuple):
            writer.add_tensor(tensor_name, array[0], raw_dtype=array[1])
        else:
            writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def source_model(case: str):
    """Random weights, the norms' included (Gemma's start at zero, the others' at one)."""
    torch.manual_seed(0)
    config = CASES[case][2]()
    model = transformers.AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.add_(torch.randn_like(param) * 0.3)
    return model


def saguaro_logits(model, tokens: list[int]) -> torch.Tensor:
    cache = KVCache(model.config, 1, len(tokens), model.dtype)
    return model.logits(model(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache))[0]


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# 80 positions, past the llama3 case's 64-token original context.
TOKENS = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def converted(request, tmp_path_factory):
    """(case, source transformers model, GGUF file)."""
    arch, name, _, keys = CASES[request.param]
    source = source_model(request.param)
    file = write_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf", source, arch, name, keys)
    return request.param, source, file


def test_gguf_matches_its_source_model(converted):
    _, source, file = converted
    expected = hf_logits(source, TOKENS)
    assert expected.std() > 0.1  # the weights are large enough for the comparison to mean something
    assert max_diff(saguaro_logits(load_model(file), TOKENS), expected) < 1e-4


def test_gguf_matches_transformers_reading_it(converted):
    case, _, file = converted
    if case not in READ_RIGHT_BY_TRANSFORMERS:
        pytest.skip(f"transformers' GGUF reader misreads the {case} file")
    logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    expected = hf_logits(hf.eval(), TOKENS)
    assert max_diff(saguaro_logits(load_model(file), TOKENS), expected) < 1e-4


UNSUPPORTED = {
    "architecture": (dict(arch="falcon"), "unsupported GGUF architecture 'falcon'"),
    # No GGUF writer knows a "mistral" architecture, so its q/k row order is undefined.
    "mistral architecture": (dict(arch="mistral"), "writes Mistral models as 'llama'"),
    "yarn rope": (dict(keys={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}), "rope scaling 'yarn'"),
    "partial rope": (dict(keys={"rope.dimension_count": 8}), "partial rope"),
    "unknown tensor": (dict(tensors={"blk.0.attn_gate.weight": np.ones((8, 64), dtype=np.float32)}),
                       "attn_gate"),
    "longrope without its original context": (
        dict(arch="phi3", tensors={f"rope_factors_{kind}.weight": np.ones(8, dtype=np.float32)
                                   for kind in ("long", "short")}),
        "'longrope' without short_factor or original_max_position_embeddings"),
    "longrope outside phi3": (dict(tensors={"rope_factors_short.weight": np.ones(8, dtype=np.float32)}),
                              "'longrope' .* not supported for 'llama'"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_gguf_raises_a_clear_error(case, tmp_path):
    """What saguaro cannot run exactly is refused, never loaded silently wrong."""
    changes, message = UNSUPPORTED[case]
    options = {"arch": "llama", **changes}
    file = write_gguf(tmp_path / "model.gguf", source_model("mistral"), name="tiny", **options)
    with pytest.raises(UnsupportedModelError, match=message):
        load_model(file)


def assert_reads_like_gguf_py(path: Path) -> None:
    from saguaro.models.gguf_file import read_gguf_file

    ours, theirs = read_gguf_file(path), gguf.GGUFReader(str(path))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields.keys() == expected.keys()
    for key, value in expected.items():
        assert ours.fields[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.shape, a.tensor_type) == (b.name, tuple(int(n) for n in b.shape), b.tensor_type)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_gguf_file_reads_what_gguf_py_reads(converted):
    """saguaro's own reader (gguf_file.py) against gguf-py's GGUFReader: every metadata value and
    every tensor's name, shape, type and bytes."""
    assert_reads_like_gguf_py(converted[2])


def test_gguf_file_reads_the_shipped_model_as_gguf_py_does(smollm2_path):
    """Q4_1 and Q8_0 tensors, and the tokenizer's 49,152 tokens and merges."""
    assert_reads_like_gguf_py(smollm2_path)


def test_a_smollm3_file_loads_with_its_tokenizer(smollm2_path, tmp_path, monkeypatch):
    """transformers' GGUF reader knows no "smollm3" file, so its tokenizer is built from the
    file's tokenizer fields alone; the file then decodes text as any other."""
    from saguaro import LLM

    monkeypatch.setenv("SAGUARO_CACHE", str(tmp_path / "cache"))
    fields = {k: v for k, v in read_gguf_file(smollm2_path).fields.items() if k in TOKENIZER_WRITERS}
    torch.manual_seed(0)
    config = transformers.SmolLM3Config(**SMALL | dict(vocab_size=len(fields["tokenizer.ggml.tokens"]), num_hidden_layers=4,
                                                       bos_token_id=1, eos_token_id=2, pad_token_id=2))
    path = write_gguf(tmp_path / "smollm3.gguf", transformers.AutoModelForCausalLM.from_config(config).eval(),
                      "smollm3", "SmolLM3 tiny", tokenizer=fields)
    prompt = "def fibonacci(n):"
    with LLM(str(path), method="ar", dtype="float32") as llm:
        assert llm.encode(prompt) == load_tokenizer(smollm2_path)(prompt)["input_ids"]
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.text
