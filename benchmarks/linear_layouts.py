"""How fast one core streams SmolLM2's projection weights for a single fp32 row of activations,
in each weight layout saguaro could keep (GB/s of weights read; the reason `PackedLinear` keeps
fp32 weights in blocks of 16 outputs for single rows).

Each shape is timed over 30 copies of the weight, as many as the model has layers, so that
the weights come from memory and not from cache, as they do in a decode step.

    python benchmarks/linear_layouts.py [--copies 30] [--repeats 7]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from saguaro.models.packed import output_blocks

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
BLOCKS = (8, 16, 32, 48)


def best_seconds(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def bmm_blocks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.bmm(x.reshape(1, 1, -1).expand(w.shape[0], 1, -1), w)


# name -> (how the weight is stored, how x @ weight.T is computed from it)
LAYOUTS = {
    "row-major (BLAS)": (lambda w: w, F.linear),
    "column-major (BLAS)": (lambda w: w.t().contiguous().t(), F.linear),
    "oneDNN packed": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
                      lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
    **{f"bmm, blocks of {b}": (lambda w, b=b: output_blocks(w, b), bmm_blocks) for b in BLOCKS},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    big = torch.ones(2**27)
    print(f"one core reads {big.nbytes / best_seconds(big.sum, args.repeats) / 1e9:.1f} GB/s (tensor.sum)\n")
    rows, totals = [], {}
    for name, (out_features, in_features) in SHAPES.items():
        copies = args.copies if name != "head" else 1
        weights = [torch.randn(out_features, in_features) for _ in range(copies)]
        x = torch.randn(1, in_features)
        cells = []
        for layout, (store, run) in LAYOUTS.items():
            stored = [store(w) for w in weights]
            seconds = best_seconds(lambda: [run(x, w) for w in stored], args.repeats)
            totals[layout] = totals.get(layout, 0.0) + seconds * (30 if name != "head" else 1) / copies
            cells.append(f"{sum(w.nbytes for w in weights) / seconds / 1e9:.1f}")
        rows.append(f"| {name} {out_features} x {in_features} | " + " | ".join(cells) + " |")
    names = list(LAYOUTS)
    print("| weight | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    print("\n".join(rows))
    print("| all of one step (30 layers + head), ms | " + " | ".join(f"{1000 * totals[n]:.1f}" for n in names) + " |")


if __name__ == "__main__":
    main()
