"""One Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2) in plain PyTorch.

Every call names the tokens, their positions, the KV-cache slots they are written to and
which cache slots each of them may attend to. That one signature serves prefill, one-token
decode, verification of K+1 tokens and tree decoding of many branches over a shared prefix.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from saguaro.models import invariant
from saguaro.models.config import ModelConfig
from saguaro.models.kv_cache import KVCache, as_slice


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op; for bf16 it computes in fp32 and rounds once, like
        # (x.float() * rsqrt(mean(x.float()**2) + eps) * weight.float()).to(bf16). Mixed dtypes
        # (bf16 activations, fp32 weights under autocast in training) do the same explicitly.
        if x.dtype != self.weight.dtype:
            return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Embedding(nn.Embedding):
    """nn.Embedding that leaves a table on the meta device uninitialized: the loaders build
    models there and assign the checkpoint's weights, and normal_ on meta would first import
    torch._dynamo (seconds)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, with the linear or llama3 long-context scaling when configured, or
    divided by per-dimension `divisors` (how a GGUF file carries Llama 3's scaling)."""
    dim = config.head_dim
    # on the CPU also where a model is built on the meta device (whose arange imports for seconds)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0, 1)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen < old_ctx / high, inv_freq,
                               torch.where(wavelen > old_ctx / low, inv_freq / factor, scaled))
    elif kind == "divisors":
        inv_freq = inv_freq / torch.tensor(scaling["divisors"], dtype=torch.float64, device="cpu")
    elif kind != "default":
        raise NotImplementedError(f"rope scaling {kind!r} is not supported")
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [B, T, 1, D/2] (rotate-half layout, as in Hugging Face)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.batch_invariant = False  # see LlamaModel.set_batch_invariant
        self.reduce = None  # tensor parallel: sums the ranks' partial outputs (saguaro.models.tensor_parallel)

    def forward(self, x, cos, sin, cache: KVCache, rows, slots, attn_mask, span: int) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        project = invariant.project if self.batch_invariant else _call
        qkv = project(self.qkv_proj, x).view(B, T, H + 2 * Hkv, D)
        qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])), dim=2)
        qk = apply_rope(qk, cos, sin)  # q and k rotated together: one pass instead of two
        q, k = qk[:, :, :H], qk[:, :, H:]
        keys, values = cache.write(self.layer_idx, rows, slots, k, v, span=span)
        # Grouped-query attention without copying K/V: the G query heads sharing one KV head
        # are stacked along the query axis (attn_mask is already laid out that way).
        G = H // Hkv
        q = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        attend = invariant.attention if self.batch_invariant else F.scaled_dot_product_attention
        out = attend(q, keys, values, attn_mask=attn_mask)
        out = out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)
        return _reduced(self.reduce, project(self.o_proj, out))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.batch_invariant = False  # see LlamaModel.set_batch_invariant
        self.reduce = None  # see Attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        project = invariant.project if self.batch_invariant else _call
        gate, up = project(self.gate_up_proj, x).chunk(2, dim=-1)
        return _reduced(self.reduce, project(self.down_proj, F.silu(gate) * up))


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _reduced(reduce, x: torch.Tensor) -> torch.Tensor:
    if reduce is not None:
        x = x.contiguous()
        reduce(x)
    return x


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, rows, slots, attn_mask, span):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, rows, slots, attn_mask, span)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder with an LM head; `forward` returns hidden states, `logits` applies the head.

    Keeping the head separate lets callers pay for it only at the positions they sample from.
    """

    reads_features = False  # see EagleDraft

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.batch_invariant = False
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.head_vocab_size or config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if config.head_vocab_size is not None:
            # Vocabulary id of each head row; saved with the weights.
            self.register_buffer("head_token_ids", torch.zeros(config.head_vocab_size, dtype=torch.long))
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.native_layers = None  # saguaro.models.native.NativeLayers, where the loader attached them
        self.quantization: str | None = None  # the mode the loader built it in (saguaro.models.quantized)
        self.tensor_parallel = None  # rank 0 of a tensor-parallel target: its Driver (saguaro.models.tensor_parallel)

    def set_batch_invariant(self, on: bool) -> None:
        """Whether each position's logits are bit-identical however many tokens and sequences
        share its pass (saguaro.models.invariant): what makes greedy SD and SSD equal AR in
        every dtype."""
        for module in self.modules():
            if hasattr(module, "batch_invariant"):
                module.batch_invariant = on

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rows: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [B, T]. rows: cache rows of the B sequences (default 0..B-1).
        slots: cache slots written (default: the positions). mask: [B, T, S] bool, which of the
        first S slots each token attends to (default: causal over slots). Returns [B, T, hidden]."""
        if self.tensor_parallel is not None:  # the other ranks run the same pass on their slices
            self.tensor_parallel.announce(tokens, positions, cache, rows, slots, mask)
        return self.run_layers(self.embed_tokens(tokens), positions, cache, rows, slots, mask)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                   rows: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder layers and final norm over input vectors x [B, T, hidden]."""
        if slots is None:
            slots = positions
        if mask is None:
            mask = causal_mask(slots)
        if mask.shape[-1] > cache.num_slots:
            raise IndexError(f"the KV cache has {cache.num_slots} slots; {mask.shape[-1]} needed")
        freqs = positions[..., None].float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()  # [B, T, head_dim / 2]
        rows = as_slice(rows)
        if self.native_layers is not None:
            return self.native_layers.run(x, cos, sin, cache, rows, slots, mask, mask.shape[-1])  # norm included
        cos, sin = cos[:, :, None], sin[:, :, None]
        attn_mask = gqa_mask(mask, self.config.num_heads // self.config.num_kv_heads)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, rows, slots, attn_mask, mask.shape[-1])
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the full vocabulary. With a reduced head, tokens outside it get
        -inf: probability exactly zero, so the distribution a proposal is drawn from is exact."""
        return self.to_vocab(self.head_logits(hidden), float("-inf"))

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the head's own rows: the vocabulary, or a reduced head's tokens.
        Drafts sample in this space (all the mass is there, at a fraction of the width) and
        map rows to token ids with `head_token`."""
        project = invariant.project if self.batch_invariant else _call
        return project(self.lm_head, hidden).float()

    def head_token(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.config.head_vocab_size is None else self.head_token_ids[rows]

    def to_vocab(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[..., head rows] -> [..., vocabulary], `fill` outside the head."""
        if self.config.head_vocab_size is None:
            return values
        return scatter_to_vocab(values, self.head_token_ids, self.config.vocab_size, fill)


def scatter_to_vocab(values: torch.Tensor, token_ids: torch.Tensor, vocab_size: int,
                     fill: float = 0.0) -> torch.Tensor:
    """Places values [..., H] at columns token_ids [H] of a [..., vocab_size] tensor."""
    full = values.new_full((*values.shape[:-1], vocab_size), fill)
    return full.index_copy_(-1, token_ids.to(values.device), values)


def causal_mask(slots: torch.Tensor) -> torch.Tensor:
    """Each token sees every slot up to its own: right for sequences stored contiguously."""
    span = int(slots.max()) + 1
    return torch.arange(span, device=slots.device) <= slots[..., None]


def gqa_mask(mask: torch.Tensor, group: int) -> torch.Tensor | None:
    """[B, T, S] -> [B, 1, group * T, S], the layout Attention stacks query heads in; None
    when every token sees every slot (one-token decode), which takes SDPA's unmasked path."""
    if mask.all():
        return None
    B, T, S = mask.shape
    return mask[:, None].expand(B, group, T, S).reshape(B, 1, group * T, S)
