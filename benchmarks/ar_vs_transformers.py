"""Decode speed of saguaro's autoregressive (AR) decoder against Hugging Face transformers'
`generate` on SmolLM2-135M: one CPU core, batch 1, fp32 and bf16, medians over real prompts
run interleaved (so that machine noise hits both engines alike).

Batch-1 decoding is memory-bound: every token reads all the weights once. The report turns
time per token into achieved bandwidth (weight bytes per token / seconds per token) and
compares it with what one core moves in a plain large tensor copy.

    python benchmarks/ar_vs_transformers.py [--prompts 10] [--new-tokens 128] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from saguaro import LLM, SamplingParams
from saguaro.bench import peers
from saguaro.datasets import humaneval_prompts, sharegpt_first_turns
from saguaro.models import hub
from saguaro.models.llama import LlamaModel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """GB/s one core moves copying a tensor far larger than the caches (bytes read + written)."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def weight_bytes_per_token(model: LlamaModel) -> int:
    """Bytes of weights one decode step reads: every matrix once, of the embedding table one
    row (the tied head reads it all: the state dict lists it again as lm_head.weight)."""
    state = model.state_dict()
    table = state["embed_tokens.weight"]
    total = sum(v.numel() * v.element_size() for v in state.values() if v.is_floating_point())
    return total - table.nbytes + table[0].nbytes


def kv_bytes_per_token(model: LlamaModel, context: float) -> float:
    """Bytes of cached keys and values one decode step reads at a given context length."""
    c = model.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * context * model.embed_tokens.weight.element_size()


def load_prompts(llm: LLM, n: int) -> list[list[int]]:
    """Half HumanEval (raw), half held-out ShareGPT first turns (chat template), alternating."""
    code = [llm.encode(p) for p in humaneval_prompts()[:n - n // 2]]
    chat = [llm.encode([{"role": "user", "content": p}])
            for p in sharegpt_first_turns("heldout", limit=n // 2, seed=0, max_chars=1000)]
    return [p for pair in zip(code, chat) for p in pair] + code[len(chat):]


def saguaro_decode(llm: LLM, prompt: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """(decode tokens/s after the first token, the tokens)."""
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)[0]
    return out.metrics.decode_tokens_per_s, out.token_ids


def transformers_decode(model, prompt: list[int], new_tokens: int, pad_id: int) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    record = peers.generate(model, [prompt], params, pad_id)[0]
    return record["decode_tokens_per_s"], record["token_ids"]


def until_eos(tokens: list[int], eos: set[int]) -> int:
    return next((i for i, t in enumerate(tokens) if t in eos), len(tokens))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run(num_prompts: int, new_tokens: int) -> dict:
    torch.set_num_threads(1)
    engines = {}
    for name, dtype in DTYPES.items():
        engines[("saguaro", name)] = LLM(hub.DEFAULT_MODEL, method="ar", dtype=dtype)
        engines[("transformers", name)] = peers.load_target(hub.resolve(hub.DEFAULT_MODEL), dtype)
    reference = engines[("saguaro", "fp32")]
    prompts = load_prompts(reference, num_prompts)
    pad_id = reference.eos_token_ids[0]

    def decode(key, prompt, n):
        engine = engines[key]
        if key[0] == "saguaro":
            return saguaro_decode(engine, prompt, n)
        return transformers_decode(engine, prompt, n, pad_id)

    for key in engines:  # warm-up: first calls pay for allocation and kernel selection
        decode(key, prompts[0], 8)
    rates = {key: [] for key in engines}
    tokens = {key: [] for key in engines}
    for prompt in prompts:
        for key in engines:
            rate, out = decode(key, prompt, new_tokens)
            rates[key].append(rate)
            tokens[key].append(out)

    copy_gbs = copy_bandwidth()
    context = statistics.fmean(len(p) for p in prompts) + new_tokens / 2
    rows = []
    for (engine, name), values in rates.items():
        model = engines[("saguaro", name)].target
        weights = weight_bytes_per_token(model)
        median = statistics.median(values)
        rows.append({"engine": engine, "dtype": name, "decode_tokens_per_s": median,
                     "ms_per_token": 1000 / median, "weight_mb_per_token": weights / 1e6,
                     "kv_mb_per_token": kv_bytes_per_token(model, context) / 1e6,
                     "achieved_gb_per_s": weights * median / 1e9,
                     "fraction_of_copy_bandwidth": weights * median / 1e9 / copy_gbs,
                     "all_tokens_per_s": values})
    speedups = {name: statistics.median(rates[("saguaro", name)]) / statistics.median(rates[("transformers", name)])
                for name in DTYPES}
    # transformers' min_new_tokens forbids EOS, saguaro's ignore_eos samples it: compare up to it.
    eos = set(reference.eos_token_ids)
    same = [a[:until_eos(a, eos)] == b[:until_eos(a, eos)]
            for a, b in zip(tokens[("saguaro", "fp32")], tokens[("transformers", "fp32")])]
    bf16 = [first_difference(a, b) for a, b in zip(tokens[("saguaro", "fp32")], tokens[("saguaro", "bf16")])]
    return {"threads": torch.get_num_threads(), "prompts": len(prompts), "new_tokens": new_tokens,
            "mean_context": context, "copy_bandwidth_gb_per_s": copy_gbs, "results": rows,
            "speedup_saguaro_over_transformers": speedups,
            "fp32_outputs_identical_to_transformers": sum(same),
            "bf16_first_divergence_from_fp32": bf16}


def markdown(report: dict) -> str:
    lines = [f"SmolLM2-135M, batch 1, {report['threads']} thread, {report['prompts']} prompts x "
             f"{report['new_tokens']} new tokens (medians); one-core copy bandwidth "
             f"{report['copy_bandwidth_gb_per_s']:.1f} GB/s (read + write)", "",
             "| engine | dtype | decode tok/s | ms/token | weights MB/token | achieved GB/s | of copy bandwidth |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['engine']} | {r['dtype']} | {r['decode_tokens_per_s']:.1f} | {r['ms_per_token']:.1f} | "
                     f"{r['weight_mb_per_token']:.0f} | {r['achieved_gb_per_s']:.1f} | "
                     f"{100 * r['fraction_of_copy_bandwidth']:.0f}% |")
    lines += ["", "saguaro / transformers: " + ", ".join(
        f"{name} {x:.2f}x" for name, x in report["speedup_saguaro_over_transformers"].items()),
        f"fp32 greedy outputs identical to transformers (up to EOS): {report['fp32_outputs_identical_to_transformers']}"
        f"/{report['prompts']}; bf16 first divergence from fp32 (token index, None = identical): "
        f"{report['bf16_first_divergence_from_fp32']}",
        f"KV cache read per token at the mean context ({report['mean_context']:.0f} tokens): "
        + ", ".join(f"{r['dtype']} {r['kv_mb_per_token']:.1f} MB" for r in report["results"] if r["engine"] == "saguaro")]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench_out/ar_vs_transformers.json"))
    args = parser.parse_args()
    report = run(args.prompts, args.new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(markdown(report))


if __name__ == "__main__":
    main()
