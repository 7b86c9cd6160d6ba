"""How close saguaro's multi-row products come to the core's arithmetic limit, and what verifying
K + 1 tokens costs against one step.

1. peak: one core's int8 multiply-add peak (AVX512-VNNI `vpdpbusd`, 64 a instruction) and bf16
   peak (`vdpbf16ps`, 32), from a tiny C loop of independent chains compiled here: the best of
   the repeats, in multiply-adds a second and GFLOP-equivalents (2 per multiply-add).
2. products: each tile kind's product (random tiles, tile_rows.py's, cycled from memory as in a
   pass) at 1 to 64 rows, as a share of that peak (int8 kinds of the int8 peak, bf16 of bf16's).
3. layers: a pass through every decoder layer of a 1.7B-cost model (random tiles; the twin of
   issue 53 by default: SmolLM2-135M widened to hidden 1920, 30 heads over 10 kv heads, FFN 7680,
   30 layers, Q4_1 projections) and its Q8_0 head over every row, 256 cached tokens: one token
   (a step) against 6 (a verification of K = 5), and their ratio.
4. breakdown: that pass's products one by one (each projection over every layer, the head), ms
   a pass and share of the int8 peak; the rest of the pass is attention, norms and rope.

With --against, the kernels of another folder of sources (an older checkout's
saguaro/models/native) run the same work in the same process, the two taking turns; medians.
On one thread times are the thread's CPU time, so that other processes on a shared machine
count less (they still share the memory's bandwidth).

    python benchmarks/peak.py --threads 1
    python benchmarks/peak.py --against ../old/saguaro/models/native --kinds q4_1,q4_k --rows 1,6
    python benchmarks/peak.py --what layers --context 1024 --against ../old/saguaro/models/native
    python benchmarks/peak.py --what layers,breakdown --repeats 9
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from saguaro.models.native import bindings, compiler
from tile_rows import WIDTHS, copies_on, load, random_tiles

LOOP = r"""
#include <immintrin.h>
/* n rounds of 16 independent multiply-add chains, the accumulators named so that they stay in
 * registers (12 chains did not keep the int8 unit busy); returns a sum so that nothing is dropped */
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
__attribute__((target("avx512f,avx512bw,avx512vnni"))) int vnni(long n, const int *w, const int *x) {
    const __m512i a = _mm512_loadu_si512(w), b = _mm512_loadu_si512(x);
#define ZERO(c) __m512i acc##c = _mm512_set1_epi32(c);
#define STEP(c) acc##c = _mm512_dpbusd_epi32(acc##c, a, b);
#define SUM(c) sum += _mm512_reduce_add_epi32(acc##c);
    CHAINS(ZERO)
    for (long i = 0; i < n; i++) { CHAINS(STEP) }
    int sum = 0;
    CHAINS(SUM)
    return sum;
}
__attribute__((target("avx512f,avx512bf16"))) float bf16(long n, const int *w, const int *x) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(w), b = (__m512bh)_mm512_loadu_si512(x);
#undef ZERO
#undef STEP
#undef SUM
#define ZERO(c) __m512 acc##c = _mm512_set1_ps((float)c);
#define STEP(c) acc##c = _mm512_dpbf16_ps(acc##c, a, b);
#define SUM(c) sum += _mm512_reduce_add_ps(acc##c);
    CHAINS(ZERO)
    for (long i = 0; i < n; i++) { CHAINS(STEP) }
    float sum = 0;
    CHAINS(SUM)
    return sum;
}
"""
CHAINS = 16
# multiply-adds one instruction does: 16 lanes of 4 byte pairs, or of 2 bf16 pairs
MACS = {"vnni": 64, "bf16": 32}
# the kinds by their GGUF type's name (tile_rows.py's names)


def clock(threads: int = 1) -> float:
    """Seconds: on one thread the calling thread's CPU time, where the kernels then run, so that
    on a shared machine the time other processes hold the core is not counted; else wall time."""
    return time.thread_time() if threads == 1 else time.perf_counter()


KINDS = {"q4_0": "q4_0", "q4_1": "4", "q4_k": "q4_k", "q5_k": "q5_k", "q6_k": "q6_k", "q8_0": "8", "bf16": "bf16"}


@dataclass
class Shape:
    """A model's decoder shape, and the kind of its projections and head."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    kind: str
    head_kind: str


SHAPES = {"twin": Shape(1920, 30, 10, 64, 7680, 30, 49152, "q4_1", "q8_0"),  # issue 53's twin of SmolLM2-135M
          "1.7b": Shape(2048, 32, 32, 64, 8192, 24, 49152, "q4_k", "q6_k")}  # SmolLM2-1.7B, as a Q4_K_M file's


def peak(repeats: int) -> dict[str, float]:
    """Multiply-adds a second of one core, best of the repeats, per instruction kind."""
    with tempfile.TemporaryDirectory() as folder:
        source, library = Path(folder) / "peak.c", Path(folder) / "peak.so"
        source.write_text(LOOP)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
        lib = ctypes.CDLL(str(library))
    operands = (ctypes.c_int * 16)(*[0x01010101] * 16)
    rates = {}
    for name in MACS:
        function = getattr(lib, name)
        function.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        rounds, best = 2_000_000, float("inf")
        for _ in range(repeats):
            start = clock()
            function(rounds, operands, operands)
            best = min(best, clock() - start)
        rates[name] = rounds * CHAINS * MACS[name] / best
    return rates


def product_shares(libraries: dict[str, ctypes.CDLL], kinds: list[str], rows: list[int], shape: Shape,
                   peaks: dict[str, float], args: argparse.Namespace) -> None:
    """Each kind's products of the model's widest projection (gate and up), as a share of the peak."""
    out_features, in_features = 2 * shape.intermediate, shape.hidden
    if any(k in ("q4_k", "q5_k", "q6_k") for k in kinds) and in_features % 256:
        raise SystemExit(f"hidden {in_features} is not a multiple of 256: K-quants need --shape 1.7b")
    print(f"\nproducts {out_features}x{in_features} from memory, {args.threads} thread(s): share of one core's peak "
          f"x threads (int8 kinds: vpdpbusd's, bf16: vdpbf16ps'), medians of {args.repeats}")
    print("| kind | rows | " + " | ".join(libraries) + " |\n|---|---|" + "---|" * len(libraries))
    for kind in kinds:
        bits = WIDTHS[KINDS[kind]]
        tiles = random_tiles(bits, out_features, in_features)
        copies = copies_on("2m", tiles, max(1, args.megabytes * 2**20 // tiles.numel()))
        limit = peaks["bf16" if bits == 16 else "vnni"] * args.threads
        for count in rows:
            x = torch.randn(count, in_features).to(torch.bfloat16)
            out = torch.empty(count, out_features, dtype=torch.bfloat16)
            seconds: dict[str, list[float]] = {label: [] for label in libraries}
            for _ in range(args.repeats):
                for label, lib in libraries.items():  # taking turns
                    start = clock(args.threads)
                    for copy in copies:
                        lib.saguaro_group_matmul(bits, copy.data_ptr(), x.data_ptr(), out.data_ptr(), count,
                                                 in_features, out_features, 0, args.threads, None, 0)
                    seconds[label].append(clock(args.threads) - start)
            macs = len(copies) * count * out_features * in_features
            print(f"| {kind} | {count} | " + " | ".join(
                f"{macs / statistics.median(seconds[label]) / limit:.0%}" for label in libraries) + " |", flush=True)


class Model:
    """Random tiles of a model's shape: its layers as decoder_layer.c takes them, its head, a KV cache."""

    def __init__(self, shape: Shape, context: int, most_tokens: int):
        self.shape = shape
        bits, qkv = WIDTHS[KINDS[shape.kind]], (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        ones = torch.ones(max(shape.hidden, shape.head_dim), dtype=torch.bfloat16)
        self.kept = [ones]
        self.projections = []  # each layer's tiles by name, with their (outputs, inputs)
        layers = []
        for _ in range(shape.layers):
            projections = {name: random_tiles(bits, out_features, in_features)
                           for name, out_features, in_features in (
                               ("qkv", qkv, shape.hidden), ("o", shape.hidden, shape.heads * shape.head_dim),
                               ("gate_up", 2 * shape.intermediate, shape.hidden),
                               ("down", shape.hidden, shape.intermediate))}
            self.kept += projections.values()
            self.projections.append({name: (tiles, (out_features, in_features)) for (name, out_features, in_features), tiles
                                     in zip((("qkv", qkv, shape.hidden), ("o", shape.hidden, shape.heads * shape.head_dim),
                                             ("gate_up", 2 * shape.intermediate, shape.hidden),
                                             ("down", shape.hidden, shape.intermediate)), projections.values())})
            layers.append(bindings.LayerWeights(
                hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                intermediate=shape.intermediate, eps=1e-5, input_norm=ones.data_ptr(), post_norm=ones.data_ptr(),
                rope=1, rotary_dim=shape.head_dim, norm_offset=0.0,
                **{name: tiles.data_ptr() for name, tiles in projections.items()},
                **{f"{name}_bits": bits for name in projections}))
        self.layers = (bindings.LayerWeights * len(layers))(*layers)
        self.head_bits = WIDTHS[KINDS[shape.head_kind]]
        self.head = random_tiles(self.head_bits, shape.vocab, shape.hidden)
        self.slots = context + max(most_tokens, 16)  # a pass's tokens are written after the cached ones
        cache_shape = (shape.layers, 1, shape.kv_heads, self.slots, shape.head_dim)
        self.keys = (torch.randn(cache_shape) * 0.1).to(torch.bfloat16)
        self.values = (torch.randn(cache_shape) * 0.1).to(torch.bfloat16)
        self.context = context

    def pass_seconds(self, lib: ctypes.CDLL, tokens: int, threads: int) -> float:
        """One pass of `tokens` new tokens after the cached ones, the head over every token."""
        s = self.shape
        x = (torch.randn(tokens, s.hidden) * 0.5).to(torch.bfloat16)
        angles = torch.rand(tokens, s.head_dim // 2)
        cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
        rows = torch.zeros(tokens, dtype=torch.int64)
        slots = torch.arange(self.context, self.context + tokens, dtype=torch.int64)
        span = self.context + tokens
        mask = torch.ones(tokens, span, dtype=torch.uint8).tril(self.context)
        logits = torch.empty(tokens, s.vocab)
        start = clock(threads)
        status = lib.saguaro_decoder_layers(
            self.layers, s.layers, x.data_ptr(), tokens, cos.data_ptr(), sin.data_ptr(), self.keys.data_ptr(),
            self.values.data_ptr(), self.keys[0].numel(), self.slots, rows.data_ptr(), slots.data_ptr(),
            mask.data_ptr(), span, self.kept[0].data_ptr(), None, None, None, threads)
        status = status or lib.saguaro_group_matmul(self.head_bits, self.head.data_ptr(), x.data_ptr(),
                                                    logits.data_ptr(), tokens, s.hidden, s.vocab, 1, threads,
                                                    None, 0)
        if status:
            raise RuntimeError(f"the kernels failed ({status})")
        return clock(threads) - start


def verification_cost(libraries: dict[str, ctypes.CDLL], model: Model, shape_name: str, tokens: list[int],
                      args: argparse.Namespace) -> None:
    print(f"\nlayers and head of the {shape_name} shape ({model.shape}), {args.context} cached tokens, "
          f"{args.threads} thread(s), ms a pass, medians of {args.repeats}")
    print("| tokens | " + " | ".join(libraries) + " |\n|---|" + "---|" * len(libraries))
    ms = {(label, n): [] for label in libraries for n in tokens}
    for _ in range(args.repeats):
        for n in tokens:
            for label, lib in libraries.items():  # taking turns
                ms[(label, n)].append(model.pass_seconds(lib, n, args.threads) * 1000)
    medians = {key: statistics.median(values) for key, values in ms.items()}
    for n in tokens:
        print(f"| {n} | " + " | ".join(f"{medians[(label, n)]:.1f}" for label in libraries) + " |")
    for n in tokens[1:]:
        print(f"| {n} / {tokens[0]} | " + " | ".join(
            f"{medians[(label, n)] / medians[(label, tokens[0])]:.2f}" for label in libraries) + " |")


def product_costs(libraries: dict[str, ctypes.CDLL], model: Model, peaks: dict[str, float], tokens: list[int],
                  args: argparse.Namespace) -> None:
    """Each product of a pass (a projection over every layer, the head once) at each token count:
    ms a pass and share of the int8 peak (x threads); what the pass takes beyond them is attention,
    norms, rope and the rest."""
    s = model.shape
    bits = WIDTHS[KINDS[s.kind]]
    products = {name: [(layer[name][0], *layer[name][1], bits, 0) for layer in model.projections]
                for name in ("qkv", "o", "gate_up", "down")}  # bf16 out, as in the layers; the head's in fp32
    products["head"] = [(model.head, s.vocab, s.hidden, model.head_bits, 1)]
    limit = peaks["vnni"] * args.threads
    print(f"\nthe products of a pass of the {args.shape} shape, {args.threads} thread(s), medians of {args.repeats}: "
          "ms a pass (share of the int8 peak)")
    print("| product | tokens | " + " | ".join(libraries) + " |\n|---|---|" + "---|" * len(libraries))
    for name, parts in products.items():
        for n in tokens:
            x = (torch.randn(n, max(p[2] for p in parts)) * 0.5).to(torch.bfloat16)
            out = torch.empty(n, max(p[1] for p in parts), dtype=torch.float32)
            seconds: dict[str, list[float]] = {label: [] for label in libraries}
            for _ in range(args.repeats):
                for label, lib in libraries.items():  # taking turns
                    start = clock(args.threads)
                    for tiles, out_features, in_features, kind, fp32 in parts:
                        lib.saguaro_group_matmul(kind, tiles.data_ptr(), x.data_ptr(), out.data_ptr(), n, in_features,
                                                 out_features, fp32, args.threads, None, 0)
                    seconds[label].append(clock(args.threads) - start)
            macs = n * sum(out_features * in_features for _, out_features, in_features, _, _ in parts)
            print(f"| {name} | {n} | " + " | ".join(
                f"{1000 * statistics.median(seconds[label]):.1f} ({macs / statistics.median(seconds[label]) / limit:.0%})"
                for label in libraries) + " |", flush=True)
    print("| attention | tokens | " + " | ".join(libraries) + " |")
    for n in tokens:  # every layer's, over its cache (libraries without saguaro_attention: -)
        qkv = (torch.randn(n, (s.heads + 2 * s.kv_heads) * s.head_dim)).to(torch.bfloat16)
        attn = torch.empty(n, s.heads * s.head_dim, dtype=torch.bfloat16)
        rows = torch.zeros(n, dtype=torch.int64)
        span = model.context + n
        mask = torch.ones(n, span, dtype=torch.uint8).tril(model.context)
        seconds = {label: [] for label, lib in libraries.items() if hasattr(lib, "saguaro_attention")}
        for _ in range(args.repeats):
            for label in seconds:
                start = clock(args.threads)
                for i in range(s.layers):
                    libraries[label].saguaro_attention(
                        ctypes.byref(model.layers[i]), qkv.data_ptr(), n, model.keys[i].data_ptr(),
                        model.values[i].data_ptr(), model.slots, rows.data_ptr(), mask.data_ptr(), span,
                        attn.data_ptr(), args.threads)
                seconds[label].append(clock(args.threads) - start)
        print(f"| attention | {n} | " + " | ".join(
            f"{1000 * statistics.median(seconds[label]):.1f}" if label in seconds else "-" for label in libraries) + " |")


def with_layer_calls(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name in ("saguaro_decoder_layers", "saguaro_attention"):
        if hasattr(lib, name):  # an older checkout's kernels may lack saguaro_attention
            getattr(lib, name).argtypes = getattr(bindings.library(), name).argtypes
            getattr(lib, name).restype = ctypes.c_int
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", default="products,layers",
                        help="of products, layers, breakdown (the peak is always measured)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    parser.add_argument("--rows", default="1,2,4,6,8,16,64")
    parser.add_argument("--tokens", default="1,6", help="tokens a pass of the layers: the first is the step")
    parser.add_argument("--shape", default="twin", choices=list(SHAPES), help="the layers' shape")
    parser.add_argument("--product-shape", default="1.7b", choices=list(SHAPES), help="the products' shape")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="1: times are the thread's CPU time")
    parser.add_argument("--megabytes", type=int, default=200, help="tiles cycled in the products")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--against", type=Path, help="another folder of the kernels' sources to compare")
    args = parser.parse_args()
    if bindings.build() != "avx512":
        raise SystemExit("this benchmark measures the AVX512-VNNI build")
    what = args.what.split(",")
    libraries = {"this": with_layer_calls(load(Path(compiler.__file__).parent))}
    if args.against:
        libraries["against"] = with_layer_calls(load(args.against.resolve()))
    peaks = peak(args.repeats)
    print(f"one core's peak: int8 {peaks['vnni'] / 1e9:.0f} G multiply-adds/s ({2 * peaks['vnni'] / 1e9:.0f} GFLOP-eq), "
          f"bf16 {peaks['bf16'] / 1e9:.0f} G ({2 * peaks['bf16'] / 1e9:.0f} GFLOP-eq), best of {args.repeats}")
    if "products" in what:
        product_shares(libraries, args.kinds.split(","), [int(r) for r in args.rows.split(",")],
                       SHAPES[args.product_shape], peaks, args)
    tokens = [int(t) for t in args.tokens.split(",")]
    if "layers" in what or "breakdown" in what:
        model = Model(SHAPES[args.shape], args.context, max(tokens))
        if "layers" in what:
            verification_cost(libraries, model, args.shape, tokens, args)
        if "breakdown" in what:
            product_costs(libraries, model, peaks, tokens, args)


if __name__ == "__main__":
    main()
