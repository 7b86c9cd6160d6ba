"""SSD's proposer on the engine's side: one SpecRequest per round to the draft worker(s).

Each round the target sends the outcome of its last verification to the worker and gets the
next speculation back: at once when the worker had pre-drafted it (a cache hit), after a backup
otherwise. While the target verifies, the worker fills its cache for the next round. Losing,
replacing and handing over a worker is the pool's (remote/pool.py); while no worker is up the
proposer proposes nothing and the round runs without speculation.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from saguaro.config import Backup, checked_fan_out
from saguaro.config import TreeShape
from saguaro.engine.proposal import Outcome, Proposal
from saguaro.engine.round import CacheHits, RoundRecord, RowRecord
from saguaro.engine.sequence import Sequence
from saguaro.engine.rejection import point_masses
from saguaro.models.llama import scatter_to_vocab
from saguaro.speculation.local.drafters import FeatureLog
from saguaro.speculation.policy.planning import GeometricPlan, SpeedModel, critical_batch_size
from saguaro.speculation.protocol import Speculation, dense_probs
from saguaro.speculation.remote.pool import DraftPool
from saguaro.system import CorePlacement

MISS_CAUSES = ("bonus", "length", "unfilled", "lost")  # RequestSpeculation.miss
EXPLORE_MISSES = 8  # misses each backup is tried on before auto trusts the speed model
# measurements the speed model reads, the latest of each kind: choosing a backup then costs the
# same in a server's millionth round as in its first (over all of them, its medians had come to
# 0.2 ms of a 7 ms round within a few hundred), and follows the text as it changes
RECENT = 256


@dataclass
class SSDStats:
    """Per-round measurements over the decoder's life (all sequences), read off each round's record."""
    cache: CacheHits = field(default_factory=CacheHits)  # the one count of SSD's cache hits
    hit_lengths: list[int] = field(default_factory=list)  # acceptance length after a hit
    # acceptance lengths after a hit or a miss, in order: the latest, which the fan-out is fitted to
    recent_lengths: deque[int] = field(default_factory=lambda: deque(maxlen=RECENT))
    miss_lengths: dict[str, list[int]] = field(default_factory=lambda: {"neural": [], "fast": []})
    lookup_lengths: list[int] = field(default_factory=list)  # after a prompt-lookup speculation
    verify_s: list[float] = field(default_factory=list)
    fill_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)  # target idle, waiting for the draft
    backup_s: dict[str, list[float]] = field(  # worker time on misses, per round with one
        default_factory=lambda: {"neural": [], "fast": []})
    t_p: list[float] = field(default_factory=list)
    answer_s: list[float] = field(default_factory=list)  # the worker's time from an outcome to its reply
    # the rest of the target's wait in rounds whose fill fitted the verification: messages both ways
    exchange_s: list[float] = field(default_factory=list)
    shared_hits: int = 0  # hits on a branch another request drafted (worker/cache.py)
    miss_causes: Counter = field(default_factory=Counter)  # misses by RequestSpeculation.miss
    drafted_tokens: int = 0  # draft tokens the worker decoded (its tree and neural backups)
    committed_tokens: int = 0  # tokens SSD rounds committed

    def add_round(self, previous: list[Outcome | None], spec: Speculation, rows: list[RowRecord], backup: Backup,
                  wait_s: float, verify_s: float) -> None:
        """One SSD round's figures: the worker's speculation, the rows' record, the backup it
        used, the target's wait for the draft and its verification time. previous: each
        request's outcome before this round (None: its first, which cannot hit)."""
        if self.verify_s and spec.fill_time_s > 0:
            self.fill_s.append(spec.fill_time_s)
            self.t_p.append(spec.fill_time_s / self.verify_s[-1])
            if spec.fill_time_s <= self.verify_s[-1]:  # the worker was waiting when the outcome came
                self.exchange_s.append(max(0.0, wait_s - spec.backup_time_s))
        self.answer_s.append(spec.backup_time_s)
        self.verify_s.append(verify_s)
        self.wait_s.append(wait_s)
        self.shared_hits += sum(r.shared for r in spec.requests)
        self.drafted_tokens += spec.drafted_tokens
        self.committed_tokens += sum(row.accepted_len + 1 for row in rows)
        if any(not r.hit and not r.lookup for r in spec.requests):
            self.backup_s[backup].append(spec.backup_time_s)  # a lookup needs no backup
        for before, request, row in zip(previous, spec.requests, rows):
            if before is None or row.hit is None:
                continue  # a request's first round cannot hit
            self.cache.add(row)
            if row.looked_up:
                self.lookup_lengths.append(row.accepted_len + 1)
            else:
                (self.hit_lengths if row.hit else self.miss_lengths[backup]).append(row.accepted_len + 1)
                self.recent_lengths.append(row.accepted_len + 1)
                if not row.hit:
                    self.miss_causes[request.miss] += 1

    def summary(self) -> dict:
        cache = self.cache
        mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
        median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {
            "cache_hits": cache.hits,
            "cache_hit_rate": cache.rate,
            "lookup_rate": cache.lookup_rounds / cache.rounds if cache.rounds else None,
            "acceptance_length_hit": mean(self.hit_lengths),
            "acceptance_length_lookup": mean(self.lookup_lengths),
            "acceptance_length_miss_neural": mean(self.miss_lengths["neural"]),
            "acceptance_length_miss_fast": mean(self.miss_lengths["fast"]),
            "t_p_median": median(self.t_p),
            "verify_s_median": median(self.verify_s),
            "fill_s_median": median(self.fill_s),
            "target_wait_s_total": sum(self.wait_s),
            "target_wait_s_median": median(self.wait_s),
            "worker_answer_s_median": median(self.answer_s),
            "exchange_s_median": median(self.exchange_s),
            "shared_branch_hits": self.shared_hits,
            # where misses come from (a shared hit saves some): the accepted length predicted but
            # not the bonus token, the accepted length not predicted, no branches at all, or no
            # worker's answer (it was lost and the round ran on an n-gram guess)
            **{f"misses_{cause}": self.miss_causes[cause] for cause in MISS_CAUSES},
            "draft_tokens_per_committed_token":
                self.drafted_tokens / self.committed_tokens if self.committed_tokens else None,
        }


class RemoteProposer:
    """SSD's proposals, from the draft workers of `pool`. placement: where the target runs
    while SSD does, and after (None: the worker has its own device or host, and the target
    every core). plan: re-fits a geometric fan-out as it runs."""
    reads_target_features = False

    def __init__(self, pool: DraftPool, backup: Backup = Backup.AUTO, plan: GeometricPlan | None = None,
                 vocab_size: int | None = None, placement: CorePlacement | None = None):
        self.pool, self.backup = pool, Backup(backup)
        self.k = pool.k
        self.outcomes: dict[int, Outcome | None] = {}  # the sequences the workers know, and their last outcome
        self.stats = SSDStats()
        head = pool.ready.head_token_ids
        self.draft_head_ids = None if head is None else torch.tensor(head)  # rows of its distributions
        self.vocab_size = vocab_size or pool.ready.vocab_size
        # the target's hidden states not sent yet, for an EAGLE draft
        self.features = FeatureLog() if pool.ready.reads_features else None
        self.reads_target_features = self.features is not None
        self.fan_out = list(pool.fan_out)
        self._new_fan_out: list[int] | None = None
        self.plan = plan
        self.branch_budget = plan.budget if plan else None
        self.placement = placement
        self._sent: tuple[Speculation, Backup, list[Outcome | None], float] | None = None  # the round in flight
        self._rounds = 0

    @property
    def available(self) -> bool:
        """Whether a worker is up to propose (a replacement that is ready is taken up first)."""
        return self.pool.live

    def set_fan_out(self, fan_out: list[int]) -> None:
        """Re-plans the branches per accepted length; the workers get it with the next request."""
        self.fan_out = self._new_fan_out = checked_fan_out(fan_out, self.k)

    def reserve(self, num_rows: int, num_slots: int) -> None:
        self.pool.reserve(num_slots - 1, num_rows)

    def keep_hidden(self, seqs: list[Sequence], hidden: list[torch.Tensor]) -> None:
        if self.features is not None:
            for seq, h in zip(seqs, hidden):
                self.features.add(seq.seq_id, h)

    def reset_stats(self) -> None:
        """Counts SSD's figures afresh (a benchmark's, per group of requests); its backup choice and
        fan-out plan start again from the priors. Not for auto's SSD: its controller reads the hits."""
        self.stats = SSDStats()

    def metrics(self) -> dict:
        """SSD's summary, its cache hits under vLLM's names, and the pool's worker losses."""
        return {**self.stats.cache.summary(), **self.stats.summary(), **self.pool.metrics()}

    def propose(self, seqs: list[Sequence], k: int, tree: TreeShape | None = None) -> Proposal | None:
        """The workers' speculation; sequences they do not know are handed to them first, from
        their committed tokens (so their first round cannot hit). None while no worker is up.
        The workers speculate chains (tree must be None)."""
        if tree is not None:
            raise ValueError("SSD's workers speculate chains, not token trees")
        if not self.available:
            if self.features is not None and self.pool.gone:
                self.features = None  # no worker will read them again
            return None
        if self.placement is not None:
            self.placement.for_ssd()  # a caller may have moved this process since the last round
        started = time.perf_counter()
        if new := [s for s in seqs if s.seq_id not in self.outcomes]:
            for seq in new:
                self.outcomes[seq.seq_id] = None
            self.pool.prefill(new, self._take_features(new))
        asked = time.perf_counter()
        backup = self.choose_backup(len(seqs))
        outcomes = [self.outcomes[s.seq_id] for s in seqs]
        spec = self.pool.speculate(seqs, outcomes, backup, self._new_fan_out, self._take_features(seqs))
        self._new_fan_out = None
        received = time.perf_counter()
        self._sent = (spec, backup, outcomes, received - asked)
        tokens = torch.tensor([r.tokens for r in spec.requests])
        probs = None
        if any(r.probs is not None for r in spec.requests):
            masses = point_masses(tokens, self.vocab_size)
            probs = torch.stack([m if r.probs is None else self._to_vocab(dense_probs(r.probs))
                                 for m, r in zip(masses, spec.requests)])
        return Proposal(tokens, probs, looked_up=[i for i, r in enumerate(spec.requests) if r.lookup],
                        hits=[r.hit for r in spec.requests], start_s=asked - started)

    def observe(self, record: RoundRecord) -> None:
        spec, backup, previous, wait_s = self._sent
        self._sent = None
        self.stats.add_round(previous, spec, record.rows, backup, wait_s, record.verify_s)
        for seq, outcome in zip(record.seqs, record.outcomes):
            self.outcomes[seq.seq_id] = outcome
        self._rounds += 1
        if self.plan is not None and self._rounds % self.plan.every_rounds == 0:
            self._replan()

    def _replan(self) -> None:
        if self.stats.t_p:
            self.branch_budget = self.plan.next_budget(
                self.branch_budget, statistics.median(self.stats.t_p[-self.plan.every_rounds:]))
        lengths = list(self.stats.recent_lengths)
        fan_out = self.plan.fan_out(lengths, self.k, self.branch_budget) if lengths else self.fan_out
        if fan_out != self.fan_out:
            self.set_fan_out(fan_out)

    def pause(self) -> None:
        """The workers forget their sequences (stale from here: they hear only the outcomes of
        SSD rounds) and the target gets back the cores SSD left it."""
        self.forget(list(self.outcomes))
        if self.placement is not None:
            self.placement.for_all()

    def release(self, seq_ids: list[int]) -> None:
        self.forget(seq_ids)
        if self.features is not None:
            for seq_id in seq_ids:
                self.features.drop(seq_id)

    def forget(self, seq_ids: list[int]) -> None:
        """The workers forget these sequences (the target's KV rows stay)."""
        known = [sid for sid in seq_ids if sid in self.outcomes]
        for sid in known:
            del self.outcomes[sid]
        if known:
            self.pool.release(known)

    def _take_features(self, seqs: list[Sequence]) -> list[torch.Tensor | None] | None:
        """The hidden states an EAGLE draft has not seen yet: the prompt's, then each round's."""
        if self.features is None:
            return None
        return [self.features.take(s.seq_id) for s in seqs]

    def _to_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """A draft distribution over its head rows -> over the vocabulary (zero elsewhere)."""
        if self.draft_head_ids is None:
            return probs
        return scatter_to_vocab(probs, self.draft_head_ids, self.vocab_size)

    def speed_model(self) -> SpeedModel:
        """The measured quantities of Theorem 7, with prior guesses where nothing was measured
        yet (the paper found neural backup best at batch 1, fast from batch 2), from the
        RECENT latest of each measurement."""
        s = self.stats
        hits, misses = s.cache.drafted
        mean = lambda xs, default: statistics.fmean(xs[-RECENT:]) if xs else default  # noqa: E731
        median = lambda xs, default: statistics.median(xs[-RECENT:]) if xs else default  # noqa: E731
        verify = median(s.verify_s, 1.0)
        e_hit = mean(s.hit_lengths, self.k / 2 + 1)
        return SpeedModel(
            p_hit=hits / (hits + misses) if hits + misses >= 10 else 0.8,
            e_hit=e_hit,
            e_neural=mean(s.miss_lengths["neural"], e_hit),
            e_fast=mean(s.miss_lengths["fast"], 1.0),
            t_p=median(s.t_p, 0.8),
            t_neural=median(s.backup_s["neural"], 0.8 * verify) / verify,
            t_fast=median(s.backup_s["fast"], 0.0) / verify,
        )

    def choose_backup(self, batch_size: int) -> Backup:
        """The forced backup, else the one the speed model favours at this batch size, once
        both have been tried on EXPLORE_MISSES misses: until then the priors decide, and a
        backup the priors disfavour would never be measured."""
        if self.backup != Backup.AUTO:
            return self.backup
        tried = {kind: len(lengths) for kind, lengths in self.stats.miss_lengths.items()}
        if min(tried.values()) < EXPLORE_MISSES:
            return Backup(min(tried, key=tried.get))
        b_star = critical_batch_size(self.speed_model().fast_wins)
        return Backup.FAST if b_star is not None and batch_size >= b_star else Backup.NEURAL

    def close(self) -> None:
        """Stops the draft workers (also done at exit) and gives back the cores they had."""
        self.pool.close()
        if self.placement is not None:
            self.placement.for_all()
