"""`saguaro bench`: AR, SD and SSD on the same target, draft and prompts, in one run.

Methods take turns prompt batch by prompt batch (the order rotates), so drift of a shared,
noisy machine hits them alike. All in-process decoding (AR, SD, and SSD's target side) runs on
the same cores; SSD's draft worker gets a core of its own, and `tokens/s per device` charges
it for that.
"""
from __future__ import annotations

import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from saguaro.engine.decoders import ARDecoder, SDDecoder
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.ssd import SSDDecoder, SSDStats
from saguaro.llm import LLM
from saguaro.models import hub
from saguaro.models.loader import load_draft

DEVICES = {"ar": 1, "sd": 1, "ssd": 2}  # devices (cores or GPUs) each method occupies


@dataclass
class BenchConfig:
    model: str = hub.DEFAULT_MODEL
    draft: str | None = None  # default: the shipped draft of the model
    methods: list[str] = field(default_factory=lambda: ["ar", "sd", "ssd"])
    dataset: str = "humaneval"  # humaneval | sharegpt | random
    num_prompts: int = 10
    max_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    num_speculative_tokens: int = 5
    fan_out: str | list[int] = "geometric"
    fan_out_budget: int = 16
    saguaro_c: float = 1.0
    backup: str = "auto"
    dtype: str = "bfloat16"
    chat_template: bool = True
    ignore_eos: bool = True  # every request decodes max_tokens: equal work for every method
    seed: int = 0


def bench_prompts(llm: LLM, config: BenchConfig) -> list[list[int]]:
    """Token ids of the benchmark prompts; held-out ShareGPT turns only (never trained on)."""
    from saguaro.datasets import humaneval_prompts, sharegpt_first_turns

    if config.dataset == "random":
        rng = random.Random(config.seed)
        vocab = llm.target.config.vocab_size
        return [[rng.randrange(vocab) for _ in range(64)] for _ in range(config.num_prompts)]
    if config.dataset == "humaneval":
        texts = humaneval_prompts()[: config.num_prompts]
    elif config.dataset == "sharegpt":
        texts = sharegpt_first_turns("heldout", limit=config.num_prompts, seed=config.seed, max_chars=1500)
    else:
        raise ValueError(f"unknown dataset {config.dataset!r}")
    if config.chat_template:
        return [llm.encode([{"role": "user", "content": t}]) for t in texts]
    return [llm.encode(t) for t in texts]


def build_decoders(llm: LLM, config: BenchConfig) -> dict:
    """One target shared by every method; SSD's decoder is the LLM's own (it owns the worker)."""
    draft_path = hub.resolve(config.draft) if config.draft else hub.default_draft(config.model)
    decoders = {}
    if "ar" in config.methods:
        decoders["ar"] = ARDecoder(llm.target)
    if "sd" in config.methods:
        decoders["sd"] = SDDecoder(llm.target, load_draft(draft_path, llm.target), config.num_speculative_tokens)
    if "ssd" in config.methods:
        decoders["ssd"] = llm.decoder
    return decoders


def run(config: BenchConfig, out_dir: Path | None = None) -> dict:
    torch.manual_seed(config.seed)
    method = "ssd" if "ssd" in config.methods else "sd" if "sd" in config.methods else "ar"
    llm = LLM(config.model, draft=config.draft, method=method, num_speculative_tokens=config.num_speculative_tokens,
              dtype=config.dtype, fan_out=config.fan_out, fan_out_budget=config.fan_out_budget,
              saguaro_c=config.saguaro_c, backup=config.backup)
    if method != "ssd":
        torch.set_num_threads(1)
    decoders = build_decoders(llm, config)
    prompts = bench_prompts(llm, config)
    records, engine = [], {}
    steps = [(t, b, i) for t in config.temperatures for b in config.batch_sizes
             for i in range(0, len(prompts), b)]
    try:
        with tqdm(total=len(steps) * len(decoders), desc="bench", unit="run") as bar:
            for turn, (temperature, batch, start) in enumerate(steps):
                if start == 0 and "ssd" in decoders:
                    decoders["ssd"].stats = SSDStats()
                names = list(decoders)
                names = names[turn % len(names):] + names[:turn % len(names)]
                for name in names:
                    llm.decoder = decoders[name]
                    params = SamplingParams(temperature=temperature, max_tokens=config.max_tokens,
                                            ignore_eos=config.ignore_eos, seed=config.seed + start)
                    began = time.perf_counter()
                    outputs = llm.generate(prompts[start:start + batch], params, use_tqdm=False)
                    wall = time.perf_counter() - began
                    for j, out in enumerate(outputs):
                        records.append({"method": name, "temperature": temperature, "batch": batch,
                                        "prompt": start + j, "batch_wall_s": wall,
                                        "batch_tokens": sum(len(o.token_ids) for o in outputs),
                                        **asdict(out.metrics)})
                    bar.update()
                if start + batch >= len(prompts) and "ssd" in decoders:
                    engine[f"t={temperature},b={batch}"] = decoders["ssd"].stats.summary()
    finally:
        llm.decoder = decoders.get("ssd", llm.decoder)
        llm.close()
    result = {"config": asdict(config), "environment": environment(), "records": records, "ssd_engine": engine,
              "summary": summarize(records, engine)}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "bench.json").write_text(json.dumps(result, indent=1))
        (out_dir / "bench.md").write_text(markdown_table(result["summary"]))
    return result


def fan_out_sweep(config: BenchConfig, fan_outs: list[int], temperature: float = 0.0,
                  out_dir: Path | None = None) -> dict:
    """Cache hit rate of SSD against a uniform fan-out F (F candidates per accepted length),
    and the power law 1 - p_hit = F^-r fitted to it (Definition 11)."""
    from saguaro.draft.fanout import fit_power_law

    llm = LLM(config.model, draft=config.draft, method="ssd", num_speculative_tokens=config.num_speculative_tokens,
              dtype=config.dtype, fan_out=[max(fan_outs)] * (config.num_speculative_tokens + 1),
              saguaro_c=config.saguaro_c, backup=config.backup)
    prompts = bench_prompts(llm, config)
    points = []
    try:
        for f in tqdm(fan_outs, desc="fan-out sweep"):
            llm.decoder.set_fan_out([f] * (config.num_speculative_tokens + 1))
            llm.decoder.stats = SSDStats()
            params = SamplingParams(temperature=temperature, max_tokens=config.max_tokens,
                                    ignore_eos=config.ignore_eos, seed=config.seed)
            for prompt in prompts:
                llm.generate([prompt], params, use_tqdm=False)
            summary = llm.decoder.stats.summary()
            points.append({"fan_out": f, "cache_hit_rate": summary["cache_hit_rate"],
                           "t_p_median": summary["t_p_median"]})
    finally:
        llm.close()
    r = fit_power_law([p["fan_out"] for p in points], [1 - p["cache_hit_rate"] for p in points])
    result = {"temperature": temperature, "points": points, "power_law_r": r}
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"fan_out_t{temperature}.json").write_text(json.dumps(result, indent=1))
    return result


def environment() -> dict:
    import os

    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "processor": platform.processor(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def summarize(records: list[dict], engine: dict) -> list[dict]:
    """One row per (temperature, batch, method): medians and the side-by-side ratios."""
    rows = []
    keys = sorted({(r["temperature"], r["batch"]) for r in records})
    for temperature, batch in keys:
        per_method = {}
        for method in dict.fromkeys(r["method"] for r in records):
            rs = [r for r in records if (r["temperature"], r["batch"], r["method"]) == (temperature, batch, method)]
            if not rs:
                continue
            batches = {r["prompt"] - r["prompt"] % batch: r for r in rs}.values()
            total = statistics.median(b["batch_tokens"] / b["batch_wall_s"] for b in batches)
            lengths = [r["mean_acceptance_length"] for r in rs if r["mean_acceptance_length"]]
            hits = [r["cache_hit_rate"] for r in rs if r["cache_hit_rate"] is not None]
            per_method[method] = {
                "temperature": temperature, "batch": batch, "method": method, "requests": len(rs),
                "decode_tok_s_median": statistics.median(r["decode_tokens_per_s"] for r in rs),
                "decode_tok_s_p10": _quantile([r["decode_tokens_per_s"] for r in rs], 0.1),
                "decode_tok_s_p90": _quantile([r["decode_tokens_per_s"] for r in rs], 0.9),
                "total_tok_s_median": total,
                "tok_s_per_device": total / DEVICES[method],
                "ttft_s_median": statistics.median(r["ttft_s"] for r in rs),
                "acceptance_length_mean": statistics.fmean(lengths) if lengths else None,
                "cache_hit_rate": statistics.fmean(hits) if hits else None,
                "t_p_median": (engine.get(f"t={temperature},b={batch}") or {}).get("t_p_median") if method == "ssd" else None,
            }
        for method, row in per_method.items():
            for base in ("sd", "ar"):
                if method == "ssd" and base in per_method:
                    row[f"ssd_over_{base}"] = row["decode_tok_s_median"] / per_method[base]["decode_tok_s_median"]
            rows.append(row)
    return rows


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def markdown_table(rows: list[dict]) -> str:
    def fmt(x, digits=2):
        return "–" if x is None else f"{x:.{digits}f}"

    lines = ["| temp | batch | method | decode tok/s (median, p10–p90) | total tok/s | tok/s per device "
             "| TTFT s | accept len | hit rate | T_p | SSD/SD | SSD/AR |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['temperature']} | {r['batch']} | {r['method']} | {fmt(r['decode_tok_s_median'], 1)} "
            f"({fmt(r['decode_tok_s_p10'], 1)}–{fmt(r['decode_tok_s_p90'], 1)}) | {fmt(r['total_tok_s_median'], 1)} "
            f"| {fmt(r['tok_s_per_device'], 1)} | {fmt(r['ttft_s_median'], 3)} | {fmt(r['acceptance_length_mean'])} "
            f"| {fmt(r['cache_hit_rate'])} | {fmt(r['t_p_median'])} | {fmt(r.get('ssd_over_sd'))} "
            f"| {fmt(r.get('ssd_over_ar'))} |")
    return "\n".join(lines) + "\n"
