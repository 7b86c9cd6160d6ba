"""Decode rate of one method on held-out prompts, batch 1, through the public API alone, so that
the same script times two checkouts of saguaro against each other:

    for i in 1 2 3; do for tree in OLD NEW; do
        PYTHONPATH=$tree python benchmarks/decode_rate.py --method sd; done; done
    SAGUARO_WEIGHT_CACHE=0 python benchmarks/decode_rate.py --model gguf_files/1.7b-Q4_K_M.gguf --threads 1 \
        --prompts 3 --max-tokens 32   # a file of one's own, repacked at each load

Prints one JSON line: the method, committed tokens / seconds inside generate (prefill
included) over every prompt after a warm-up one, and what LLM.metrics() reports.
"""
from __future__ import annotations

import argparse
import json
import time

from saguaro import LLM, SamplingParams
from saguaro.datasets import humaneval_prompts, sharegpt_first_turns


def prompts(dataset: str, count: int) -> list:
    if dataset == "humaneval":
        return humaneval_prompts()[:count]
    return [[{"role": "user", "content": text}] for text in sharegpt_first_turns("heldout", limit=count, seed=7,
                                                                                 max_chars=400)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="ar", choices=("ar", "sd", "ssd", "auto"))
    parser.add_argument("--dataset", default="sharegpt", choices=("sharegpt", "humaneval"))
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model", help="a GGUF file or folder (default: the embedded model)")
    parser.add_argument("--threads", type=int, help="torch's and saguaro's kernels' threads (default: all cores)")
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    texts = prompts(args.dataset, args.prompts + 1)
    options = {"num_threads": args.threads} if args.threads else {}
    with LLM(*([args.model] if args.model else []), method=args.method, **options) as llm:
        llm.generate([texts[0]], params, use_tqdm=False)  # warm-up, not counted
        tokens, seconds = 0, 0.0
        for text in texts[1:]:
            start = time.perf_counter()
            out = llm.generate([text], params, use_tqdm=False)[0]
            seconds += time.perf_counter() - start
            tokens += len(out.token_ids)
        figures = {k: v for k, v in llm.metrics().items() if isinstance(v, (int, float, str, type(None)))}
    print(json.dumps({"method": args.method, "tok_s": round(tokens / seconds, 1), "metrics": figures}))


if __name__ == "__main__":
    main()
