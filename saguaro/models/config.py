"""Model configuration shared by every decoder architecture saguaro runs: Llama and its
relatives, whose differences (Gemma's norms and soft-capping, sliding-window layers, partial or
absent rope) are fields here rather than classes."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma3_text")
# rope_scaling types rope_inv_freq implements
ROPE_TYPES = ("default", "linear", "llama3", "divisors", "longrope")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder saguaro can run."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    # Hugging Face's rope_scaling, or {"rope_type": "divisors", "divisors": [...]} from a GGUF's rope_freqs
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    qk_norm: bool = False  # Qwen3 normalizes each head of q and k
    max_position_embeddings: int = 8192
    architecture: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # A draft may predict only a subset of the vocabulary (a cheaper head): `head_vocab_size`
    # rows, whose token ids the model stores. Its logits stay full-vocabulary, -inf elsewhere.
    head_vocab_size: int | None = None
    # An EAGLE-style draft (saguaro.models.eagle): its input is each token's embedding together
    # with the target's hidden state at the previous position.
    eagle: bool = False
    # Features of other architectures; the defaults are Llama's.
    mlp_activation: str = "silu"  # the gate's activation: "silu", or Gemma's "gelu_tanh"
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (offset + weight)
    embed_scale: float | None = None  # Gemma multiplies the embeddings by sqrt(hidden_size)
    # Gemma's sandwich norms: on the attention output, and before and after the MLP
    post_norms: bool = False
    attn_scale: float | None = None  # query scale (Gemma's query_pre_attn_scalar); None: 1/sqrt(head_dim)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    logit_softcap: float | None = None  # the same on the final logits
    partial_rotary_factor: float = 1.0  # Phi-4-mini rotates the first 3/4 of each head only
    no_rope_layers: list[int] = field(default_factory=list)  # SmolLM3: layers without positions
    # Layers that attend only to the last `sliding_window` positions (their own included)
    sliding_window: int | None = None
    sliding_layers: list[int] = field(default_factory=list)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' rope base, unscaled
    source_hidden_size: int | None = None  # a twin's (twin.py) source width: drafts borrow that many embedding columns

    def __post_init__(self):
        if self.head_vocab_size is not None and self.tie_word_embeddings:
            raise ValueError("a reduced head (head_vocab_size) cannot be tied to the embeddings")
        if self.rotary_dim % 2:
            raise UnsupportedModelError(f"partial rotary over an odd {self.rotary_dim} dimensions")
        if self.sliding_layers and not self.sliding_window:
            raise ValueError("sliding_layers without a sliding_window")
        short = (self.rope_scaling or {}).get("short_factor")
        if short is not None and len(short) != self.rotary_dim // 2:
            raise UnsupportedModelError(f"longrope has {len(short)} short factors, {self.rotary_dim // 2} expected")

    @property
    def rotary_dim(self) -> int:
        """transformers' int(head_dim * factor), safe from a product a hair under its integer
        (a GGUF file gives the dimension count, from which the factor is computed)."""
        return int(round(self.head_dim * self.partial_rotary_factor, 6))

    @property
    def rope_attention_factor(self) -> float:
        """Longrope's scale on cos and sin (on both q and k, so on the scores twice)."""
        return (self.rope_scaling or {}).get("attention_factor", 1.0)

    @property
    def llama_like(self) -> bool:
        """Whether every layer is a plain Llama/Qwen layer."""
        return (self.mlp_activation == "silu" and not self.norm_offset and self.embed_scale is None
                and not self.post_norms and self.attn_scale is None and self.attn_softcap is None
                and self.logit_softcap is None and not self.sliding_layers and not self.no_rope_layers
                and self.rotary_dim == self.head_dim and self.rope_attention_factor == 1.0)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Builds a config from a Hugging Face config.json dictionary."""
        arch = hf.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}: saguaro runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        gemma = arch in ("gemma2", "gemma3_text")
        rope, rope_local_theta = _rope_parameters(hf, arch)
        partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        max_positions = hf.get("max_position_embeddings", 8192)
        if rope_type in ("longrope", "su"):  # "su": Phi-3's first name for it
            rope, max_positions = _longrope(rope, hf, max_positions)
            rope_type = "longrope"
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported")
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        window, sliding = _sliding_layers(hf, arch)
        if arch in ("mistral", "qwen2", "qwen3") and window:
            # Their window is not applied; within it, it equals full attention, so the usable
            # context stops there.
            max_positions, window, sliding = min(max_positions, window), None, []
        if window and window >= max_positions:  # Phi-4-mini's 262144: no position is ever outside it
            window, sliding = None, []
        activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
        if activation not in _ACTIVATIONS:
            raise UnsupportedModelError(f"MLP activation {activation!r} is not supported")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("MLP biases (mlp_bias) are not supported")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention (use_bidirectional_attention) is not supported")
        query_scalar = hf.get("query_pre_attn_scalar")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else rope,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=hf.get("tie_word_embeddings", gemma),
            attention_bias=hf.get("attention_bias", arch == "qwen2"),
            qk_norm=arch in ("qwen3", "gemma3_text"),
            max_position_embeddings=max_positions,
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            mlp_activation=_ACTIVATIONS[activation],
            norm_offset=1.0 if gemma else 0.0,
            embed_scale=hf["hidden_size"] ** 0.5 if gemma else None,
            post_norms=gemma,
            attn_scale=None if query_scalar is None or not gemma else query_scalar ** -0.5,
            attn_softcap=hf.get("attn_logit_softcapping") if gemma else None,
            logit_softcap=hf.get("final_logit_softcapping") if gemma else None,
            partial_rotary_factor=partial,
            no_rope_layers=_no_rope_layers(hf) if arch == "smollm3" else [],
            sliding_window=window,
            sliding_layers=sliding,
            rope_local_theta=rope_local_theta,
        )

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls(**json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))


# Hugging Face activation names -> ModelConfig.mlp_activation
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _rope_parameters(hf: dict, arch: str) -> tuple[dict, float | None]:
    """(the rope parameters of full-attention layers, Gemma 3's rope base for sliding layers).
    transformers 5 writes one dictionary per layer type; older config.json files a rope_theta,
    a rope_scaling and Gemma 3's rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention")
        params = dict(params.get("full_attention") or local)
        if local is not None and arch == "gemma3_text":
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"rope scaling {local['rope_type']!r} on sliding layers is not supported")
            return params, float(local["rope_theta"])
        return params, None
    rope = dict(params or hf.get("rope_scaling") or {})
    local_theta = hf.get("rope_local_base_freq", 10000.0) if arch == "gemma3_text" else None
    return rope, None if local_theta is None else float(local_theta)


def _sliding_layers(hf: dict, arch: str) -> tuple[int | None, list[int]]:
    """(window, the layers it applies to), as each architecture's transformers model decides."""
    window = hf.get("sliding_window")
    n = hf["num_hidden_layers"]
    if not window or arch == "llama" or (arch in ("qwen2", "qwen3", "smollm3") and not hf.get("use_sliding_window")):
        return None, []
    if arch in ("mistral", "qwen2", "qwen3", "phi3"):  # every layer
        return window, list(range(n))
    types = hf.get("layer_types")
    if not types:
        if arch == "smollm3":  # the layers without rope
            types = ["full_attention" if use else "sliding_attention" for use in _rope_flags(hf)]
        else:
            pattern = 2 if arch == "gemma2" else hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer types {sorted(unknown)} are not supported")
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    return (window, sliding) if sliding else (None, [])


def _rope_flags(hf: dict) -> list[int]:
    """SmolLM3's no_rope_layers: per layer, 1 where rope is applied (despite the name)."""
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])]
    return list(flags)


def _no_rope_layers(hf: dict) -> list[int]:
    return [i for i, use in enumerate(_rope_flags(hf)) if not use]


def _longrope(rope: dict, hf: dict, max_positions: int) -> tuple[dict, int]:
    """Phi-3's longrope as transformers applies it within the original context (llama.cpp too,
    in contexts no longer than it): the short factors, and cos and sin scaled by the attention
    factor. Past that length transformers switches every position to the long factors at once,
    which cached keys cannot follow, so the context stops there. Returns (rope_scaling,
    max_position_embeddings)."""
    original = rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not original or "short_factor" not in rope:
        raise UnsupportedModelError("rope scaling 'longrope' without short_factor or original_max_position_embeddings")
    factor = rope.get("factor") or max_positions / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    scaling = {"rope_type": "longrope", "short_factor": list(rope["short_factor"]),
               "attention_factor": float(attention)}
    return scaling, min(max_positions, original)
