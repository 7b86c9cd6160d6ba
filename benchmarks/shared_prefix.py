"""What prefix caching and n > 1 buy: requests that share a long system prompt, and n samples of
one prompt, with the prefix cache on and off, side by side.

Scenarios (each run `--repeats` times, the two settings taking turns, medians reported):
  prefill  one request whose ~500-token system prompt an earlier request left in the cache,
           with a question never asked before, against the same request without the cache:
           time to first token;
  system   8 requests with one ~500-token system prompt (ShareGPT text) and 8 different
           questions, arriving together (one batch), the cache empty at the start;
  n=8      one prompt, 8 samples at T = 0.7: `n = 8` with the cache against 8 copies of
           the prompt without it (what saguaro ran before n > 1 existed).
Reported per run: median time to first token, total output tokens/s, SSD cache hit rate,
prefix-cache hit tokens.

    python benchmarks/shared_prefix.py --methods ar,ssd [--repeats 3] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from saguaro import LLM, SamplingParams
from saguaro.datasets import sharegpt_first_turns
from saguaro.models.prefix_cache import new_prefix_cache

SYSTEM_TOKENS = 500


def system_prompt(llm: LLM) -> str:
    """About SYSTEM_TOKENS tokens of held-out ShareGPT text, framed as a system prompt."""
    text = " ".join(sharegpt_first_turns("heldout", limit=40, seed=1, max_chars=4000))
    ids = llm.tokenizer(text)["input_ids"][:SYSTEM_TOKENS - 20]
    return "Answer using the reference text below.\n\n" + llm.tokenizer.decode(ids)


def questions(n: int) -> list[str]:
    return sharegpt_first_turns("heldout", limit=n, seed=7, max_chars=200)


def run(llm: LLM, prompts: list, params: SamplingParams, fresh_cache: bool) -> dict:
    """One timed generate; fresh_cache empties the prefix cache first (the same budget)."""
    if fresh_cache and llm.decoder.verifier.prefix_cache is not None:
        llm.decoder.verifier.prefix_cache = new_prefix_cache(llm.decoder.verifier.prefix_cache.budget_bytes / 2 ** 20)
    before = llm.metrics().get("prefix_cache_hit_tokens", 0)
    start = time.perf_counter()
    outputs = [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    seconds = time.perf_counter() - start
    hits = [c.metrics.cache_hit_rate for c in outputs if c.metrics.cache_hit_rate is not None]
    return {"ttft_s": statistics.median(c.metrics.ttft_s for c in outputs),
            "tok_s": sum(len(c.token_ids) for c in outputs) / seconds,
            "hit_rate": statistics.mean(hits) if hits else None,
            "cached_tokens": llm.metrics().get("prefix_cache_hit_tokens", 0) - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,ssd")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for method in args.methods.split(","):
        on, off = LLM(method=method), LLM(method=method, enable_prefix_caching=False)
        system = system_prompt(on)
        asks = questions(9 + args.repeats)
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in asks]
        fresh = iter(chats[9:])  # a new question for each prefill run
        greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        sampled = SamplingParams(temperature=0.7, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
        scenarios = {
            "prefill": (lambda: run(on, current[0], SamplingParams(temperature=0, max_tokens=1), False),
                        lambda: run(off, current[0], SamplingParams(temperature=0, max_tokens=1), False)),
            "system x8": (lambda: run(on, chats[:8], greedy, True), lambda: run(off, chats[:8], greedy, True)),
            "n=8": (lambda: run(on, chats[8], SamplingParams(**{**sampled.__dict__, "n": 8}), True),
                    lambda: run(off, [chats[8]] * 8, sampled, True)),
        }
        run(on, chats[0], SamplingParams(temperature=0, max_tokens=4), True)  # warm-up; caches the system prompt
        run(off, chats[0], SamplingParams(temperature=0, max_tokens=4), True)
        results = {(name, setting): [] for name in scenarios for setting in ("on", "off")}
        current = [None]
        for _ in range(args.repeats):
            current[0] = next(fresh)
            for name, (with_cache, without) in scenarios.items():
                results[name, "on"].append(with_cache())
                results[name, "off"].append(without())
        for (name, setting), runs in results.items():
            row = {"method": method, "scenario": name, "prefix cache": setting}
            for key in ("ttft_s", "tok_s", "hit_rate", "cached_tokens"):
                values = [r[key] for r in runs if r[key] is not None]
                row[key] = statistics.median(values) if values else None
            rows.append(row)
        on.close()
        off.close()
    print(f"system prompt: {len(on.encode(system))} tokens; medians of {args.repeats} runs, settings interleaved\n")
    print("| method | scenario | prefix cache | TTFT s | tok/s | SSD hit rate | cached tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        hit = f"{r['hit_rate']:.2f}" if r["hit_rate"] is not None else "-"
        print(f"| {r['method']} | {r['scenario']} | {r['prefix cache']} | {r['ttft_s']:.3f} | {r['tok_s']:.1f} | "
              f"{hit} | {r['cached_tokens']:.0f} |")


if __name__ == "__main__":
    main()
