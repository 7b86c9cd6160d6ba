"""The dry run's reliability: python benchmarks/gpu_check_runs.py --runs 10

Runs `gpu_check.py --device cpu` N times, each a fresh process as a user runs it, in pairs: the
first of a pair on a fresh weight cache (only the model file and the compiled kernels) while a
second process loads the same model at the same moment (a first fill of the cache shared by
two processes once failed the dry run), the second alone on the cache that the first filled.
Prints each run's pass or fail, its wall time and its CPU time (the check's process and the
workers it ended: on a shared machine the wall time says how crowded it was, the CPU time what
the run cost), its peak memory (the twin check's build of a 1.7B-size twin sets it), each check's (wall / CPU seconds), and leaves each run's report and log in --out. The goal (issue 54): every run passes, in
at most 3 minutes each on 2 quiet cores.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CONCURRENT_LOAD = ("from saguaro import LLM, SamplingParams\n"
                   "with LLM('smollm2', method='sd') as llm:\n"
                   "    llm.generate(['def f(x):'], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)\n")


@dataclass
class RunResult:
    passed: bool
    returncode: int
    wall_s: float
    cpu_s: float  # the process's and its waited-for children's (SSD's workers), user + system
    peak_gb: float  # the largest resident set of the process or one of those children
    log_tail: str


def fresh_cache(model_file: Path, native_dir: Path | None, folder: Path) -> Path:
    """A weight cache holding only the default model's file (and the compiled kernels, which are
    not what is checked): every load from it is a first fill."""
    (folder / "smollm2").mkdir(parents=True)
    shutil.copy(model_file, folder / "smollm2" / model_file.name)
    if native_dir is not None and native_dir.is_dir():
        shutil.copytree(native_dir, folder / "native")
    return folder


def environment(cache: Path, threads: int | None) -> dict:
    env = os.environ | {"SAGUARO_CACHE": str(cache), "PYTHONUNBUFFERED": "1",
                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return env | ({"OMP_NUM_THREADS": str(threads)} if threads else {})


def start_concurrent_load(env: dict) -> subprocess.Popen:
    """A second process loading the default model from the same cache."""
    return subprocess.Popen([sys.executable, "-c", CONCURRENT_LOAD], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def run_check(out: Path, env: dict, *options: str, timeout: float = 600) -> RunResult:
    """gpu_check.py --device cpu as a process of its own; its CPU time from the kernel's account
    of it (os.wait4), which counts the workers it started and ended."""
    started = time.monotonic()
    with open(out.with_suffix(".log"), "w") as log:
        process = subprocess.Popen([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), *options],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = started + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.2)
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - started
    tail = out.with_suffix(".log").read_text(errors="replace")[-3000:]
    return RunResult(process.returncode == 0, process.returncode, wall, usage.ru_utime + usage.ru_stime,
                     usage.ru_maxrss / 2**20, tail)


def checks_line(out: Path) -> str:
    """Each check's outcome, wall and CPU seconds, from the run's report."""
    try:
        checks = json.loads((out / "gpu_check.json").read_text())["checks"]
    except (OSError, ValueError, KeyError):
        return f"no report in {out}"
    return ", ".join(f"{name} skipped ({c['skipped']})" if "skipped" in c else
                     f"{name} {'ok' if c.get('passed') else 'FAILED'} {c['seconds']:.0f}/{c['cpu_seconds']:.0f} s"
                     for name, c in checks.items())


def main(argv: list[str] | None = None) -> int:
    from saguaro.models import hub

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="dry runs in all, half beside a concurrent first load")
    parser.add_argument("--out", default=None, help="folder for each run's report and log (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS of every process (default 1, as under CI's two test processes: the "
                             "check's SSD worker holds the other core, and on a crowded machine a second thread's "
                             "waits cost the greedy check 6x its CPU time); 0: torch's default")
    parser.add_argument("--timeout-s", type=float, default=600, help="a run killed after this long fails")
    parser.add_argument("check_options", nargs="*", help="passed to gpu_check.py after --")
    args = parser.parse_args(argv)
    model_file = Path(hub.resolve(hub.DEFAULT_MODEL))
    native = hub.cache_dir() / "native"
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_runs_"))
    out.mkdir(parents=True, exist_ok=True)
    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_cache_") as scratch:
        for run in range(args.runs):
            concurrent = run % 2 == 0
            if concurrent:
                cache = fresh_cache(model_file, native, Path(scratch) / f"cache{run}")
            env = environment(cache, args.threads)
            loader = start_concurrent_load(env) if concurrent else None
            result = run_check(out / f"run{run}", env, *args.check_options, timeout=args.timeout_s)
            if loader is not None and loader.wait(timeout=args.timeout_s) != 0:
                result.passed = False
                result.log_tail += "\nthe concurrent load failed:\n" + loader.stderr.read()[-2000:]
            results.append(result)
            kind = "fresh cache, concurrent load" if concurrent else "filled cache, alone"
            print(f"run {run + 1}/{args.runs} ({kind}): {'passed' if result.passed else 'FAILED'} "
                  f"in {result.wall_s:.0f} s wall, {result.cpu_s:.0f} s CPU, peak {result.peak_gb:.1f} GiB; "
                  f"{checks_line(out / f'run{run}')}",
                  flush=True)
            if not result.passed:
                print(result.log_tail, flush=True)
    walls = sorted(r.wall_s for r in results)
    print(f"{sum(r.passed for r in results)}/{len(results)} passed; wall {walls[0]:.0f}-{walls[-1]:.0f} s "
          f"(median {walls[len(walls) // 2]:.0f}), CPU median {sorted(r.cpu_s for r in results)[len(results) // 2]:.0f} s, "
          f"peak memory up to {max(r.peak_gb for r in results):.1f} GiB")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
