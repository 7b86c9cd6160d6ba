"""Token trees against chains, side by side: AR, SD with chains, SD with a tree, and auto with
chains only and with the tree beside them, taking turns prompt group by prompt group (the machine's speed drifts),
on held-out chat or HumanEval prompts. Per configuration: tokens/s (median over the groups of
its ratio to AR's on the same group), tokens committed per speculation round, and what auto
chose.

    python benchmarks/trees.py [--dataset sharegpt|humaneval] [--temperature 0.7] [--batch 1] \
        [--groups 6] [--max-tokens 128] [--tree 5x3x6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter

from saguaro import LLM, SamplingParams
from saguaro.bench.runner import BenchConfig, bench_prompts

os.environ.setdefault("SAGUARO_AUTO_PROFILE", "0")  # auto starts from nothing in every configuration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("humaneval", "sharegpt"), default="sharegpt")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--groups", type=int, default=6, help="prompt groups of --batch prompts each")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="chain length and tree depth")
    parser.add_argument("--tree", default="5x3x6", help="SD's tree: DEPTHxTOPKxNODES")
    args = parser.parse_args()
    depth, topk, nodes = (int(n) for n in args.tree.split("x"))
    options = {"AR": dict(method="ar"),
               f"SD, K = {args.k}": dict(method="sd", num_speculative_tokens=args.k),
               f"SD, tree {args.tree}": dict(method="sd", num_speculative_tokens=depth, tree_topk=topk,
                                             num_draft_tokens=nodes),
               "auto, chains only": dict(method="auto", num_speculative_tokens=args.k, tree_topk=1),
               f"auto, chains and tree {args.tree}": dict(method="auto", num_speculative_tokens=depth,
                                                         tree_topk=topk, num_draft_tokens=nodes)}
    engines = {name: LLM(**o) for name, o in options.items()}
    prompts = bench_prompts(engines["AR"], args.dataset, BenchConfig(num_prompts=(args.groups + 1) * args.batch))
    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    for llm in engines.values():  # a warm-up group each, not counted
        llm.generate(groups[0], params, use_tqdm=False)
    rates = {name: [] for name in engines}
    rounds = {name: [0, 0] for name in engines}  # sequence rounds that speculated, tokens they committed
    for group in groups[1:]:
        for name, llm in engines.items():
            started = time.perf_counter()
            outputs = llm.generate(group, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            rates[name].append(sum(len(o.token_ids) for o in outputs) / seconds)
            for o in outputs:
                if o.metrics.mean_acceptance_length is not None:  # None: no round speculated
                    rounds[name][0] += o.metrics.num_rounds
                    rounds[name][1] += o.metrics.mean_acceptance_length * o.metrics.num_rounds
    print(f"\n{args.dataset}, T = {args.temperature}, batch {args.batch}, {args.groups} groups x "
          f"{args.max_tokens} tokens")
    print("| configuration | tok/s (median) | / AR (median of groups) | tokens a speculation round | auto chose |")
    print("|---|---|---|---|---|")
    for name, llm in engines.items():
        ratio = statistics.median(r / a for r, a in zip(rates[name], rates["AR"]))
        seq_rounds, committed = rounds[name]
        per_round = f"{committed / seq_rounds:.2f}" if seq_rounds else "-"
        chose = ""
        if name.startswith("auto"):
            counts = Counter(llm.metrics()["auto_rounds_by_k"])
            total = sum(counts.values())
            chose = ", ".join(f"{c}: {n / total:.0%}" for c, n in counts.most_common(4))
        print(f"| {name} | {statistics.median(rates[name]):.1f} | {ratio:.2f} | {per_round} | {chose} |")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
