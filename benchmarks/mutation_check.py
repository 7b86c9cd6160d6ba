"""Mutation check: does the test suite catch the exactness bugs we know of?

For each known bug, copies the package (saguaro/) and tests/ to a scratch folder, applies the bug
there as a textual patch (search / replace on the source; an anchor that is not found, or found
more than once, is an error: a refactor must not silently disable a mutation), and runs the
tests that must catch it against that copy. A mutation is caught when at least one of its tests
fails. Exits non-zero if any mutation survived or could not be applied.

    python benchmarks/mutation_check.py            # every mutation
    python benchmarks/mutation_check.py -k tree    # those whose name contains "tree"
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mutation:
    name: str
    file: str  # relative to the repository root
    search: str
    replace: str
    tests: list[str]  # pytest node ids, any of which failing catches the bug


SSD = "tests/test_ssd.py::"
EXACT = "tests/test_exactness.py::"
TREES = "tests/test_trees.py::"

MUTATIONS = [
    Mutation("saguaro sampling: tree drafts from sigma, reports q",
             "saguaro/speculation/worker/speculator.py",
             "                probs.append(q.view(B, NB, -1))",
             "                probs.append(warp(logits, params).view(B, NB, -1))",
             [SSD + "test_ssd_is_exact_with_saguaro_sampling_over_many_hits"]),
    Mutation("saguaro sampling: neural backup drafts from sigma, reports q",
             "saguaro/speculation/local/drafters.py",
             "            token = model.head_token(sample(q, u[:, i]))\n            probs.append(q)",
             "            token = model.head_token(sample(q, u[:, i]))\n            probs.append(warp(logits, params))",
             [SSD + "test_ssd_is_exact_with_saguaro_sampling_over_many_hits"]),
    Mutation("prompt lookup over a cache hit keeps the branch's distributions",
             "saguaro/speculation/worker/speculator.py",
             "            seqs[i].speculate(guess)\n            probs[i] = None\n        missed",
             "            seqs[i].speculate(guess)\n        missed",
             [SSD + "test_ssd_is_exact_on_every_path[lookup-hit-1.0]"]),
    Mutation("tree reseeded the same way every fill",
             "saguaro/speculation/worker/speculator.py",
             "        u = self._uniforms(seqs, NB * k).view(B, NB, k)",
             "        u = uniforms([torch.Generator().manual_seed(s.seq_id) for s in seqs], NB * k)"
             ".to(device).view(B, NB, k)",
             [SSD + "test_ssd_is_exact_over_many_rounds"]),
    Mutation("a restarted worker reuses its random streams",
             "saguaro/speculation/remote/client.py",
             "lost.target_device, lost.incarnation + 1)",
             "lost.target_device, lost.incarnation)",
             [SSD + "test_ssd_is_exact_across_worker_restarts"]),
    Mutation("top-k / top-p misreported by the neural backup",
             "saguaro/speculation/local/drafters.py",
             "            token = model.head_token(sample(q, u[:, i]))\n            probs.append(q)",
             "            token = model.head_token(sample(q, u[:, i]))\n"
             "            probs.append(torch.softmax(logits.float() / params.temperature[:, None], -1))",
             [SSD + "test_ssd_neural_backup_is_exact_with_top_k_and_top_p"]),
    Mutation("bonus after K accepted drafts drawn from the residual",
             "saguaro/engine/rejection.py",
             "torch.zeros_like(draft_probs[:, :1])",
             "draft_probs[:, -1:]",
             [SSD + "test_ssd_is_exact_when_every_draft_is_accepted",
              EXACT + "test_sd_decoder_is_exact_when_every_draft_is_accepted"]),
    # blind spots of the pooled PIT tests (each caught by a test of its own)
    Mutation("tree walk draws its bonus with the last node's uniform (index off by one)",
             "saguaro/engine/tree.py",
             "torch.tensor([u[-1]])",
             "torch.tensor([u[-2]])",
             [TREES + "test_walk_commits_each_token_as_often_as_a_fixed_target_gives_it[walk-True]"]),
    Mutation("SSD's cached branches draw every depth with one uniform",
             "saguaro/speculation/worker/speculator.py",
             "sample(q, u[:, :, depth].flatten())",
             "sample(q, u[:, :, 0].flatten())",
             [SSD + "test_ssd_check_of_cached_branches_drawing_each_depth_afresh[False]"]),
    Mutation("rows of one batch verified with each other's sampling parameters",
             "saguaro/engine/sampler.py",
             "temperature=self.temperature.repeat_interleave(n)",
             "temperature=self.temperature.repeat(n)",
             [EXACT + "test_sd_decoder_check_of_rows_with_very_different_settings[False]"]),
    Mutation("a cached branch served for the right accepted length but another bonus token",
             "saguaro/speculation/worker/cache.py",
             "i = None if outcome is None else branches.index.get(outcome)",
             "i = None if outcome is None else next((j for o, j in branches.index.items() if o[0] == outcome[0]), None)",
             [SSD + "test_ssd_check_of_a_hit_serving_the_branch_of_its_own_outcome[False]"]),
    Mutation("top-p drops the token that crosses the threshold",
             "saguaro/engine/sampler.py",
             "mass_before = probs.cumsum(-1) - probs",
             "mass_before = probs.cumsum(-1)",
             [EXACT + "test_sd_decoder_check_of_top_p_against_a_nucleus_computed_apart[False]"]),
    # the existing controls' bugs
    Mutation("bonus after a rejection drawn from p (residual ignored)",
             "saguaro/engine/rejection.py",
             "    residual = (p_at - q_at).clamp_(min=0)",
             "    residual = p_at.clone()",
             [EXACT + "test_verify_is_exact[1.0]"]),
    Mutation("every draft accepted",
             "saguaro/engine/rejection.py",
             "    accepted = u_accept * q_x < p_x",
             "    accepted = torch.ones_like(q_x, dtype=torch.bool)",
             [EXACT + "test_sd_decoder_is_exact"]),
    Mutation("top tokens kept without renormalizing",
             "saguaro/speculation/worker/speculator.py",
             "    return kept / kept.sum(-1, keepdim=True)",
             "    return kept",
             [SSD + "test_ssd_is_exact_when_the_worker_drafts_from_its_top_tokens[hit-c0.5]"]),
]


def apply(mutation: Mutation, root: Path) -> None:
    path = root / mutation.file
    text = path.read_text()
    count = text.count(mutation.search)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name!r}: anchor found {count} times in {mutation.file} "
                         f"(expected once): {mutation.search!r}")
    path.write_text(text.replace(mutation.search, mutation.replace))


def run(mutation: Mutation, timeout_s: int) -> tuple[bool, str, float]:
    """(caught, pytest's last line, seconds) for one mutation, in a scratch copy."""
    with tempfile.TemporaryDirectory(prefix="saguaro-mutation-") as scratch:
        root = Path(scratch)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(ROOT / "saguaro", root / "saguaro", ignore=ignore)
        shutil.copytree(ROOT / "tests", root / "tests", ignore=ignore)
        for name in ("pyproject.toml",):
            if (ROOT / name).exists():
                shutil.copy(ROOT / name, root / name)
        apply(mutation, root)
        env = dict(os.environ, PYTHONPATH=str(root))
        start = time.perf_counter()
        try:
            # in one process (-o addopts=: no xdist), where -x stops with exit 1 (xdist's stop is exit 2)
            done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                   "-o", "addopts=", *mutation.tests], cwd=root, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout_s} s", time.perf_counter() - start
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        last = lines[-1] if lines else done.stderr.strip()[-200:]
        # exit 1: tests failed (caught); 0: all passed (survived); anything else: an error
        if done.returncode not in (0, 1):
            return False, f"pytest exit {done.returncode}: {last}", time.perf_counter() - start
        return done.returncode == 1, last, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mutation")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    for mutation in chosen:  # every anchor is checked before anything runs
        count = (ROOT / mutation.file).read_text().count(mutation.search)
        if count != 1:
            raise SystemExit(f"mutation {mutation.name!r}: anchor found {count} times in {mutation.file}")
    survived = []
    start = time.perf_counter()
    for mutation in chosen:
        caught, last, seconds = run(mutation, args.timeout)
        print(f"{'CAUGHT  ' if caught else 'SURVIVED'} {seconds:6.1f} s  {mutation.name}\n"
              f"         {', '.join(t.split('::')[-1] for t in mutation.tests)}: {last}", flush=True)
        if not caught:
            survived.append(mutation.name)
    print(f"{len(chosen) - len(survived)} of {len(chosen)} mutations caught in {time.perf_counter() - start:.0f} s")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
