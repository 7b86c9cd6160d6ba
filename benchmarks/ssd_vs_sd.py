"""Issue 35's headline comparison: does SSD's extra core pay? SD with its target and draft on one
core against SSD with its target on one core and its worker on the other, both at their
defaults, taking turns prompt by prompt on held-out chat and HumanEval prompts; decode tok/s
medians and the median of the paired ratios.

    python benchmarks/ssd_vs_sd.py [--temperature 0] [--prompts 8] [--max-tokens 128] \
        [--ssd-draft PATH] [--fan-out-budget N] [--sd-k K] [--ssd-k K]

--ssd-draft gives SSD's worker a draft of its own (SD keeps the shipped one); a deeper draft
fills fewer branches within a verification, which --fan-out-budget sets.
"""
from __future__ import annotations

import argparse
import statistics

from saguaro import LLM, SamplingParams
from saguaro.bench.runner import BenchConfig, bench_prompts

SSD_FIGURES = ("cache_hit_rate", "acceptance_length_hit", "acceptance_length_miss_neural", "misses_bonus",
               "misses_length", "misses_unfilled", "misses_lost", "t_p_median", "verify_s_median", "fill_s_median",
               "target_wait_s_median", "exchange_s_median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ssd-draft", help="SSD's draft (default: SSD's default)")
    parser.add_argument("--sd-k", type=int, default=5, help="SD's draft tokens per round")
    parser.add_argument("--ssd-k", type=int, default=5, help="SSD's draft tokens per round")
    parser.add_argument("--fan-out-budget", type=int, default=16, help="SSD's cached branches per request")
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    engines = {"sd": LLM(method="sd", num_threads=1, num_speculative_tokens=args.sd_k),
               "ssd": LLM(method="ssd", ssd_draft=args.ssd_draft, num_speculative_tokens=args.ssd_k,
                          fan_out_budget=args.fan_out_budget)}
    try:
        for dataset in ("sharegpt", "humaneval"):
            prompts = bench_prompts(engines["sd"], dataset, BenchConfig(num_prompts=args.prompts, seed=7))
            for llm in engines.values():
                llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
            rates: dict[str, list[float]] = {name: [] for name in engines}
            for prompt in prompts:
                for name, llm in engines.items():
                    rates[name].append(llm.generate([prompt], params, use_tqdm=False)[0].metrics.decode_tokens_per_s)
            ratios = [ssd / sd for sd, ssd in zip(rates["sd"], rates["ssd"])]
            print(f"{dataset}, T = {args.temperature}: SD {statistics.median(rates['sd']):.1f}, SSD "
                  f"{statistics.median(rates['ssd']):.1f} tok/s; SSD / SD {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}); SSD's hit rate so far "
                  f"{engines['ssd'].metrics().get('cache_hit_rate') or 0:.2f}", flush=True)
        ssd = engines["ssd"].metrics()
        print("SSD over both sets: " + ", ".join(f"{key} {ssd.get(key)}" for key in SSD_FIGURES), flush=True)
    finally:
        for llm in engines.values():
            llm.close()


if __name__ == "__main__":
    main()
