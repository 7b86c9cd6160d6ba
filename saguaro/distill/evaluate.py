"""Development figures for a draft: acceptance length under speculative decoding (the engine's
SD decoder, one prompt at a time), and how its step time compares with one target verification."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from saguaro.engine.sampler import SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.models.kv_cache import KVCache
from saguaro.models.llama import LlamaModel
from saguaro.speculation.local.drafters import model_drafter
from saguaro.speculation.policy.planning import acceptance_rate
from saguaro.speculation.build import sd_decoder


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
        return acceptance_rate(self.mean, self.k)


@torch.inference_mode()
def speculate(target: LlamaModel, draft: LlamaModel, prompt: list[int], k: int, temperature: float,
              new_tokens: int, eos_ids: set[int], seed: int) -> list[int]:
    """Speculative decoding of one prompt with the engine's SD decoder; returns the acceptance
    length of every round."""
    decoder = sd_decoder(target, model_drafter(draft, k))
    seq = Sequence(0, prompt, SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=seed), list(eos_ids))
    decoder.reserve(1, len(prompt) + new_tokens + decoder.lookahead)
    decoder.prefill([seq])
    while not seq.finished:
        decoder.step([seq])
    return seq.stats.acceptance_lengths


def acceptance(target: LlamaModel, draft: LlamaModel, prompts: list[list[int]], k: int = 5,
               temperature: float = 0.0, new_tokens: int = 128, eos_ids: set[int] = frozenset(),
               seed: int = 0, progress=None) -> Acceptance:
    lengths = []
    for i, prompt in enumerate(prompts):
        lengths += speculate(target, draft, prompt, k, temperature, new_tokens, set(eos_ids), seed + i)
        if progress is not None:
            progress.update(1)
    return Acceptance(k, lengths)


@torch.inference_mode()
def step_ms(model: LlamaModel, rows: int, tokens: int, context: int = 256, repeats: int = 30) -> float:
    """Median milliseconds of one forward pass of `tokens` new tokens in each of `rows` rows after
    `context` cached ones, head included (what a draft step or a verification costs). The head
    gives its own rows, as decoders sample them: a reduced draft head is never widened."""
    cache = KVCache(model.config, rows, context + tokens, model.dtype, model.device)
    features = lambda n: ({"features": torch.zeros(rows, n, model.config.hidden_size)}  # noqa: E731
                          if model.reads_features else {})
    model(torch.zeros(rows, context, dtype=torch.long), torch.arange(context).expand(rows, context), cache,
          **features(context))
    step = torch.zeros(rows, tokens, dtype=torch.long)
    positions = torch.arange(context, context + tokens).expand(rows, tokens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.head_logits(model(step, positions, cache, **features(tokens)))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)
