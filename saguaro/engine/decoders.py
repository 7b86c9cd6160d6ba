"""The decoder interface, and the autoregressive (AR) decoder every other one builds on.

Invariant shared by every decoder: a sequence's target KV cache row holds all its tokens but
the last one, which is the input of its next target pass. A decoder works on whichever
sequences it is handed, so a scheduler may add and drop requests between rounds.
"""
from __future__ import annotations

from typing import Protocol

import torch

from saguaro.engine.runner import forward_chunks, last_hidden, prefill_chunks
from saguaro.engine.sampler import WarpParams, sample, uniforms, warp
from saguaro.engine.sequence import Sequence
from saguaro.engine.verify import point_masses, verify, verify_greedy
from saguaro.models.kv_cache import CacheRows, KVCache, ensure_cache
from saguaro.models.llama import LlamaModel
from saguaro.models.prefix_cache import PrefixCache


class Decoder(Protocol):
    """What the engine loop drives: AR here; SD and SSD in saguaro.speculation."""
    num_speculative_tokens: int | None  # draft tokens per round; None without speculation

    @property
    def lookahead(self) -> int:
        """Slots a round may write past a sequence's committed length."""

    def reserve(self, num_rows: int, num_slots: int) -> None:
        """Makes room for num_rows sequences of up to num_slots tokens each."""

    def prefill(self, seqs: list[Sequence]) -> None:
        """Runs the prompts and commits each sequence's first token."""

    def step(self, seqs: list[Sequence]) -> None:
        """One round: commits one or more tokens to each sequence."""

    def release(self, seqs: list[Sequence]) -> None:
        """Frees what finished (or cancelled) sequences held."""

    def metrics(self) -> dict:
        """Engine-wide figures (SSD: cache hit rate, draft worker losses, ...)."""

    def close(self) -> None:
        """Stops what the decoder started (a draft worker)."""


def sample_next(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    if all(s.params.greedy for s in seqs):  # the argmax the one-hot distribution would sample, without building it
        return logits.argmax(-1).tolist()
    params = WarpParams.of([s.params for s in seqs], logits.device)
    probs = warp(logits, params)
    u = uniforms([s.generator for s in seqs], 1)[:, 0].to(logits.device)
    return sample(probs, u).tolist()


class ARDecoder:
    """One target pass per token. SD and SSD verify with verify_and_commit.
    prefix_cache: where prompts' KV entries are kept for later prompts that start the same way."""
    num_speculative_tokens: int | None = None

    def __init__(self, target: LlamaModel, prefix_cache: PrefixCache | None = None):
        self.target = target
        self.prefix_cache = prefix_cache
        self.cache: KVCache | None = None
        self.rows = CacheRows()

    @property
    def lookahead(self) -> int:
        return 1

    def reserve(self, num_rows: int, num_slots: int) -> None:
        self.cache = ensure_cache(self.cache, self.target, num_rows, num_slots)

    def release(self, seqs: list[Sequence]) -> None:
        """Frees the sequences' rows; the prefix cache first keeps their text's blocks (its KV
        entries are all there but the last token's), which the next turn of a chat starts with."""
        if self.prefix_cache is not None:
            for seq in seqs:
                if seq.seq_id in self.rows.of:
                    self.prefix_cache.store(self.cache, self.rows.of[seq.seq_id], seq.token_ids[:-1])
        self.rows.free([s.seq_id for s in seqs])

    def metrics(self) -> dict:
        return self.prefix_cache.summary() if self.prefix_cache is not None else {}

    def close(self) -> None:
        pass

    def keep_hidden(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Receives the target's final hidden states of the tokens it just ran for a sequence
        (also one that just finished): what an EAGLE-style draft reads. Unused here."""

    def prefill(self, seqs: list[Sequence]) -> None:
        self.rows.assign([s.seq_id for s in seqs], self.cache.num_rows)
        chunks = [s.prompt_ids for s in seqs]
        hidden, starts = prefill_chunks(self.target, self.cache, self._rows(seqs), chunks, self.prefix_cache)
        tails = [chunk[start:] for chunk, start in zip(chunks, starts)]
        first = sample_next(self.target.logits(last_hidden(hidden, tails)), seqs)
        for i, (seq, token) in enumerate(zip(seqs, first)):
            seq.stats.cached_tokens = starts[i]
            seq.commit([token])
            self.keep_hidden(seq, hidden[i, :len(tails[i])])

    def step(self, seqs: list[Sequence]) -> None:
        chunks = [[s.token_ids[-1]] for s in seqs]
        hidden = forward_chunks(self.target, self.cache, self._rows(seqs), chunks, [len(s) - 1 for s in seqs])
        for i, (seq, token) in enumerate(zip(seqs, sample_next(self.target.logits(hidden[:, 0]), seqs))):
            seq.commit([token])
            self.keep_hidden(seq, hidden[i, :1])

    def verify_and_commit(self, seqs: list[Sequence], draft_tokens: torch.Tensor,
                          draft_probs: torch.Tensor | None) -> list[tuple[int, int]]:
        """One target pass over [last token, drafts]; commits accepted drafts + bonus and
        returns each sequence's outcome (accepted_len, bonus_token). draft_probs None means
        the drafts are point masses (greedy drafts, cheap backup tokens)."""
        B, K = draft_tokens.shape
        device = self.target.device
        draft_tokens = draft_tokens.to(device)
        drafts = draft_tokens.tolist()
        chunks = [[s.token_ids[-1]] + d for s, d in zip(seqs, drafts)]
        hidden = forward_chunks(self.target, self.cache, self._rows(seqs), chunks, [len(s) - 1 for s in seqs])
        logits = self.target.logits(hidden)
        if all(s.params.greedy for s in seqs):
            outcomes = verify_greedy(drafts, logits.argmax(-1).tolist())
        else:
            params = WarpParams.of([s.params for s in seqs], device).repeat(K + 1)
            if draft_probs is None:
                draft_probs = point_masses(draft_tokens, self.target.config.vocab_size)
            target_probs = warp(logits.flatten(0, 1), params).view(B, K + 1, -1)
            u = uniforms([s.generator for s in seqs], K + 1).to(device)
            accepted_len, bonus = verify(draft_tokens, draft_probs.to(device), target_probs, u[:, :K], u[:, K])
            outcomes = list(zip(accepted_len.tolist(), bonus.tolist()))
        for i, (seq, drafted, (k, bonus_token)) in enumerate(zip(seqs, drafts, outcomes)):
            seq.commit(drafted[:k] + [bonus_token])
            seq.stats.acceptance_lengths.append(k + 1)
            self.keep_hidden(seq, hidden[i, :k + 1])
        return outcomes

    def _rows(self, seqs: list[Sequence]) -> list[int]:
        return self.rows[[s.seq_id for s in seqs]]
