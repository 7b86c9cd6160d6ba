"""Where an AR step's and an SD round's time goes at batch 1: timers around the target's passes,
its head, the drafter and verification, over a few HumanEval prompts decoded one at a time
(greedy, the default two threads). What bounds speculation's gain over AR on this machine.

    python benchmarks/round_costs.py [--k 3] [--prompts 4] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from saguaro import LLM, SamplingParams
from saguaro.datasets import humaneval_prompts
from saguaro.engine import decoders
from saguaro.speculation import drafters


def timed(times: dict, name, function):
    """function, with each call's seconds added to times[name(args)]."""
    def call(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        times[name(*args)].append(time.perf_counter() - start)
        return result
    return call


def profile(method: str, k: int, prompts: list[str], params: SamplingParams) -> dict[str, list[float]]:
    times: dict[str, list[float]] = defaultdict(list)
    llm = LLM(method=method, num_speculative_tokens=k)
    rows = lambda model, cache, rows, chunks, *rest: max(len(c) for c in chunks)  # noqa: E731
    target_pass, draft_pass = decoders.forward_chunks, drafters.forward_chunks
    decoders.forward_chunks = timed(times, lambda *a: f"target pass, {rows(*a)} tokens", target_pass)
    drafters.forward_chunks = timed(times, lambda *a: f"draft pass, {rows(*a)} tokens", draft_pass)
    llm.target.logits = timed(times, lambda h: f"target head, {h.shape[:-1].numel()} rows", llm.target.logits)
    decoder = llm.decoder
    if method == "sd":
        decoder.drafter.propose = timed(times, lambda *a: "draft (K steps)", decoder.drafter.propose)
        decoder.verify_and_commit = timed(times, lambda *a: "verify and commit", decoder.verify_and_commit)
    decoder.step = timed(times, lambda *a: "round", decoder.step)
    for prompt in prompts[:1]:
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
    times.clear()
    for prompt in prompts:
        llm.generate([prompt], params, use_tqdm=False)
    llm.close()
    decoders.forward_chunks, drafters.forward_chunks = target_pass, draft_pass  # the next method's timers wrap these
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = humaneval_prompts()[:args.prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens = args.prompts * (args.max_tokens - 1)  # committed by rounds; the prefill commits the first
    per_token = {}
    for method in ("ar", "sd"):
        times = profile(method, args.k, prompts, params)
        print(f"\n{method}{f' (K = {args.k})' if method == 'sd' else ''}: median ms per call (calls)")
        for name, values in sorted(times.items()):
            if len(values) >= 8:
                print(f"  {name:28s} {statistics.median(values) * 1e3:7.2f}  ({len(values)})")
        rounds = times["round"]
        per_token[method] = sum(rounds) / tokens
        print(f"  tokens a round {tokens / len(rounds):.2f}, ms a token {per_token[method] * 1e3:.2f}")
    print(f"\nSD / AR speed: {per_token['ar'] / per_token['sd']:.2f}")


if __name__ == "__main__":
    main()
