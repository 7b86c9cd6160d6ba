"""Where an AR step's and an SD round's time goes at batch 1, and how far SD could get with a
draft that cost nothing: timers around the target's passes, its head, the drafter and
verification, over prompts decoded one at a time (the default two threads).

For each K, the ceiling is what SD would reach if drafting took no time: the tokens a round
commits (acceptance and prompt lookup as measured) over the round's verification alone,
against AR's time per token. No draft of this acceptance beats it on this machine, however
cheap; only a draft that is accepted more often does.

With --trees, SD also grows token trees (saguaro.engine.tree) of depth --tree-depth: TOPKxNODES,
comma-separated (4x10: the 4 best nodes expanded at each depth, 10 verified). --verbose also
gives the target pass's median time per token count (a tree's verification cost per node count).

    python benchmarks/round_costs.py [--dataset humaneval|sharegpt] [--temperature 0.7] \
        [--ks 1,2,3,5] [--trees 4x10,4x16] [--tree-depth 5] [--prompts 4] [--max-tokens 128] [--verbose]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from saguaro import LLM, SamplingParams
from saguaro.bench.runner import BenchConfig, bench_prompts
from saguaro.engine import verifier
from saguaro.speculation.local import drafters


class Timers:
    """Per-call seconds of the parts of a round, kept for whichever engine runs now (`times`)."""

    def __init__(self):
        self.times: dict[str, list[float]] = defaultdict(list)

    def wrap(self, name, function):
        """function, with each call's seconds added to times[name(args)]."""
        def call(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.times[name(*args)].append(time.perf_counter() - start)
            return result
        return call

    def attach(self, llm: LLM) -> None:
        """Times llm's rounds and their parts (the passes through the module functions that
        every engine shares, so wrap those once with `attach_passes`)."""
        llm.target.logits = self.wrap(lambda h, *rest: f"target head, {h.shape[:-1].numel()} rows",
                                      llm.target.logits)
        decoder = llm.decoder
        if decoder.num_speculative_tokens:
            drafter = decoder.policy.choice.proposer.drafter
            drafter.propose = self.wrap(lambda *a: "draft", drafter.propose)
            decoder.verifier.verify = self.wrap(lambda *a: "verify and commit", decoder.verifier.verify)
        decoder.step = self.wrap(lambda *a: "round", decoder.step)

    def attach_passes(self) -> None:
        rows = lambda model, cache, rows, chunks, *rest: max(len(c) for c in chunks)  # noqa: E731
        verifier.forward_chunks = self.wrap(lambda *a: f"target pass, {rows(*a)} tokens", verifier.forward_chunks)
        drafters.forward_chunks = self.wrap(lambda *a: f"draft pass, {rows(*a)} tokens", drafters.forward_chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=("humaneval", "sharegpt"), default="humaneval")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ks", default="1,2,3,5", help="SD's K values, comma-separated")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--trees", default="", help="token trees TOPKxNODES, comma-separated")
    parser.add_argument("--tree-depth", type=int, default=5)
    parser.add_argument("--prompt-lookup", type=int, default=2, help="SD's prompt lookup N (0: off)")
    parser.add_argument("--verbose", action="store_true", help="also each part's median ms per call")
    parser.add_argument("--model", help="the target: a GGUF file or folder (default: the embedded model), e.g. a twin")
    parser.add_argument("--draft", help="its draft (default: its shipped one), e.g. smollm2 for a twin of it")
    parser.add_argument("--threads", type=int, help="the kernels' threads (default: all cores)")
    args = parser.parse_args()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    options = {"AR": dict(method="ar")}
    options.update({f"SD, K = {k}": dict(method="sd", num_speculative_tokens=int(k), prompt_lookup=args.prompt_lookup)
                    for k in args.ks.split(",") if k})
    for tree in filter(None, args.trees.split(",")):
        topk, nodes = (int(n) for n in tree.split("x"))
        options[f"SD tree, depth {args.tree_depth}, top {topk}, {nodes} nodes"] = dict(
            method="sd", num_speculative_tokens=args.tree_depth, tree_topk=topk, num_draft_tokens=nodes,
            prompt_lookup=args.prompt_lookup)
    ks = list(options)
    shared = {"num_threads": args.threads} if args.threads else {}
    if args.draft:
        shared["draft"] = args.draft
    for k in ks:
        options[k].update(shared)
    timers = Timers()
    timers.attach_passes()
    engines = {k: LLM(*([args.model] if args.model else []), **options[k]) for k in ks}
    prompts = bench_prompts(engines["AR"], args.dataset, BenchConfig(num_prompts=args.prompts + 1))
    for llm in engines.values():  # a warm-up prompt each, not counted
        timers.attach(llm)
        llm.generate([prompts[0]], params, use_tqdm=False)
    times = {k: defaultdict(list) for k in ks}
    for prompt in prompts[1:]:  # the engines take turns prompt by prompt: the machine's speed drifts
        for k, llm in engines.items():
            timers.times = times[k]
            llm.generate([prompt], params, use_tqdm=False)
    for llm in engines.values():
        llm.close()
    tokens = args.prompts * (args.max_tokens - 1)  # committed by rounds; the prefill commits the first
    rows, ar_ms = [], None
    for k in ks:
        if args.verbose:
            print(f"\n{k}: median ms per call (calls)")
            for name, values in sorted(times[k].items()):
                if len(values) >= 8:
                    print(f"  {name:28s} {statistics.median(values) * 1e3:7.2f}  ({len(values)})")
        rounds = len(times[k]["round"])
        ms = lambda name: sum(times[k][name]) * 1e3 / rounds  # noqa: E731  mean ms per round
        per_token = sum(times[k]["round"]) * 1e3 / tokens
        if k == "AR":
            ar_ms = per_token
            rows.append(f"| AR | 1.00 | {ms('round'):.2f} | {ms('round'):.2f} | - | {per_token:.2f} | 1.00 | - |")
            continue
        per_round = tokens / rounds
        rows.append(f"| {k} | {per_round:.2f} | {ms('round'):.2f} | {ms('verify and commit'):.2f} | "
                    f"{ms('draft'):.2f} | {per_token:.2f} | {ar_ms / per_token:.2f} | "
                    f"{per_round * ar_ms / ms('verify and commit'):.2f} |")
    print(f"\n{args.dataset}, T = {args.temperature}, {args.prompts} prompts x {args.max_tokens} tokens, batch 1; "
          "mean ms per round")
    print("| method | tokens a round | round | verification | draft | ms a token | speed / AR | ceiling: free draft / AR |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
