"""What method="auto" measures and estimates from it: the target's and the draft's pass costs,
the acceptance of each draft position, SSD's slowdown and hit rate, trees' yields and each
choice's measured rate; and the profile file a later process starts from. How auto chooses
from these is the controller's (auto.py); what they predict is planning.py's rate model."""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from saguaro.config import TreeShape
from saguaro.engine.round import CacheHits
from saguaro.speculation.policy.planning import EMA, RowCosts, expected_tokens

SSD = "ssd"  # the controller's option of an SSD round
Option = int | str | TreeShape  # K = 0..K_max, SSD, or SD with token trees of a shape

DECAY = 0.95  # per round of a choice: its measured rate follows about its last 1 / (1 - DECAY) rounds
PRIOR_ACCEPTANCE = 0.7  # a_i before any draft token was verified
ACCEPTANCE_DECAY = 0.99  # per SD round: the acceptance follows about the last 100 rounds' drafts
PROFILE_WEIGHT = 32  # verified drafts a position that a restored acceptance counts as, at most
TREE_GAIN = 1.1  # a tree's committed tokens before it ran: the chain's of its depth times this
TREE_PRIOR_ROUNDS = 8.0  # ... counted as this many sequence rounds of measurement


def batch_bucket(batch: int) -> int:
    """Batch sizes whose measured rates are pooled: each one up to 4, then half-octaves (6, 8,
    11, 16, 23, 32, ...), so that a server whose batch drifts between 25 and 32 does not explore
    every size anew."""
    return batch if batch <= 4 else round(2 ** (round(2 * math.log2(batch)) / 2))


@dataclass
class Estimates:
    """What auto has measured, per kind of round (greedy or sampling) where the two differ."""
    max_k: int
    target: RowCosts = field(default_factory=RowCosts)  # target pass on all cores, by token rows
    draft_step: RowCosts = field(default_factory=RowCosts)  # one draft step, by sequences
    # Whether the rounds being chosen and recorded sample (any sequence at T > 0) or are all
    # greedy: acceptance and measured rates are kept apart for the two, which differ widely
    # (SD's acceptance length 2.5 greedy, 1.4-1.6 at T = 0.7 on the default model).
    sampling: bool = False
    # (batch bucket, sampling, choice) -> decayed sums of committed tokens and seconds, and the rounds counted
    measured: dict[tuple[int, bool, Option], list[float]] = field(default_factory=dict)
    ssd_slowdown: float | None = None  # measured: SSD's verification / the same pass on all cores
    ssd_cache: CacheHits = field(default_factory=CacheHits)  # the SSD proposer's count of its cache hits
    bucket_rounds: Counter = field(default_factory=Counter)  # measured rounds per (batch bucket, sampling)
    last_measured: dict[tuple[int, bool, Option], int] = field(default_factory=dict)  # ... at its latest round
    tree_draft: dict[TreeShape, RowCosts] = field(default_factory=dict)  # a tree's drafting, by sequences
    # (sampling, tree) -> decayed sums of the tokens its rounds committed and of their sequence rounds
    tree_tokens: dict[tuple[bool, TreeShape], list[float]] = field(default_factory=dict)
    # committed tokens and seconds of every round measured, by choice, warm-ups too (saguaro plan)
    totals: dict[Option, list[float]] = field(default_factory=dict)

    def __post_init__(self):
        # per kind of round (sampling), per draft position: accepted and verified drafts, decayed
        self.verified = {kind: ([0.0] * self.max_k, [0.0] * self.max_k) for kind in (False, True)}
        # ... the same for the tokens prompt lookup proposed, and its share of the sequence rounds
        self.verified_lookup = {kind: ([0.0] * self.max_k, [0.0] * self.max_k) for kind in (False, True)}
        self.lookup_share = {kind: [0.0, 0.0] for kind in (False, True)}  # looked up, all (decayed)
        self._expected: dict[bool, list[float]] = {}  # per kind: E_0..E_Kmax (expected_tokens)

    @property
    def accepted(self) -> list[float]:
        return self.verified[self.sampling][0]

    @property
    def tried(self) -> list[float]:
        return self.verified[self.sampling][1]

    def for_round(self, sampling: bool) -> None:
        """The kind of the round about to be chosen and recorded: sampling (any sequence at T > 0) or greedy."""
        self.sampling = sampling

    def bucket(self, batch: int) -> tuple[int, bool]:
        """What measured rates are pooled by: the batch's bucket and the kind of round."""
        return batch_bucket(batch), self.sampling

    def acceptance(self, lookup: bool = False) -> list[float]:
        """a_1..a_Kmax of the draft model's tokens (lookup: of prompt lookup's); an unverified
        position takes the one before it (the prior at first)."""
        rates, last = [], PRIOR_ACCEPTANCE
        for accepted, tried in zip(*(self.verified_lookup if lookup else self.verified)[self.sampling]):
            last = (accepted + 2 * last) / (tried + 2) if tried else last  # shrunk towards the one before
            rates.append(last)
        return rates

    def looked_up(self) -> float:
        """The share of sequence rounds whose tokens prompt lookup proposed."""
        looked, total = self.lookup_share[self.sampling]
        return looked / total if total else 0.0

    def expected_tokens(self, k: int) -> float:
        """E_k over the draft model's and prompt lookup's proposals in their shares, from a table
        rebuilt only when a verification changed the acceptance: every round reads it for each
        choice."""
        if self.sampling not in self._expected:
            share, model, lookup = self.looked_up(), self.acceptance(), self.acceptance(lookup=True)
            self._expected[self.sampling] = [(1 - share) * expected_tokens(model, n) + share * expected_tokens(lookup, n)
                                             for n in range(self.max_k + 1)]
        return self._expected[self.sampling][k]

    def tree_expected_tokens(self, tree: TreeShape) -> float:
        """The tokens a sequence's round of this tree commits: measured, shrunk towards the
        chain's of its depth times TREE_GAIN."""
        prior = TREE_GAIN * self.expected_tokens(min(tree.depth, tree.num_nodes, self.max_k))
        tokens, rounds = self.tree_tokens.get((self.sampling, tree), (0.0, 0.0))
        return (tokens + TREE_PRIOR_ROUNDS * prior) / (rounds + TREE_PRIOR_ROUNDS)

    def round_tokens(self, choice: Option) -> float:
        """The tokens a sequence's round of a choice is expected to commit."""
        if isinstance(choice, TreeShape):
            return self.tree_expected_tokens(choice)
        return self.expected_tokens(self.max_k if choice == SSD else choice)

    def was_measured(self, batch: int, choice: Option) -> bool:
        """Whether a round of this choice at this batch size counted (after its warm-up)."""
        return self.measured.get((*self.bucket(batch), choice), (0, 0, 0))[2] > 0

    def record(self, batch: int, k: int, target_s: float, draft_s: float, accepted_lens: list[int],
               committed: int, draft_prefill_s: float = 0.0, steady_rows: int | None = None,
               lookup_lens: list[int] = (), waited: bool = False) -> None:
        """One AR or SD round: its passes' times, the accepted drafts of each sequence the draft
        model drafted for and (lookup_lens) of each prompt lookup proposed for, kept apart
        (lookups are accepted far more often on code; mixed, they would make a deep K look good
        for the model's own tokens), the tokens it committed, and the time the drafter took first
        to run the prompts it had not seen: SD's price of entry for new requests, charged to the
        round's rate and not to the draft step.
        steady_rows: the sequences the draft model drafted one step at a time (None: all), whose
        K steps draft_s then times; none where the draft first ran the tokens of a stretch
        without it (catching up on AR rounds is not what a step costs). Prompt lookup's
        sequences cost no step, so a round where it proposed for some still times the others'.
        waited: the engine's thread waited during the round (RoundRecord.waited): its times count
        for the choice's measured rate, and as what its passes cost only where no cost is known
        at their row count (a machine whose every round waits still gets costs)."""
        if not waited or batch * (k + 1) not in self.target.rows:
            self._add_target_pass(batch * (k + 1), target_s)
        step_rows = batch if steady_rows is None else steady_rows
        if k and steady_rows != 0 and (not waited or step_rows not in self.draft_step.rows):
            self.draft_step.add(step_rows, draft_s / k)
        if k:
            for table, lens in ((self.verified, accepted_lens), (self.verified_lookup, lookup_lens)):
                accepted, tried = table[self.sampling]
                for i in range(self.max_k):  # older rounds fade: the text and the requests change
                    accepted[i] *= ACCEPTANCE_DECAY
                    tried[i] *= ACCEPTANCE_DECAY
                for n in lens:
                    for i in range(min(n + 1, k)):
                        tried[i] += 1
                        accepted[i] += i < n
            share = self.lookup_share[self.sampling]
            share[0] = share[0] * ACCEPTANCE_DECAY + len(lookup_lens)
            share[1] = share[1] * ACCEPTANCE_DECAY + len(lookup_lens) + len(accepted_lens)
            self._expected.pop(self.sampling, None)
        self._measure(batch, k, committed, target_s + draft_s + draft_prefill_s)

    def record_tree(self, batch: int, tree: TreeShape, target_s: float, draft_s: float, committed: int,
                    draft_prefill_s: float = 0.0, steady: bool = True, waited: bool = False) -> None:
        """One round of SD with token trees: its target pass (rows by its nodes), its drafting
        (steady: no sequence first caught up on a stretch without the draft) and the tokens it
        committed; waited as for `record`."""
        if not waited or batch * (tree.num_nodes + 1) not in self.target.rows:
            self._add_target_pass(batch * (tree.num_nodes + 1), target_s)
        drafting = self.tree_draft.setdefault(tree, RowCosts())
        if steady and (not waited or batch not in drafting.rows):
            drafting.add(batch, draft_s)
        sums = self.tree_tokens.setdefault((self.sampling, tree), [0.0, 0.0])
        sums[0] = sums[0] * ACCEPTANCE_DECAY + committed
        sums[1] = sums[1] * ACCEPTANCE_DECAY + batch
        self._measure(batch, tree, committed, target_s + draft_s + draft_prefill_s)

    def _add_target_pass(self, rows: int, seconds: float) -> None:
        """A target pass's cost; one that contradicts the restored profile drops the draft's
        restored costs too, so that auto measures both as a fresh process does (AR, then K_max)."""
        if self.target.add(rows, seconds):
            self.draft_step.drop_restored()

    def record_ssd(self, batch: int, verify_s: float, wait_s: float, committed: int) -> None:
        """One SSD round after the first of its stint: its verification, the target's wait for
        the worker and the tokens it committed (its hits are the SSD proposer's count, ssd_cache)."""
        full = self.target(batch * (self.max_k + 1))
        if full:
            slowdown = verify_s / full
            self.ssd_slowdown = slowdown if self.ssd_slowdown is None else \
                self.ssd_slowdown + EMA * (slowdown - self.ssd_slowdown)
        self._measure(batch, SSD, committed, verify_s + wait_s)

    def profile(self) -> dict:
        """What a later process on this machine may start from: the pass costs and the acceptance."""
        return {"target": [self.target.rows, self.target.seconds],
                "draft_step": [self.draft_step.rows, self.draft_step.seconds],
                "verified": {"sampling" if kind else "greedy": counts for kind, counts in self.verified.items()}}

    def start_from(self, profile: dict) -> None:
        """Takes an earlier process's profile: its costs (each row count still warms up once
        here) and its acceptance, counted as at most PROFILE_WEIGHT verified drafts a position,
        so that this process's own rounds soon outweigh it."""
        for costs, (rows, seconds) in ((self.target, profile["target"]), (self.draft_step, profile["draft_step"])):
            costs.restore(rows, seconds)
        for kind in (False, True):
            accepted, tried = profile["verified"]["sampling" if kind else "greedy"]
            scales = [min(1.0, PROFILE_WEIGHT / t) if t > 0 else 0.0 for t in tried]
            pad = [0.0] * self.max_k
            self.verified[kind] = ([a * c for a, c in zip(accepted, scales)][:self.max_k] + pad)[:self.max_k], \
                                  ([t * c for t, c in zip(tried, scales)][:self.max_k] + pad)[:self.max_k]
        self._expected.clear()

    def forget_costs(self) -> None:
        """Drops the measured pass costs and rates, keeping the acceptance: rounds run while a
        draft worker was loading on one of the target's cores say little about later ones."""
        self.target, self.draft_step, self.measured, self.tree_draft = RowCosts(), RowCosts(), {}, {}

    def _measure(self, batch: int, choice: Option, committed: int, seconds: float) -> None:
        """Adds a round to its choice's rate at this batch size; the first is a warm-up (see RowCosts)."""
        total = self.totals.setdefault(choice, [0.0, 0.0])
        total[0], total[1] = total[0] + committed, total[1] + seconds
        key = (*self.bucket(batch), choice)
        self.bucket_rounds[key[:2]] += 1
        self.last_measured[key] = self.bucket_rounds[key[:2]]
        if key not in self.measured:
            self.measured[key] = [0.0, 0.0, 0.0]
            return
        sums = self.measured[key]
        sums[0], sums[1], sums[2] = sums[0] * DECAY + committed, sums[1] * DECAY + seconds, sums[2] + 1

    def read_hits(self, cache: CacheHits) -> None:
        """SSD's worker is up: its proposer's count of cache hits is the one read from here on."""
        self.ssd_cache = cache

    def measured_rate(self, batch: int, choice: Option) -> tuple[float, float] | None:
        """The choice's measured rate at this batch size and the rounds behind it (None: not measured)."""
        if not self.was_measured(batch, choice):
            return None
        tokens, seconds, rounds = self.measured[(*self.bucket(batch), choice)]
        return tokens / seconds, rounds

    def rounds_since(self, batch: int, choice: Option) -> tuple[tuple[int, bool, Option], int]:
        """The choice's key at this batch size, and the rounds measured there since it last ran."""
        key = (*self.bucket(batch), choice)
        return key, self.bucket_rounds[key[:2]] - self.last_measured.get(key, 0)

    def remeasure(self, batch: int, choice: Option) -> None:
        """Drops the choice's measured rate at this batch size (its passes' costs stay), so that
        the round about to run measures it anew."""
        key = (*self.bucket(batch), choice)
        self.measured[key] = [0.0, 0.0, 0.0]
        self.last_measured[key] = self.bucket_rounds[key[:2]]


def read_profile(path: Path) -> dict | None:
    """The profile an earlier process left (None: none, or one this version cannot read). A
    fresh process otherwise spends its first rounds measuring what the last one knew."""
    try:
        profile = json.loads(path.read_text())
        Estimates(1).start_from(profile)  # the shape is checked on throwaway estimates
        return profile
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_profile(estimates: Estimates, path: Path) -> None:
    """Writes the estimates' profile atomically; a cache that cannot be written only costs
    the next process its first rounds' exploration."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(estimates.profile()))
        os.replace(temporary, path)
    except OSError:
        pass
