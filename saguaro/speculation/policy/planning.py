"""The rate model: what AR, SD and SSD commit per second from pass costs, acceptance and hit
rate (`expected_tokens`, `sd_rate`, `ssd_rate`), and how many bonus-token candidates to cache per
accepted length and which backup to use. auto's controller, SSD's backup choice and `saguaro
plan --profile` (`forecast`) all rate their choices here.

The formulas are the paper's (docs/DESIGN.md, "The theory the planner uses"): cache misses fall as a power law in
fan-out, 1 - p_hit(F) = F^-r; under a branch budget the optimal fan-out is capped geometric;
in a batch one miss stalls everyone, which decides between the neural and the fast backup.
`forecast` puts them together with measured pass costs (`RowCosts`, which auto's controller
keeps too) for `saguaro plan --profile`.
"""
from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

EMA = 0.2  # weight of a new measurement of a pass's cost
RESTORED_WITHIN = 1.25  # a pass this many times off its restored cost (either way) drops the restored costs


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


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E_k = 1 + a_1 + a_1 a_2 + ... + a_1...a_k: the tokens a sequence's round of k drafts commits."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def sd_rate(batch: int, tokens: float, target_s: float, draft_s: float) -> float:
    """Committed tokens per second of a round of b sequences that each commit `tokens`, after a
    target pass of target_s and drafting of draft_s (AR: none; SD: k steps; a tree: its levels)."""
    return batch * tokens / (target_s + draft_s)


def ssd_rate(batch: int, p_hit: float, e_hit: float, e_miss: float, verify_s: float, fill_s: float,
             backup_s: float) -> float:
    """SSD's committed tokens per second (Theorem 7 with Corollary 16's batch stall): each round
    the worker fills its cache while the target verifies, hidden only while the fill is the
    shorter; a round where any of the b sequences missed waits for the backup's backup_s."""
    tokens = p_hit * e_hit + (1 - p_hit) * e_miss
    return batch * tokens / (max(verify_s, fill_s) + (1 - p_hit ** batch) * backup_s)


def critical_batch_size(fast_wins: Callable[[int], bool], max_batch: int = 256) -> int | None:
    """b*: the smallest batch at which SSD's fast backup beats the neural one (None: none up to max_batch)."""
    return next((b for b in range(1, max_batch + 1) if fast_wins(b)), None)


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
        return ssd_rate(batch, self.p_hit, self.e_hit, e_miss, 1.0, self.t_p, t_b) / batch

    def fast_wins(self, batch: int) -> bool:
        """Whether the fast backup is the faster at this batch size."""
        return self.speedup(batch, "fast") > self.speedup(batch, "neural")


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


class RowCosts:
    """Seconds per pass as a function of the rows it runs: running means per row count,
    interpolated linearly between them, flat below the smallest and proportional above the
    largest (a pass never costs less than a smaller one). The first pass at a row count is a
    warm-up and is not counted: a process's first passes run several times slower, and a cost
    measured then would keep auto off that choice for good. Costs restored from an earlier
    process (`restore`) stand until this process measures their row count: its first counted
    pass replaces the restored cost, and one that differs from it by more than RESTORED_WITHIN
    drops every restored cost (`add` says so): a profile taken while a busy server's threads
    slowed its passes would otherwise keep auto off the choices it no longer runs, since a try
    is only made of a choice predicted close to the best."""

    def __init__(self, known: dict[int, float] | None = None):
        """known: costs known already (see `of`), warm at every row count."""
        known = known or {}
        self.rows: list[int] = sorted(known)
        self.seconds: list[float] = [known[r] for r in self.rows]
        self.warmed: set[int] = set(self.rows)
        self.restored: set[int] = set()  # row counts whose cost an earlier process measured, not measured here yet

    def restore(self, rows: list[int], seconds: list[float]) -> None:
        """Costs an earlier process measured (its profile)."""
        self.rows, self.seconds = [int(r) for r in rows], [float(x) for x in seconds]
        self.restored = set(self.rows)

    def drop_restored(self) -> None:
        """Forgets the restored costs this process has not measured yet."""
        kept = [(r, x) for r, x in zip(self.rows, self.seconds) if r not in self.restored]
        self.rows, self.seconds = [r for r, _ in kept], [x for _, x in kept]
        self.restored = set()

    @classmethod
    def of(cls, table: dict[int, float]) -> "RowCosts":
        """Costs known already (a profile's), warm at every row count."""
        return cls(table)

    def add(self, rows: int, seconds: float) -> bool:
        """Counts a pass; True where it contradicted a restored cost (the restored ones are then dropped)."""
        if rows not in self.warmed:
            self.warmed.add(rows)
            return False
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows and rows in self.restored:
            self.restored.discard(rows)
            contradicted = not 1 / RESTORED_WITHIN <= seconds / self.seconds[i] <= RESTORED_WITHIN
            self.seconds[i] = seconds
            if contradicted:
                self.drop_restored()
            return contradicted
        if i < len(self.rows) and self.rows[i] == rows:
            self.seconds[i] += EMA * (seconds - self.seconds[i])
        else:
            self.rows.insert(i, rows)
            self.seconds.insert(i, seconds)
        return False

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
class SsdDraft:
    """SSD's own draft where it is not SD's: its worker's hardware hides a draft step, so SSD
    can afford a draft that SD cannot (slower a step, right more often) while SD keeps the
    cheap one. Its measured step costs, acceptance and hit rate, as HardwareProfile holds SD's."""
    draft_step_s: dict[int, float]
    acceptance: list[float]
    hit_rate: float

    @classmethod
    def from_json(cls, data: dict) -> "SsdDraft":
        if unknown := set(data) - set(cls.__dataclass_fields__):
            raise ValueError(f"unknown ssd_draft fields {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        if missing := set(cls.__dataclass_fields__) - set(data):
            raise ValueError(f"an ssd_draft needs {sorted(missing)}")
        return cls(**_checked(data, ("draft_step_s",)))


def _checked(data: dict, tables: tuple[str, ...]) -> dict:
    """A profile's fields with its cost tables keyed by row counts, refused where a value cannot be."""
    fields = dict(data)
    for table in tables:
        fields[table] = {int(rows): float(s) for rows, s in data[table].items()}
        if not fields[table] or min(fields[table].values()) <= 0:
            raise ValueError(f"{table} needs positive seconds for at least one row count")
    if not fields["acceptance"] or not all(0 <= a <= 1 for a in fields["acceptance"]):
        raise ValueError("acceptance needs one rate in [0, 1] per draft position")
    if not 0 <= fields["hit_rate"] <= 1:
        raise ValueError("hit_rate must lie in [0, 1]")
    return fields


@dataclass
class HardwareProfile:
    """What a forecast for hardware saguaro is not running on needs: the two models' measured
    costs there, and the pair's acceptance and SSD cache hit rate (`saguaro plan --profile`)."""
    name: str
    target_pass_s: dict[int, float]  # the target's pass, by token rows (sequences x tokens each)
    draft_step_s: dict[int, float]  # one draft step, by sequences
    acceptance: list[float]  # a_1..a_K: draft position i accepted, given the ones before it were
    hit_rate: float  # SSD: a sequence's round finds its outcome cached
    fan_out: int = 16  # SSD: the most branches the worker may pre-draft per sequence; hit_rate is at this many
    power_law_r: float = 0.5  # SSD: misses fall as F^-r with the fan-out F (Definition 11)
    link_s: float = 0.0  # SSD: the exchange's share of a round that nothing hides
    target_devices: int = 1
    draft_devices: int = 1  # SSD's worker's, besides the target's
    draft_on_host: bool = False  # SSD's worker on the host's idle CPU cores: free, no device charged
    ssd_draft: SsdDraft | None = None  # SSD's own draft; None: SD's

    @classmethod
    def from_json(cls, data: dict) -> "HardwareProfile":
        known = set(cls.__dataclass_fields__)
        if unknown := set(data) - known - {"notes"}:
            raise ValueError(f"unknown profile fields {sorted(unknown)}; known: {sorted(known)}")
        missing = {"name", "target_pass_s", "draft_step_s", "acceptance", "hit_rate"} - set(data)
        if missing:
            raise ValueError(f"a profile needs {sorted(missing)}")
        fields = _checked({k: v for k, v in data.items() if k in known}, ("target_pass_s", "draft_step_s"))
        if fields.get("ssd_draft") is not None:
            fields["ssd_draft"] = SsdDraft.from_json(fields["ssd_draft"])
        return cls(**fields)

    def fast_wins(self, batch: int) -> bool:
        """Whether SSD does better with the fast backup at this batch size (its forecast's choice)."""
        return forecast(self, batch).ssd_backup == "fast"


@dataclass
class Forecast:
    """Predicted total tokens/s at one batch size, and what each method's choice was."""
    batch: int
    ar_tok_s: float
    sd_tok_s: float
    sd_k: int  # the K that SD does best with
    ssd_tok_s: float
    ssd_backup: str  # what SSD does on a miss: "neural" (draft anew) or "fast" (a cheap token)
    ssd_fan_out: int  # the branches per sequence SSD does best with
    ssd_t_p: float  # the worker's fill time / a verification: above 1 it is not hidden
    devices: tuple[int, int]  # (AR's and SD's, SSD's)

    def per_device(self) -> tuple[float, float, float]:
        """AR, SD and SSD tokens/s per device: SSD is charged its worker's devices too."""
        sd_devices, ssd_devices = self.devices
        return self.ar_tok_s / sd_devices, self.sd_tok_s / sd_devices, self.ssd_tok_s / ssd_devices


def forecast(profile: HardwareProfile, batch: int, sd_ks: list[int] | None = None) -> Forecast:
    """AR: b / t_T(b). SD: `sd_rate` with k draft steps t_D(b) at its best k <= K. SSD: `ssd_rate`
    with a round's verification t_T(b (K + 1)) plus the link, the fill K t_D(b F), a neural miss
    drafting anew for K t_D(b), a fast one committing about one token; at the fan-out F <=
    profile.fan_out and the backup that do best, the hit rate following the power law from the
    profile's. sd_ks: only these k (what an engine ran, to check the forecast against it). SSD
    drafts with profile.ssd_draft where there is one."""
    target, draft = RowCosts.of(profile.target_pass_s), RowCosts.of(profile.draft_step_s)
    sd_rates = {k: sd_rate(batch, expected_tokens(profile.acceptance, k), target(batch * (k + 1)), k * draft(batch))
                for k in sd_ks or range(1, len(profile.acceptance) + 1)}
    sd_k = max(sd_rates, key=sd_rates.get)
    ssd_side = profile.ssd_draft or profile
    draft = RowCosts.of(ssd_side.draft_step_s)
    k_max = len(ssd_side.acceptance)
    verify = target(batch * (k_max + 1)) + profile.link_s
    e_k = expected_tokens(ssd_side.acceptance, k_max)
    best = (0.0, "neural", 1, 0.0)
    for fan_out in range(1, profile.fan_out + 1):
        misses = (1 - ssd_side.hit_rate) * (fan_out / profile.fan_out) ** -profile.power_law_r
        fill = k_max * draft(batch * fan_out)
        for backup, e_miss, backup_s in (("neural", e_k, k_max * draft(batch)), ("fast", 1.0, 0.0)):
            rate = ssd_rate(batch, max(0.0, 1 - misses), e_k, e_miss, verify, fill, backup_s)
            if rate > best[0]:
                best = (rate, backup, fan_out, fill / verify)
    ssd_tok_s, backup, fan_out, t_p = best
    return Forecast(batch, batch / target(batch), sd_rates[sd_k], sd_k, ssd_tok_s, backup, fan_out, t_p,
                    (profile.target_devices, profile.target_devices + (0 if profile.draft_on_host else profile.draft_devices)))
