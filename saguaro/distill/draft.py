"""The draft's shape and its initialization from the target.

A standalone draft is a LlamaModel like any other: a few of the target's layers (copied, then
trained), the target's embedding table (shared and frozen, so the checkpoint can leave it out)
and a head over the tokens the target actually produces most often (a fraction of the cost of
a full-vocabulary head, which would otherwise dominate a shallow draft's step time). An EAGLE
draft (saguaro.models.eagle) has the same parts, one layer, and a projection of [embedding,
target hidden state] into that layer; its head rows stay the target's (frozen), because what it
learns to predict is the target's hidden state, which those rows turn into logits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from saguaro.distill.teacher import Sequence
from saguaro.models.eagle import model_class
from saguaro.models.llama import LlamaModel


@dataclass
class DraftSpec:
    layers: tuple[int, ...] = (0, 29)  # target layers the draft's layers start from
    head_vocab: int = 8192
    eagle: bool = False  # an EAGLE-style draft: one layer (layers[0]) reading target hidden states


def target_layers(text: str, num_layers: int) -> tuple[int, ...]:
    """--layers as the target's layer indices, negative ones counted from the end (-1: the last),
    so that one default ("0,-1": the first and last layer) fits any target."""
    named = [int(i) for i in text.split(",")]
    resolved = tuple(i + num_layers if i < 0 else i for i in named)
    outside = [i for i, r in zip(named, resolved) if not 0 <= r < num_layers]
    if outside:
        raise ValueError(f"the target has {num_layers} layers (0 to {num_layers - 1}, or -1 to -{num_layers}); "
                         f"--layers names {', '.join(map(str, outside))}")
    return resolved


def select_vocab(sequences: Seq[Sequence], size: int, vocab_size: int, always: Seq[int] = ()) -> torch.Tensor:
    """The `size` token ids the teacher most often ranks first, plus `always` (e.g. EOS), sorted.

    Counting the teacher's first choices favours what the draft must propose. Tokens the sample
    never shows are ranked by id: BPE ids follow merge order, roughly the tokenizer corpus's
    frequency (the prior stays below one count, so it only orders unseen or tied tokens)."""
    counts = 0.5 / (1 + torch.arange(vocab_size, dtype=torch.float64) / 2000)
    for s in sequences:
        counts.index_add_(0, s.topk_ids[:, 0].long(), torch.ones(len(s.topk_ids), dtype=torch.float64))
    counts[list(always)] = float("inf")
    return counts.topk(min(size, vocab_size)).indices.sort().values


def init_draft(target: LlamaModel, spec: DraftSpec, vocab_ids: torch.Tensor) -> LlamaModel:
    """An fp32 draft whose layers, final norm and head rows are copies of the target's. An EAGLE
    draft's head stays frozen: it learns the target's hidden state, which those rows read."""
    if spec.eagle and len(spec.layers) != 1:
        raise ValueError("an EAGLE draft has one layer: give one target layer to start from")
    target_config = target.config
    # Per-layer features (no rope, a sliding window) follow the layers the draft copies.
    config = dataclasses.replace(
        target_config, num_layers=len(spec.layers), tie_word_embeddings=False, head_vocab_size=len(vocab_ids),
        eagle=spec.eagle, no_rope_layers=[i for i, j in enumerate(spec.layers) if j in target_config.no_rope_layers],
        sliding_layers=[i for i, j in enumerate(spec.layers) if j in target_config.sliding_layers])
    draft = model_class(config)(config)
    state = {"embed_tokens.weight": target.embed_tokens.weight, "norm.weight": target.norm.weight,
             "lm_head.weight": target.lm_head.weight[vocab_ids], "head_token_ids": vocab_ids}
    if spec.eagle:
        # Starts as "the target's hidden state carried over": the embedding half is small noise.
        hidden = config.hidden_size
        noise = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)) * 0.02 / hidden ** 0.5
        state["fc.weight"] = torch.cat((noise, torch.eye(hidden)), dim=1)
        state["feature_norm.weight"] = embedding_scale(target).expand(hidden)
    target_state = target.state_dict()
    for i, j in enumerate(spec.layers):
        for name, value in target_state.items():
            if name.startswith(f"layers.{j}."):
                state[f"layers.{i}." + name.removeprefix(f"layers.{j}.")] = value
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    draft.reset_rope()
    draft.embed_tokens.weight.requires_grad_(False)
    if spec.eagle:
        draft.lm_head.weight.requires_grad_(False)
    return draft


def eagle_from(standalone: LlamaModel) -> LlamaModel:
    """An EAGLE draft that starts as a trained standalone draft: same layers, norm and head, and
    a projection that passes the token embedding through and ignores the target's features, so
    training starts from the standalone draft's agreement and can only add what they tell."""
    config = dataclasses.replace(standalone.config, eagle=True)
    draft = model_class(config)(config)
    hidden = config.hidden_size
    state = {k: v.float() if v.is_floating_point() else v for k, v in standalone.state_dict().items()}
    state["fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
    state["feature_norm.weight"] = embedding_scale(standalone).expand(hidden)
    draft.load_state_dict(state)
    draft.reset_rope()
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


def embedding_scale(model: LlamaModel) -> torch.Tensor:
    """The root-mean-square size of the model's token embeddings (a scalar)."""
    return model.embed_tokens.weight.float().pow(2).mean().sqrt()
