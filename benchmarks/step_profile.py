"""Where a target pass's time goes in each quantization mode, and each mode's peak memory.

cost: one pass (batch-invariant, the head included, 256 cached tokens) per shape (requests x
tokens), the modes taking turns, medians over the repeats, and one AR step's profile: its wall
time, the time in torch's projection and head kernels and in the other torch operations, and
the number of aten calls (saguaro's own kernels, called through ctypes, are outside torch's
profiler: their time is the wall time the torch operations leave). Modes: none, int8, auto
(saguaro's kernels where they run) and auto-torch (auto on torch's kernels, SAGUARO_NATIVE=0).
memory: peak resident memory of a fresh process that loads the model in each mode and decodes
one prompt.

    python benchmarks/step_profile.py cost [--threads 1] [--repeats 15]
    python benchmarks/step_profile.py memory
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from saguaro.engine.runner import forward_chunks
from saguaro.models import hub
from saguaro.models.native import bindings
from saguaro.models.kv_cache import new_cache
from saguaro.models.loader import load_model

MODES = ("none", "int8", "auto", "auto-torch")  # auto: the GGUF's Q4_1 blocks as int4
SHAPES = [(1, 1), (1, 4), (1, 6), (4, 6), (8, 1)]
CONTEXT = 256
# the projection and head kernels of each mode in bf16
PROJECTION_KERNELS = ("aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise")


def one_pass(model, cache, requests: int, tokens: int) -> float:
    start = time.perf_counter()
    hidden = forward_chunks(model, cache, list(range(requests)), [[7] * tokens] * requests, [CONTEXT] * requests)
    model.logits(hidden[:, -1])
    return (time.perf_counter() - start) * 1000


def step_profile(model, cache) -> dict[str, float]:
    """Milliseconds of one AR step by where they go (self time; the profiler slows small ops)."""
    with torch.profiler.profile() as prof:
        wall = one_pass(model, cache, 1, 1)
    events = prof.key_averages()
    torch_ms = sum(e.self_cpu_time_total for e in events) / 1000
    projections = sum(e.self_cpu_time_total for e in events if e.key in PROJECTION_KERNELS) / 1000
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    return {"wall_ms": wall, "projection_and_head_kernels_ms": projections, "other_torch_ms": torch_ms - projections,
            "aten_calls": calls}


def load(path, mode: str):
    if mode != "auto-torch":
        return load_model(path, torch.bfloat16, quantization=mode)
    available = bindings.available
    bindings.available = lambda: False
    try:
        return load_model(path, torch.bfloat16, quantization="auto")
    finally:
        bindings.available = available


def cost(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    models = {mode: load(hub.resolve(args.model), mode) for mode in MODES}
    caches = {}
    with torch.no_grad():
        for mode, model in models.items():
            model.set_batch_invariant(True)
            caches[mode] = new_cache(model, 8, CONTEXT + 16)
            forward_chunks(model, caches[mode], list(range(8)), [[5] * CONTEXT] * 8, [0] * 8)
        times = {(mode, shape): [] for mode in MODES for shape in SHAPES}
        for _ in range(args.repeats):
            for shape in SHAPES:
                for mode in MODES:
                    times[(mode, shape)].append(one_pass(models[mode], caches[mode], *shape))
        profiles = {mode: step_profile(models[mode], caches[mode]) for mode in MODES}
    print(f"bf16, {args.threads} thread(s), {CONTEXT} cached tokens, median of {args.repeats}, ms per pass")
    print("| requests x tokens | " + " | ".join(MODES) + " |\n" + "|---" * (len(MODES) + 1) + "|")
    for shape in SHAPES:
        print(f"| {shape[0]} x {shape[1]} | " + " | ".join(
            f"{statistics.median(times[(mode, shape)]):.1f}" for mode in MODES) + " |")
    print("\none AR step under the profiler (ms; torch's kernels and operations by self time):")
    print("| mode | wall | torch projection + head kernels | other torch operations | aten calls |\n|---|---|---|---|---|")
    for mode, p in profiles.items():
        print(f"| {mode} | {p['wall_ms']:.1f} | {p['projection_and_head_kernels_ms']:.1f} | {p['other_torch_ms']:.1f} "
              f"| {p['aten_calls']} |")


def memory(args: argparse.Namespace) -> None:
    print("| mode | peak RSS (MiB) |\n|---|---|")
    for mode in MODES:
        quantization = "auto" if mode == "auto-torch" else mode
        code = ("import resource, sys; from saguaro import LLM, SamplingParams; "
                f"llm = LLM({args.model!r}, method='ar', quantization={quantization!r}); "
                "llm.generate('def fib(n):', SamplingParams(temperature=0, max_tokens=64), use_tqdm=False); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        env = dict(os.environ, SAGUARO_NATIVE="0" if mode == "auto-torch" else os.environ.get("SAGUARO_NATIVE", "1"))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        print(f"| {mode} | {int(out.stdout.split()[-1]) / 1024:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["cost", "memory"])
    parser.add_argument("--model", default=hub.DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    {"cost": cost, "memory": memory}[args.what](args)


if __name__ == "__main__":
    main()
