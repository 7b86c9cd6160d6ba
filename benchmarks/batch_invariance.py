"""What batch-invariant numerics cost, and what they buy.

cost: one target pass per shape (requests x tokens), invariance on and off taking turns, one
thread, medians over the repeats. agreement: greedy SD and SSD against AR on held-out prompts
(HumanEval and ShareGPT, alternating), each method in the default dtype, on and off.

    python benchmarks/batch_invariance.py cost --dtype bfloat16
    python benchmarks/batch_invariance.py agreement --prompts 8 --max-tokens 128
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from saguaro import LLM, SamplingParams
from saguaro.engine.runner import forward_chunks
from saguaro.models import hub
from saguaro.models.kv_cache import new_cache
from saguaro.models.loader import load_model
from saguaro.models.quantized import resolve_dtype

SHAPES = [(1, 1), (1, 6), (4, 6), (8, 1), (8, 6), (1, 256)]  # (requests, tokens); (1, 256) a prefill


def pass_ms(model, cache, requests: int, tokens: int, context: int) -> float:
    start = time.perf_counter()
    hidden = forward_chunks(model, cache, list(range(requests)), [[7] * tokens] * requests, [context] * requests)
    model.logits(hidden[:, -1])
    return (time.perf_counter() - start) * 1000


def cost(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model = load_model(hub.resolve(args.model), resolve_dtype(args.dtype))
    context = 256
    cache = new_cache(model, 8, context + 300)
    times = {(shape, on): [] for shape in SHAPES for on in (False, True)}
    with torch.no_grad():
        forward_chunks(model, cache, list(range(8)), [[5] * context] * 8, [0] * 8)
        for _ in range(args.repeats):
            for shape in SHAPES:
                for on in (False, True):
                    model.set_batch_invariant(on)
                    times[(shape, on)].append(pass_ms(model, cache, *shape, context))
    print(f"{args.dtype}, one thread, {context} cached tokens, median of {args.repeats}")
    print("| requests x tokens | off (ms) | on (ms) | on / off |\n|---|---|---|---|")
    for shape in SHAPES:
        off, on = (statistics.median(times[(shape, s)]) for s in (False, True))
        print(f"| {shape[0]} x {shape[1]} | {off:.1f} | {on:.1f} | {on / off:.2f} |")


def agreement(args: argparse.Namespace) -> None:
    from saguaro.datasets import humaneval_prompts, sharegpt_first_turns

    code = humaneval_prompts()[:args.prompts // 2]
    chat = [[{"role": "user", "content": p}] for p in
            sharegpt_first_turns("heldout", limit=args.prompts - len(code), seed=0, max_chars=1000)]
    prompts = [p for pair in zip(code, chat) for p in pair]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"{args.dtype}, {len(prompts)} held-out prompts x {args.max_tokens} tokens, greedy")
    print("| invariance | method | prompts equal to AR | first divergence (token) |\n|---|---|---|---|")
    for on in (True, False):
        ar = LLM(args.model, method="ar", dtype=args.dtype, batch_invariant=on)
        expected = [o.token_ids for o in ar.generate(prompts, params, use_tqdm=False)]
        for method in ("sd", "ssd"):
            with LLM(args.model, method=method, dtype=args.dtype, batch_invariant=on) as llm:
                got = [llm.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts]
            diverge = [next(i for i, (a, b) in enumerate(zip(g, e)) if a != b) for g, e in zip(got, expected) if g != e]
            print(f"| {'on' if on else 'off'} | {method} | {len(prompts) - len(diverge)}/{len(prompts)} | "
                  f"{', '.join(map(str, sorted(diverge))) or '-'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["cost", "agreement"])
    parser.add_argument("--model", default=hub.DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.what == "cost":
        cost(args)
    else:
        agreement(args)


if __name__ == "__main__":
    main()
