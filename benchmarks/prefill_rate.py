"""Prefill of one long prompt, saguaro against llama.cpp: the same GGUF file, the same token ids
(held-out ShareGPT first turns joined until they reach --tokens) and the same thread count, the
two taking turns, after a warm-up each; medians of --repeats, in prompt tokens a second.

saguaro's time is its time to the first token (the prefill and one head) with its prefix cache
off, so that every repeat prefills the whole prompt; llama.cpp's is its time to the first token
from an empty cache (llama-cpp-python, n_batch 512: `saguaro.bench.peers`).

    python benchmarks/gguf_types.py --make gguf_files --shapes 1.7b --types Q4_K_M
    python benchmarks/prefill_rate.py --model gguf_files/1.7b-Q4_K_M.gguf --tokens 1024 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from saguaro import LLM, SamplingParams
from saguaro.bench import peers
from saguaro.datasets import sharegpt_first_turns
from saguaro.models import hub


def prompt_ids(llm: LLM, tokens: int) -> list[int]:
    """Held-out first turns, joined, cut at `tokens` token ids."""
    ids: list[int] = []
    for text in sharegpt_first_turns("heldout", limit=400, seed=7):
        ids += llm.tokenizer.encode(text + "\n\n")
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"the held-out turns hold fewer than {tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF file (default: the embedded model's)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    model = args.model or str(hub.resolve(hub.DEFAULT_MODEL))
    llm = LLM(model, method="ar", num_threads=args.threads, enable_prefix_caching=False)
    llama = peers.load_llamacpp(Path(model), args.threads, args.tokens + 16)
    ids = prompt_ids(llm, args.tokens)
    seconds: dict[str, list[float]] = {"saguaro": [], "llama.cpp": []}
    for repeat in range(args.repeats + 1):  # the first round warms both up, uncounted
        saguaro_s = llm.generate([ids], params, use_tqdm=False)[0].metrics.ttft_s
        [record] = peers.generate_llamacpp(llama, [ids], params)
        if repeat:
            seconds["saguaro"].append(saguaro_s)
            seconds["llama.cpp"].append(record["ttft_s"])
    llm.close()
    rates = {name: args.tokens / statistics.median(s) for name, s in seconds.items()}
    ratios = [b / a for a, b in zip(seconds["saguaro"], seconds["llama.cpp"])]
    print(json.dumps({"model": Path(model).name, "tokens": args.tokens, "threads": args.threads,
                      "saguaro_tok_s": round(rates["saguaro"], 1), "llamacpp_tok_s": round(rates["llama.cpp"], 1),
                      "ratio": round(statistics.median(ratios), 2),
                      "ratio_range": [round(min(ratios), 2), round(max(ratios), 2)]}))


if __name__ == "__main__":
    main()
