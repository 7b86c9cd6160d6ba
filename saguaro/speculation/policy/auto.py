"""method="auto": each round, speculate only as far as it pays, on the cores that pay.

Before every round the controller predicts, at the round's batch size b, the committed tokens
per second of each choice: no speculation (K = 0) or SD with K = 1..K_max draft tokens, both on
all the cores, and, once its draft worker is up, SSD (K_max, with SSD's own fan-out and backup
planning), whose target keeps only the cores the worker does not hold (the rate model is
planning.py's `sd_rate` and `ssd_rate`, which `saguaro plan` and SSD's backup choice use too):

    rate(b, K)   = b * E_K / (t_target(b * (K + 1)) + K * t_step(b))
    rate(b, SSD) = b * (p E_hit + (1 - p) E_miss) / (s * max(t_target(b * (K + 1)), K * t_step(b * F))
                                                     + (1 - p^b) * K * t_step(b))

SD with token trees (saguaro.engine.tree; the configured tree, else `auto_trees`) is a choice
too, for a draft model that is not EAGLE-style:

    rate(b, tree) = b * E_tree / (t_target(b * (N + 1)) + t_tree(b))

with N the tree's nodes, E_tree the tokens its rounds committed per sequence (before they ran:
TREE_GAIN times E at its depth) and t_tree(b) its drafting as measured (before: its depth
times a draft step over b * topk rows).

E_K = 1 + a_1 + a_1 a_2 + ... + a_1...a_K is the expected number of tokens a round commits per
sequence, a_i the measured chance that draft token i is accepted after the ones before it (over
about the last 100 SD rounds, greedy rounds and rounds that sample counted apart);
t_target(n) is the target's pass over n token rows and t_step(b) one draft step over b
sequences, both read off the passes measured so far (interpolated in the number of rows, so a
batch size never seen borrows from its neighbours). For SSD, p is its cache hit rate, E_hit and
E_miss the tokens a round commits after a hit and after a miss (a round where any sequence
missed waits for the backup draft), F the branches the worker pre-drafts per request (the fill hides behind verification
only while it is the shorter), and s how much slower a pass runs on SSD's share of the cores
than on all of them: sqrt(cores / SSD's cores) until SSD has run (a small model's pass scales
sublinearly with threads), then measured.

Where a choice has run at this batch size (sizes above 4 pool by half-octaves) and kind of
round (greedy or sampling), its measured rate over its recent rounds outweighs the prediction
as its rounds add up. The controller
switches only for a predicted gain of HYSTERESIS, and tries an untried choice that the model
rates close to the best, so the table fills where it matters; a measured rate REFRESH_ROUNDS
rounds old is measured again (then after twice as many rounds each time). Either try is made only of a choice whose round costs at most
TRY_COST of the best's. An SSD stint lasts at least
SSD_MIN_ROUNDS rounds: its worker first runs what it has not seen, and a first round cannot hit.

Every round commits tokens distributed exactly as the target alone would (AR rounds trivially,
SD and SSD rounds by verification), so switching between rounds keeps the output exact; greedy
output equals AR's token for token (the target's numerics are batch-invariant).
"""
from __future__ import annotations

import math
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from saguaro.config import TreeShape
from saguaro.engine.round import AR, Choice, Proposer, RoundRecord
from saguaro.engine.sequence import Sequence
from saguaro.speculation.local.proposer import DraftProposer
from saguaro.speculation.policy.estimates import SSD, Estimates, Option, read_profile, write_profile
from saguaro.speculation.policy.planning import sd_rate, ssd_rate
from saguaro.speculation.remote.proposer import RemoteProposer
from saguaro.system import CorePlacement

HYSTERESIS = 0.05  # a switch needs this much more predicted throughput
EXPLORE_WITHIN = 0.85  # an untried choice predicted at least this share of the best is tried once
PRIOR_ROUNDS = 4.0  # the prediction counts as this many rounds of measurement
PRIOR_HIT_RATE = 0.8  # SSD's cache hit rate before one was measured
SSD_MIN_ROUNDS = 8  # the shortest SSD stint
REFRESH_ROUNDS = 64  # a choice not measured for this many rounds at a batch size is measured again ...
REFRESH_WITHIN = 0.5  # ... if its rate is at least this share of the best
TRY_COST = 2.0  # a choice is tried (untried or stale) only if its round costs at most this many of the best's
MIN_VERIFIED_BEFORE_SSD = 32  # draft tokens verified before the acceptance may start a worker
SSD_CHECK_ROUNDS = 16  # rounds between two asks whether a worker on the target's cores would pay
PROFILE_ROUNDS = 256  # rounds between two writes of the profile a later process starts from


def auto_trees(k: int, topk: int | None = None, configured: TreeShape | None = None,
               device: str = "cpu") -> list[TreeShape]:
    """The token trees auto may choose besides chains: the configured one; none where top-k is 1
    (chains only); by default, on an accelerator, two of its own: two branches at each depth
    within K nodes (as wide as the chain: its runners-up instead of its tail) and three at each
    of 3 depths over 5 nodes. Not on a CPU: there each row of the target's pass costs about 12%
    of a step (its dot products are compute-bound past one row), no tree beat the best chain,
    and trying them cost auto 3-15% of its speed (benchmarks/trees.py)."""
    if configured is not None:
        return [configured]
    if topk is not None or k < 2 or device == "cpu":
        return []
    return [TreeShape(k, 2, k), TreeShape(min(k, 3), 3, 5)]


@dataclass
class Controller:
    """How auto chooses each round, K (0: no speculation), a tree or SSD, from its estimates
    (estimates.py) rated by planning.py's rate model: exploration, refreshes and switches."""
    max_k: int
    estimates: Estimates | None = None  # what it chooses from (None: fresh ones)
    ssd_cores_ratio: float | None = None  # all cores / SSD's target cores; None: no SSD worker (yet)
    ssd_branches: int = 1  # branches the worker pre-drafts per request (its fan-out's sum)
    refresh_after: dict[tuple[int, bool, Option], int] = field(default_factory=dict)  # rounds before a refresh (is_stale)
    trees: list[TreeShape] = field(default_factory=list)  # the token trees it may choose besides chains
    current: Option | None = None
    stint: int = 0  # rounds since the last switch
    rounds_by_choice: Counter = field(default_factory=Counter)
    switches: int = 0

    def __post_init__(self):
        if self.estimates is None:
            self.estimates = Estimates(self.max_k)

    def offer_ssd(self, cores_ratio: float | None) -> None:
        """SSD is a choice, its target on 1 / cores_ratio of the cores (None: no worker is up)."""
        self.ssd_cores_ratio = cores_ratio

    def take_ssd(self, cores_ratio: float, branches: int) -> None:
        """SSD's worker is up, and pre-drafts this many branches per request."""
        self.ssd_cores_ratio, self.ssd_branches = cores_ratio, branches

    def predicted_rate(self, batch: int, choice: Option) -> float | None:
        """Committed tokens per second; None where the model lacks a measurement."""
        if isinstance(choice, TreeShape):
            return self._predicted_tree(batch, choice)
        k = self.max_k if choice == SSD else choice
        target = self.estimates.target(batch * (k + 1))
        step = self.estimates.draft_step(batch) if k else 0.0
        if target is None or step is None:
            return None
        if choice != SSD:  # the draft model runs unless prompt lookup proposed for every sequence
            return sd_rate(batch, self.estimates.expected_tokens(k), target,
                           k * step * (1 - self.estimates.looked_up() ** batch))
        return self._predicted_ssd(batch, target, step, self.estimates.ssd_slowdown or math.sqrt(self.ssd_cores_ratio))

    def _predicted_tree(self, batch: int, tree: TreeShape) -> float | None:
        """A tree's round: the target's pass over its nodes, and its drafting as measured (before
        it ran: a draft step over its `topk` nodes per sequence at each depth)."""
        target = self.estimates.target(batch * (tree.num_nodes + 1))
        measured = self.estimates.tree_draft.get(tree)
        draft = measured(batch) if measured is not None and measured.rows else None
        if draft is None and (step := self.estimates.draft_step(batch * tree.topk)) is not None:
            draft = tree.depth * step
        if target is None or draft is None:
            return None
        return sd_rate(batch, self.estimates.tree_expected_tokens(tree), target,
                       draft * (1 - self.estimates.looked_up() ** batch))

    def _predicted_ssd(self, batch: int, target: float, step: float, slowdown: float) -> float:
        k = self.max_k
        cache = self.estimates.ssd_cache
        p = (cache.hits + 4 * PRIOR_HIT_RATE) / (cache.rounds + 4)
        e_hit, e_miss = (tokens if (tokens := cache.tokens_after(hit)) is not None else self.estimates.expected_tokens(k)
                         for hit in (True, False))
        fill = self.estimates.draft_step(batch * self.ssd_branches) * k  # all branches, hidden only while it fits
        return ssd_rate(batch, p, e_hit, e_miss, slowdown * target, slowdown * fill, k * step)

    def ssd_would_pay(self, batch: int, cores_ratio: float) -> bool:
        """Whether SSD, its worker holding 1 - 1 / cores_ratio of the target's cores, is predicted
        to beat every choice without it by HYSTERESIS, once the acceptance and both models' costs
        are measured: what a worker on this machine's own cores must promise before it starts (it
        takes a core from the target while it loads, for seconds). Until SSD has run, its pass is
        taken to slow in proportion to the cores it loses, not by the square root the choice
        itself assumes: a worker started in vain costs the target a core while it loads, so the
        bar to start one is set higher than the bar to choose SSD once it runs."""
        target, step = self.estimates.target(batch * (self.max_k + 1)), self.estimates.draft_step(batch)
        if sum(self.estimates.tried) < MIN_VERIFIED_BEFORE_SSD or target is None or step is None:
            return False
        others = [r for k in range(self.max_k + 1) if (r := self.rate(batch, k)) is not None]
        slowdown = self.estimates.ssd_slowdown or cores_ratio
        return max(others) * (1 + HYSTERESIS) < self._predicted_ssd(batch, target, step, slowdown)

    def rate(self, batch: int, choice: Option) -> float | None:
        """The measured rate at this batch size, shrunk towards the prediction by PRIOR_ROUNDS
        against every round measured: the rate follows the recent rounds (DECAY), but the
        evidence for it is all of them. Weighed against the decayed sum of rounds, which never
        passes 1 / (1 - DECAY) = 20, a prediction kept a sixth of the say for ever, and one biased
        (it leaves out a round's overheads) kept auto on a choice measured a quarter slower."""
        predicted = self.predicted_rate(batch, choice)
        if (measured := self.estimates.measured_rate(batch, choice)) is None:
            return predicted
        observed, rounds = measured
        if predicted is None:
            return observed
        return (rounds * observed + PRIOR_ROUNDS * predicted) / (rounds + PRIOR_ROUNDS)

    def is_stale(self, batch: int, choice: Option) -> bool:
        """Whether the choice's measured rate at this batch size is more than REFRESH_ROUNDS
        rounds old, twice that after each refresh of it: the machine, the text and the
        temperature may have changed since, and a measurement taken in a bad moment would
        otherwise keep auto off a choice for good. The interval doubles because each refresh of
        a choice that stays behind costs a round: every 64 rounds for each of K = 1..5, that is
        a round in 13 spent on choices that lose, for as long as a server runs."""
        key, rounds = self.estimates.rounds_since(batch, choice)
        return rounds > self.refresh_after.get(key, REFRESH_ROUNDS)

    def _refresh(self, batch: int, choice: Option) -> Option:
        """Drops a stale choice's measured rate (its passes' costs stay), so that the round about
        to run measures it anew."""
        key, _ = self.estimates.rounds_since(batch, choice)
        self.estimates.remeasure(batch, choice)
        self.refresh_after[key] = 2 * self.refresh_after.get(key, REFRESH_ROUNDS)
        return choice

    def choices(self) -> list[Option]:
        return list(range(self.max_k + 1)) + self.trees + ([SSD] if self.ssd_cores_ratio else [])

    def choose(self, batch: int, can_try: bool = True) -> Option:
        """AR and the largest K run first, so both costs are measured; then the best rate,
        after one try of any untried choice the model rates close to it. can_try: whether a try
        (of an untried or a stale choice) may run now; not while a batch of several holds
        requests whose prompts the draft has not run, which a try would first prefill: the try
        would then be charged the price of entry of every request in the batch, and cost more
        than it learns (a server at 8 clients that allowed one new request among 8 ran K = 1 in
        most rounds, at 0.8x AR). A lone request may be new: a server's always is while AR runs,
        and auto would never measure SD there again."""
        if self.estimates.target(batch) is None:
            return self.pick(0)
        if not self.estimates.draft_step.rows:
            return self.pick(self.max_k)
        choices = self.choices()
        if self.current == SSD and SSD in choices and self.stint < SSD_MIN_ROUNDS:
            return self.pick(SSD)
        rates = {c: self.rate(batch, c) for c in choices}
        rates = {c: r for c, r in rates.items() if r is not None}
        best = max(rates, key=rates.get)
        # A try costs a round of that choice: at batch 16 a round of K = 5 runs 96 rows, as long
        # as several AR rounds, and a try of each K costs a 96-token batch a good share of its time.
        round_s = {c: batch * self.estimates.round_tokens(c) / r for c, r in rates.items()}
        affordable = [c for c in rates if round_s[c] <= TRY_COST * round_s[best]]
        if not can_try:
            affordable = []
        untried = [c for c in affordable if not self.estimates.was_measured(batch, c) and rates[c] >= EXPLORE_WITHIN * rates[best]]
        if untried:
            return self.pick(max(untried, key=rates.get))
        stale = [c for c in affordable if c != self.current and rates[c] >= REFRESH_WITHIN * rates[best]
                 and self.is_stale(batch, c)]
        if stale:
            return self.pick(self._refresh(batch, max(stale, key=rates.get)))
        if self.current in rates and rates[best] <= rates[self.current] * (1 + HYSTERESIS):
            return self.pick(self.current)
        return self.pick(best)

    def pick(self, choice: Option) -> Option:
        """Takes this choice for the next round (what choose ends with; `saguaro plan` fixes one)."""
        if self.current is not None and choice != self.current:
            self.switches += 1
            self.stint = 0
        self.current = choice
        self.stint += 1
        self.rounds_by_choice[choice] += 1
        return choice

    def reset_stats(self) -> None:
        """Forgets which choices it made (the benchmark tallies each group of runs apart)."""
        self.rounds_by_choice.clear()

    def summary(self) -> dict:
        return {"auto_rounds_by_k": {str(c): n for c, n in self.rounds_by_choice.items()},
                "auto_switches": self.switches, "auto_acceptance": [round(a, 3) for a in self.estimates.acceptance()],
                "auto_ssd_slowdown": self.estimates.ssd_slowdown}


@dataclass
class SSDLauncher:
    """How auto gets SSD: `start` begins its worker's start in the background. A worker on hardware of its own (another device or host) starts at
    once; one on the target's own cores only once the controller predicts that SSD pays
    (`Controller.ssd_would_pay`), and meanwhile the target keeps off its core."""
    start: Callable[[], Future[RemoteProposer]]
    placement: CorePlacement  # the target's cores with SSD and without
    branches: int  # the branches the worker pre-drafts per request (its first fan-out's sum)

    @property
    def on_own_hardware(self) -> bool:
        return self.placement.share.ssd == self.placement.share.all

    def begin(self) -> Future[RemoteProposer]:
        """Starts the worker, the target kept off the cores it takes while it loads."""
        self.placement.for_ssd()
        return self.start()


class AutoPolicy:
    """Chooses each round (see the module docstring): K = 0 (a plain AR round) or SD with the
    draft's K, and, once `ssd`'s worker is up, SSD rounds on the cores its placement leaves the target."""

    def __init__(self, draft: DraftProposer, ssd: SSDLauncher | None = None, profile: Path | None = None,
                 trees: list[TreeShape] = ()):
        self.draft = draft
        k = draft.drafter.k
        self.max_k = max([k] + [t.span for t in trees])  # what the engine reserves KV slots for
        self.estimates = Estimates(k)
        self.controller = Controller(k, self.estimates, trees=list(trees),
                                     ssd_branches=ssd.branches if ssd is not None else 1)
        self.profile = profile  # where the estimates' profile is kept for the next process (see read_profile)
        if profile is not None:
            if (earlier := read_profile(profile)) is not None:
                self.estimates.start_from(earlier)
            weakref.finalize(self, write_profile, self.estimates, profile)
        self._choices = [AR] + [Choice(draft, n, "sd") for n in range(1, k + 1)]
        self._trees = {tree: Choice(draft, tree.depth, "sd", tree) for tree in trees}
        self.launcher, self.ssd_starting = ssd, None
        self.ssd: RemoteProposer | None = None
        self.placement = ssd.placement if ssd is not None else None
        self.worker_loading = False
        self.rounds = 0
        self.fixed: Option | None = None  # the choice of every round while set (fixed_choice)
        if ssd is not None and ssd.on_own_hardware:
            self._start_ssd()

    def proposers(self) -> list[Proposer]:
        return [self.draft] if self.ssd is None else [self.draft, self.ssd]

    def _start_ssd(self) -> None:
        """Starts SSD's worker. While it loads on one of the target's cores, the target keeps off
        that core (SSDLauncher.begin): its threads would each wait for the one sharing it."""
        self.worker_loading = not self.launcher.on_own_hardware
        self.ssd_starting, self.launcher = self.launcher.begin(), None

    def choose(self, seqs: list[Sequence]) -> Choice:
        self._adopt_ssd()
        self.rounds += 1
        self.estimates.for_round(sampling=not all(s.params.greedy for s in seqs))
        if self.profile is not None and self.rounds % PROFILE_ROUNDS == 0:
            write_profile(self.estimates, self.profile)
        if self.launcher is not None and self.rounds % SSD_CHECK_ROUNDS == 1 and \
                self.controller.ssd_would_pay(len(seqs), self.placement.share.ratio):
            self._start_ssd()
        can_try = len(seqs) == 1 or all(self.draft.knows(s) for s in seqs)
        choice = self.controller.choose(len(seqs), can_try=can_try) if self.fixed is None else \
            self.controller.pick(self.fixed)
        if isinstance(choice, TreeShape):
            return self._trees[choice]
        return Choice(self.ssd, self.controller.max_k, "ssd") if choice == SSD else self._choices[choice]

    def observe(self, record: RoundRecord) -> None:
        """Records the round's costs, acceptance and committed tokens in the estimates. The
        draft's first run of new prompts (proposal.start_s) is SD's price of entry: charged to
        the round's rate, not to the draft step."""
        proposal, batch = record.proposal, len(record.seqs)
        if record.choice.name == "ssd":
            if proposal is not None and self.controller.stint > 1:  # a measured SSD round
                self.estimates.record_ssd(batch, record.verify_s, record.propose_s, record.committed)
            return
        if record.choice.tree is not None and proposal is not None:
            self.estimates.record_tree(batch, record.choice.tree, record.verify_s, record.propose_s, record.committed,
                                        proposal.start_s, proposal.steady_rows == batch, record.waited)
            return
        k = record.choice.k if proposal is not None else 0
        looked_up = set(proposal.looked_up) if proposal is not None else set()
        accepted = [o.accepted_len for i, o in enumerate(record.outcomes) if i not in looked_up] if k else []
        self.estimates.record(batch, k, record.verify_s, record.propose_s, accepted, record.committed,
                               proposal.start_s if proposal is not None else 0.0,
                               batch if proposal is None else proposal.steady_rows,
                               [record.outcomes[i].accepted_len for i in sorted(looked_up)], record.waited)

    def _adopt_ssd(self) -> None:
        """Takes SSD's proposer once its worker is up (a worker that failed to start leaves auto
        without SSD, with a warning); SSD is no choice while no worker is up."""
        if self.ssd is not None:
            self.controller.offer_ssd(self.placement.share.ratio if self.ssd.available else None)
        if self.ssd_starting is None or not self.ssd_starting.done():
            return
        starting, self.ssd_starting = self.ssd_starting, None
        if self.worker_loading:
            self.placement.for_all()
            self.worker_loading = False
            self.estimates.forget_costs()
        try:
            self.ssd = starting.result()
        except Exception as e:
            warnings.warn(f"method=auto continues without SSD: its draft worker did not start ({e})", RuntimeWarning)
            return
        self.controller.take_ssd(self.placement.share.ratio, max(1, sum(self.ssd.fan_out)))
        self.estimates.read_hits(self.ssd.stats.cache)

    @contextmanager
    def fixed_choice(self, choice: Option) -> Iterator[None]:
        """Every round makes this choice meanwhile, measured as usual (`saguaro plan` times each)."""
        self.fixed = choice
        try:
            yield
        finally:
            self.fixed = None

    def wait_for_ssd(self, start: bool = False) -> None:
        """Blocks until SSD's worker is up (or failed to start); start: starts it first if auto
        has not (yet) judged it worth a core."""
        if start and self.launcher is not None:
            self._start_ssd()
        if self.ssd_starting is not None:
            try:
                self.ssd_starting.result()
            except Exception:
                pass  # _adopt_ssd warns
            self._adopt_ssd()

    def metrics(self) -> dict:
        return self.controller.summary()

    def close(self) -> None:
        """Stops the SSD worker (or its start) and gives the target all the cores back."""
        if self.ssd_starting is not None and not self.ssd_starting.cancel():
            self._adopt_ssd()
        if self.ssd is not None:
            self.ssd.close()
            self.ssd = None
        if self.placement is not None:
            self.placement.for_all()
        self.draft.close()
