"""Decode rate of one method on held-out prompts, batch 1, through the public API alone, so that
the same script times two checkouts of saguaro against each other:

    for i in 1 2 3; do for tree in OLD NEW; do
        PYTHONPATH=$tree python benchmarks/decode_rate.py --method sd; done; done
    SAGUARO_WEIGHT_CACHE=0 python benchmarks/decode_rate.py --model gguf_files/1.7b-Q4_K_M.gguf --threads 1 \
        --prompts 3 --max-tokens 32   # a file of one's own, repacked at each load
    saguaro twin --shape 1920,30,10,7680 smollm2 twin.gguf   # SmolLM2-135M at 1.7B's cost
    taskset -c 0 python benchmarks/decode_rate.py --model twin.gguf --draft smollm2 --threads 1 --method sd

Prints one JSON line: the method, committed tokens / seconds inside generate (prefill
included) over every prompt after a warm-up one, the decode rate alone (tokens after each
request's first over the time after it), a digest of the output tokens (greedy methods that
agree print the same) and what LLM.metrics() reports.
"""
from __future__ import annotations

import argparse
import hashlib
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
    parser.add_argument("--draft", help="the draft: a known name or a file (default: the target's shipped one), "
                                        "e.g. smollm2 for a twin of it")
    parser.add_argument("--k", type=int, help="num_speculative_tokens (a tree's depth)")
    parser.add_argument("--tree-topk", type=int, help="grow token trees: children kept per node ...")
    parser.add_argument("--num-draft-tokens", type=int, help="... and nodes verified a round")
    parser.add_argument("--threads", type=int, help="torch's and saguaro's kernels' threads (default: all cores)")
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    texts = prompts(args.dataset, args.prompts + 1)
    options = {"num_threads": args.threads} if args.threads else {}
    for name in ("draft", "k", "tree_topk", "num_draft_tokens"):
        if getattr(args, name) is not None:
            options["num_speculative_tokens" if name == "k" else name] = getattr(args, name)
    with LLM(*([args.model] if args.model else []), method=args.method, **options) as llm:
        llm.generate([texts[0]], params, use_tqdm=False)  # warm-up, not counted
        tokens, seconds, decode_seconds, outputs = 0, 0.0, 0.0, []
        for text in texts[1:]:
            start = time.perf_counter()
            out = llm.generate([text], params, use_tqdm=False)[0]
            seconds += time.perf_counter() - start
            tokens += len(out.token_ids)
            if out.metrics.decode_tokens_per_s > 0:  # more than one token
                decode_seconds += (len(out.token_ids) - 1) / out.metrics.decode_tokens_per_s
            outputs.append(out.token_ids)
        figures = {k: v for k, v in llm.metrics().items() if isinstance(v, (int, float, str, type(None)))}
    print(json.dumps({"method": args.method, "tok_s": round(tokens / seconds, 1),
                      "decode_tok_s": round((tokens - len(outputs)) / decode_seconds, 1) if decode_seconds else None,
                      "outputs": hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:12], "metrics": figures}))


if __name__ == "__main__":
    main()
