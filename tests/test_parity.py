"""Logits parity with Hugging Face transformers, the reference implementation of every
architecture saguaro runs: the real default checkpoint (GGUF) and tiny random-weight models
that exercise each architecture's particular feature."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from saguaro.models.config import ModelConfig, UnsupportedModelError
from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel
from saguaro.models.build import build_model
from saguaro.models.loader import load_model, read_checkpoint

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256)

FOUR_LAYERS = SMALL | dict(num_hidden_layers=4)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary

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
    # Layers 1 and 3 without rope.
    "smollm3": lambda: transformers.SmolLM3Config(**FOUR_LAYERS | TOKEN_IDS, no_rope_layer_interval=2),
    # Fused qkv and gate/up weights, rope over 12 of 16 head dimensions (Phi-4-mini's 3/4), and
    # Phi-3-mini's window on every layer, made short.
    "phi3": lambda: transformers.Phi3Config(
        **SMALL | TOKEN_IDS, sliding_window=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
    # Phi-4-mini's longrope: short factors and an attention factor (here sqrt(1 + ln 4 / ln 128))
    # within the original context of 128, which is where the context stops.
    "phi3_longrope": lambda: transformers.Phi3Config(
        **SMALL | TOKEN_IDS | dict(max_position_embeddings=512), original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 128, "short_factor": [1.0, 1.3, 1.9, 2.6, 4.0, 7.5],
            "long_factor": [2.0, 3.0, 5.0, 9.0, 17.0, 30.0]}),
    # Every Gemma feature is made to matter: windows of 4 on layers 0 and 2, soft caps near the
    # scores' and logits' size, a query scale other than 1/sqrt(head_dim).
    "gemma2": lambda: transformers.Gemma2Config(
        **FOUR_LAYERS, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0, final_logit_softcapping=2.0, attn_implementation="eager"),
    # q/k norms, windows on layers 0, 1 and 3 with their own rope base, linear scaling on the others.
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **FOUR_LAYERS, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        attn_implementation="eager"),
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


def tiny_model(name: str):
    """A transformers model with random weights, its norms' included: Gemma's start at zero
    (it scales by 1 + weight), the others' at one, either of which would hide a wrong offset."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval().requires_grad_(False)
    for param_name, param in hf.named_parameters():
        if "norm" in param_name:
            param.add_(torch.randn_like(param) * 0.3)
    return hf


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny_pair(request, tmp_path_factory):
    """(saguaro model, transformers model) with the same random weights, via safetensors."""
    hf = tiny_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return load_model(folder), hf, request.param


def test_tiny_architectures_match_transformers(tiny_pair):
    ours, hf, _ = tiny_pair
    tokens = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(hf, tokens)
    assert expected.std() > 0.1  # the weights are large enough for the comparison to mean something
    assert max_diff(saguaro_logits(ours, tokens), expected) < 1e-4


def test_tiny_batch_invariant_path_matches_transformers(tiny_pair):
    """The engine's default path (saguaro.models.invariant's attention, with Gemma's query scale
    and soft caps) computes the same logits."""
    ours, hf, _ = tiny_pair
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours.set_batch_invariant(True)
    try:
        assert max_diff(cached_logits(ours, tokens, 29), hf_logits(hf, tokens)[29:]) < 1e-4
    finally:
        ours.set_batch_invariant(False)


def test_tiny_cached_chunk_matches_full_forward(tiny_pair):
    ours, hf, _ = tiny_pair
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    assert max_diff(cached_logits(ours, tokens, 29), hf_logits(hf, tokens)[29:]) < 1e-4


GEMMA = dict(mlp_activation="gelu_tanh", norm_offset=1.0, embed_scale=8.0, post_norms=True, attn_scale=24 ** -0.5)
# Each case's config fields that differ from Llama's defaults.
FEATURES = {
    "llama3.1": dict(rope_scaling=True), "qwen3": dict(qk_norm=True), "qwen2": dict(attention_bias=True),
    "smollm3": dict(no_rope_layers=[1, 3]),
    "phi3": dict(partial_rotary_factor=0.75, sliding_window=8, sliding_layers=[0, 1]),
    "phi3_longrope": dict(rope_scaling=True, partial_rotary_factor=0.75, max_position_embeddings=128),
    "gemma2": GEMMA | dict(attn_softcap=1.0, logit_softcap=2.0, sliding_window=4, sliding_layers=[0, 2]),
    "gemma3_text": GEMMA | dict(rope_scaling=True, qk_norm=True, sliding_window=4, sliding_layers=[0, 1, 3],
                                rope_local_theta=10000.0),
}


def test_loaded_config_has_the_architecture_features(tiny_pair):
    config, case = tiny_pair[0].config, tiny_pair[2]
    features = FEATURES.get(case, {})
    assert (config.rope_scaling is not None) == features.get("rope_scaling", False)
    defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                for f in dataclasses.fields(ModelConfig)}
    for name in FEATURES_FIELDS:
        assert getattr(config, name) == features.get(name, defaults[name]), name
    assert config.llama_like == (config.architecture in ("llama", "qwen2", "qwen3", "mistral"))
    if "max_position_embeddings" in features:
        assert config.max_position_embeddings == features["max_position_embeddings"]


FEATURES_FIELDS = ("qk_norm", "attention_bias", "mlp_activation", "norm_offset", "embed_scale", "post_norms",
                   "attn_scale", "attn_softcap", "logit_softcap", "partial_rotary_factor", "no_rope_layers",
                   "sliding_window", "sliding_layers", "rope_local_theta")

# (architecture, the feature turned off): each must change the logits, or the parity above
# would not show that it is implemented.
FEATURE_CONTROLS = [
    ("smollm3", dict(no_rope_layers=[])), ("phi3", dict(partial_rotary_factor=1.0)),
    ("phi3", dict(sliding_layers=[])), ("phi3_longrope", dict(rope_scaling=None)),
    ("phi3_longrope", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6, 4.0, 7.5]})),
    ("gemma2", dict(sliding_layers=[])), ("gemma2", dict(attn_softcap=None)),
    ("gemma2", dict(logit_softcap=None)), ("gemma2", dict(norm_offset=0.0)), ("gemma2", dict(embed_scale=None)),
    ("gemma2", dict(attn_scale=None)), ("gemma2", dict(mlp_activation="silu")), ("gemma2", dict(post_norms=False)),
    ("gemma3_text", dict(rope_local_theta=None)), ("gemma3_text", dict(sliding_layers=[])),
]


@pytest.mark.parametrize("arch, change", FEATURE_CONTROLS, ids=lambda c: c if isinstance(c, str) else next(iter(c)))
def test_each_feature_changes_the_logits(arch, change, tmp_path):
    hf = tiny_model(arch)
    hf.save_pretrained(tmp_path)
    config, state = read_checkpoint(tmp_path)
    if change.get("post_norms") is False:  # the layers then have no place for these norms
        state = {k: v for k, v in state.items() if "feedforward_layernorm" not in k}
    broken = build_model(dataclasses.replace(config, **change), state, torch.float32, "cpu")
    tokens = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    assert max_diff(saguaro_logits(broken, tokens), hf_logits(hf, tokens)) > 1e-2


UNSUPPORTED = {
    "yarn": (dict(model_type="qwen3", rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope scaling 'yarn'"),
    "longrope factors": (dict(model_type="phi3", original_max_position_embeddings=64,
                              rope_scaling={"type": "longrope", "long_factor": [1.0] * 4, "short_factor": [1.0] * 4}),
                         "longrope has 4 short factors, 8 expected"),
    "layer type": (dict(model_type="gemma3_text", sliding_window=4, layer_types=["chunked_attention"] * 2),
                   "chunked_attention"),
    "activation": (dict(model_type="gemma2", hidden_activation="gelu"), "MLP activation 'gelu'"),
    "mlp bias": (dict(model_type="smollm3", mlp_bias=True), "mlp_bias"),
    "architecture": (dict(model_type="gemma3n_text"), "unsupported architecture 'gemma3n_text'"),
}


def test_gemma3_image_text_checkpoint_runs_its_language_model(tmp_path):
    """Gemma 3's 4B to 27B models are image-text checkpoints: their language model runs on text."""
    text = dict(FOUR_LAYERS, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention"] * 2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                                       image_token_index=VOCAB - 1)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval().requires_grad_(False)
    for name, param in hf.named_parameters():
        if "norm" in name:
            param.add_(torch.randn_like(param) * 0.3)
    hf.save_pretrained(tmp_path)
    tokens = torch.randint(0, VOCAB - 3, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = load_model(tmp_path)
    assert ours.config.architecture == "gemma3_text" and ours.config.sliding_layers == [0, 2]
    expected = hf_logits(hf, tokens)
    assert expected.std() > 0.1
    assert max_diff(saguaro_logits(ours, tokens), expected) < 1e-4


@pytest.mark.parametrize("arch, window, layers, sliding", [
    ("llama", 4, 2, []), ("phi3", 1024, 2, []), ("phi3", 1023, 2, [0, 1]), ("gemma3_text", 4, 6, [0, 1, 2, 3, 4])])
def test_windows_apply_where_transformers_applies_them(arch, window, layers, sliding):
    """Llama ignores a sliding_window key; a window as long as the context is none; Gemma 3's
    default pattern is 5 sliding layers, then a global one."""
    hf = dict(model_type=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
              num_attention_heads=4, max_position_embeddings=1024, sliding_window=window)
    assert ModelConfig.from_hf(hf).sliding_layers == sliding


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_features_raise_naming_them(case):
    """What saguaro cannot run exactly is refused, never loaded silently wrong."""
    changes, message = UNSUPPORTED[case]
    hf = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2) | changes
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf(hf)


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
