"""Logits parity with Hugging Face transformers, the reference implementation of every
architecture saguaro runs: the real default checkpoint (GGUF) and tiny random-weight models
that exercise each architecture's particular feature."""
from __future__ import annotations

import pytest
import torch
import transformers

from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel
from saguaro.models.loader import load_model

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256)

CONFIGS = {
    # llama3 rope scaling: with head_dim 16 and a 64-token original context, the inverse
    # frequencies fall in all three bands (kept, interpolated, divided by the factor).
    "llama3.1": lambda: transformers.LlamaConfig(
        **SMALL, head_dim=16, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64}),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32, tie_word_embeddings=True),  # q/k norm
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),  # biases on q, k, v
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
}


def saguaro_logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """One full forward pass from an empty cache: [T, V]."""
    T = len(tokens)
    cache = KVCache(model.config, 1, T, model.dtype)
    return model.logits(model(torch.tensor([tokens]), torch.arange(T)[None], cache))[0]


def cached_logits(model: LlamaModel, tokens: list[int], split: int) -> torch.Tensor:
    """Prefill tokens[:split], then the rest as one chunk at that offset: the chunk's logits."""
    T = len(tokens)
    cache = KVCache(model.config, 1, T, model.dtype)
    model(torch.tensor([tokens[:split]]), torch.arange(split)[None], cache)
    hidden = model(torch.tensor([tokens[split:]]), torch.arange(split, T)[None], cache)
    return model.logits(hidden)[0]


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny_pair(request, tmp_path_factory):
    """(saguaro model, transformers model) with the same random weights, via safetensors."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).eval().requires_grad_(False)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return load_model(folder), hf


def test_tiny_architectures_match_transformers(tiny_pair):
    ours, hf = tiny_pair
    tokens = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(hf, tokens)
    assert expected.std() > 0.1  # the weights are large enough for the comparison to mean something
    assert max_diff(saguaro_logits(ours, tokens), expected) < 1e-4


def test_tiny_cached_chunk_matches_full_forward(tiny_pair):
    ours, hf = tiny_pair
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    assert max_diff(cached_logits(ours, tokens, 29), hf_logits(hf, tokens)[29:]) < 1e-4


def test_loaded_config_has_the_architecture_features(tiny_pair):
    config = tiny_pair[0].config
    expected = {"llama": dict(rope_scaling=True), "qwen3": dict(qk_norm=True), "qwen2": dict(attention_bias=True)}
    features = expected.get(config.architecture, {})
    assert (config.rope_scaling is not None) == features.get("rope_scaling", False)
    assert config.qk_norm == features.get("qk_norm", False)
    assert config.attention_bias == features.get("attention_bias", False)


@pytest.fixture(scope="module")
def smollm2(llm) -> LlamaModel:
    return llm.target


@pytest.fixture(scope="module")
def real_tokens(llm) -> list[int]:
    return llm.encode([{"role": "user", "content": "Write a haiku about the desert and its tall cacti."}])


def test_smollm2_gguf_matches_transformers(smollm2, hf_model, real_tokens):
    expected = hf_logits(hf_model, real_tokens)
    ours = saguaro_logits(smollm2, real_tokens)
    assert max_diff(ours, expected) < 2e-3
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_smollm2_cached_chunk_matches_full_forward(smollm2, real_tokens):
    split = len(real_tokens) - 6
    full = saguaro_logits(smollm2, real_tokens)[split:]
    assert max_diff(cached_logits(smollm2, real_tokens, split), full) < 1e-3


def test_sliding_window_limits_the_context(tmp_path):
    """Sliding-window attention equals full attention only within the window."""
    transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=32)).save_pretrained(tmp_path)
    assert load_model(tmp_path).config.max_position_embeddings == 32
