"""How many bonus-token candidates to cache per accepted length, and which backup to use.

The formulas are the paper's (docs/DESIGN.md, "The theory the planner uses"): cache misses fall as a power law in
fan-out, 1 - p_hit(F) = F^-r; under a branch budget the optimal fan-out is capped geometric;
in a batch one miss stalls everyone, which decides between the neural and the fast backup.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


def outcome_probs(a: float, k: int) -> list[float]:
    """P(accepted_len = j) for j = 0..k when each draft token is accepted with probability a."""
    return [a ** j * (1 - a) for j in range(k)] + [a ** k]


def geometric_fan_out(budget: int, k: int, a: float, r: float) -> list[int]:
    """Capped geometric fan-out (Theorem 12): F_j proportional to P(j)^(1/(1+r)), scaled so the
    branches sum to about `budget`, rounded to integers >= 0 (largest remainders first)."""
    a = min(max(a, 1e-3), 1 - 1e-3)
    weights = [p ** (1 / (1 + r)) for p in outcome_probs(a, k)]
    scale = budget / sum(weights)
    raw = [w * scale for w in weights]
    fan_out = [int(math.floor(x)) for x in raw]
    by_remainder = sorted(range(k + 1), key=lambda j: raw[j] - fan_out[j], reverse=True)
    for j in by_remainder[: budget - sum(fan_out)]:
        fan_out[j] += 1
    return fan_out


def uniform_fan_out(budget: int, k: int) -> list[int]:
    base, extra = divmod(budget, k + 1)
    return [base + (1 if j < extra else 0) for j in range(k + 1)]


def acceptance_rate(mean_acceptance_length: float, k: int) -> float:
    """Per-token acceptance a with (1 - a^(k+1)) / (1 - a) = mean acceptance length."""
    target = min(max(mean_acceptance_length, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit_power_law(fan_outs: list[float], miss_rates: list[float]) -> float:
    """Least-squares r in log(miss) = -r log(F), over the points with 0 < miss < 1."""
    points = [(math.log(f), math.log(m)) for f, m in zip(fan_outs, miss_rates) if f >= 1 and 0 < m < 1]
    if not points:
        return 1.0
    den = sum(x * x for x, _ in points)
    return -sum(x * y for x, y in points) / den if den > 0 else 1.0


@dataclass
class SpeedModel:
    """Measured quantities, in units of one verification (Theorem 7 and Corollary 16)."""
    p_hit: float  # per-sequence cache hit rate
    e_hit: float  # acceptance length after a hit
    e_neural: float  # acceptance length after a neural-backup miss
    e_fast: float  # acceptance length after a fast-backup miss
    t_p: float  # cache fill time / verification time
    t_neural: float  # neural backup time / verification time
    t_fast: float = 0.0

    def speedup(self, batch: int, backup: str) -> float:
        """Per-sequence tokens per verification-time, relative to AR."""
        e_miss, t_b = (self.e_neural, self.t_neural) if backup == "neural" else (self.e_fast, self.t_fast)
        all_hit = self.p_hit ** batch
        tokens = self.p_hit * self.e_hit + (1 - self.p_hit) * e_miss
        return tokens / (all_hit * max(1.0, self.t_p) + (1 - all_hit) * (1 + t_b))

    def critical_batch_size(self, max_batch: int = 256) -> int:
        """The smallest batch at which the fast backup is faster than the neural one."""
        for b in range(1, max_batch + 1):
            if self.speedup(b, "fast") > self.speedup(b, "neural"):
                return b
        return max_batch + 1


@dataclass
class GeometricPlan:
    """Re-plans a geometric fan-out from the acceptance measured so far (Theorem 12), under a
    branch budget that keeps filling the cache within one verification."""
    budget: int  # most branches per request
    power_law_r: float
    every_rounds: int = 16
    target_t_p: float = 0.9  # cache-fill time / verification time to aim for

    def fan_out(self, acceptance_lengths: list[int], k: int, budget: int) -> list[int]:
        a = acceptance_rate(statistics.fmean(acceptance_lengths), k)
        return geometric_fan_out(budget, k, a, self.power_law_r)

    def next_budget(self, budget: int, t_p: float) -> int:
        """Fill time grows about linearly with the branches (a larger batch means more of
        them), so scale the budget towards target_t_p, within 1..self.budget."""
        return max(1, min(self.budget, round(budget * self.target_t_p / max(t_p, 1e-6))))
