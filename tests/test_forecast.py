"""`saguaro plan --profile`: AR, SD and SSD forecast for hardware saguaro is not running on,
from a profile of pass costs, acceptance and hit rate (saguaro.speculation.policy.planning)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from saguaro.cli import main
from saguaro.speculation.policy.planning import (HardwareProfile, SsdDraft, critical_batch_size, expected_tokens,
                                                 forecast)

PROFILES = Path(__file__).resolve().parent.parent / "benchmarks" / "profiles"


def profile(**changes) -> HardwareProfile:
    fields = dict(name="test", target_pass_s={1: 0.010, 6: 0.012, 24: 0.020}, draft_step_s={1: 0.001, 16: 0.002},
                  acceptance=[0.8] * 5, hit_rate=0.9, fan_out=16, power_law_r=0.5)
    return HardwareProfile(**(fields | changes))


def test_ar_and_sd_follow_their_formulas():
    p = profile()
    f = forecast(p, 1)
    assert f.ar_tok_s == pytest.approx(100.0)
    # SD at its best K, each K's rate by hand (costs interpolated linearly between measured rows)
    by_hand = {}
    for k in range(1, 6):
        rows = k + 1
        target = 0.010 + (0.012 - 0.010) * (rows - 1) / 5
        by_hand[k] = expected_tokens(p.acceptance, k) / (target + k * 0.001)
    best = max(by_hand, key=by_hand.get)
    assert (f.sd_k, f.sd_tok_s) == (best, pytest.approx(by_hand[best]))
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)


def test_ssd_with_every_outcome_cached_and_the_fill_hidden_commits_e_k_per_verification():
    p = profile(hit_rate=1.0)
    f = forecast(p, 1)
    assert f.ssd_t_p < 1
    assert f.ssd_tok_s == pytest.approx(expected_tokens(p.acceptance, 5) / 0.012)
    slower_link = forecast(profile(hit_rate=1.0, link_s=0.012), 1)
    assert slower_link.ssd_tok_s == pytest.approx(f.ssd_tok_s / 2)


def test_misses_cost_ssd_and_a_batch_stalls_on_any_one():
    hits = [forecast(profile(hit_rate=h), 1).ssd_tok_s for h in (0.5, 0.7, 0.9)]
    assert hits == sorted(hits) and hits[0] < hits[-1]
    per_sequence = [forecast(profile(hit_rate=0.8), b).ssd_tok_s / b for b in (1, 4)]
    assert per_sequence[1] < per_sequence[0]


def test_per_device_charges_ssd_its_worker():
    f = forecast(profile(target_devices=4, draft_devices=1), 1)
    ar, sd, ssd = f.per_device()
    assert ar == pytest.approx(f.ar_tok_s / 4) and sd == pytest.approx(f.sd_tok_s / 4)
    assert ssd == pytest.approx(f.ssd_tok_s / 5)
    on_host = forecast(profile(target_devices=4, draft_devices=1, draft_on_host=True), 1)
    assert on_host.per_device()[2] == pytest.approx(on_host.ssd_tok_s / 4)  # the host's cores cost no device


def test_the_fast_backup_takes_over_from_the_critical_batch_size():
    p = profile(hit_rate=0.8, draft_step_s={1: 0.002, 64: 0.004})
    b_star = critical_batch_size(p.fast_wins)
    assert b_star is not None and b_star > 1
    assert forecast(p, 1).ssd_backup == "neural" and forecast(p, b_star).ssd_backup == "fast"
    assert critical_batch_size(profile(hit_rate=1.0).fast_wins) is None  # nothing ever misses


def test_the_paper_profile_forecasts_the_papers_ssd_within_ten_percent():
    """The profile is built from the paper's AR and SD timings only; its SSD rates a sequence at
    batch 1, 4 and 16 (250, 237, 170 tok/s, fast backup from batch 2) are what it must forecast."""
    p = HardwareProfile.from_json(json.loads((PROFILES / "paper-llama70b-h100.json").read_text()))
    for batch, sd, ssd in ((1, 162, 250), (4, 154, 237), (16, 131, 170)):
        f = forecast(p, batch)
        assert f.sd_tok_s / batch == pytest.approx(sd, rel=0.01)  # how the profile was built
        assert f.ssd_tok_s / batch == pytest.approx(ssd, rel=0.10)
    assert critical_batch_size(p.fast_wins) == 2


@pytest.mark.parametrize("change, message", [
    ({"hit_rate": 1.5}, "hit_rate"), ({"acceptance": []}, "acceptance"), ({"draft_step_s": {"1": -1}}, "positive"),
    ({"fan_outs": 3}, "unknown profile fields"), ({"target_pass_s": None}, "needs"),
    ({"ssd_draft": {"draft_step_s": {"1": 0.002}, "acceptance": [0.9], "hit_rate": 1.5}}, "hit_rate"),
    ({"ssd_draft": {"draft_step_s": {"1": 0.002}, "acceptance": [0.9]}}, "an ssd_draft needs"),
])
def test_bad_profiles_are_refused_plainly(change, message, tmp_path, capsys):
    data = json.loads((PROFILES / "h200-llama3-8b-1b.json").read_text()) | change
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    assert main(["plan", "--profile", str(path)]) == 1
    assert message in capsys.readouterr().err


def test_plan_with_a_profile_prints_the_forecast_without_a_model(capsys, monkeypatch):
    import saguaro.llm

    monkeypatch.setattr(saguaro.llm, "LLM", None)  # a load would fail
    path = PROFILES / "h200-llama3-8b-1b.json"
    argv = ["plan", "--profile", str(path), "--batch-sizes", "1,8", "--acceptance", "0.6", "--hit-rate", "0.7"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    p = HardwareProfile.from_json(json.loads(path.read_text()) | {"acceptance": [0.6] * 5, "hit_rate": 0.7})
    for batch in (1, 8):
        f = forecast(p, batch)
        assert f"| {batch} | {f.ar_tok_s:.1f} | {f.sd_tok_s:.1f} ({f.sd_k}) | {f.ssd_tok_s:.1f} " in out
    assert "hit rate 0.70" in out and "b*" in out


def test_plan_check_times_the_engines_rounds_and_forecasts_each_method(tmp_path, monkeypatch):
    """benchmarks/plan_check.py end to end at CI's size: the rounds it times in the engines make
    the profile (a broken timer leaves rows out), and each method gets a forecast beside its run."""
    import importlib.util
    import sys

    benchmarks = PROFILES.parent
    monkeypatch.syspath_prepend(str(benchmarks))
    monkeypatch.syspath_prepend(str(benchmarks.parent / "tests"))
    spec = importlib.util.spec_from_file_location("plan_check", benchmarks / "plan_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["plan_check.py", "--batch-sizes", "1", "--prompts", "2", "--max-tokens", "8",
                                      "--repeats", "1", "--out", str(tmp_path)])
    module.main()
    report = json.loads((tmp_path / "plan_check.json").read_text())
    assert {"1", str(module.K + 1)} <= set(report["target_side_in_engine_s"])  # AR's step and SD's verification
    assert "1" in report["draft_step_in_engine_s"]
    assert [r["method"] for r in report["rows"]] == ["ar", "sd", "ssd"]
    assert all(r["measured_tok_s"] > 0 and r["forecast_tok_s"] > 0 for r in report["rows"])
    from saguaro.engine.verifier import Verifier
    assert Verifier.verify.__qualname__ == "Verifier.verify"  # the timer took its wrappers off
    assert main(["plan", "--profile", str(tmp_path / "profile.json")]) == 0  # this machine's profile reads back


def test_ssd_can_draft_with_a_draft_of_its_own_while_sd_keeps_its_cheap_one():
    base = profile(hit_rate=1.0)
    same = profile(hit_rate=1.0, ssd_draft=SsdDraft(base.draft_step_s, base.acceptance, base.hit_rate))
    assert forecast(same, 1) == forecast(base, 1)
    # a draft twice as slow a step but right more often: SD is untouched, SSD's fill is still hidden
    deeper = SsdDraft({rows: 2 * s for rows, s in base.draft_step_s.items()}, [0.95] * 5, 1.0)
    f, before = forecast(profile(hit_rate=1.0, ssd_draft=deeper), 1), forecast(base, 1)
    assert (f.sd_tok_s, f.sd_k) == (before.sd_tok_s, before.sd_k)
    assert f.ssd_t_p < 1 and f.ssd_tok_s == pytest.approx(expected_tokens([0.95] * 5, 5) / 0.012)
    # too slow to hide: the fill outlasts a verification, and SSD falls below the cheap draft's
    too_slow = SsdDraft({rows: 20 * s for rows, s in base.draft_step_s.items()}, [0.95] * 5, 1.0)
    assert forecast(profile(hit_rate=1.0, ssd_draft=too_slow), 1).ssd_tok_s < before.ssd_tok_s


def test_plan_forecasts_ssd_with_its_own_draft_from_the_command_line(capsys, monkeypatch):
    import saguaro.llm

    monkeypatch.setattr(saguaro.llm, "LLM", None)
    path = PROFILES / "h200-llama3-8b-1b.json"
    argv = ["plan", "--profile", str(path), "--batch-sizes", "1", "--ssd-draft-cost", "2", "--ssd-acceptance", "0.9",
            "--ssd-hit-rate", "0.95"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    p = HardwareProfile.from_json(data | {"ssd_draft": {
        "draft_step_s": {rows: 2 * s for rows, s in data["draft_step_s"].items()},
        "acceptance": [0.9] * len(data["acceptance"]), "hit_rate": 0.95}})
    f, sd_only = forecast(p, 1), forecast(HardwareProfile.from_json(data), 1)
    assert f.sd_tok_s == sd_only.sd_tok_s and f.ssd_tok_s != sd_only.ssd_tok_s
    assert f"| 1 | {f.ar_tok_s:.1f} | {f.sd_tok_s:.1f} ({f.sd_k}) | {f.ssd_tok_s:.1f} " in out
    assert "SSD's own draft: a step 2.00x SD's draft's" in out and "hit rate 0.95" in out
