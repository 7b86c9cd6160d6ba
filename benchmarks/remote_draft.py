"""What the wire between the target and a draft on another host costs per SSD round.

The engine (default model, SSD, the worker attached by address) runs once with the worker on
this host over loopback and once with the worker in another network namespace over a veth pair
(tests/netns.py; needs root), the two placements taking turns. For temperatures 0 and 0.7 at
batch 1 and 8 it reports the bytes per round each way (token ids at T = 0; the proposal
distributions at T > 0) and the median time the target waits for the worker per round; the
difference between the placements is what the wire adds.

    python benchmarks/remote_draft.py [--repeats 2] [--max-tokens 64] [--proposal-top 256]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import netns  # noqa: E402

PORT = 29531
CASES = [(0.0, 1), (0.0, 8), (0.7, 1), (0.7, 8)]


def engine(address: str, max_tokens: int, proposal_top: int) -> None:
    """The target side: one JSON line per (temperature, batch)."""
    import torch

    from saguaro import LLM, SamplingParams
    from saguaro.datasets import humaneval_prompts, sharegpt_first_turns

    torch.set_num_threads(1)
    llm = LLM(method="ssd", draft_address=address, enable_prefix_caching=False, proposal_top=proposal_top)
    decoder = llm.decoder
    code = humaneval_prompts()[:4]
    chat = [[{"role": "user", "content": t}] for t in sharegpt_first_turns("heldout", limit=4, seed=0, max_chars=800)]
    prompts = [p for pair in zip(code, chat) for p in pair]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    for temperature, batch in CASES:
        channel, stats = decoder.client.channel, decoder.stats
        sent, received, rounds = channel.bytes_sent, channel.bytes_received, len(stats.wait_s)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
        for i in range(0, len(prompts), batch):
            llm.generate(prompts[i:i + batch], params, use_tqdm=False)
        n = len(stats.wait_s) - rounds
        print(json.dumps({"temperature": temperature, "batch": batch, "rounds": n,
                          "sent_per_round": (channel.bytes_sent - sent) / n,
                          "received_per_round": (channel.bytes_received - received) / n,
                          "wait_ms_median": 1000 * statistics.median(stats.wait_s[rounds:])}), flush=True)
    llm.close()


def run(placement: str, hosts: netns.Hosts, max_tokens: int, proposal_top: int) -> list[dict]:
    worker_host = hosts.draft_ns if placement == "veth" else hosts.target_ns
    address = f"{hosts.target_ip if placement == 'veth' else '127.0.0.1'}:{PORT}"
    worker = subprocess.Popen(hosts.command(worker_host, [sys.executable, "-m", "saguaro.speculation.worker",
                                                           "--connect", address, "--cpus", "1"]))
    try:
        out = subprocess.run(hosts.command(hosts.target_ns, ["taskset", "-c", "0", sys.executable, __file__,
                                                             "--engine", address, "--max-tokens", str(max_tokens),
                                                             "--proposal-top", str(proposal_top)]),
                             capture_output=True, text=True, check=True, timeout=1800).stdout
    finally:
        worker.wait(timeout=60)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--proposal-top", type=int, default=256, help="the worker's proposal_top (0: whole head)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        return engine(args.engine, args.max_tokens, args.proposal_top)
    if why := netns.available():
        sys.exit(f"needs two network namespaces: {why}")
    results: dict[tuple, list[dict]] = {}
    with netns.two_hosts(subnet=31) as hosts:
        for _ in range(args.repeats):
            for placement in ("loopback", "veth"):
                for row in run(placement, hosts, args.max_tokens, args.proposal_top):
                    results.setdefault((placement, row["temperature"], row["batch"]), []).append(row)
    print(f"proposal_top {args.proposal_top}; medians of {args.repeats} runs per placement, placements interleaved\n")
    print("| T | batch | bytes/round to worker | bytes/round back | wait ms loopback | wait ms veth | wire ms |")
    print("|---|---|---|---|---|---|---|")
    for temperature, batch in CASES:
        lo, ve = results["loopback", temperature, batch], results["veth", temperature, batch]
        med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
        print(f"| {temperature} | {batch} | {med(ve, 'sent_per_round'):.0f} | {med(ve, 'received_per_round'):.0f} | "
              f"{med(lo, 'wait_ms_median'):.2f} | {med(ve, 'wait_ms_median'):.2f} | "
              f"{med(ve, 'wait_ms_median') - med(lo, 'wait_ms_median'):+.2f} |")


if __name__ == "__main__":
    main()
