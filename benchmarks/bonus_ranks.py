"""How often a draft's runner-up tokens hold the target's next token: the ceiling on SSD's hit rate.

Where the draft's first choice is wrong, SSD's cache hits only if the target's token (the bonus
after a rejection) is among the F candidates it cached for that accepted length: the draft's
next most likely tokens. Over the target's greedy continuations of held-out chat prompts, this
prints the draft's top-1 agreement and, where it is wrong, the share of positions whose target
token is among the draft's next F, for F = 1 .. 64 (greedy, teacher-forced, one draft pass per
prompt).

    python benchmarks/bonus_ranks.py [--prompts 12] [--max-tokens 96] [--draft DIR]
"""
from __future__ import annotations

import argparse

import torch

from saguaro import LLM, SamplingParams
from saguaro.bench.runner import BenchConfig, bench_prompts
from saguaro.engine.runner import forward_chunks
from saguaro.models.kv_cache import new_cache

CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft", default=None, help="(default: the shipped draft)")
    args = parser.parse_args()
    with LLM(method="sd", prompt_lookup=None, draft=args.draft) as llm, torch.inference_mode():
        draft = llm.decoder.policy.choice.proposer.drafter.model
        prompts = bench_prompts(llm, "sharegpt", BenchConfig(num_prompts=args.prompts, seed=7))
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        ranks = []
        for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
            text = list(prompt) + out.token_ids
            cache = new_cache(draft, 1, len(text))
            logits = draft.logits(forward_chunks(draft, cache, [0], [text[:-1]], [0])[0]).float()
            targets = torch.tensor(text[len(prompt):])
            scores = logits[len(prompt) - 1:]
            ranks += (scores > scores.gather(1, targets[:, None])).sum(1).tolist()  # tokens the draft ranks higher
    wrong = [r for r in ranks if r > 0]
    print(f"{len(ranks)} positions; the draft's first choice is the target's at {1 - len(wrong) / len(ranks):.3f}")
    print("| F | target token among the draft's next F, where its first is wrong |\n|---|---|")
    for f in CANDIDATES:
        print(f"| {f} | {sum(r <= f for r in wrong) / len(wrong):.3f} |")


if __name__ == "__main__":
    main()
