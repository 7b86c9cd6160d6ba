"""The documents stay short and current: README.md is what a user reads first, BENCHMARKS.md one
current section per area (history goes to docs/benchmarks-log.md), and a figure is dated by its
day and commit, never by the number of the working period that measured it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE_LIMITS = {"README.md": 200, "BENCHMARKS.md": 300}
# "session" followed by a number, built so that this file does not match itself.
PERIOD_NUMBER = re.compile(r"\b" + "sess" + r"ions?\s+\d+", re.IGNORECASE)
CHECKED_SUFFIXES = {".md", ".py", ".c", ".h"}


def checked_files() -> list[Path]:
    return [path for path in ROOT.rglob("*")
            if path.suffix in CHECKED_SUFFIXES and path.is_file()
            and not any(part.startswith(".") or part in {"build", "dist", "__pycache__"}
                        for part in path.relative_to(ROOT).parts)]


def period_numbers(text: str) -> list[str]:
    return PERIOD_NUMBER.findall(text)


def test_front_documents_stay_short():
    for name, limit in LINE_LIMITS.items():
        lines = (ROOT / name).read_text().count("\n")
        assert lines <= limit, f"{name} has {lines} lines (at most {limit}): move history or detail to docs/"


def test_figures_are_dated_by_day_and_commit():
    found = {str(path.relative_to(ROOT)): hits for path in checked_files()
             if (hits := period_numbers(path.read_text(errors="replace")))}
    assert not found, f"date these by day and commit instead: {found}"


def test_period_numbers_are_caught():
    """Control: the pattern finds the forms the documents used to carry."""
    samples = ["measured in " + "sess" + "ion 12", "Sess" + "ions 14 and 15", "sess" + "ions 1-13"]
    assert all(period_numbers(sample) for sample in samples)
    assert not period_numbers("measured 2026-12-05 on engine 0887bf3 (a pytest session fixture)")
