"""saguaro AR against llama.cpp on GGUF files of each quantization type and model shape.

Batch-1 greedy decode, the same file, prompts and thread count for both engines: saguaro AR
(`LLM(file, method="ar")`, its default quantization) and llama.cpp (llama-cpp-python), taking
turns prompt by prompt on held-out prompts (HumanEval and ShareGPT alternating), EOS ignored so
that every prompt decodes --max-tokens; a first round warms both up and is dropped. Per file
and thread count: the median decode tok/s of each engine and the ratio of the medians, the
first position where the two engines' greedy tokens differ on each prompt, and the bytes of
weights each engine's decode step reads (bandwidth.py's counts) with the GB/s that makes, as a
share of the machine's read limit at that thread count (bandwidth.py's read_bandwidth, measured
before every round: this VM's limit moves by a third within an hour).

Making the files: the 135m shape re-quantizes the default model (a Q4_1 file with a Q8_0
embedding, so every type of it carries Q4_1's rounding); bigger shapes are written first as an
F16 file of random weights (N(0, 0.02), norms 1, SmolLM2's tokenizer and metadata) under
DIR/sources/, then quantized. Both go through llama.cpp's own quantizer, which, like llama.cpp's
tools, falls back to other types for rows that are not a multiple of the k-quants' 256 (the
135m and 360m shapes' 576 and 960): each file's mix of types is printed as it is made. Files
already in DIR are kept; timing a folder takes its .gguf files, not sources/.

    python benchmarks/gguf_types.py --make gguf_files --shapes 135m,360m,1.7b   # about 19 GB in all
    python benchmarks/gguf_types.py --files gguf_files --threads 1,2 [--prompts 6] [--max-tokens 64] \\
        [--out gguf_types_out]
    python benchmarks/gguf_types.py --files gguf_files/135m-Q4_K_M.gguf,gguf_files/135m-Q8_0.gguf
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import logging
import os
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bandwidth import bytes_per_token, gguf_bytes_per_token, read_bandwidth
from saguaro import LLM, SamplingParams
from saguaro.bench import peers
from saguaro.datasets import humaneval_prompts, sharegpt_first_turns
from saguaro.models import hub
from saguaro.models.gguf_file import read_gguf_file

TYPES = ("Q4_0", "Q4_1", "Q5_K_M", "Q4_K_M", "Q6_K", "Q8_0", "BF16")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    arch: str = "llama"  # "smollm3": llama.cpp then skips rope on every 4th layer; "phi3": fused tensors;
    # "gemma3": q / k norms and norms after attention and the MLP, windows on 5 layers of 6
    rotary: float = 1.0  # the share of each head rope turns
    head_dim: int | None = None  # None: hidden / heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden // self.heads


# None: the source file itself, re-quantized. The others are SmolLM2's shapes (vocabulary 49152,
# head dimension 64, tied embeddings) with random weights.
SHAPES = {"135m": None,
          "360m": Shape(hidden=960, layers=32, heads=15, kv_heads=5, intermediate=2560),
          "1.7b": Shape(hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192),
          # SmolLM3-3B's layers (head dimension 128), with SmolLM2's vocabulary of 49,152 for its 128,256
          "smollm3-3b": Shape(hidden=2048, layers=36, heads=16, kv_heads=4, intermediate=11008, arch="smollm3"),
          # Phi-4-mini's layers (rope over 96 of 128 dimensions; plain rope, no longrope factors),
          # with SmolLM2's vocabulary for its 200,064
          "phi4-mini": Shape(hidden=3072, layers=32, heads=24, kv_heads=8, intermediate=8192, arch="phi3",
                             rotary=0.75),
          # Gemma-3-1B's layers (head dimension 256), with SmolLM2's vocabulary for its 262,144
          "gemma3-1b": Shape(hidden=1152, layers=26, heads=4, kv_heads=1, intermediate=6912, arch="gemma3",
                             head_dim=256)}
_SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "rope.dimension_count", "attention.key_length", "attention.value_length")


def quiet_llamacpp(level: int = logging.ERROR) -> None:
    """llama.cpp logs every model it loads and every tensor it quantizes (each fallback to
    another type at the error level): keep what is at `level` or above."""
    logging.getLogger("llama-cpp-python").setLevel(level)


def layer_tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """llama.cpp's names and shapes (outermost first) for a Llama model with a tied head."""
    head_dim = shape.head_width
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    tensors = [("token_embd.weight", (vocab, shape.hidden))]
    for i in range(shape.layers):
        if shape.arch == "phi3":  # attention's and the MLP's input projections fused, as llama.cpp holds them
            tensors += [(f"blk.{i}.attn_norm.weight", (shape.hidden,)),
                        (f"blk.{i}.attn_qkv.weight", (q + 2 * kv, shape.hidden)),
                        (f"blk.{i}.attn_output.weight", (shape.hidden, q)), (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
                        (f"blk.{i}.ffn_up.weight", (2 * shape.intermediate, shape.hidden)),
                        (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate))]
            continue
        tensors += [(f"blk.{i}.attn_norm.weight", (shape.hidden,)), (f"blk.{i}.attn_q.weight", (q, shape.hidden)),
                    (f"blk.{i}.attn_k.weight", (kv, shape.hidden)), (f"blk.{i}.attn_v.weight", (kv, shape.hidden)),
                    (f"blk.{i}.attn_output.weight", (shape.hidden, q)), (f"blk.{i}.ffn_norm.weight", (shape.hidden,)),
                    (f"blk.{i}.ffn_gate.weight", (shape.intermediate, shape.hidden)),
                    (f"blk.{i}.ffn_up.weight", (shape.intermediate, shape.hidden)),
                    (f"blk.{i}.ffn_down.weight", (shape.hidden, shape.intermediate))]
        if shape.arch == "gemma3":
            tensors += [(f"blk.{i}.attn_q_norm.weight", (head_dim,)), (f"blk.{i}.attn_k_norm.weight", (head_dim,)),
                        (f"blk.{i}.post_attention_norm.weight", (shape.hidden,)),
                        (f"blk.{i}.post_ffw_norm.weight", (shape.hidden,))]
    return tensors + [("output_norm.weight", (shape.hidden,))]


def write_random(source: Path, name: str, shape: Shape, target: Path, seed: int = 0) -> None:
    """An F16 GGUF of the shape with random weights and the source's tokenizer and other
    metadata, written a tensor at a time (norms F32 ones, the rest N(0, 0.02))."""
    import gguf

    reader = gguf.GGUFReader(source)
    source_arch, arch = reader.fields["general.architecture"].contents(), shape.arch
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    overrides = {f"{arch}.{key}": value for key, value in zip(_SHAPE_KEYS, (
        shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads,
        int(shape.rotary * shape.head_width), shape.head_width, shape.head_width))}
    if arch == "gemma3":
        overrides[f"{arch}.attention.sliding_window"] = 512
    overrides |= {"general.file_type": int(gguf.LlamaFileType.MOSTLY_F16), "general.size_label": name.upper(),
                  "general.name": f"random {name}"}
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        key = f"{arch}.{key.removeprefix(source_arch + '.')}" if key.startswith(source_arch + ".") else key
        writer.add_key_value(key, overrides.pop(key, field.contents()), kind, sub)
    for key, value in overrides.items():  # shape keys the source lacks
        if isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    tensors = layer_tensors(shape, vocab)
    for tensor_name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(tensor_name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor_name, dims in tqdm(tensors, desc=f"writing {partial.name}", unit="tensor"):
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
        else:
            writer.write_tensor_data((rng.standard_normal(dims, np.float32) * 0.02).astype(np.float16))
    writer.close()
    partial.replace(target)


def quantize(source: Path, target: Path, kind: str, threads: int) -> None:
    """llama.cpp's quantizer, as its llama-quantize tool runs it (re-quantizing allowed)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    params.nthread = threads
    partial = target.with_suffix(".partial")
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source} to {kind} (status {status})")
    partial.replace(target)


def type_mix(path: Path) -> str:
    """The tensor types of a file by count, most common first: 'q5_0 x120, q8_0 x62, ...'."""
    counts = collections.Counter(t.tensor_type.name for t in read_gguf_file(path).tensors)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common())


def make_files(folder: Path, shapes: list[str], kinds: list[str], source: Path, threads: int) -> None:
    import llama_cpp

    missing = [k for k in kinds if not hasattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{k}")]
    if missing:
        raise SystemExit(f"llama.cpp has no file type {', '.join(missing)}")
    quiet_llamacpp(logging.CRITICAL)  # type_mix() sums up the fallbacks
    folder.mkdir(parents=True, exist_ok=True)
    for name in shapes:
        origin = source
        if SHAPES[name] is not None:
            origin = folder / "sources" / f"{name}-F16.gguf"
            if not origin.exists():
                origin.parent.mkdir(exist_ok=True)
                write_random(source, name, SHAPES[name], origin)
        todo = [k for k in kinds if not (folder / f"{name}-{k}.gguf").exists()]
        for kind in tqdm(todo, desc=f"quantizing {name}", unit="file"):
            target = folder / f"{name}-{kind}.gguf"
            quantize(origin, target, kind, threads)
            tqdm.write(f"{target.name}: {target.stat().st_size / 1e6:.0f} MB; {type_mix(target)}")


def file_order(path: Path) -> tuple:
    """Shapes in SHAPES' order, then types in TYPES' order, then other files by name."""
    shape, _, kind = path.stem.rpartition("-")
    shapes, kinds = list(SHAPES), list(TYPES)
    return (shapes.index(shape) if shape in shapes else len(shapes),
            kinds.index(kind) if kind in kinds else len(kinds), path.name)


def label(path: Path) -> str:
    shape, _, kind = path.stem.rpartition("-")
    return f"{shape.upper()} {kind}" if shape in SHAPES else path.stem


def held_out_prompts(llm: LLM, count: int) -> list[list[int]]:
    """HumanEval and ShareGPT (held-out) prompts alternating, as token ids, as bandwidth.py takes them."""
    code = [llm.encode(p) for p in humaneval_prompts()[:count - count // 2]]
    chat = [llm.encode([{"role": "user", "content": p}])  # (limit=0 would mean all of them)
            for p in sharegpt_first_turns("heldout", seed=0, max_chars=1000)[:count // 2]]
    return [p for pair in zip(code, chat) for p in pair] + code[len(chat):]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (or one ends), None where they agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def time_file(path: Path, threads: list[int], prompt_count: int, max_tokens: int) -> dict:
    """Both engines on one file at each thread count; one model of each engine loaded at a time."""
    llm = LLM(str(path), method="ar")
    prompts = held_out_prompts(llm, prompt_count)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    context = max(len(p) for p in prompts) + max_tokens + 8
    result = {"file": str(path), "label": label(path), "bytes": path.stat().st_size,
              "saguaro_bytes_per_token": bytes_per_token(llm.target),
              "llamacpp_bytes_per_token": gguf_bytes_per_token(path),
              "prompt_tokens": [len(p) for p in prompts], "threads": {}}
    for count in threads:
        torch.set_num_threads(count)
        llama = peers.load_llamacpp(path, count, context)
        rates = {"saguaro": [], "llama.cpp": []}
        differences, limits = [], []
        for i, prompt in enumerate([prompts[0]] + prompts):  # the first round warms both up and is dropped
            limits.append(read_bandwidth(repeats=3))  # it drifts within minutes: measured beside each round
            ours = llm.generate(prompt, params, use_tqdm=False)[0]
            theirs = peers.generate_llamacpp(llama, [prompt], params)[0]
            if i:
                rates["saguaro"].append(ours.metrics.decode_tokens_per_s)
                rates["llama.cpp"].append(theirs["decode_tokens_per_s"])
                differences.append(first_difference(list(ours.token_ids), theirs["token_ids"]))
        llama.close()
        del llama
        gc.collect()
        medians = {name: statistics.median(values) for name, values in rates.items()}
        result["threads"][count] = {"decode_tok_s": rates, "median_tok_s": medians,
                                    "ratio": medians["saguaro"] / medians["llama.cpp"],
                                    "read_limit_gb_s": statistics.median(limits[1:]),
                                    "first_difference": differences}
        tqdm.write(f"{result['label']}, {count} thread(s): saguaro {medians['saguaro']:.1f} tok/s, "
                   f"llama.cpp {medians['llama.cpp']:.1f} tok/s")
    llm.close()
    del llm
    gc.collect()
    return result


def tables(results: list[dict], threads: list[int], prompt_count: int, max_tokens: int) -> str:
    plural = {count: "thread" if count == 1 else "threads" for count in threads}
    lines = [f"Decode tok/s, batch 1, greedy, {prompt_count} held-out prompts x {max_tokens} tokens (EOS ignored), "
             "medians; saguaro AR / llama.cpp on the same file and threads.", "",
             "| file | size | " + " | ".join(f"{n} {plural[n]}: saguaro / llama.cpp" for n in threads) + " |",
             "|---|---|" + "---|" * len(threads)]
    for r in results:
        cells = []
        for count in threads:
            t = r["threads"][count]
            cells.append(f"{t['median_tok_s']['saguaro']:.1f} / {t['median_tok_s']['llama.cpp']:.1f} "
                         f"= {t['ratio']:.2f}x")
        lines.append(f"| {r['label']} | {r['bytes'] / 1e6:.0f} MB | " + " | ".join(cells) + " |")
    lines += ["", "Weights read per token (saguaro: as its kernels hold them; llama.cpp: the file's tensors); each "
              "engine's GB/s at its median rate, as a share of the read limit given after \"of\" (the median of "
              "read_bandwidth measured before each round); the first position where the greedy tokens differ, "
              "per prompt.", "",
              "| file | saguaro MB/token | llama.cpp MB/token | "
              + " | ".join(f"saguaro / llama.cpp GB/s, {n} {plural[n]}" for n in threads) + " | "
              + " | ".join(f"first difference, {n} {plural[n]}" for n in threads) + " |",
              "|---|---|---|" + "---|" * 2 * len(threads)]
    for r in results:
        per = [r["threads"][count] for count in threads]
        gbs = []
        for t in per:
            ours = r["saguaro_bytes_per_token"] * t["median_tok_s"]["saguaro"] / 1e9
            theirs = r["llamacpp_bytes_per_token"] * t["median_tok_s"]["llama.cpp"] / 1e9
            limit = t["read_limit_gb_s"]
            gbs.append(f"{ours:.1f} ({ours / limit:.0%}) / {theirs:.1f} ({theirs / limit:.0%}) of {limit:.1f}")
        diff = [", ".join("none" if d is None else str(d) for d in t["first_difference"]) for t in per]
        lines.append(f"| {r['label']} | {r['saguaro_bytes_per_token'] / 1e6:.1f} | "
                     f"{r['llamacpp_bytes_per_token'] / 1e6:.1f} | " + " | ".join(gbs + diff) + " |")
    return "\n".join(lines)


def listed_files(spec: str) -> list[Path]:
    """A folder's .gguf files (not its sources/) in shape and type order, or comma-separated files."""
    if Path(spec).is_dir():
        return sorted(Path(spec).glob("*.gguf"), key=file_order)
    return [Path(p) for p in spec.split(",") if p]


def numbers(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def names(allowed):
    def parse(text: str) -> list[str]:
        chosen = [n for n in text.split(",") if n]
        unknown = [n for n in chosen if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; known: {', '.join(allowed)}")
        return chosen
    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make", type=Path, metavar="DIR", help="write <shape>-<TYPE>.gguf files into DIR "
                        "(those already there are kept)")
    parser.add_argument("--shapes", type=names(SHAPES), default=["135m"], help=f"for --make, of {', '.join(SHAPES)}")
    parser.add_argument("--types", type=str.upper, default=",".join(TYPES),
                        help="for --make, llama.cpp file types (LLAMA_FTYPE_MOSTLY_<TYPE>)")
    parser.add_argument("--source", type=Path, help="for --make, the file the 135m shape re-quantizes and the "
                        "others copy their metadata from (default: saguaro's default model)")
    parser.add_argument("--make-threads", type=int, default=os.cpu_count(), help="the quantizer's threads")
    parser.add_argument("--files", help="a folder of .gguf files or FILE1,FILE2,... to time")
    parser.add_argument("--threads", type=numbers, default=[1, 2])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, help="a folder for gguf_types.md and gguf_types.json")
    args = parser.parse_args()
    if args.make is None and args.files is None:
        parser.error("give --make DIR, --files, or both")
    if args.make is not None:
        source = args.source or hub.resolve(hub.DEFAULT_MODEL)
        make_files(args.make, args.shapes, [k for k in args.types.split(",") if k], source, args.make_threads)
    if args.files is None:
        return
    files = listed_files(args.files)
    if not files:
        parser.error(f"no .gguf files in {args.files}")
    quiet_llamacpp()
    results = [time_file(path, args.threads, args.prompts, args.max_tokens) for path in files]
    text = tables(results, args.threads, args.prompts, args.max_tokens)
    print(text)
    if args.out is not None:
        import llama_cpp

        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gguf_types.md").write_text(text + "\n")
        environment = {"machine": platform.machine(), "processor": platform.processor(), "cpus": os.cpu_count(),
                       "torch": torch.__version__, "llama_cpp_python": llama_cpp.__version__}
        settings = {"threads": args.threads, "prompts": args.prompts, "max_tokens": args.max_tokens}
        (args.out / "gguf_types.json").write_text(json.dumps(
            {"settings": settings, "environment": environment, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
