"""The planning formulas (docs/DESIGN.md, section 3): fan-out, acceptance fit, power law, backup choice."""
from __future__ import annotations

import pytest

from saguaro.speculation.policy.planning import (SpeedModel, acceptance_rate, critical_batch_size, fit_power_law,
                                                 geometric_fan_out, outcome_probs, uniform_fan_out)


@pytest.mark.parametrize("budget, k, a, r", [(16, 5, 0.75, 0.6), (16, 5, 0.4, 0.6), (30, 3, 0.9, 1.5), (7, 2, 0.5, 1.0)])
def test_geometric_fan_out_spends_the_budget_where_outcomes_are_likely(budget, k, a, r):
    fan_out = geometric_fan_out(budget, k, a, r)
    assert len(fan_out) == k + 1 and sum(fan_out) == budget and min(fan_out) >= 0
    assert fan_out[:k] == sorted(fan_out[:k], reverse=True)  # F_k falls with k below K
    probs = outcome_probs(a, k)
    assert probs.index(max(probs)) == fan_out.index(max(fan_out))


def test_geometric_fan_out_follows_theorem_12():
    """F_k / F_0 = a^(k/(1+r)) below K and F_K / F_0 = a^(K/(1+r)) (1-a)^(-1/(1+r)), up to rounding."""
    a, r, k, budget = 0.7, 0.5, 4, 1000
    fan_out = geometric_fan_out(budget, k, a, r)
    for j in range(1, k):
        assert fan_out[j] / fan_out[0] == pytest.approx(a ** (j / (1 + r)), rel=0.02)
    assert fan_out[k] / fan_out[0] == pytest.approx(a ** (k / (1 + r)) * (1 - a) ** (-1 / (1 + r)), rel=0.02)


def test_uniform_fan_out():
    assert uniform_fan_out(14, 3) == [4, 4, 3, 3]


@pytest.mark.parametrize("a", [0.2, 0.5, 0.73, 0.95])
def test_acceptance_rate_inverts_the_expected_length(a):
    k = 5
    assert acceptance_rate(sum(a ** j for j in range(k + 1)), k) == pytest.approx(a, abs=1e-6)


def test_power_law_fit_recovers_r():
    fan_outs = [1, 2, 4, 8, 16]
    assert fit_power_law(fan_outs, [f ** -0.8 for f in fan_outs]) == pytest.approx(0.8)


def test_fast_backup_wins_only_from_the_critical_batch_size_on():
    model = SpeedModel(p_hit=0.8, e_hit=3.5, e_neural=3.5, e_fast=1.0, t_p=0.9, t_neural=0.8)
    b_star = critical_batch_size(model.fast_wins)
    assert b_star == 2  # neural 3.02 vs fast 3.00 at b=1; 2.72 vs 3.00 at b=2
    assert model.speedup(1, "neural") > model.speedup(1, "fast")
    assert model.speedup(2, "fast") > model.speedup(2, "neural")
    assert critical_batch_size(SpeedModel(1.0, 3.0, 3.0, 1.0, 0.5, 0.8).fast_wins) is None  # no misses: never fast


def test_branch_budget_follows_the_measured_fill_time():
    from saguaro.speculation.remote.proposer import GeometricPlan

    plan = GeometricPlan(budget=16, power_law_r=0.5, target_t_p=0.9)
    assert plan.next_budget(16, t_p=1.8) == 8  # fill took twice the target: halve the branches
    assert plan.next_budget(8, t_p=0.45) == 16  # room to spare: grow back, up to the budget
    assert plan.next_budget(16, t_p=0.2) == 16
    assert plan.next_budget(2, t_p=50.0) == 1  # never below one branch
    assert sum(plan.fan_out([2, 1, 3], k=4, budget=5)) == 5


def decoder_with(stats, backup: str = "auto"):
    """The parts of SSD's proposer that choose a backup, without a draft worker behind them."""
    from types import SimpleNamespace

    from saguaro.speculation.remote.proposer import RemoteProposer

    decoder = SimpleNamespace(backup=backup, stats=stats, k=5)
    decoder.speed_model = lambda: RemoteProposer.speed_model(decoder)
    decoder.choose_backup = lambda batch: RemoteProposer.choose_backup(decoder, batch)
    return decoder


def measured(hit=3.0, neural=2.0, fast=2.0, neural_s=0.010, misses=8):
    from saguaro.engine.round import CacheHits
    from saguaro.speculation.remote.proposer import SSDStats

    cache = CacheHits(rounds=20 + 2 * misses, hits=20)
    return SSDStats(cache, hit_lengths=[hit] * 20, miss_lengths={"neural": [neural] * misses, "fast": [fast] * misses},
                    verify_s=[0.030] * 20, t_p=[0.8] * 20,
                    backup_s={"neural": [neural_s] * misses, "fast": [0.0] * misses})


def test_auto_backup_tries_both_before_trusting_the_speed_model():
    from saguaro.speculation.remote.proposer import EXPLORE_MISSES

    decoder = decoder_with(measured(misses=0))
    tried = []
    for _ in range(2 * EXPLORE_MISSES):
        tried.append(decoder.choose_backup(1))
        decoder.stats.miss_lengths[tried[-1]].append(1)
    assert tried.count("neural") == tried.count("fast") == EXPLORE_MISSES


def test_auto_backup_follows_measured_acceptance_and_cost():
    # Misses drafted just in time accept twice as much: worth their 10 ms at batch 1, not at 16.
    assert decoder_with(measured(neural=2.0, fast=1.0)).choose_backup(1) == "neural"
    assert decoder_with(measured(neural=2.0, fast=1.0)).choose_backup(16) == "fast"
    # As good and free: fast even at batch 1. The neural backup's own time is what it costs.
    assert decoder_with(measured(neural=1.5, fast=1.5)).choose_backup(1) == "fast"
    assert decoder_with(measured(neural=1.5, fast=1.5)).speed_model().t_neural == pytest.approx(1 / 3)
    assert decoder_with(measured(neural=1.0, fast=4.0), backup="neural").choose_backup(1) == "neural"


def test_the_speed_model_reads_the_latest_measurements():
    """What the model reads is the RECENT latest of each measurement: verifications that took
    a second each long ago do not make today's 10 ms backup look free."""
    from saguaro.speculation.remote.proposer import RECENT

    stats = measured(neural=1.5, fast=1.5)
    stats.verify_s = [1.0] * 1000 + [0.030] * RECENT
    assert decoder_with(stats).speed_model().t_neural == pytest.approx(1 / 3)  # over all of them: 0.01


def test_backup_time_is_measured_only_on_rounds_that_ran_a_backup():
    """A miss covered by a prompt lookup ran no backup: its reply time would make the neural
    backup look free, and auto would never switch to the fast one at any batch size."""
    from types import SimpleNamespace

    from saguaro.engine.proposal import Outcome
    from saguaro.engine.round import RowRecord
    from saguaro.speculation.protocol import RequestSpeculation, Speculation
    from saguaro.speculation.remote.proposer import SSDStats

    decoder = SimpleNamespace(stats=SSDStats())
    for looked, backup_s in ((True, 0.0001), (False, 0.012), (True, 0.0001)):
        spec = Speculation([RequestSpeculation([0], hit=False, lookup=looked)], backup_time_s=backup_s)
        decoder.stats.add_round([Outcome(1, 7)], spec, [RowRecord(2, 3, False, looked)], "neural", 0.0, 0.030)
    assert decoder.stats.backup_s["neural"] == [0.012]
    assert len(decoder.stats.lookup_lengths) == 2 and decoder.stats.miss_lengths["neural"] == [3]
    assert (decoder.stats.cache.rounds, decoder.stats.cache.lookup_rounds, decoder.stats.cache.hits) == (3, 2, 0)


def test_the_fan_out_follows_the_latest_acceptance_lengths_of_hits_and_misses_alike():
    """The geometric fan-out is re-fitted to the RECENT latest rounds' acceptance lengths, in the
    order they came, whether they hit or missed."""
    from types import SimpleNamespace

    from saguaro.engine.proposal import Outcome
    from saguaro.engine.round import RowRecord
    from saguaro.speculation.protocol import RequestSpeculation, Speculation
    from saguaro.speculation.remote.proposer import RECENT, GeometricPlan, RemoteProposer, SSDStats

    decoder = SimpleNamespace(stats=SSDStats())
    for hit, accepted in [(False, 3)] * RECENT + [(True, 0)] * RECENT:  # long accepts on misses, then short on hits
        spec = Speculation([RequestSpeculation([0], hit=hit, miss=None if hit else "bonus")], backup_time_s=0.0)
        decoder.stats.add_round([Outcome(1, 7)], spec, [RowRecord(accepted, accepted + 1, hit)], "neural", 0.0, 0.030)
    assert list(decoder.stats.recent_lengths) == [1] * RECENT  # (the misses' 4s, older, are out)
    chosen = []
    planner = SimpleNamespace(stats=decoder.stats, plan=GeometricPlan(budget=16, power_law_r=0.6), k=5,
                              branch_budget=16, fan_out=[1] * 6, set_fan_out=chosen.append)
    RemoteProposer._replan(planner)
    assert chosen and chosen[0][0] == max(chosen[0])  # short accepts: the branches go to length 0
