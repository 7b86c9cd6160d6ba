"""Load test for `saguaro serve`: throughput and latency at several numbers of concurrent clients.

Each of C clients sends streaming chat completions back to back (a closed loop) until the
level's requests are done; prompts are held-out ShareGPT first turns, greedy, and every
request decodes exactly --max-tokens tokens (ignore_eos), so every method does equal work.
Per request it records the time to first token (request sent -> first content chunk) and the
per-token latency ((last chunk - first chunk) / (tokens - 1)); throughput is all generated
tokens over the level's wall time. SD and SSD commit several tokens per round, so their chunks
arrive in bursts: per-token latency is the mean within a request, p50/p95 are across requests.

Against a running server:
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --concurrency 1 8 32
Starting a server per method (`saguaro serve` on a free loopback port; later arguments go to it):
    python benchmarks/serve_load.py --launch ar sd ssd --concurrency 1 8 32 -- --dtype float32 --threads 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import httpx

from saguaro.datasets import sharegpt_first_turns


@dataclass
class Result:
    ttft_s: float
    per_token_s: float | None  # None for a single-token output
    tokens: int


@dataclass
class Level:
    method: str
    concurrency: int
    requests: int
    errors: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    per_token_p50_ms: float
    per_token_p95_ms: float
    acceptance_length: float | None
    cache_hit_rate: float | None
    auto_rounds: dict[str, int]  # method=auto: the level's rounds by choice ("0": AR, "1".."K": SD, "ssd")


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Result:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    if first is None:
        raise RuntimeError("no content")
    return Result(first - sent, (last - first) / (tokens - 1) if tokens > 1 else None, tokens)


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                    max_tokens: int) -> tuple[list[Result], int, float]:
    """C workers share a queue of requests; returns the results, the error count, wall time."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(prompts[i % len(prompts)])
    results: list[Result] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                results.append(await one_request(client, model, prompt, max_tokens))
            except (RuntimeError, httpx.HTTPError) as e:
                errors += 1
                print(f"  error: {e}", file=sys.stderr)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return results, errors, time.perf_counter() - start


AUTO_ROUNDS = re.compile(r'saguaro_auto_rounds_total\{k="(\w+)"\} (\S+)')


def scrape(url: str) -> dict[str, float]:
    """The server's unlabelled counters, and auto's rounds by choice as auto_rounds:K."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("saguaro_") and "{" not in line:
            name, value = line.split()
            values[name.removeprefix("saguaro_")] = float(value)
        elif match := AUTO_ROUNDS.match(line):
            values[f"auto_rounds:{match.group(1)}"] = float(match.group(2))
    return values


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def measure(url: str, method: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
            max_tokens: int) -> Level:
    before = scrape(url)
    results, errors, wall = asyncio.run(run_level(url, model, prompts, concurrency, num_requests, max_tokens))
    after = scrape(url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    ttft = [r.ttft_s * 1000 for r in results]
    per_token = [r.per_token_s * 1000 for r in results if r.per_token_s is not None]
    rounds = delta["acceptance_length_count"]
    lookups = delta["speculation_cache_lookups_total"]
    return Level(method, concurrency, len(results), errors, wall, sum(r.tokens for r in results) / wall,
                 percentile(ttft, 50), percentile(ttft, 95), percentile(per_token, 50), percentile(per_token, 95),
                 delta["acceptance_length_sum"] / rounds if rounds else None,
                 delta["speculation_cache_hits_total"] / lookups if lookups else None,
                 {k.split(":")[1]: int(v) for k, v in sorted(delta.items()) if k.startswith("auto_rounds:") and v})


def launch(method: str, serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "saguaro.server", "--method", method, "--port", str(port),
               "--log-level", "warning", *serve_args]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"saguaro serve --method {method} exited with {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.kill()
            raise RuntimeError("the server did not start")
        time.sleep(1)


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def markdown(levels: list[Level]) -> str:
    def fmt(x, digits=1):
        return "-" if x is None else f"{x:.{digits}f}"

    lines = ["| method | clients | requests | errors | tokens/s | TTFT p50 ms | TTFT p95 ms | per-token p50 ms "
             "| per-token p95 ms | acceptance length | cache hit rate | auto's rounds by K |", "|" + "---|" * 12]
    for v in levels:
        lines.append(f"| {v.method} | {v.concurrency} | {v.requests} | {v.errors} | {fmt(v.tokens_per_s)} | "
                     f"{fmt(v.ttft_p50_ms, 0)} | {fmt(v.ttft_p95_ms, 0)} | {fmt(v.per_token_p50_ms)} | "
                     f"{fmt(v.per_token_p95_ms)} | {fmt(v.acceptance_length, 2)} | {fmt(v.cache_hit_rate, 2)} | "
                     f"{' '.join(f'{k}: {n}' for k, n in v.auto_rounds.items()) or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server")
    target.add_argument("--launch", nargs="+", choices=("ar", "sd", "ssd", "auto"),
                        help="start a server for each method, in turn (repeat them to alternate: ar auto ar auto)")
    parser.add_argument("--model", default="smollm2", help="the served model's name (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="requests per level = this x clients, at least --min-requests (default: %(default)s)")
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=64, help="held-out ShareGPT turns to cycle through")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    prompts = sharegpt_first_turns("heldout", limit=args.prompts, seed=0, max_chars=1000)
    levels: list[Level] = []
    for method in args.launch or ["-"]:
        server, url = launch(method, serve_args) if args.launch else (None, args.url)
        try:
            warm = measure(url, method, args.model, prompts, 1, 1, 8)  # first-call costs stay out of the table
            if warm.errors:
                raise RuntimeError("the warm-up request failed")
            for c in args.concurrency:
                levels.append(measure(url, method, args.model, prompts, c,
                                      max(args.min_requests, args.requests_per_client * c), args.max_tokens))
                print(markdown(levels[-1:]).splitlines()[-1], file=sys.stderr)
        finally:
            if server is not None:
                stop(server)
    print(markdown(levels))
    if args.out:
        report = {"levels": [asdict(v) for v in levels], "serve_args": serve_args, "max_tokens": args.max_tokens,
                  "cpus": len(os.sched_getaffinity(0))}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
