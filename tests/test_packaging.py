"""An installed (non-editable) copy holds every file saguaro reads from its own folder at run
time: a wheel carries only the data files pyproject.toml's package-data names, so a source
left out there is missing on every machine that installs saguaro instead of cloning it."""
from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

from saguaro.models.native import compiler

ROOT = Path(__file__).resolve().parent.parent


def shipped(relative: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(relative, pattern) for pattern in patterns)


def package_data() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["saguaro"]


def test_the_kernels_sources_and_headers_are_package_data():
    patterns = package_data()
    missing = [name for name in compiler.SOURCES + compiler.HEADERS if not shipped(f"models/native/{name}", patterns)]
    assert missing == []
    # Control: the patterns before the AVX2 headers were added leave the headers out.
    assert [name for name in compiler.HEADERS if not shipped(f"models/native/{name}", ["models/native/*.c"])] == \
        list(compiler.HEADERS)


def test_the_shipped_draft_is_package_data():
    patterns = package_data()
    draft = ROOT / "saguaro" / "drafts"
    files = [path.relative_to(ROOT / "saguaro").as_posix() for path in draft.rglob("*") if path.is_file()]
    assert files and all(shipped(name, patterns) for name in files)
