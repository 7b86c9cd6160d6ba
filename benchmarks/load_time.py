"""A fresh process that loads a GGUF file and prints 8 greedy tokens: saguaro against llama.cpp.

What a user waits for and the memory the machine needs before the first answer: wall time and
peak resident memory of `saguaro generate --model FILE --max-tokens 8` and of the same through
llama.cpp's Python binding, the two taking turns, medians of --repeats fresh processes each
(the page cache is warm after the first: each engine's first run is not counted; saguaro's first
also writes its weight cache, which the others map, unless --no-weight-cache).

    python benchmarks/load_time.py FILE [--repeats 3] [--threads 2] [--no-weight-cache]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a function that reverses a string."

LLAMACPP = """
import sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), verbose=False)
print(llm(sys.argv[3], max_tokens=8, temperature=0)["choices"][0]["text"])
"""


def run(command: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, peak resident GB) of one child process."""
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{command[0]} failed: {child.stderr.read().decode()[-500:]}")
    return wall, usage.ru_maxrss / 1e6  # kB -> GB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-weight-cache", action="store_true", help="saguaro repacks the weights every time "
                        "(SAGUARO_WEIGHT_CACHE=0)")
    args = parser.parse_args()
    environments = {"saguaro": dict(os.environ, SAGUARO_WEIGHT_CACHE="0") if args.no_weight_cache else None,
                    "llama.cpp": None}
    commands = {
        "saguaro": [sys.executable, "-m", "saguaro.cli", "generate", "--model", args.file, "--max-tokens", "8",
                    "--threads", str(args.threads), PROMPT],
        "llama.cpp": [sys.executable, "-c", LLAMACPP, args.file, str(args.threads), PROMPT],
    }
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for i in range(args.repeats + 1):
        for name, command in commands.items():
            result = run(command, environments[name])
            if i:  # the first of each warms the page cache (and saguaro's compiled kernels)
                runs[name].append(result)
    cache = "off" if args.no_weight_cache else "on"
    print(f"{args.file}: medians of {args.repeats} fresh processes, {args.threads} threads, saguaro's weight cache {cache}")
    print("| engine | wall s | peak resident GB |\n|---|---|---|")
    medians = {}
    for name, results in runs.items():
        medians[name] = (statistics.median(r[0] for r in results), statistics.median(r[1] for r in results))
        print(f"| {name} | {medians[name][0]:.2f} | {medians[name][1]:.2f} |")
    print(f"saguaro / llama.cpp: wall {medians['saguaro'][0] / medians['llama.cpp'][0]:.2f}x, "
          f"memory {medians['saguaro'][1] / medians['llama.cpp'][1]:.2f}x")


if __name__ == "__main__":
    main()
