"""One Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2/3, Phi-3, Gemma 2/3) in plain
PyTorch; what the architectures do differently is in ModelConfig's fields.

Every call names the tokens, their positions, the KV-cache slots they are written to and
which cache slots each of them may attend to. That one signature serves prefill, one-token
decode, verification of K+1 tokens and tree decoding of many branches over a shared prefix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Protocol

import numpy
import torch
import torch.nn.functional as F
from torch import nn

from saguaro.models import invariant
from saguaro.models.config import ModelConfig
from saguaro.models.kv_cache import KVCache, as_slice


class LayerRunner(Protocol):
    """Runs a model's decoder layers and final norm in one call (saguaro.models.native.layers)."""

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, rows, slots: torch.Tensor,
            mask: torch.Tensor, span: int, local: tuple | None = None) -> torch.Tensor: ...


class PassAnnouncer(Protocol):
    """Rank 0 of a tensor-parallel target: tells the other ranks each pass to run (saguaro.models.tensor_parallel)."""

    def announce(self, tokens, positions, cache: KVCache, rows, slots, mask) -> None: ...

    def close(self) -> None: ...


class CapturedPasses(Protocol):
    """A model's small passes captured and replayed (saguaro.models.graphs.StepGraphs)."""

    def takes(self, tokens_per_row: int) -> bool: ...


@dataclass(frozen=True)
class Execution:
    """How a model's passes run, chosen where it is built and handed to it whole by
    `LlamaModel.use`: the model branches on these and nothing else sets them."""
    quantization: str | None = None  # the mode its projections were built in (saguaro.models.quantized)
    batch_invariant: bool = False  # each position's logits independent of what shares its pass (saguaro.models.invariant)
    native_layers: LayerRunner | None = None  # the layers and final norm in saguaro's kernels, where they run
    reduce: Callable[[torch.Tensor], None] | None = None  # tensor parallel: sums the ranks' partial outputs in place
    tensor_parallel: PassAnnouncer | None = None  # rank 0 of a tensor-parallel target
    cuda_graphs: str = "auto"  # how small passes are captured (saguaro.models.graphs; a draft takes its target's)
    step_graphs: CapturedPasses | None = None  # the captured passes, where there are any


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset  # Gemma scales by (1 + weight), in fp32 like its reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return F.rms_norm(x.float(), self.weight.shape, self.weight.float() + self.offset, self.eps).to(x.dtype)
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


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies over the rotated dimensions, with the linear, llama3 or longrope
    long-context scaling when configured, or divided by per-dimension `divisors` (how a GGUF
    file carries Llama 3's scaling). `local`: Gemma 3's sliding layers' own base, unscaled."""
    dim = config.rotary_dim
    theta = config.rope_local_theta if local else config.rope_theta
    # on the CPU also where a model is built on the meta device (whose arange imports for seconds)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = {} if local else config.rope_scaling or {}
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
    elif kind == "longrope":  # within the original context: the short factors
        inv_freq = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64, device="cpu")
    elif kind != "default":
        raise NotImplementedError(f"rope scaling {kind!r} is not supported")
    return inv_freq.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [B, T, 1, R/2] (rotate-half layout, as in Hugging Face). With
    partial rotary (R < D) only the first R dimensions turn; the rest pass through."""
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft limit on attention scores and logits: cap * tanh(x / cap)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor | None,
              scale: float | None = None, cap: float | None = None) -> torch.Tensor:
    """softmax(cap(q k^T * scale)) v; SDPA unless the scores are soft-capped, which it cannot do."""
    if cap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, scale=scale)
    scores = softcap((q @ keys.transpose(-1, -2)).float() * (scale or q.shape[-1] ** -0.5), cap)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return (scores.softmax(dim=-1).to(q.dtype) @ values)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_offset) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, config.norm_offset) if config.qk_norm else None
        self.rope = layer_idx not in config.no_rope_layers
        self.scale, self.softcap = config.attn_scale, config.attn_softcap
        self.execution = Execution()  # its model's, given by use

    def use(self, execution: Execution) -> None:
        self.execution = execution

    def forward(self, x, cos, sin, cache: KVCache, rows, slots, attn_mask, span: int) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        project = invariant.project if self.execution.batch_invariant else _call
        qkv = project(self.qkv_proj, x).view(B, T, H + 2 * Hkv, D)
        qk, v = qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])), dim=2)
        if self.rope:
            qk = apply_rope(qk, cos, sin)  # q and k rotated together: one pass instead of two
        q, k = qk[:, :, :H], qk[:, :, H:]
        keys, values = cache.write(self.layer_idx, rows, slots, k, v, span=span)
        # Grouped-query attention without copying K/V: the G query heads sharing one KV head
        # are stacked along the query axis (attn_mask is already laid out that way).
        G = H // Hkv
        q = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        attend = invariant.attention if self.execution.batch_invariant else attention
        out = attend(q, keys, values, attn_mask, self.scale, self.softcap)
        out = out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)
        return _reduced(self.execution.reduce, project(self.o_proj, out))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation = _ACTIVATIONS[config.mlp_activation]
        self.execution = Execution()  # see Attention

    def use(self, execution: Execution) -> None:
        self.execution = execution

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        project = invariant.project if self.execution.batch_invariant else _call
        gate, up = project(self.gate_up_proj, x).chunk(2, dim=-1)
        return _reduced(self.execution.reduce, project(self.down_proj, self.activation(gate) * up))


_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _reduced(reduce, x: torch.Tensor) -> torch.Tensor:
    if reduce is not None:
        x = x.contiguous()
        reduce(x)
    return x


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP. With `post_norms` (Gemma), post_attention_layernorm norms
    the attention's output, as Hugging Face names it, and two more norms wrap the MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(config)
        self.pre_feedforward_layernorm = norm() if config.post_norms else None
        self.post_feedforward_layernorm = norm() if config.post_norms else None
        self.sliding = layer_idx in config.sliding_layers  # which mask and rope LlamaModel passes

    def use(self, execution: Execution) -> None:
        self.self_attn.use(execution)
        self.mlp.use(execution)

    def forward(self, x, cos, sin, cache, rows, slots, attn_mask, span):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, cache, rows, slots, attn_mask, span)
        if self.pre_feedforward_layernorm is None:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaModel(nn.Module):
    """Decoder with an LM head; `forward` returns hidden states, `logits` applies the head.

    Keeping the head separate lets callers pay for it only at the positions they sample from.
    """

    reads_features = False  # see EagleDraft

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.execution = Execution()  # how its passes run: see use
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.head_vocab_size or config.vocab_size, bias=False)
        self.tie_weights()
        if config.head_vocab_size is not None:
            # Vocabulary id of each head row; saved with the weights.
            self.register_buffer("head_token_ids", torch.zeros(config.head_vocab_size, dtype=torch.long))
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        if config.rope_local_theta is not None:  # Gemma 3's sliding layers' rope
            self.register_buffer("inv_freq_local", rope_inv_freq(config, local=True), persistent=False)
        else:
            self.inv_freq_local = None

    @classmethod
    def with_weights(cls, config: ModelConfig, state: dict[str, torch.Tensor],
                     modules: dict[str, nn.Module] | None = None) -> LlamaModel:
        """The model holding a checkpoint's tensors as they are (built on the meta device: nothing
        initialised or copied), with `modules` (quantized projections, by name) in place of the
        plain ones whose weights `state` lacks, its head tied as the config says and its rope
        buffers computed (the meta device has none)."""
        modules = modules or {}
        with torch.device("meta"):
            model = cls(config)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if unexpected or set(missing) - {f"{name}.{kind}" for name in modules for kind in ("weight", "bias")}:
            raise RuntimeError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
        for name, module in modules.items():
            model.set_submodule(name, module)
        if "lm_head" not in modules:  # assigning the weights untied them
            model.tie_weights()
        model.reset_rope()
        return model

    def use(self, execution: Execution) -> None:
        """Runs its passes as `execution` says from now on: the one way its running state changes."""
        self.execution = execution
        for layer in self.layers:
            layer.use(execution)

    def tie_weights(self) -> None:
        """Shares the embedding table with the head, as a config that ties them says."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def refit_vocabulary(self, rows: int, head_token_ids: torch.Tensor) -> None:
        """Fits it to a vocabulary of `rows` rows of the same tokenizer (saguaro.models.pairing):
        its embedding table padded with zero rows or cut, its head a reduced one whose rows
        predict `head_token_ids` (the head already cut to them by the caller)."""
        table = self.embed_tokens.weight.detach()
        if rows > len(table):
            table = torch.cat((table, table.new_zeros(rows - len(table), table.shape[1])))
        self.embed_tokens = Embedding(rows, table.shape[1], _weight=table[:rows], _freeze=True)
        self.config = replace(self.config, vocab_size=rows, head_vocab_size=len(head_token_ids), tie_word_embeddings=False)
        self.register_buffer("head_token_ids", head_token_ids)

    @property
    def quantization(self) -> str | None:
        return self.execution.quantization

    @property
    def native_layers(self) -> LayerRunner | None:
        return self.execution.native_layers

    @property
    def tensor_parallel(self) -> PassAnnouncer | None:
        return self.execution.tensor_parallel

    @property
    def cuda_graphs(self) -> str:
        return self.execution.cuda_graphs

    @property
    def step_graphs(self) -> CapturedPasses | None:
        return self.execution.step_graphs

    def reset_rope(self) -> None:
        """Computes the rope buffers anew, on the CPU: a model built on the meta device has none."""
        self.inv_freq = rope_inv_freq(self.config)
        if self.inv_freq_local is not None:
            self.inv_freq_local = rope_inv_freq(self.config, local=True)

    def set_batch_invariant(self, on: bool) -> None:
        """Whether each position's logits are bit-identical however many tokens and sequences
        share its pass (saguaro.models.invariant): what makes greedy SD and SSD equal AR in
        every dtype."""
        self.use(replace(self.execution, batch_invariant=on))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rows: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, static_shapes: bool = False) -> torch.Tensor:
        """tokens, positions: [B, T]. rows: cache rows of the B sequences (default 0..B-1).
        slots: cache slots written (default: the positions). mask: [B, T, S] bool, which of the
        first S slots each token attends to (default: causal over slots). static_shapes: a pass
        being captured (saguaro.models.graphs): no host synchronisation, no shape read from data.
        Returns [B, T, hidden]."""
        if self.execution.tensor_parallel is not None:  # the other ranks run the same pass on their slices
            self.execution.tensor_parallel.announce(tokens, positions, cache, rows, slots, mask)
        x = self.embed_tokens(tokens)
        if self.config.embed_scale is not None:  # rounded to the weights' dtype, as Gemma does
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return self.run_layers(x, positions, cache, rows, slots, mask, static_shapes)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                   rows: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None, static_shapes: bool = False) -> torch.Tensor:
        """The decoder layers and final norm over input vectors x [B, T, hidden]."""
        if slots is None:
            slots = positions
        if mask is None:
            mask = causal_mask(slots)
        if mask.shape[-1] > cache.num_slots:
            raise IndexError(f"the KV cache has {cache.num_slots} slots; {mask.shape[-1]} needed")
        freqs = positions[..., None].float() * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()  # [B, T, rotary_dim / 2]
        if self.config.rope_attention_factor != 1.0:
            cos, sin = cos * self.config.rope_attention_factor, sin * self.config.rope_attention_factor
        if not static_shapes:  # a captured pass reads its rows by index, as they are
            rows = as_slice(rows)
        local = None  # the sliding layers' (mask, cos, sin), cos and sin None where they turn as the others
        if self.config.sliding_layers:
            local = (window_mask(mask, self.config.sliding_window), None, None)
            if self.inv_freq_local is not None:
                freqs = positions[..., None].float() * self.inv_freq_local
                local = (local[0], freqs.cos(), freqs.sin())
        if self.execution.native_layers is not None:  # the final norm included
            return self.execution.native_layers.run(x, cos, sin, cache, rows, slots, mask, mask.shape[-1], local)
        group = self.config.num_heads // self.config.num_kv_heads
        full = (cos[:, :, None], sin[:, :, None], gqa_mask(mask, group, _dense(mask, static_shapes)))
        if local is not None:
            window, local_cos, local_sin = local
            local = (full[0] if local_cos is None else local_cos[:, :, None],
                     full[1] if local_sin is None else local_sin[:, :, None], gqa_mask(window, group, _dense(window, static_shapes)))
        for layer in self.layers:
            cos, sin, attn_mask = local if layer.sliding else full
            x = layer(x, cos, sin, cache, rows, slots, attn_mask, mask.shape[-1])
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, legal: numpy.ndarray | None = None) -> torch.Tensor:
        """fp32 logits over the full vocabulary. With a reduced head, tokens outside it get
        -inf: probability exactly zero, so the distribution a proposal is drawn from is exact.
        legal: a grammar's masks over the head's rows (`head_logits`)."""
        return self.to_vocab(self.head_logits(hidden, legal), float("-inf"))

    @property
    def masks_in_head(self) -> bool:
        """Whether the head takes a grammar's masks into its product (`head_logits`, legal):
        saguaro's kernels compute it in fp32, with no softcap after it (which would turn -inf
        finite)."""
        return (getattr(self.lm_head, "out_dtype", None) == torch.float32 and self.dtype == torch.bfloat16
                and self.config.logit_softcap is None and self.device.type == "cpu")

    @property
    def head_ids(self) -> numpy.ndarray | None:
        """The token of each of a reduced head's rows; None for a head over the vocabulary."""
        return None if self.config.head_vocab_size is None else self.head_token_ids.numpy()

    def head_logits(self, hidden: torch.Tensor, legal: numpy.ndarray | None = None) -> torch.Tensor:
        """fp32 logits over the head's own rows: the vocabulary, or a reduced head's tokens.
        Drafts sample in this space (all the mass is there, at a fraction of the width) and
        map rows to token ids with `head_token`. legal (only where masks_in_head): a grammar's
        masks over the head's rows, one int32 row per row of hidden: -inf at each row's illegal
        tokens, written by the product itself (bindings.group_matmul)."""
        if legal is not None:
            if not self.masks_in_head:
                raise ValueError("this model's head does not take masks (LlamaModel.masks_in_head)")
            return self.lm_head.matmul(hidden.reshape(-1, hidden.shape[-1]), legal).reshape(*hidden.shape[:-1], -1)
        project = invariant.project if self.execution.batch_invariant else _call
        return softcap(project(self.lm_head, hidden).float(), self.config.logit_softcap)

    def head_token(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.config.head_vocab_size is None else self.head_token_ids[rows]

    def to_vocab(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[..., head rows] -> [..., vocabulary], `fill` outside the head."""
        if self.config.head_vocab_size is None:
            return values
        return scatter_to_vocab(values, self.head_token_ids, self.config.vocab_size, fill)


def _dense(mask: torch.Tensor, static_shapes: bool) -> bool:
    """Every token sees every slot; not asked of a pass being captured (it would synchronise)."""
    return not static_shapes and bool(mask.all())


def scatter_to_vocab(values: torch.Tensor, token_ids: torch.Tensor, vocab_size: int,
                     fill: float = 0.0) -> torch.Tensor:
    """Places values [..., H] at columns token_ids [H] of a [..., vocab_size] tensor."""
    full = values.new_full((*values.shape[:-1], vocab_size), fill)
    return full.index_copy_(-1, token_ids.to(values.device), values)


def causal_mask(slots: torch.Tensor) -> torch.Tensor:
    """Each token sees every slot up to its own: right for sequences stored contiguously."""
    span = int(slots.max()) + 1
    return torch.arange(span, device=slots.device) <= slots[..., None]


def window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """Of the slots each token sees, only its last `window`: its own and the window - 1 positions
    before it. A token sees its ancestors, one per position, stored in position order (a prefix,
    then a tree path, each node after its parent), so they are the last `window` it sees."""
    seen_after = mask.flip(-1).cumsum(-1).flip(-1)  # slots seen at or after each slot
    return mask & (seen_after <= window)


def gqa_mask(mask: torch.Tensor, group: int, dense: bool = False) -> torch.Tensor | None:
    """[B, T, S] -> [B, 1, group * T, S], the layout Attention stacks query heads in; None
    where `dense` says every token sees every slot (one-token decode), which takes SDPA's
    unmasked path."""
    if dense:
        return None
    B, T, S = mask.shape
    return mask[:, None].expand(B, group, T, S).reshape(B, 1, group * T, S)
