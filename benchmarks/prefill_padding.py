"""Prefill of 4, 8 and 16 held-out ShareGPT chat prompts arriving together: one pass padded to
the longest prompt (what saguaro did before) against passes of similar lengths
(`runner.length_groups`), taking turns in one process, prefix cache off, medians of 5 rounds.

    python benchmarks/prefill_padding.py
"""
from __future__ import annotations

import statistics
import time

from saguaro import LLM, SamplingParams
from saguaro.datasets import sharegpt_first_turns
from saguaro.engine import runner

SETTINGS = {"one pass": (float("inf"), 10 ** 9), "grouped": (runner.PADDING_WASTE, runner.PADDING_ROWS)}


def prefill_seconds(llm: LLM, prompts: list[list[int]], setting: str) -> float:
    runner.PADDING_WASTE, runner.PADDING_ROWS = SETTINGS[setting]
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    llm = LLM(method="ar", enable_prefix_caching=False)
    texts = sharegpt_first_turns("heldout", limit=16, seed=0, max_chars=1000)
    prompts = [llm.encode([{"role": "user", "content": t}]) for t in texts]
    prefill_seconds(llm, prompts[:4], "grouped")  # warm-up
    print("| prompts at once | one pass s | grouped s | speed-up |\n|---|---|---|---|")
    for batch in (4, 8, 16):
        seconds = {name: [] for name in SETTINGS}
        for _ in range(5):
            for name in SETTINGS:
                seconds[name] += [prefill_seconds(llm, prompts[i:i + batch], name) for i in range(0, 16, batch)]
        one, grouped = (statistics.median(seconds[name]) for name in SETTINGS)
        print(f"| {batch} | {one:.3f} | {grouped:.3f} | {one / grouped:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
