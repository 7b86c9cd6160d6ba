"""A target on two ranks against one, and SSD with two draft workers against one, on the same cores.

    python benchmarks/scale_out.py tp [--repeats 3] [--max-tokens 48]
        fp32 AR on the default model: one rank on two threads against two ranks (this process
        and one worker) on one thread each, taking turns; held-out prompts (4 HumanEval, 4
        ShareGPT) one at a time. Reports decode tok/s (median), the largest logit difference
        relative to the largest logit, and how many greedy outputs are equal.

    python benchmarks/scale_out.py pool [--repeats 3] [--max-tokens 48] [--batch 8]
        SSD (bf16, the default quantization) with one draft worker against two, taking turns, one
        batch of the 8 prompts: total tok/s and the cache hit rate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from saguaro import LLM, SamplingParams
from saguaro.datasets import humaneval_prompts, sharegpt_first_turns
from saguaro.engine.runner import forward_chunks
from saguaro.models.kv_cache import new_cache


def prompts(llm: LLM) -> list[list[int]]:
    code = [llm.encode(p) for p in humaneval_prompts()[:4]]
    chat = [llm.encode([{"role": "user", "content": t}])
            for t in sharegpt_first_turns("heldout", limit=4, seed=0, max_chars=800)]
    return [p for pair in zip(code, chat) for p in pair]


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    cache = new_cache(llm.target, 1, len(ids))
    return llm.target.logits(forward_chunks(llm.target, cache, [0], [ids], [0])[0])


def tensor_parallel(repeats: int, max_tokens: int) -> dict:
    one = LLM(method="ar", dtype="float32", num_threads=2, enable_prefix_caching=False)
    two = LLM(method="ar", dtype="float32", tensor_parallel_size=2)
    threads = {"tp1": 2, "tp2": 1}  # the same two cores either way
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rates, tokens = {"tp1": [], "tp2": []}, {"tp1": [], "tp2": []}
    batch = prompts(one)
    for _ in range(repeats):
        for ids in batch:
            for name, llm in (("tp1", one), ("tp2", two)):
                torch.set_num_threads(threads[name])
                out = llm.generate([ids], params, use_tqdm=False)[0]
                rates[name].append(out.metrics.decode_tokens_per_s)
                tokens[name].append(out.token_ids)
    errors = []
    for ids in batch:
        torch.set_num_threads(2)
        reference = last_logits(one, ids)
        torch.set_num_threads(1)
        errors.append(float((last_logits(two, ids) - reference).abs().max() / reference.abs().max()))
    two.close()
    return {"decode_tok_s_tp1": statistics.median(rates["tp1"]), "decode_tok_s_tp2": statistics.median(rates["tp2"]),
            "max_relative_logit_difference": max(errors),
            "greedy_equal": sum(a == b for a, b in zip(tokens["tp1"], tokens["tp2"])), "outputs": len(tokens["tp1"])}


def pool(repeats: int, max_tokens: int, batch: int) -> dict:
    llms = {n: LLM(method="ssd", num_draft_workers=n, enable_prefix_caching=False) for n in (1, 2)}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    work = (prompts(llms[1]) * batch)[:batch]
    rates = {n: [] for n in llms}
    for _ in range(repeats):
        for n, llm in llms.items():
            started = time.perf_counter()
            outputs = llm.generate(work, params, use_tqdm=False)
            rates[n].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started))
    summary = {f"workers_{n}": {"tok_s": statistics.median(rates[n]), "cache_hit_rate": llm.metrics()["cache_hit_rate"]}
               for n, llm in llms.items()}
    for llm in llms.values():
        llm.close()
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["tp", "pool"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    result = tensor_parallel(args.repeats, args.max_tokens) if args.what == "tp" else \
        pool(args.repeats, args.max_tokens, args.batch)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
