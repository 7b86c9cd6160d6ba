"""A request being decoded: its tokens, stop rules, random stream and measurements."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from saguaro.engine.sampler import SamplingParams


@dataclass
class SequenceStats:
    """Raw measurements; RequestMetrics turns them into the reported figures."""
    prompt_len: int = 0
    t_arrival: float = 0.0
    t_first_token: float | None = None
    t_finish: float | None = None
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1, per round
    cache_hits: list[bool] = field(default_factory=list)  # SSD: per round after the first


class Sequence:
    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int]):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.seq_id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.finish_reason: str | None = None
        self.text_limit: int | None = None  # where a stop string cut the text
        self.stats = SequenceStats(prompt_len=len(prompt_ids), t_arrival=time.perf_counter())

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def commit(self, tokens: list[int]) -> int:
        """Appends tokens up to and including the first stop token (kept in token ids, as in
        vLLM); returns how many were kept."""
        kept = 0
        for token in tokens:
            if self.finished:
                break
            kept += 1
            self.output_ids.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        now = time.perf_counter()
        if self.stats.t_first_token is None and kept:
            self.stats.t_first_token = now
        if self.finished:
            self.stats.t_finish = now
        return kept

    def check_stop_strings(self, text: str) -> None:
        """Ends the sequence at the first stop string in its decoded output."""
        for stop in self.params.stop:
            at = text.find(stop)
            if at >= 0 and (self.text_limit is None or at < self.text_limit):
                self.text_limit = at
        if self.text_limit is not None and not self.finished:
            self.finish_reason = "stop"
            self.stats.t_finish = time.perf_counter()
