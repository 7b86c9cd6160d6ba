"""The target side of speculative speculative decoding (SSD).

Each round the target sends the outcome of its last verification to the draft worker and gets
the next speculation back: at once when the worker had pre-drafted it (a cache hit), after a
backup otherwise. While the target verifies, the worker fills its cache for the next round.
If the worker dies or stops answering, decoding goes on here, autoregressively and exactly,
while a new worker starts in the background; once it is ready it is told the live requests
(their committed tokens) and SSD resumes.
"""
from __future__ import annotations

import statistics
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from saguaro.config import BACKUPS
from saguaro.engine.decoders import ARDecoder
from saguaro.engine.sequence import Sequence
from saguaro.engine.verify import point_masses
from saguaro.models.llama import LlamaModel, scatter_to_vocab
from saguaro.models.prefix_cache import PrefixCache
from saguaro.system import use_cores
from saguaro.speculation.remote.client import DraftClient, replace_worker
from saguaro.speculation.local.drafters import FeatureLog
from saguaro.speculation.policy.planning import GeometricPlan, SpeedModel
from saguaro.speculation.remote.pool import DraftPool
from saguaro.speculation.protocol import DraftUnavailable, SpecRequest, dense_probs

EXPLORE_MISSES = 8  # misses each backup is tried on before auto trusts the speed model


@dataclass
class SSDStats:
    """Per-round measurements over the decoder's life (all sequences)."""
    hit_lengths: list[int] = field(default_factory=list)  # acceptance length after a hit
    miss_lengths: dict[str, list[int]] = field(default_factory=lambda: {"neural": [], "fast": []})
    lookup_lengths: list[int] = field(default_factory=list)  # after a prompt-lookup speculation
    lookup_hits: int = 0  # rounds whose outcome the cache held, but a lookup was sent instead
    verify_s: list[float] = field(default_factory=list)
    fill_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)  # target idle, waiting for the draft
    backup_s: dict[str, list[float]] = field(  # worker time on misses, per round with one
        default_factory=lambda: {"neural": [], "fast": []})
    t_p: list[float] = field(default_factory=list)
    draft_losses: int = 0  # the worker died or stopped answering
    draft_restarts: int = 0  # a new worker took over
    shared_hits: int = 0  # hits on a branch another request drafted (speculation/cache.py)
    drafted_tokens: int = 0  # draft tokens the worker decoded (its tree and neural backups)
    committed_tokens: int = 0  # tokens SSD rounds committed

    def summary(self) -> dict:
        hits = len(self.hit_lengths) + self.lookup_hits
        rounds = len(self.hit_lengths) + sum(len(v) for v in self.miss_lengths.values()) + len(self.lookup_lengths)
        mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
        median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {
            "cache_hits": hits,
            "cache_hit_rate": hits / rounds if rounds else None,
            "lookup_rate": len(self.lookup_lengths) / rounds if rounds else None,
            "acceptance_length_hit": mean(self.hit_lengths),
            "acceptance_length_lookup": mean(self.lookup_lengths),
            "acceptance_length_miss_neural": mean(self.miss_lengths["neural"]),
            "acceptance_length_miss_fast": mean(self.miss_lengths["fast"]),
            "t_p_median": median(self.t_p),
            "verify_s_median": median(self.verify_s),
            "fill_s_median": median(self.fill_s),
            "target_wait_s_total": sum(self.wait_s),
            "target_wait_s_median": median(self.wait_s),
            "draft_losses": self.draft_losses,
            "draft_restarts": self.draft_restarts,
            "shared_branch_hits": self.shared_hits,
            "draft_tokens_per_committed_token":
                self.drafted_tokens / self.committed_tokens if self.committed_tokens else None,
        }


class SSDDecoder(ARDecoder):
    """The target side of SSD: one SpecRequest and one verification per round (see above)."""

    def __init__(self, target: LlamaModel, client: DraftClient | DraftPool, backup: str = "auto",
                 plan: GeometricPlan | None = None, prefix_cache: PrefixCache | None = None):
        super().__init__(target, prefix_cache)
        if backup not in BACKUPS:
            raise ValueError(f"backup must be one of {', '.join(BACKUPS)}")
        self.client, self.backup = client, backup
        self.k = self.num_speculative_tokens = client.config.speculative.num_speculative_tokens
        self.outcomes: dict[int, tuple[int, int] | None] = {}
        self.stats = SSDStats()
        head = client.ready.head_token_ids
        self.draft_head_ids = None if head is None else torch.tensor(head)  # rows of its distributions
        self.draft_lost = False
        self.restart: Future[DraftClient] | None = None  # the worker starting after a loss
        # the target's hidden states not sent yet, for an EAGLE draft
        self.features = FeatureLog() if client.ready.reads_features else None
        self.fan_out = list(client.config.speculative.fan_out)
        self._new_fan_out: list[int] | None = None
        self.plan = plan
        self.cores_before: tuple[set[int], int] | None = None  # given back by close (see client.split_cores)
        self.branch_budget = plan.budget if plan else None
        self._rounds = 0

    def set_fan_out(self, fan_out: list[int]) -> None:
        """Re-plans the branches per accepted length; the worker gets it with the next request."""
        if len(fan_out) != self.k + 1:
            raise ValueError(f"fan_out needs K+1 = {self.k + 1} entries")
        self.fan_out = self._new_fan_out = list(fan_out)

    @property
    def lookahead(self) -> int:
        return self.k + 1

    def keep_hidden(self, seq: Sequence, hidden: torch.Tensor) -> None:
        if self.features is not None:
            self.features.add(seq.seq_id, hidden)

    def metrics(self) -> dict:
        pool = self.client.metrics() if isinstance(self.client, DraftPool) else {}
        return {**self.stats.summary(), **pool, **super().metrics()}

    def prefill(self, seqs: list[Sequence]) -> None:
        super().prefill(seqs)
        for seq in seqs:
            self.outcomes[seq.seq_id] = None
        if not self.draft_lost:
            try:
                self.client.prefill([s.seq_id for s in seqs], [s.token_ids for s in seqs],
                                    [s.params for s in seqs], self.cache.num_slots - 1, self.cache.num_rows,
                                    self._take_features(seqs))
            except DraftUnavailable as e:
                self._lose_draft(e)

    def release(self, seqs: list[Sequence]) -> None:
        super().release(seqs)
        self.forget([s.seq_id for s in seqs])

    def forget(self, seq_ids: list[int]) -> None:
        """The worker forgets these sequences (the target's KV rows stay)."""
        for seq_id in seq_ids:
            self.outcomes.pop(seq_id, None)
            if self.features is not None:
                self.features.drop(seq_id)
        if not self.draft_lost and seq_ids:
            try:
                self.client.release(seq_ids)
            except DraftUnavailable as e:
                self._lose_draft(e)

    def step(self, seqs: list[Sequence]) -> None:
        if self.draft_lost and not self._resume(seqs):
            return super().step(seqs)
        backup = self.choose_backup(len(seqs))
        outcomes = [self.outcomes[s.seq_id] for s in seqs]
        asked = time.perf_counter()
        try:
            spec = self.client.speculate(SpecRequest([s.seq_id for s in seqs], outcomes, backup, self._new_fan_out,
                                                     self._take_features(seqs)))
            self._new_fan_out = None
        except DraftUnavailable as e:
            self._lose_draft(e)
            return super().step(seqs)
        received = time.perf_counter()
        tokens = torch.tensor(spec.tokens)
        probs = None
        if any(p is not None for p in spec.probs):
            masses = point_masses(tokens, self.target.config.vocab_size)
            probs = torch.stack([m if p is None else self._to_vocab(dense_probs(p))
                                 for m, p in zip(masses, spec.probs)])
        new_outcomes = self.verify_and_commit(seqs, tokens, probs)
        verified = time.perf_counter()
        self._record(seqs, outcomes, spec, new_outcomes, backup, received - asked, verified - received)
        for seq, outcome in zip(seqs, new_outcomes):
            self.outcomes[seq.seq_id] = outcome
        self._rounds += 1
        if self.plan is not None and self._rounds % self.plan.every_rounds == 0:
            if self.stats.t_p:
                self.branch_budget = self.plan.next_budget(
                    self.branch_budget, statistics.median(self.stats.t_p[-self.plan.every_rounds:]))
            lengths = self.stats.hit_lengths + sum(self.stats.miss_lengths.values(), [])
            fan_out = self.plan.fan_out(lengths[-256:], self.k, self.branch_budget) if lengths else self.fan_out
            if fan_out != self.fan_out:
                self.set_fan_out(fan_out)

    def _take_features(self, seqs: list[Sequence]) -> list[torch.Tensor | None] | None:
        """The hidden states an EAGLE draft has not seen yet: the prompt's, then each round's."""
        if self.features is None:
            return None
        return [self.features.take(s.seq_id) for s in seqs]

    def _to_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """A draft distribution over its head rows -> over the vocabulary (zero elsewhere)."""
        if self.draft_head_ids is None:
            return probs
        return scatter_to_vocab(probs, self.draft_head_ids, self.target.config.vocab_size)

    def _record(self, seqs, previous, spec, outcomes, backup, wait_s, verify_s) -> None:
        stats = self.stats
        if stats.verify_s and spec.fill_time_s > 0:
            stats.fill_s.append(spec.fill_time_s)
            stats.t_p.append(spec.fill_time_s / stats.verify_s[-1])
        stats.verify_s.append(verify_s)
        stats.wait_s.append(wait_s)
        stats.shared_hits += sum(spec.shared or [])
        stats.drafted_tokens += spec.drafted_tokens
        stats.committed_tokens += sum(accepted_len + 1 for accepted_len, _ in outcomes)
        lookups = spec.lookups or [False] * len(seqs)
        if any(not hit and not looked for hit, looked in zip(spec.hits, lookups)):
            stats.backup_s[backup].append(spec.backup_time_s)  # a lookup needs no backup
        for seq, before, hit, looked, (accepted_len, _) in zip(seqs, previous, spec.hits, lookups, outcomes):
            if before is None:
                continue  # a request's first round cannot hit
            seq.stats.cache_hits.append(hit)
            if looked:
                stats.lookup_lengths.append(accepted_len + 1)
                stats.lookup_hits += hit
            else:
                (stats.hit_lengths if hit else stats.miss_lengths[backup]).append(accepted_len + 1)

    def speed_model(self) -> SpeedModel:
        """The measured quantities of Theorem 7, with prior guesses where nothing was measured
        yet (the paper found neural backup best at batch 1, fast from batch 2)."""
        s = self.stats
        hits, misses = len(s.hit_lengths), sum(len(v) for v in s.miss_lengths.values())
        verify = statistics.median(s.verify_s) if s.verify_s else 1.0
        mean = lambda xs, default: statistics.fmean(xs) if xs else default  # noqa: E731
        e_hit = mean(s.hit_lengths, self.k / 2 + 1)
        return SpeedModel(
            p_hit=hits / (hits + misses) if hits + misses >= 10 else 0.8,
            e_hit=e_hit,
            e_neural=mean(s.miss_lengths["neural"], e_hit),
            e_fast=mean(s.miss_lengths["fast"], 1.0),
            t_p=statistics.median(s.t_p) if s.t_p else 0.8,
            t_neural=statistics.median(s.backup_s["neural"]) / verify if s.backup_s["neural"] else 0.8,
            t_fast=statistics.median(s.backup_s["fast"]) / verify if s.backup_s["fast"] else 0.0,
        )

    def choose_backup(self, batch_size: int) -> str:
        """The forced backup, else the one the speed model favours at this batch size, once
        both have been tried on EXPLORE_MISSES misses: until then the priors decide, and a
        backup the priors disfavour would never be measured."""
        if self.backup != "auto":
            return self.backup
        tried = {kind: len(lengths) for kind, lengths in self.stats.miss_lengths.items()}
        if min(tried.values()) < EXPLORE_MISSES:
            return min(tried, key=tried.get)
        return "neural" if batch_size < self.speed_model().critical_batch_size() else "fast"

    def _lose_draft(self, error: Exception) -> None:
        """Decodes without the draft from here; a new worker is started, except for an EAGLE
        draft, which would need the target's hidden states of every committed token again."""
        warnings.warn(f"draft worker lost ({error}); continuing with autoregressive decoding", RuntimeWarning)
        self.draft_lost = True
        self.stats.draft_losses += 1
        self.client.abandon()
        if self.features is None:
            self.restart = replace_worker(self.client, self.fan_out)
        self.features = None

    def _resume(self, seqs: list[Sequence]) -> bool:
        """Hands a restarted worker the live requests, each from its committed tokens (its
        cache starts empty, so their next round is a first one). True once it has them."""
        if self.restart is None or not self.restart.done():
            return False
        self.client, self.restart = self.restart.result(), None
        self.draft_lost = False
        self.stats.draft_restarts += 1
        return self.hand_over(seqs)

    def hand_over(self, seqs: list[Sequence]) -> bool:
        """The worker gets these sequences from their committed tokens (so their next round
        cannot hit). False if it is lost meanwhile."""
        for seq in seqs:
            self.outcomes[seq.seq_id] = None
        try:
            self.client.prefill([s.seq_id for s in seqs], [s.token_ids for s in seqs], [s.params for s in seqs],
                                self.cache.num_slots - 1, self.cache.num_rows)
        except DraftUnavailable as e:
            self._lose_draft(e)
            return False
        return True

    def close(self) -> None:
        """Stops the draft worker (also done at exit) and gives back the core it had."""
        if self.restart is not None and not self.restart.cancel():
            self.restart.result().close()
        self.client.close()
        if self.cores_before is not None:
            use_cores(*self.cores_before)
            self.cores_before = None
