"""What each engine's decode step reads, and how close it comes to the core's streaming limit.

Batch-1 decoding reads every weight once a token, so bytes per token over seconds per token is
the bandwidth an engine reaches, and what the cores read from memory in a plain pass over a
large buffer bounds it. Engines, on the default GGUF, greedy, held-out prompts (HumanEval and
ShareGPT alternating), taking turns prompt by prompt, medians:
  - saguaro AR with its own kernels (the default),
  - saguaro AR on torch's kernels (the same int4 weights, SAGUARO_NATIVE=0's path),
  - saguaro AR with everything dequantized to bf16 (quantization="none"),
  - llama.cpp (llama-cpp-python) on the same file; also its own eval time per token
    (llama_perf), which leaves out llama-cpp-python's Python loop.

    python benchmarks/bandwidth.py [--prompts 6] [--new-tokens 128] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from saguaro import LLM, SamplingParams
from saguaro.bench import peers
from saguaro.datasets import humaneval_prompts, sharegpt_first_turns
from saguaro.models import hub, weight_cache
from saguaro.models.native import bindings
from saguaro.models.gguf_file import read_gguf_file
from saguaro.models.llama import Embedding
from saguaro.models.packed import PackedLinear
from saguaro.models.quantized import QuantizedLinear


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s the cores read summing a buffer far larger than the caches (best of the repeats), on
    2 MB pages as saguaro's weights lie (weight_cache.fresh_buffer): from 4 KB pages the same sum
    read 1.22x less on one core and 1.25x less on two (2026-12-05, engine cce1900)."""
    buffer = weight_cache.fresh_buffer(megabytes * 2**20).view(torch.float32)
    buffer.fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step of a saguaro model reads: each projection as its kernel
    holds it, one row of the embedding table, the head whole."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += sum(b.nbytes for b in module.buffers(recurse=False))
        elif isinstance(module, PackedLinear):
            total += module.in_features * module.out_features * model.dtype.itemsize
        elif isinstance(module, nn.Linear):
            total += module.weight.nbytes
        elif isinstance(module, Embedding):
            total += module.weight[0].nbytes
        elif not list(module.children()):
            total += sum(p.nbytes for p in module.parameters(recurse=False))
    return total


def gguf_bytes_per_token(path) -> int:
    """What llama.cpp reads a token: every tensor of the file once (the tied embedding as head)."""
    return sum(int(t.data.nbytes) for t in read_gguf_file(path).tensors)


def load_saguaro(quantization: str, native_kernels: bool) -> LLM:
    if native_kernels:
        return LLM(hub.DEFAULT_MODEL, method="ar", quantization=quantization)
    available = bindings.available
    bindings.available = lambda: False
    try:
        return LLM(hub.DEFAULT_MODEL, method="ar", quantization=quantization)
    finally:
        bindings.available = available


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = hub.resolve(hub.DEFAULT_MODEL)
    engines = {"saguaro, own kernels": load_saguaro("auto", True),
               "saguaro, torch's int4 kernel": load_saguaro("auto", False),
               "saguaro, bf16 (none)": load_saguaro("none", True)}
    reference = engines["saguaro, own kernels"]
    code = [reference.encode(p) for p in humaneval_prompts()[:args.prompts - args.prompts // 2]]
    chat = [reference.encode([{"role": "user", "content": p}])
            for p in sharegpt_first_turns("heldout", limit=args.prompts // 2, seed=0, max_chars=1000)]
    prompts = [p for pair in zip(code, chat) for p in pair] + code[len(chat):]
    context = max(len(p) for p in prompts) + args.new_tokens + 8
    llama = peers.load_llamacpp(path, args.threads, context)
    import llama_cpp  # present once load_llamacpp succeeded (an optional extra)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    rates = {name: [] for name in [*engines, "llama.cpp", "llama.cpp eval"]}
    for prompt in [prompts[0]] + prompts:  # the first round warms every engine up and is dropped
        for name, llm in engines.items():
            rates[name].append(llm.generate(prompt, params, use_tqdm=False)[0].metrics.decode_tokens_per_s)
        llama_cpp.llama_perf_context_reset(llama.ctx)
        rates["llama.cpp"].append(peers.generate_llamacpp(llama, [prompt], params)[0]["decode_tokens_per_s"])
        perf = llama_cpp.llama_perf_context(llama.ctx)
        rates["llama.cpp eval"].append(1000 * perf.n_eval / perf.t_eval_ms)
    limit = read_bandwidth()
    sizes = {name: bytes_per_token(llm.target) for name, llm in engines.items()}
    sizes["llama.cpp"] = sizes["llama.cpp eval"] = gguf_bytes_per_token(path)
    print(f"{path.name}, batch 1, {args.threads} thread(s), {len(prompts)} prompts x {args.new_tokens} tokens, "
          f"medians; the cores read {limit:.1f} GB/s summing a 512 MiB buffer\n")
    print("| engine | decode tok/s | ms/token | weights MB/token | GB/s | of the read limit |\n|---|---|---|---|---|---|")
    for name, values in rates.items():
        rate = statistics.median(values[1:])
        gbs = sizes[name] * rate / 1e9
        print(f"| {name} | {rate:.1f} | {1000 / rate:.1f} | {sizes[name] / 1e6:.1f} | {gbs:.1f} | {100 * gbs / limit:.0f}% |")


if __name__ == "__main__":
    main()
