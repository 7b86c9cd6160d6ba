"""Model configuration shared by every Llama-family architecture saguaro runs."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


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

    def __post_init__(self):
        if self.head_vocab_size is not None and self.tie_word_embeddings:
            raise ValueError("a reduced head (head_vocab_size) cannot be tied to the embeddings")

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Builds a config from a Hugging Face config.json dictionary."""
        arch = hf.get("model_type", "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r}: saguaro runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        num_heads = hf["num_attention_heads"]
        # Sliding-window attention is not implemented; within the window it equals full
        # attention, so the usable context stops there.
        window = hf.get("sliding_window") if arch == "mistral" or hf.get("use_sliding_window") else None
        max_positions = hf.get("max_position_embeddings", 8192)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else rope,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", arch == "qwen2"),
            qk_norm=arch == "qwen3",
            max_position_embeddings=min(max_positions, window) if window else max_positions,
            architecture=arch,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls(**json.loads(Path(path).read_text()))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))
