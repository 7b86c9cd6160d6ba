"""Soak test for `saguaro serve --method ssd`: many streaming clients for a long time, bad
requests mixed in, and the draft worker killed along the way.

C clients (a closed loop each) send streaming chat completions to a server on a loopback port;
about one request in five is bad: malformed JSON, a wrong type, a max_tokens beyond the
context, a body over the server's limit. Twice (--kills) the draft worker, found among the
server's child processes, is killed with SIGKILL. At the end it checks that every good request
completed, every bad one got a 4xx, nothing got a 5xx, the server replaced its worker after
each kill, and the server's resident memory stayed flat: growth under 5 % from the end of the
warm-up to the end. Linux only (it reads /proc).

    python benchmarks/soak.py                          # 32 clients, 10 minutes
    python benchmarks/soak.py --duration 120 --clients 8 -- --dtype float32 --threads 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from saguaro.datasets import sharegpt_first_turns
from serve_load import launch, scrape, stop

WORKER_MODULE = "saguaro.speculation.worker"
MAX_RSS_GROWTH = 0.05
BODY_LIMIT = 1 << 20  # saguaro serve's default --max-body-bytes


@dataclass
class Tally:
    good_ok: int = 0
    good_failed: Counter = field(default_factory=Counter)  # what went wrong, by kind
    bad_4xx: int = 0
    bad_other: Counter = field(default_factory=Counter)  # status of bad requests not answered 4xx
    status_5xx: int = 0
    tokens: int = 0


def bad_request(model: str, rng: random.Random) -> bytes:
    """One of the ways a client gets a request wrong; each must get a 4xx."""
    kind = rng.randrange(4)
    if kind == 0:
        return b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": '
    if kind == 1:
        return json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": "many"}).encode()
    if kind == 2:
        return json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}],
                           "max_tokens": 10 ** 7}).encode()
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 1)}]}).encode()


async def good_request(client: httpx.AsyncClient, model: str, prompt: str, rng: random.Random, tally: Tally) -> None:
    """A streaming chat completion that must end with a finish reason, usage and [DONE]."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(8, 48),
            "temperature": rng.choice([0.0, 0.7]), "stream": True, "stream_options": {"include_usage": True}}
    finish, tokens, done = None, 0, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            tally.status_5xx += response.status_code >= 500
            tally.good_failed[f"HTTP {response.status_code}"] += 1
            return
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    tally.good_failed["error event"] += 1
                    return
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event["choices"] and event["choices"][0]["finish_reason"]:
                    finish = event["choices"][0]["finish_reason"]
    if done and finish and 0 < tokens <= body["max_tokens"]:
        tally.good_ok += 1
        tally.tokens += tokens
    else:
        tally.good_failed["incomplete stream"] += 1


async def client_loop(url: str, model: str, prompts: list[str], deadline: float, seed: int, bad_share: float,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900, connect=60)) as client:
        while time.monotonic() < deadline:
            if rng.random() < bad_share:
                try:
                    r = await client.post("/v1/chat/completions", content=bad_request(model, rng),
                                          headers={"Content-Type": "application/json"})
                except httpx.HTTPError as e:
                    tally.bad_other[type(e).__name__] += 1
                    continue
                if 400 <= r.status_code < 500:
                    tally.bad_4xx += 1
                else:
                    tally.bad_other[r.status_code] += 1
                    tally.status_5xx += r.status_code >= 500
            else:
                try:
                    await good_request(client, model, rng.choice(prompts), rng, tally)
                except httpx.HTTPError as e:
                    tally.good_failed[type(e).__name__] += 1


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def draft_workers(parent: int) -> list[int]:
    """The parent's child processes that run the draft worker."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        if ppid == parent and WORKER_MODULE in command:
            found.append(int(entry))
    return found


async def watch(server_pid: int, start: float, warmup_s: float, kill_at: list[float], deadline: float,
                report: dict) -> None:
    """Samples the server's memory, kills the worker at the planned times, notes the workers seen."""
    seen = set(draft_workers(server_pid))
    pending = sorted(kill_at)
    while time.monotonic() < deadline:
        now = time.monotonic()
        workers = draft_workers(server_pid)
        seen.update(workers)
        if report.get("rss_warm") is None and now - start >= warmup_s:
            report["rss_warm"] = rss_bytes(server_pid)
        if pending and now - start >= pending[0]:
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                report["killed"].append(workers[0])
                print(f"[{now - start:6.0f} s] killed draft worker {workers[0]}", file=sys.stderr)
                pending.pop(0)
        await asyncio.sleep(2)
    report["rss_end"] = rss_bytes(server_pid)
    report["workers_seen"] = len(seen)


async def soak(url: str, server_pid: int, args, prompts: list[str]) -> tuple[Tally, dict]:
    tally = Tally()
    report = {"killed": [], "rss_warm": None}
    start = time.monotonic()
    deadline = start + args.duration
    span = args.duration - args.warmup
    kill_at = [args.warmup + span * (i + 1) / (args.kills + 1) for i in range(args.kills)]
    clients = [client_loop(url, args.model, prompts, deadline, seed, args.bad_share, tally)
               for seed in range(args.clients)]
    await asyncio.gather(watch(server_pid, start, args.warmup, kill_at, deadline, report), *clients)
    report["wall_s"] = time.monotonic() - start
    return tally, report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default: %(default)s)")
    parser.add_argument("--warmup", type=float, default=60.0,
                        help="seconds before the memory baseline is taken (default: %(default)s)")
    parser.add_argument("--kills", type=int, default=2, help="draft worker kills, evenly spread after the warm-up")
    parser.add_argument("--bad-share", type=float, default=0.2, help="share of bad requests (default: %(default)s)")
    parser.add_argument("--model", default="smollm2", help="the served model's name (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out ShareGPT turns to cycle through")
    args = parser.parse_args(argv)
    if args.warmup >= args.duration:
        parser.error("--warmup must be shorter than --duration")
    prompts = sharegpt_first_turns("heldout", limit=args.prompts, seed=0, max_chars=1000)
    server, url = launch("ssd", ["--host", "127.0.0.1", *serve_args])
    try:
        tally, report = asyncio.run(soak(url, server.pid, args, prompts))
        metrics = scrape(url)
    finally:
        stop(server)
    growth = report["rss_end"] / report["rss_warm"] - 1
    restarts = metrics.get("draft_worker_restarts_total", 0)
    mib = 1 << 20
    print(f"duration {report['wall_s']:.0f} s, {args.clients} clients, {tally.tokens} tokens generated")
    print(f"good requests ok {tally.good_ok}, failed {sum(tally.good_failed.values())} {dict(tally.good_failed)}")
    print(f"bad requests 4xx {tally.bad_4xx}, other {dict(tally.bad_other)}")
    print(f"5xx {tally.status_5xx}")
    print(f"draft workers killed {len(report['killed'])}, lost {metrics.get('draft_worker_losses_total', 0):g}, "
          f"restarted {restarts:g} (workers seen {report['workers_seen']})")
    print(f"server RSS at warm-up {report['rss_warm'] / mib:.0f} MiB, at the end {report['rss_end'] / mib:.0f} MiB "
          f"({100 * growth:+.1f} %)")
    print(f"SSD cache hit rate {metrics.get('speculation_cache_hit_rate', 0):.2f}")
    passed = (tally.good_ok > 0 and not tally.good_failed and not tally.bad_other and tally.status_5xx == 0
              and restarts >= len(report["killed"]) == args.kills and growth < MAX_RSS_GROWTH)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
