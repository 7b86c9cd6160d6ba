"""GB/s of weights that one of saguaro's products reads, by rows of activations: what a
verification of K + 1 tokens costs against a one-token step (a pass over R rows at the same
GB/s as one row costs the same). Optionally against the kernels of another source folder (an
older checkout's saguaro/models/native), the two builds taking turns in one process.

The product is 8192 x 3072 by default (SmolLM3-3B's and Phi-4-mini's MLP widths), its tiles copied until
they fill --megabytes and cycled, so that they come from memory as in a decode step; on 2 MB pages
as a load places weights (weight_cache.fresh_buffer), or on 4 KB pages (--pages 2m,4k takes turns
between the two). Codes
are random; scales are 1.0 (fp16) and sub-scales 1, bf16 weights 1.0, so no denormals or NaNs
slow the arithmetic. Kinds: the widths 4, 5, 6 and 8, iq4, and the GGUF types with kinds of
their own (q4_0, q2_k, q3_k, q4_k, q5_k, q6_k), bf16.

    python benchmarks/tile_rows.py --bits 4,8 --rows 1,2,4,6,8 --threads 1
    python benchmarks/tile_rows.py --bits q4_0,q4_k,q6_k,8,bf16 --rows 1
    python benchmarks/tile_rows.py --against ../old/saguaro/models/native
    python benchmarks/tile_rows.py --bits bf16 --shape 1024x2048 --megabytes 0   # in cache
    python benchmarks/tile_rows.py --bits q4_0,q4_k,q6_k,8,bf16 --rows 1 --pages 2m,4k --shape 2048x8192
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time
from pathlib import Path

import torch

from saguaro.models import weight_cache
from saguaro.models.native import bindings, compiler, packing

WIDTHS = {"4": 4, "5": 5, "6": 6, "8": 8, "iq4": packing.NL4, "q4_0": packing.SYM4, "q4_k": packing.K4, "q5_k": packing.K5,
          "q6_k": packing.K6, "q3_k": packing.K3, "q2_k": packing.K2, "bf16": 16}
# where each kind keeps its fp16 parameters (set to 1.0) and its integer sub-scales (set to 1), in a
# tile or, for the K-quants, in a record of 8 groups
PARAMS = {4: (256, 320), 5: (320, 384), 6: (416, 448), 8: (512, 544), packing.NL4: (256, 288), packing.SYM4: (256, 288),
          packing.K4: (0, 64), packing.K5: (0, 64), packing.K6: (0, 32), packing.K3: (0, 32), packing.K2: (0, 64), 16: (0, 1024)}
SUB_SCALES = {6: (384, 416), packing.K4: (64, 320), packing.K5: (64, 320), packing.K6: (32, 288), packing.K3: (32, 288), packing.K2: (64, 320)}


def load(folder: Path) -> ctypes.CDLL:
    build, flags = next((name, flags) for name, flags in compiler.BUILDS if name == bindings.build())
    lib = ctypes.CDLL(str(compiler.library_path(build, flags, folder)))
    lib.saguaro_group_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_void_p, ctypes.c_int64]
    return lib


def random_tiles(bits: int, out_features: int, in_features: int) -> torch.Tensor:
    groups = 8 if bits in (packing.K2, packing.K3, packing.K4, packing.K5, packing.K6) else 1  # a record's
    tile_bytes = bindings.library().saguaro_tile_bytes(bits) * groups
    tiles = torch.randint(0, 256, (out_features // 16, in_features // 32 // groups, tile_bytes), dtype=torch.uint8)
    if bits in SUB_SCALES:
        start, end = SUB_SCALES[bits]
        tiles[..., start:end] = 1
    start, end = PARAMS[bits]
    one = torch.tensor(1.0, dtype=torch.bfloat16 if bits == 16 else torch.float16)
    tiles[..., start:end] = one.repeat((end - start) // 2).view(torch.uint8)
    return tiles


def copies_on(pages: str, tiles: torch.Tensor, count: int) -> list[torch.Tensor]:
    """`count` copies of the tiles, one after another on 2 MB pages ("2m") or 4 KB pages ("4k")."""
    nbytes = count * tiles.numel()
    if pages == "2m":
        buffer = weight_cache.fresh_buffer(nbytes)
    else:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            mapping.madvise(mmap.MADV_NOHUGEPAGE)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    copies = [buffer[i * tiles.numel():(i + 1) * tiles.numel()] for i in range(count)]
    for copy in copies:
        copy.copy_(tiles.reshape(-1))
    return copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", default="4,8", help=f"tile kinds, of {','.join(WIDTHS)}")
    parser.add_argument("--rows", default="1,2,4,6,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--megabytes", type=int, default=600, help="tiles cycled (0: one copy, from cache if it fits)")
    parser.add_argument("--shape", default="8192x3072", help="OUTxIN of the product")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--against", type=Path, help="another folder of the kernels' sources to compare")
    parser.add_argument("--pages", default="2m", help="where the tiles lie: 2m, 4k, or both (2m,4k)")
    args = parser.parse_args()
    if bindings.build() is None:
        raise SystemExit("saguaro's kernels do not run on this machine")
    builds = {"this": load(Path(compiler.__file__).parent)}
    if args.against:
        builds["against"] = load(args.against.resolve())
    pages = args.pages.split(",")
    libraries = {f"{build}, {page} pages" if len(pages) > 1 else build: (lib, page)
                 for build, lib in builds.items() for page in pages}
    out_features, in_features = map(int, args.shape.split("x"))
    print(f"build {bindings.build()}, {args.threads} thread(s); GB/s of tiles read, medians of {args.repeats}")
    print("| tiles | rows | " + " | ".join(libraries) + " |")
    print("|---|---|" + "---|" * len(libraries))
    for name in args.bits.split(","):
        bits = WIDTHS[name]
        tiles = random_tiles(bits, out_features, in_features)
        count = max(1, args.megabytes * 2**20 // tiles.numel())
        copies = {page: copies_on(page, tiles, count) for page in pages}
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features).to(torch.bfloat16)
            out = torch.empty(rows, out_features, dtype=torch.bfloat16)
            seconds: dict[str, list[float]] = {label: [] for label in libraries}
            for _ in range(args.repeats):
                for label, (lib, page) in libraries.items():  # taking turns
                    start = time.perf_counter()
                    for copy in copies[page]:
                        lib.saguaro_group_matmul(bits, copy.data_ptr(), x.data_ptr(), out.data_ptr(), rows,
                                                 in_features, out_features, 0, args.threads, None, 0)
                    seconds[label].append(time.perf_counter() - start)
            gigabytes = count * tiles.numel() / 1e9
            rates = [f"{gigabytes / statistics.median(seconds[label]):.1f}" for label in libraries]
            print(f"| {name} | {rows} | " + " | ".join(rates) + " |", flush=True)


if __name__ == "__main__":
    main()
