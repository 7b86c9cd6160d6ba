"""Does `saguaro plan --profile` forecast this machine? A profile of its costs, then real runs.

1. The profile: the target's side of each round (pass, head, verification) and SD's draft
   step as AR's and SD's engines ran them, by rows; the draft's step at the larger row counts
   of SSD's fill, timed alone on one thread (gpu_check's `pass_seconds`, 200 tokens of context).
   Both models' passes timed alone are printed too: the target's ran slower alone than in the
   engines at 24 rows and up, the draft's faster (a step's sampling and bookkeeping left out).
2. Real runs of AR and SD (target and draft on one thread) and SSD (target on one core, its
   worker on the other), the methods taking turns batch by batch (the prompts in batches of
   each size), held-out chat prompts,
   greedy, `ignore_eos`: decode tok/s (a batch's tokens after the first over the time from its
   first token to its last request's end), SD's acceptance per position, SSD's cache hit rate and its wait for
   the worker's reply (the link's share of a round). No prompt lookup: the draft model alone.
3. The forecast from the profile and each method's measured acceptance (SSD's worker drafts
   from its cache and is accepted otherwise than SD's draft) and hit rate, SD at the K it ran,
   beside the runs. DIR/profile.json keeps this machine's profile for `saguaro plan --profile`.

    python benchmarks/plan_check.py [--batch-sizes 1,4,8] [--prompts 8] [--max-tokens 64] [--repeats 2] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from gpu_check import pass_seconds
from saguaro import LLM, SamplingParams
from saguaro.bench.runner import BenchConfig, bench_prompts
from saguaro.engine.verifier import Verifier
from saguaro.speculation.local.proposer import DraftProposer
from saguaro.speculation.policy.planning import HardwareProfile, forecast

K = 5
CONTEXT = 200


def profile_costs(batch_sizes: list[int]) -> tuple[dict[int, float], dict[int, float]]:
    """The target's pass by token rows (b rows of 1 and of k + 1 tokens) and the draft's step by
    sequences (b up to b x the fan-out budget), on one thread."""
    with LLM(method="sd", num_threads=1, prompt_lookup=None) as llm, torch.inference_mode():
        target, draft = llm.target, llm.decoder.policy.choice.proposer.drafter.model
        passes: dict[int, list[float]] = {}
        for batch in batch_sizes:
            for tokens in range(1, K + 2):
                passes.setdefault(batch * tokens, []).append(pass_seconds(target, batch, tokens, CONTEXT, repeats=5))
        steps = {rows: pass_seconds(draft, rows, 1, CONTEXT, repeats=5)
                 for rows in sorted({1, 2, 4, 8, 16, 32, 64, 128} | {b * 16 for b in batch_sizes})}
    return {rows: statistics.median(s) for rows, s in passes.items()}, steps


class RoundTimer:
    """Times the parts of each round as the engines run them, by the rows they run: the target's
    side (Verifier.decode and verify: pass, head, verification) by token rows, and a draft step
    (DraftProposer.propose over its k steps, its prefill of new sequences left out) by
    sequences. What the forecast's t_T and t_D stand for."""

    def __init__(self):
        self.seconds: dict[tuple[int, int], list[float]] = {}  # (id of the timed object, rows) -> seconds
        self.originals = Verifier.decode, Verifier.verify, DraftProposer.propose

    def install(self) -> "RoundTimer":
        decode, verify, propose = self.originals

        def timed(method, rows_of, seconds_of=lambda result, seconds: seconds):
            def call(owner, seqs, *args):
                start = time.perf_counter()
                result = method(owner, seqs, *args)
                key = (id(owner), rows_of(seqs, *args))
                self.seconds.setdefault(key, []).append(seconds_of(result, time.perf_counter() - start))
                return result
            return call
        Verifier.decode = timed(decode, lambda seqs, runs=None: len(seqs) + sum(map(len, runs or [])))
        Verifier.verify = timed(verify, lambda seqs, proposal: proposal.tokens.numel() + len(seqs))
        DraftProposer.propose = timed(propose, lambda seqs, k, tree=None: len(seqs),
                                      lambda proposal, seconds: (seconds - proposal.start_s) / proposal.tokens.shape[1])
        return self

    def remove(self) -> None:
        Verifier.decode, Verifier.verify, DraftProposer.propose = self.originals

    def medians(self, owners: list[object]) -> dict[int, float]:
        """By rows, over these objects' calls."""
        ids, by_rows = {id(o) for o in owners}, {}
        for (owner, rows), seconds in self.seconds.items():
            if owner in ids:
                by_rows.setdefault(rows, []).extend(seconds)
        return {rows: statistics.median(s) for rows, s in sorted(by_rows.items()) if len(s) >= 3}


def decode_rate(llm: LLM, prompts: list, params: SamplingParams) -> float:
    """A batch's tokens after the first over the time from its first token to its last request's
    end (the batch starts decoding together, after one prefill)."""
    metrics = [o.metrics for o in llm.generate(prompts, params, use_tqdm=False)]
    tokens = [m.num_output_tokens - 1 for m in metrics]
    return sum(tokens) / max(n / m.decode_tokens_per_s for n, m in zip(tokens, metrics))


def run_methods(batch_sizes: list[int], prompts: list, params: SamplingParams,
                repeats: int) -> tuple[dict, dict, dict]:
    """Per method and batch size: decode tok/s of each batch of prompts, and what the engine's
    metrics counted over them; the target's side of a round and a draft step in the engines, by rows."""
    speculation = {"num_speculative_tokens": K, "prompt_lookup": None}  # the draft model's proposals alone
    engines = {"ar": LLM(method="ar", num_threads=1), "sd": LLM(method="sd", num_threads=1, **speculation),
               "ssd": LLM(method="ssd", **speculation)}
    runs = {m: {b: {"tok_s": []} for b in batch_sizes} for m in engines}
    timer = RoundTimer().install()
    try:
        for llm in engines.values():
            llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
        for batch in batch_sizes:
            groups = [(prompts * batch)[i:i + batch] for i in range(0, len(prompts), batch)]
            before = {name: llm.metrics() for name, llm in engines.items()}
            for repeat in range(repeats):
                for group in groups:
                    for name, llm in engines.items():
                        runs[name][batch]["tok_s"].append(decode_rate(llm, group, params))
            for name, llm in engines.items():
                runs[name][batch]["metrics"] = delta(before[name], llm.metrics())
                print(f"batch {batch} {name}: {[round(r, 1) for r in runs[name][batch]['tok_s']]} tok/s", flush=True)
    finally:
        timer.remove()
        for llm in engines.values():
            llm.close()
    # AR's and SD's: SSD's target shares the machine with its worker, and its rounds are what is forecast
    target = timer.medians([engines["ar"].decoder.verifier, engines["sd"].decoder.verifier])
    return runs, target, timer.medians([engines["sd"].decoder.policy.choice.proposer])


def delta(before: dict, after: dict) -> dict:
    """The counters a run added, and the engine's latest medians and rates."""
    out = {}
    for key, value in after.items():
        if isinstance(value, list) and isinstance(before.get(key), list):
            out[key] = [a - b for a, b in zip(value, before[key] + [0] * len(value))]
        elif isinstance(value, int) and isinstance(before.get(key), int):
            out[key] = value - before[key]
        else:
            out[key] = value
    return out


def acceptance(metrics: dict) -> list[float]:
    """a_1..a_K: draft position i accepted given i - 1 was, from per-position acceptance counts."""
    drafts, per_position = metrics["spec_decode_num_drafts"], metrics["spec_decode_num_accepted_tokens_per_pos"]
    shares = [n / drafts for n in per_position[:K]] + [0.0] * (K - len(per_position))
    return [shares[i] / (shares[i - 1] if i else 1.0) if (shares[i - 1] if i else 1.0) > 0 else 0.0 for i in range(K)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("plan_check_out"))
    args = parser.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    target_s, draft_s = profile_costs(batch_sizes)
    print("profile: target pass by rows (ms)", {r: round(s * 1e3, 2) for r, s in sorted(target_s.items())},
          "draft step by rows (ms)", {r: round(s * 1e3, 2) for r, s in sorted(draft_s.items())}, flush=True)
    with LLM(method="ar", num_threads=1) as llm:
        prompts = bench_prompts(llm, "sharegpt", BenchConfig(num_prompts=args.prompts, seed=7))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs, in_engine, draft_in_engine = run_methods(batch_sizes, prompts, params, args.repeats)
    print("in the engines (ms): the target's side of a round by rows",
          {r: round(s * 1e3, 2) for r, s in in_engine.items()},
          "a draft step by sequences", {r: round(s * 1e3, 2) for r, s in draft_in_engine.items()})
    draft_s = draft_s | draft_in_engine  # the fill's larger row counts only timed alone
    rows = []
    print("\n| batch | method | measured tok/s | forecast tok/s | forecast / measured |\n|---|---|---|---|---|")
    for batch in batch_sizes:
        sd, ssd = runs["sd"][batch]["metrics"], runs["ssd"][batch]["metrics"]
        profile = HardwareProfile("this machine, one core each", in_engine, draft_s, acceptance(sd),
                                  hit_rate=ssd.get("cache_hit_rate") or 0.0,
                                  link_s=ssd.get("target_wait_s_median") or 0.0)
        f = forecast(profile, batch, sd_ks=[K])
        ssd_profile = replace(profile, acceptance=acceptance(ssd))  # the worker's drafts, accepted as measured
        f_ssd = forecast(ssd_profile, batch)
        for name, predicted in (("ar", f.ar_tok_s), ("sd", f.sd_tok_s), ("ssd", f_ssd.ssd_tok_s)):
            measured = statistics.median(runs[name][batch]["tok_s"])
            rows.append({"batch": batch, "method": name, "measured_tok_s": measured, "forecast_tok_s": predicted,
                         "profile": vars(profile) | {"target_pass_s": None, "draft_step_s": None}})
            print(f"| {batch} | {name} | {measured:.1f} | {predicted:.1f} | {predicted / measured:.2f} |")
        print(f"|  | (SD's acceptance {', '.join(f'{a:.2f}' for a in profile.acceptance)}; SSD's "
              f"{', '.join(f'{a:.2f}' for a in ssd_profile.acceptance)}, hit {profile.hit_rate:.2f}, link "
              f"{profile.link_s * 1e3:.2f} ms; forecast: {f_ssd.ssd_backup} backup, F {f_ssd.ssd_fan_out}, "
              f"T_p {f_ssd.ssd_t_p:.2f}) | | | |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_check.json").write_text(json.dumps({"target_pass_s": target_s, "draft_step_s": draft_s,
                                                          "target_side_in_engine_s": in_engine,
                                                          "draft_step_in_engine_s": draft_in_engine,
                                                          "rows": rows, "runs": runs}, indent=1, default=str))
    # this machine's profile at the first batch size, for `saguaro plan --profile` to vary
    first = batch_sizes[0]
    sd, ssd = runs["sd"][first]["metrics"], runs["ssd"][first]["metrics"]
    mine = {"name": "this machine: the target on one core, SSD's draft on another", "target_pass_s": in_engine,
            "draft_step_s": draft_s, "acceptance": acceptance(sd), "hit_rate": ssd.get("cache_hit_rate") or 0.0,
            "link_s": ssd.get("target_wait_s_median") or 0.0,
            "notes": f"benchmarks/plan_check.py, acceptance and hit rate at batch {first}"}
    (args.out / "profile.json").write_text(json.dumps(mine, indent=1))


if __name__ == "__main__":
    main()
