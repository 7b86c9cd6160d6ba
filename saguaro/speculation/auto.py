"""method="auto": each round, speculate only as far as it pays.

Before every round the controller predicts, at the round's batch size b, the committed tokens
per second of each choice, no speculation (K = 0) or SD with K = 1..K_max draft tokens:

    rate(b, K) = b * E_K / (t_target(b * (K + 1)) + K * t_step(b) + t_catch_up)

E_K = 1 + a_1 + a_1 a_2 + ... + a_1...a_K is the expected number of tokens a round commits per
sequence, a_i the measured chance that draft token i is accepted after the ones before it;
t_target(n) is the target's pass over n token rows and t_step(b) one draft step over b
sequences, both read off the passes measured so far (interpolated in the number of rows, so a
batch size never seen borrows from its neighbours). Where a choice has run at this batch size,
its measured rate (over its recent rounds) outweighs the prediction as its rounds add up. The controller
switches only for a predicted gain of HYSTERESIS, and tries an untried choice that the model
rates close to the best, so the table fills where it matters.

Every round commits tokens distributed exactly as the target alone would (AR rounds trivially,
SD rounds by verification), so switching between rounds keeps the output exact; greedy output
equals AR's token for token (the target's numerics are batch-invariant).
"""
from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

from saguaro.engine.decoders import ARDecoder
from saguaro.engine.sequence import Sequence
from saguaro.models.llama import LlamaModel
from saguaro.speculation.drafters import Drafter
from saguaro.speculation.sd import SDDecoder

HYSTERESIS = 0.05  # a switch needs this much more predicted throughput
EXPLORE_WITHIN = 0.85  # an untried choice predicted at least this share of the best is tried once
EMA = 0.2  # weight of a new measurement of a pass's cost
DECAY = 0.95  # per round of a choice: its measured rate follows about its last 1 / (1 - DECAY) rounds
PRIOR_ROUNDS = 4.0  # the prediction counts as this many rounds of measurement
PRIOR_ACCEPTANCE = 0.7  # a_i before any draft token was verified


class RowCosts:
    """Seconds per pass as a function of the rows it runs: running means per row count,
    interpolated linearly between them, flat below the smallest and proportional above the
    largest (a pass never costs less than a smaller one)."""

    def __init__(self):
        self.rows: list[int] = []
        self.seconds: list[float] = []

    def add(self, rows: int, seconds: float) -> None:
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            self.seconds[i] += EMA * (seconds - self.seconds[i])
        else:
            self.rows.insert(i, rows)
            self.seconds.insert(i, seconds)

    def __call__(self, rows: int) -> float | None:
        if not self.rows:
            return None
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.rows):
            return self.seconds[-1] * rows / self.rows[-1]
        (r0, r1), (s0, s1) = self.rows[i - 1:i + 1], self.seconds[i - 1:i + 1]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)


@dataclass
class Controller:
    """The cost model and the choice of K per round (0: no speculation)."""
    max_k: int
    target: RowCosts = field(default_factory=RowCosts)  # target pass, by token rows
    draft_step: RowCosts = field(default_factory=RowCosts)  # one draft step, by sequences
    accepted: list[int] = field(default_factory=list)  # per draft position: accepted ...
    tried: list[int] = field(default_factory=list)  # ... out of verified
    # (batch, K) -> decayed sums of committed tokens, seconds and rounds
    measured: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    current: int | None = None
    rounds_by_k: Counter = field(default_factory=Counter)
    switches: int = 0

    def __post_init__(self):
        self.accepted = [0] * self.max_k
        self.tried = [0] * self.max_k

    def acceptance(self) -> list[float]:
        """a_1..a_Kmax; an unverified position takes the one before it (the prior at first)."""
        rates, last = [], PRIOR_ACCEPTANCE
        for accepted, tried in zip(self.accepted, self.tried):
            last = (accepted + 2 * last) / (tried + 2) if tried else last  # shrunk towards the one before
            rates.append(last)
        return rates

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance()[:k]:
            run *= a
            total += run
        return total

    def predicted_rate(self, batch: int, k: int) -> float | None:
        """Committed tokens per second; None where the model lacks a measurement."""
        target = self.target(batch * (k + 1))
        step = self.draft_step(batch) if k else 0.0
        if target is None or step is None:
            return None
        return batch * self.expected_tokens(k) / (target + k * step)

    def rate(self, batch: int, k: int) -> float | None:
        """The measured rate at this batch size, shrunk towards the prediction by PRIOR_ROUNDS."""
        predicted = self.predicted_rate(batch, k)
        if (batch, k) not in self.measured:
            return predicted
        tokens, seconds, rounds = self.measured[(batch, k)]
        observed = tokens / seconds
        return observed if predicted is None else (rounds * observed + PRIOR_ROUNDS * predicted) / (rounds + PRIOR_ROUNDS)

    def choose(self, batch: int) -> int:
        """AR and the largest K run first, so both costs are measured; then the best rate,
        after one try of any untried K the model rates close to it."""
        if self.target(batch) is None:
            return self._pick(0)
        if not self.draft_step.rows:
            return self._pick(self.max_k)
        rates = {k: self.rate(batch, k) for k in range(self.max_k + 1)}
        rates = {k: r for k, r in rates.items() if r is not None}
        best = max(rates, key=rates.get)
        untried = [k for k in rates if (batch, k) not in self.measured and rates[k] >= EXPLORE_WITHIN * rates[best]]
        if untried:
            return self._pick(max(untried, key=rates.get))
        if self.current in rates and rates[best] <= rates[self.current] * (1 + HYSTERESIS):
            return self._pick(self.current)
        return self._pick(best)

    def _pick(self, k: int) -> int:
        if self.current is not None and k != self.current:
            self.switches += 1
        self.current = k
        self.rounds_by_k[k] += 1
        return k

    def record(self, batch: int, k: int, target_s: float, draft_s: float, accepted_lens: list[int],
               committed: int) -> None:
        """One round: its passes' times, each sequence's accepted drafts, the tokens it committed."""
        self.target.add(batch * (k + 1), target_s)
        if k:
            self.draft_step.add(batch, draft_s / k)
            for n in accepted_lens:
                for i in range(min(n + 1, k)):
                    self.tried[i] += 1
                    self.accepted[i] += i < n
        sums = self.measured.setdefault((batch, k), [0.0, 0.0, 0.0])
        for i, value in enumerate((committed, target_s + draft_s, 1.0)):
            sums[i] = sums[i] * DECAY + value

    def summary(self) -> dict:
        return {"auto_rounds_by_k": dict(sorted(self.rounds_by_k.items())), "auto_switches": self.switches,
                "auto_acceptance": [round(a, 3) for a in self.acceptance()]}


class AutoDecoder(SDDecoder):
    """SD whose K the Controller picks each round, K = 0 being a plain AR round."""

    def __init__(self, target: LlamaModel, drafter: Drafter):
        super().__init__(target, drafter)
        self.controller = Controller(drafter.k)

    def step(self, seqs: list[Sequence]) -> None:
        k = self.controller.choose(len(seqs))
        before = sum(len(s) for s in seqs)
        started = time.perf_counter()
        if k == 0:
            ARDecoder.step(self, seqs)
            drafted, outcomes = started, []
        else:
            self.drafter.set_num_tokens(k)
            proposal = self.drafter.propose(seqs)
            drafted = time.perf_counter()
            outcomes = self.verify_proposal(seqs, proposal)
        verified = time.perf_counter()
        self.controller.record(len(seqs), k, verified - drafted, drafted - started,
                               [accepted_len for accepted_len, _ in outcomes], sum(len(s) for s in seqs) - before)

    def metrics(self) -> dict:
        return self.controller.summary()
