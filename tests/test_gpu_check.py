"""benchmarks/gpu_check.py end to end on the CPU: every check the GPU run makes, at CI's size.

The script is what a GPU lent for minutes runs, once; a break found only there costs the
loan. Here it runs whole with --device cpu (captured passes emulated, the SSD worker on the
CPU), and every check must pass and land in its JSON report.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from saguaro.cli import main

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_gpu_check_runs_end_to_end_on_the_cpu(gpu_check, tmp_path):
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(report["checks"]) == {"logits", "greedy", "exactness", "speed", "costs"}
    failed = {name: check for name, check in report["checks"].items() if not check.get("passed")}
    assert not failed and code == 0 and report["passed"]
    assert report["checks"]["greedy"]["sd_captured_passes"] > 0  # the target's passes ran captured
    assert report["checks"]["greedy"]["ssd_draft_losses"] == 0
    assert report["checks"]["speed"]["metrics"]["ssd"]["draft_losses"] == 0
    assert report["checks"]["exactness"]["control_pvalue"] < report["checks"]["exactness"]["alpha"]
    assert {"ar", "sd", "ssd", "auto"} <= set(report["checks"]["speed"]["tok_s"])
    assert len(report["checks"]["costs"]["what_if_batch1"]) == 6
    assert main(["plan", "--profile", str(tmp_path / "profile.json")]) == 0  # the planner reads what it left


def test_what_if_is_the_planners_forecast(gpu_check):
    from saguaro.speculation.policy.planning import HardwareProfile, forecast

    target, draft = {1: 0.010, 6: 0.012}, {1: 0.001, 16: 0.002}
    rows = gpu_check.what_if(target, draft, k=5)
    assert [(r["acceptance"], r["hit_rate"]) for r in rows] == [(a, h) for a in (0.6, 0.7, 0.8) for h in (0.6, 0.9)]
    f = forecast(HardwareProfile("x", target, draft, [0.7] * 5, 0.9), 1)
    assert rows[3]["ssd_tok_s"] == pytest.approx(f.ssd_tok_s) and rows[3]["sd_tok_s"] == pytest.approx(f.sd_tok_s)
