"""A request being decoded: its tokens, stop rules, random stream and measurements."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from saguaro.engine.detokenizer import Detokenizer, Tokenizer
from saguaro.engine.logprobs import TokenLogprobs
from saguaro.engine.processing import LogitsProcessor
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.structured import GrammarMatcher, grammar_tokenizer

if TYPE_CHECKING:
    from saguaro.engine.round import RowRecord


@dataclass
class SequenceStats:
    """Raw measurements; RequestMetrics turns them into the reported figures."""
    prompt_len: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV entries came from the prefix cache
    t_arrival: float = 0.0
    t_first_token: float | None = None
    t_finish: float | None = None
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1, per round
    cache_hits: list[bool] = field(default_factory=list)  # SSD: per round after the first

    def add(self, row: RowRecord) -> None:
        """A round that verified a proposal for this request (its row of the round's record)."""
        self.acceptance_lengths.append(row.accepted_len + 1)
        if row.hit is not None:  # None: not SSD, or the request's first SSD round, which nothing could hit
            self.cache_hits.append(row.hit)


class Sequence:
    """tokenizer: decodes the output as it is committed, for its text and stop strings (a
    sequence without one has no text). arrival: when its request came (perf_counter; now if
    None)."""

    def __init__(self, seq_id: int, prompt_ids: list[int], params: SamplingParams,
                 eos_token_ids: list[int], tokenizer: Tokenizer | None = None, arrival: float | None = None):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.seq_id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.finish_reason: str | None = None
        self.detokenizer = Detokenizer(tokenizer, params.stop) if tokenizer is not None else None
        self.stats = SequenceStats(prompt_len=len(prompt_ids),
                                   t_arrival=time.perf_counter() if arrival is None else arrival)
        grammar = None
        if params.structured_outputs is not None:
            if tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer")
            grammar = GrammarMatcher(params.structured_outputs, grammar_tokenizer(tokenizer, eos_token_ids))
        # None for a request without penalties, bias, min_tokens or a grammar: no processing at all
        self.processor = LogitsProcessor.of(params, self.stop_ids, grammar)
        self.logprobs: list[TokenLogprobs] = []  # one per output token, when params.logprobs is set
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None  # position 0: None

    def prefilled(self, cached_tokens: int, prompt_logprobs: list[TokenLogprobs | None] | None = None) -> None:
        """Records what its prompt's pass found: the prompt tokens whose KV entries came from
        the prefix cache, and the prompt's log-probabilities where they were asked for."""
        self.stats.cached_tokens = cached_tokens
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The output's text so far: whole characters, cut before the first stop string."""
        return self.detokenizer.text if self.detokenizer is not None else ""

    def commit(self, tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> int:
        """Appends tokens up to and including the first that ends the sequence: a stop token
        (kept in token ids, as in vLLM), the token in which a stop string completes, the one
        that completes its grammar, or the max_tokens-th. The rest are dropped, so every
        decoder, whatever it commits per round, keeps what one-token-at-a-time decoding would.
        logprobs: the tokens' entries, kept with them. Returns how many were kept."""
        kept = 0
        for token in tokens:
            if self.finished:
                break
            if self.processor is not None and not self.processor.commit(token):
                raise RuntimeError(f"sequence {self.seq_id}: token {token} breaks its grammar (a bug: "
                                   f"every method samples from the grammar's mask)")
            if logprobs is not None:
                self.logprobs.append(logprobs[kept])
            kept += 1
            self.output_ids.append(token)
            stop_string = self.detokenizer is not None and self.detokenizer.add(token)
            grammar_done = self.processor is not None and self.processor.grammar_finished
            if token in self.stop_ids or stop_string or grammar_done:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        now = time.perf_counter()
        if self.stats.t_first_token is None and kept:
            self.stats.t_first_token = now
        if self.finished:
            self.stats.t_finish = now
            if self.detokenizer is not None:
                self.detokenizer.finish()
        return kept
