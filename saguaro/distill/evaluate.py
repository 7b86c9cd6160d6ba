"""Development figures for a draft: acceptance length under plain speculative decoding, and how
its step time compares with one target verification.

The acceptance loop here is deliberately minimal (batch 1, one prompt at a time, no overlap);
the engine's decoders give the official figures. It is still exact: greedy acceptance at
temperature 0, rejection sampling against the draft's real proposal distribution otherwise.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from saguaro.engine.kv_cache import KVCache
from saguaro.models.llama import LlamaModel


@dataclass
class Acceptance:
    k: int
    lengths: list[int] = field(default_factory=list)  # accepted drafts + 1 bonus, per round

    @property
    def mean(self) -> float:
        return statistics.fmean(self.lengths) if self.lengths else 0.0

    def per_position(self) -> list[float]:
        """Fraction of rounds in which draft position i (1-based) was accepted."""
        n = max(len(self.lengths), 1)
        return [sum(length > i for length in self.lengths) / n for i in range(1, self.k + 1)]

    def per_token(self) -> float:
        """The per-token acceptance a with (1 - a^(K+1)) / (1 - a) equal to the mean length."""
        lo, hi = 0.0, 1.0
        for _ in range(60):
            a = (lo + hi) / 2
            if sum(a ** i for i in range(self.k + 1)) < self.mean:
                lo = a
            else:
                hi = a
        return (lo + hi) / 2


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits / temperature).softmax(-1)


def _accept(target_logits: torch.Tensor, draft_logits: torch.Tensor, proposals: list[int],
            temperature: float, generator: torch.Generator) -> tuple[int, int]:
    """(number of proposals accepted, bonus token). target_logits: [K+1, V]; draft_logits: [K, V]."""
    if temperature == 0:
        best = target_logits.argmax(-1).tolist()
        n = 0
        while n < len(proposals) and proposals[n] == best[n]:
            n += 1
        return n, best[n]
    p, q = _probs(target_logits, temperature), _probs(draft_logits, temperature)
    for i, x in enumerate(proposals):
        if torch.rand((), generator=generator) * q[i, x] < p[i, x]:
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[-1], 1, generator=generator))


@torch.inference_mode()
def speculate(target: LlamaModel, draft: LlamaModel, prompt: list[int], k: int, temperature: float,
              new_tokens: int, eos_ids: set[int], generator: torch.Generator) -> list[int]:
    """Speculative decoding of one prompt; returns the acceptance length of every round."""
    slots = len(prompt) + new_tokens + k + 1
    target_cache = KVCache(target.config, 1, slots, target.dtype, target.device)
    draft_cache = KVCache(draft.config, 1, slots, draft.dtype, draft.device)
    seq, lengths = list(prompt), []
    target_done = draft_done = 0  # committed tokens whose KV entries each cache holds
    while len(seq) - len(prompt) < new_tokens:
        proposals, draft_logits = [], []
        feed, pos = seq[draft_done:], draft_done
        for _ in range(k):
            tokens = torch.tensor([feed])
            hidden = draft(tokens, torch.arange(pos, pos + len(feed))[None], draft_cache)
            logits = draft.logits(hidden[0, -1])
            token = int(logits.argmax()) if temperature == 0 else int(
                torch.multinomial(_probs(logits, temperature), 1, generator=generator))
            proposals.append(token)
            draft_logits.append(logits)
            pos, feed = pos + len(feed), [token]
        feed = seq[target_done:] + proposals
        hidden = target(torch.tensor([feed]), torch.arange(target_done, target_done + len(feed))[None], target_cache)
        n, bonus = _accept(target.logits(hidden[0, -(k + 1):]), torch.stack(draft_logits), proposals,
                           temperature, generator)
        target_done, draft_done = len(seq) + n, len(seq) + min(n, k - 1)
        committed = proposals[:n] + [bonus]
        seq += committed
        lengths.append(n + 1)
        if eos_ids & set(committed):
            break
    return lengths


def acceptance(target: LlamaModel, draft: LlamaModel, prompts: list[list[int]], k: int = 5,
               temperature: float = 0.0, new_tokens: int = 128, eos_ids: set[int] = frozenset(),
               seed: int = 0, progress=None) -> Acceptance:
    result = Acceptance(k)
    generator = torch.Generator().manual_seed(seed)
    for prompt in prompts:
        result.lengths += speculate(target, draft, prompt, k, temperature, new_tokens, set(eos_ids), generator)
        if progress is not None:
            progress.update(1)
    return result


@torch.inference_mode()
def step_ms(model: LlamaModel, rows: int, tokens: int, context: int = 256, repeats: int = 30) -> float:
    """Median milliseconds of one forward pass of `tokens` new tokens in each of `rows` rows after
    `context` cached ones, logits included (what a draft step or a verification costs)."""
    cache = KVCache(model.config, rows, context + tokens, model.dtype, model.device)
    model(torch.zeros(rows, context, dtype=torch.long), torch.arange(context).expand(rows, context), cache)
    step = torch.zeros(rows, tokens, dtype=torch.long)
    positions = torch.arange(context, context + tokens).expand(rows, tokens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.logits(model(step, positions, cache))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)
