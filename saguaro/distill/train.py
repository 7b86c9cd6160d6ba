"""Distillation: the draft learns the target's next-token distributions (cached top-k).

Sequences are packed into fixed-length rows (each attends only within itself), the loss is the
cross-entropy from the teacher's top-k distribution to the draft's, and every run is a pure
function of (data, config, seed): batch order depends only on the seed and the step, so a run
resumed from a checkpoint continues exactly where it stopped.
"""
from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Iterator, Sequence as Seq
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from saguaro.distill.teacher import Sequence
from saguaro.models.llama import LlamaModel


@dataclass
class TrainConfig:
    steps: int = 1500
    rows: int = 8  # packed rows per step
    row_len: int = 512
    lr: float = 1e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    prompt_weight: float = 0.2  # loss weight of prompt positions relative to generated ones
    eval_every: int = 100
    checkpoint_every: int = 100
    seed: int = 0
    feature_weight: float = 1.0  # EAGLE drafts: weight of the hidden-state regression loss
    unroll: int = 2  # EAGLE drafts: passes, each fed the previous pass's own guesses (>= 1)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T, T] attention within each packed sequence
    target_ids: torch.Tensor  # [B, T, k] draft-head index of the teacher's top-k, -1 outside it
    target_logits: torch.Tensor  # [B, T, k]
    weight: torch.Tensor  # [B, T] loss weight (0 at padding and at each sequence's last token)
    teacher_top1: torch.Tensor  # [B, T] vocabulary id of the teacher's first choice
    features: torch.Tensor | None = None  # [B, T, hidden] target hidden states (EAGLE drafts)
    previous: torch.Tensor | None = None  # [B, T] index of the position before, -1 at a start


def split_heldout(sequences: Seq[Sequence], every: int = 20) -> tuple[list[Sequence], list[Sequence]]:
    """(train, heldout): every `every`-th sequence is held out."""
    train = [s for i, s in enumerate(sequences) if i % every]
    heldout = [s for i, s in enumerate(sequences) if i % every == 0]
    return train, heldout


def pack(sequences: Seq[Sequence], row_len: int) -> list[list[Sequence]]:
    """Greedy first-fit packing in the given order; longer sequences are cut at row_len."""
    rows, current, used = [], [], 0
    for s in sequences:
        n = min(len(s.tokens), row_len)
        if used + n > row_len:
            rows.append(current)
            current, used = [], 0
        current.append(s)
        used += n
    if current:
        rows.append(current)
    return rows


def make_batch(rows: Seq[Seq[Sequence]], row_len: int, to_draft: torch.Tensor, prompt_weight: float,
               generated_only: bool = False) -> Batch:
    B, k = len(rows), rows[0][0].topk_ids.shape[1]
    tokens = torch.zeros(B, row_len, dtype=torch.long)
    positions = torch.zeros(B, row_len, dtype=torch.long)
    segment = torch.full((B, row_len), -1, dtype=torch.long)
    target_ids = torch.full((B, row_len, k), -1, dtype=torch.long)
    target_logits = torch.zeros(B, row_len, k)
    weight = torch.zeros(B, row_len)
    top1 = torch.full((B, row_len), -1, dtype=torch.long)
    with_features = rows[0][0].features is not None
    features = torch.zeros(B, row_len, rows[0][0].features.shape[-1]) if with_features else None
    for b, row in enumerate(rows):
        start = 0
        for j, s in enumerate(row):
            n = min(len(s.tokens), row_len)
            span = slice(start, start + n)
            tokens[b, span] = s.tokens[:n].long()
            positions[b, span] = torch.arange(n)
            segment[b, span] = j
            ids = s.topk_ids[:n - 1].long()
            target_ids[b, start:start + n - 1] = to_draft[ids]
            target_logits[b, start:start + n - 1] = s.topk_logits[:n - 1].float()
            top1[b, start:start + n - 1] = ids[:, 0]
            w = torch.ones(n - 1)
            w[:s.num_prompt - 1] = 0.0 if generated_only else prompt_weight
            weight[b, start:start + n - 1] = w
            if with_features:
                features[b, span] = s.features[:n].float()
            start += n
    idx = torch.arange(row_len)
    mask = (segment[:, :, None] == segment[:, None, :]) & (idx[None, :] <= idx[:, None]) & (segment[:, :, None] >= 0)
    mask |= torch.eye(row_len, dtype=torch.bool)  # padding attends to itself, so no row is empty
    previous = torch.where(positions > 0, idx - 1, -1)
    return Batch(tokens, positions, mask, target_ids, target_logits, weight, top1, features, previous)


class PassCache:
    """Stands in for a KVCache when a pass covers whole rows (slots 0..T-1): the keys and values
    attended to are just this pass's, and nothing is written in place, which autograd needs."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots

    def write(self, layer, rows, slots, k, v, span):
        return k.transpose(1, 2), v.transpose(1, 2)


def draft_hidden(draft: LlamaModel, batch: Batch, features: torch.Tensor | None = None) -> torch.Tensor:
    """The draft's final hidden states [B, T, hidden] over whole packed rows. An EAGLE draft
    reads at each position the features of the position before (zeros at a sequence start):
    the target's (`batch.features`) unless `features` gives others (its own earlier guesses)."""
    B, T = batch.tokens.shape
    cache = PassCache(T)
    extra = {}
    if draft.reads_features:
        source = batch.features if features is None else features
        index = batch.previous.clamp(min=0)[..., None].expand(-1, -1, source.shape[-1])
        extra["features"] = source.gather(1, index) * (batch.previous >= 0)[..., None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return draft(batch.tokens, batch.positions, cache, slots=torch.arange(T).expand(B, T), mask=batch.mask, **extra)


def head_logits(draft: LlamaModel, hidden: torch.Tensor) -> torch.Tensor:
    """Logits over the draft's own (reduced) head vocabulary, [B, T, V_draft]."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return draft.lm_head(hidden).float()


def batch_loss(draft: LlamaModel, batch: Batch, config: TrainConfig) -> torch.Tensor:
    """Distillation loss; for an EAGLE draft also the regression of its hidden states on the
    target's, over `unroll` passes: pass i reads the guesses of pass i-1, as in drafting, where
    every token after the first is drafted from the draft's own features."""
    if not draft.reads_features:
        return distill_loss(head_logits(draft, draft_hidden(draft, batch)), batch)
    loss, features = 0.0, None
    for _ in range(config.unroll):
        hidden = draft_hidden(draft, batch, features)
        loss = loss + distill_loss(head_logits(draft, hidden), batch)
        loss = loss + config.feature_weight * feature_loss(hidden.float(), batch)
        features = hidden.detach().float()
    return loss / config.unroll


def feature_loss(hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    per_position = F.smooth_l1_loss(hidden, batch.features, reduction="none").mean(-1)
    return (per_position * batch.weight).sum() / batch.weight.sum().clamp(min=1e-9)


def distill_loss(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Cross-entropy from the teacher's top-k distribution (temperature 1) to the draft's;
    teacher mass on tokens outside the draft's head is unreachable and left out."""
    logq = logits.log_softmax(-1).gather(-1, batch.target_ids.clamp(min=0))
    p = batch.target_logits.softmax(-1) * (batch.target_ids >= 0)
    per_position = -(p * logq).sum(-1)
    return (per_position * batch.weight).sum() / batch.weight.sum().clamp(min=1e-9)


@torch.no_grad()
def evaluate(draft: LlamaModel, batches: Seq[Batch]) -> dict[str, float]:
    """On generated positions: top-1 agreement with the teacher, and the KL from the teacher's
    top-k (restricted to the draft's vocabulary, renormalized) to the draft. An EAGLE draft is
    scored reading the target's features, and (`top1_own`) reading its own guesses of them."""
    scores = {"top1": 0.0, "kl": 0.0}
    if draft.reads_features:
        scores["top1_own"] = 0.0
    count = 0.0
    for batch in batches:
        valid = batch.weight > 0
        hidden = draft_hidden(draft, batch)
        logits = head_logits(draft, hidden)
        scores["top1"] += _agreement(draft, logits, batch, valid)
        logq = logits.log_softmax(-1).gather(-1, batch.target_ids.clamp(min=0))
        in_vocab = batch.target_ids >= 0
        logp = batch.target_logits.masked_fill(~in_vocab, float("-inf")).log_softmax(-1)
        terms = torch.where(in_vocab, logp.exp() * (logp - logq), torch.zeros_like(logq))
        scores["kl"] += (terms.sum(-1) * valid).sum().item()
        if draft.reads_features:
            own = head_logits(draft, draft_hidden(draft, batch, hidden.float()))
            scores["top1_own"] += _agreement(draft, own, batch, valid)
        count += valid.sum().item()
    return {name: value / max(count, 1) for name, value in scores.items()}


def _agreement(draft: LlamaModel, logits: torch.Tensor, batch: Batch, valid: torch.Tensor) -> float:
    return ((draft.head_token_ids[logits.argmax(-1)] == batch.teacher_top1) & valid).sum().item()


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    t = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def epoch_rows(sequences: Seq[Sequence], config: TrainConfig, epoch: int) -> list[list[Sequence]]:
    order = list(sequences)
    random.Random(config.seed * 100003 + epoch).shuffle(order)
    return pack(order, config.row_len)


def batch_schedule(sequences: Seq[Sequence], config: TrainConfig) -> Iterator[tuple[int, list[list[Sequence]]]]:
    """(epoch, rows) of the batch of step 0, 1, 2, ... Each epoch packs its own shuffle, so
    epochs hold different numbers of batches; a resumed run skips the steps it has done."""
    for epoch in itertools.count():
        rows = epoch_rows(sequences, config, epoch)
        if len(rows) < config.rows:
            raise ValueError("not enough training sequences for one batch")
        for i in range(len(rows) // config.rows):
            yield epoch, rows[i * config.rows:(i + 1) * config.rows]


def train(draft: LlamaModel, train_seqs: Seq[Sequence], heldout_seqs: Seq[Sequence], config: TrainConfig,
          out: Path | None = None, log=print) -> list[dict]:
    """Trains `draft` in place and returns the evaluation history. With `out`, checkpoints go
    to out/train_state.pt (resumed from when present) and evaluations to out/eval.jsonl."""
    torch.manual_seed(config.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.95))
    state_file = out / "train_state.pt" if out else None
    step, history = 0, []
    if state_file and state_file.exists():
        saved = torch.load(state_file)
        draft.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step, history = saved["step"], saved["history"]
        log(f"resumed from step {step}")
    to_draft = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
    to_draft[draft.head_token_ids] = torch.arange(len(draft.head_token_ids))
    heldout = [make_batch(r, config.row_len, to_draft, 0.0, generated_only=True)
               for r in _chunks(pack(heldout_seqs, config.row_len), config.rows)]
    if not history:
        history.append({"step": 0, **evaluate(draft, heldout)})
        _record(history[-1], out, log)
    bar = tqdm(total=config.steps, initial=step, desc="distill", unit="step", dynamic_ncols=True)
    schedule = itertools.islice(batch_schedule(train_seqs, config), step, None)
    started = time.time()
    while step < config.steps:
        epoch, rows = next(schedule)
        batch = make_batch(rows, config.row_len, to_draft, config.prompt_weight)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss = batch_loss(draft, batch, config)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", epoch=epoch)
        if step % config.eval_every == 0 or step == config.steps:
            history.append({"step": step, "epoch": epoch, "minutes": (time.time() - started) / 60,
                            **evaluate(draft, heldout)})
            _record(history[-1], out, log)
        if state_file and (step % config.checkpoint_every == 0 or step == config.steps):
            torch.save({"step": step, "model": draft.state_dict(), "optimizer": optimizer.state_dict(),
                        "history": history, "config": asdict(config)}, state_file.with_suffix(".partial"))
            state_file.with_suffix(".partial").replace(state_file)
    bar.close()
    return history


def _chunks(items: list, n: int) -> list[list]:
    return [items[i:i + n] for i in range(0, len(items), n)]


def _record(entry: dict, out: Path | None, log) -> None:
    log("eval " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()))
    if out:
        with open(out / "eval.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
