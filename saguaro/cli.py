"""The `saguaro` command: fetch models, generate text, chat, distill drafts, serve over HTTP."""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

from packaging.requirements import Requirement

from saguaro.config import add_speculative_arguments, speculative_config_from_args
from saguaro.llm import add_llm_arguments, llm_from_args
from saguaro.models import hub
from saguaro.models.quantized import MODES
from saguaro.speculation.policy.planning import HardwareProfile


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.7, help="0 is greedy (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=-1, help="-1: off (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    group.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    group.add_argument("--seed", type=int, help="makes sampling reproducible")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable); the text ends before it")
    group.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    group.add_argument("--metrics", action="store_true", help="print each request's metrics to stderr")


def require_extra(command: str, extra: str) -> None:
    """Says before any model loads which extra a command needs, naming what of it is missing
    (read from saguaro's installed metadata: nothing to check in a tree that is not installed)."""
    try:
        requirements = [Requirement(r) for r in importlib.metadata.requires("saguaro") or []]
    except importlib.metadata.PackageNotFoundError:
        return
    missing = [r.name for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})
               and importlib.util.find_spec(r.name.replace("-", "_")) is None]
    if missing:
        raise ImportError(f"saguaro {command} needs the {extra} extra ({', '.join(missing)} not installed): "
                          f"pip install 'saguaro[{extra}]'")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saguaro", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pull = commands.add_parser("pull", help="fetch a known model into the local cache")
    pull.add_argument("name", choices=sorted(hub.KNOWN_MODELS))

    generate = commands.add_parser("generate", help="complete prompts (streams a single prompt)")
    generate.add_argument("prompts", nargs="*", metavar="PROMPT")
    generate.add_argument("--file", type=Path, help="read prompts from a file, one per line")
    generate.add_argument("--chat", action="store_true", help="send each prompt as a user message (chat template)")
    add_llm_arguments(generate)
    add_sampling_arguments(generate)

    chat = commands.add_parser("chat", help="interactive chat (type /exit to leave, /reset to start over)")
    chat.add_argument("--system", help="system prompt")
    add_llm_arguments(chat)
    add_sampling_arguments(chat)

    # Its own parser (saguaro.distill.cli) takes the remaining arguments, so it loads only when used.
    commands.add_parser("distill", add_help=False, help="distill a draft for a target (saguaro distill --help)")
    bench = commands.add_parser("bench", help="AR, SD, SSD and transformers side by side "
                                "(writes bench.json, bench.md and plots)")
    bench.add_argument("--model", default=hub.DEFAULT_MODEL)
    bench.add_argument("--methods", default="ar,sd,ssd,auto,hf,hf-assisted",
                       help="of ar, sd, ssd, auto, hf (transformers generate), hf-assisted (with the draft as "
                            "assistant), llamacpp (llama.cpp on the same GGUF: pip install 'saguaro[llamacpp]')")
    bench.add_argument("--datasets", default="humaneval", help="of humaneval, sharegpt (held-out first turns), random")
    bench.add_argument("--num-prompts", type=int, default=10)
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--temperatures", default="0,0.7,1.0")
    bench.add_argument("--batch-sizes", default="1,4,8")
    bench.add_argument("--fan-out-sweep", default="", help="also: SSD hit rate for these uniform fan-outs, e.g. 1,2,4,8")
    bench.add_argument("--dtype", default="bfloat16")
    bench.add_argument("--quantization", default="auto", choices=MODES, help="saguaro's (see saguaro generate --help)")
    bench.add_argument("--threads", type=int, help="torch threads of AR, SD, auto and transformers (default: every "
                       "core, as SSD's target and draft use together; 1: one core per model)")
    bench.add_argument("--no-chat-template", action="store_true", help="raw prompts (default: chat template applied)")
    bench.add_argument("--no-ignore-eos", action="store_true", help="stop at end-of-sequence (default: decode max tokens)")
    bench.add_argument("--quick", action="store_true",
                       help="smoke run: 2 prompts x 16 tokens, T 0, batch 1 and 2, fan-outs 1,2 (about a minute)")
    bench.add_argument("--out", type=Path, default=Path("bench_out"))
    add_speculative_arguments(bench, exclude=("method",))
    plan = commands.add_parser("plan", help="what method=auto measures, predicts and chooses, per batch size")
    plan.add_argument("--batch-sizes", default="1,4,8,16", help="(default: %(default)s)")
    plan.add_argument("--dataset", choices=["humaneval", "sharegpt"], default="humaneval",
                      help="prompts (sharegpt: held-out first turns) (default: %(default)s)")
    plan.add_argument("--max-tokens", type=int, default=64, help="per request and choice (default: %(default)s)")
    plan.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    plan.add_argument("--profile", type=Path, help="forecast for hardware saguaro is not running on, from this JSON "
                      "of pass costs, acceptance and hit rate (benchmarks/profiles/); no model is loaded")
    plan.add_argument("--acceptance", help="with --profile: per-token acceptance a, or a_1,...,a_K per position")
    plan.add_argument("--hit-rate", type=float, help="with --profile: SSD's cache hit rate")
    plan.add_argument("--ssd-draft-cost", type=float, help="with --profile: SSD drafts with a draft of its own "
                      "whose step costs this many times SD's draft's (its worker hides the cost)")
    plan.add_argument("--ssd-acceptance", help="with --profile: that draft's acceptance, as --acceptance")
    plan.add_argument("--ssd-hit-rate", type=float, help="with --profile: SSD's cache hit rate with that draft")
    add_llm_arguments(plan)
    twin = commands.add_parser("twin", help="write a wider twin of a GGUF model: the same function at a bigger "
                               "model's cost, for benchmarking speculation in a large target's regime")
    twin.add_argument("source", help="a GGUF file or a known model name (e.g. smollm2)")
    twin.add_argument("out", type=Path, help="the twin's GGUF file")
    twin.add_argument("--shape", required=True, metavar="HIDDEN,HEADS,KV_HEADS,FFN[,LAYERS]",
                      help="the twin's widths, e.g. 1920,30,10,7680 (SmolLM2-135M at SmolLM2-1.7B's cost)")
    commands.add_parser("serve", add_help=False,
                        help="serve a model over an OpenAI-compatible HTTP API (saguaro serve --help)")
    return parser


def sampling_params(args: argparse.Namespace):
    from saguaro import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)


def format_metrics(index: int, m) -> str:
    parts = [f"prompt {m.num_prompt_tokens} tok", f"output {m.num_output_tokens} tok", f"TTFT {m.ttft_s * 1000:.0f} ms",
             f"decode {m.decode_tokens_per_s:.1f} tok/s", f"end-to-end {m.e2e_tokens_per_s:.1f} tok/s",
             f"{m.num_rounds} rounds"]
    if m.mean_acceptance_length is not None:
        parts.append(f"acceptance length {m.mean_acceptance_length:.2f}")
        parts.append("per position " + " ".join(f"{a:.2f}" for a in m.per_position_acceptance))
    if m.cache_hit_rate is not None:
        parts.append(f"cache hit rate {m.cache_hit_rate:.2f}")
    return f"[metrics {index}] " + ", ".join(parts)


def stream(index: int, text: str) -> None:
    print(text, end="", flush=True)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompts)
    if args.file:
        prompts += [line for line in args.file.read_text().splitlines() if line.strip()]
    return prompts


def run_bench(args: argparse.Namespace) -> int:
    from saguaro import bench
    from saguaro.bench import report

    require_extra("bench", "bench")
    numbers = lambda text, kind: [kind(x) for x in text.split(",") if x]  # noqa: E731
    bench_config = bench.BenchConfig(
        model=args.model, speculative=speculative_config_from_args(args), methods=args.methods.split(","),
        datasets=args.datasets.split(","), num_prompts=args.num_prompts, max_tokens=args.max_tokens,
        temperatures=numbers(args.temperatures, float), batch_sizes=numbers(args.batch_sizes, int),
        fan_out_sweep=numbers(args.fan_out_sweep, int), dtype=args.dtype, quantization=args.quantization,
        chat_template=not args.no_chat_template,
        ignore_eos=not args.no_ignore_eos, threads=args.threads)
    if args.quick:
        bench_config = bench.quick(bench_config)
    result = bench.run(bench_config, args.out)
    print(report.markdown(result))
    print(f"written to {args.out}/")
    return 0


def run_plan(args: argparse.Namespace) -> int:
    from saguaro import SamplingParams
    from saguaro.bench import plan
    from saguaro.datasets import humaneval_prompts, sharegpt_first_turns

    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if args.profile is not None:
        print(plan.forecast_markdown(read_hardware_profile(args), batch_sizes))
        return 0
    require_extra("plan", "data")
    texts = humaneval_prompts() if args.dataset == "humaneval" else sharegpt_first_turns("heldout", limit=max(batch_sizes))
    llm = llm_from_args(args)
    prompts = [llm.encode([{"role": "user", "content": t}]) for t in texts[:max(batch_sizes)]]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    print(plan.markdown(plan.plan(llm, prompts, batch_sizes, params)))
    return 0


def read_hardware_profile(args: argparse.Namespace) -> HardwareProfile:
    try:
        data = json.loads(args.profile.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{args.profile} is not JSON: {e}") from None
    if args.acceptance:
        data["acceptance"] = acceptance_rates(args.acceptance, data.get("acceptance"))
    if args.hit_rate is not None:
        data["hit_rate"] = args.hit_rate
    if (args.ssd_draft_cost, args.ssd_acceptance, args.ssd_hit_rate) != (None, None, None):
        ssd = data.get("ssd_draft") or {name: data.get(name) for name in ("draft_step_s", "acceptance", "hit_rate")}
        if args.ssd_draft_cost is not None:
            ssd["draft_step_s"] = {rows: s * args.ssd_draft_cost for rows, s in (ssd["draft_step_s"] or {}).items()}
        if args.ssd_acceptance:
            ssd["acceptance"] = acceptance_rates(args.ssd_acceptance, ssd["acceptance"])
        if args.ssd_hit_rate is not None:
            ssd["hit_rate"] = args.ssd_hit_rate
        data["ssd_draft"] = ssd
    return HardwareProfile.from_json(data)


def acceptance_rates(text: str, current: list[float] | None) -> list[float]:
    """a_1,...,a_K, or one a for every position of the profile's K (5 where it has none)."""
    rates = [float(a) for a in text.split(",")]
    return rates if len(rates) > 1 else rates * len(current or [0] * 5)


def run_generate(args: argparse.Namespace) -> None:
    prompts = read_prompts(args)
    if not prompts:
        raise ValueError("no prompt: give one or more PROMPT arguments or --file")
    params = sampling_params(args)  # checked before the model loads
    llm = llm_from_args(args)
    inputs = [[{"role": "user", "content": p}] if args.chat else p for p in prompts]
    single = len(inputs) == 1
    outputs = llm.generate(inputs, params, use_tqdm=not single, on_token=stream if single else None)
    if single:
        print()
    else:
        for i, out in enumerate(outputs):
            print(f"=== {i} ===\n{out.text}")
    if args.metrics:
        for i, out in enumerate(outputs):
            print(format_metrics(i, out.metrics), file=sys.stderr)


def run_chat(args: argparse.Namespace) -> None:
    params = sampling_params(args)
    llm = llm_from_args(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    print("saguaro chat: /exit to leave, /reset to start over", file=sys.stderr)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print()
            return
        if line == "/exit":
            return
        if line == "/reset":
            history = list(start)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            out = llm.generate([history], params, use_tqdm=False, on_token=stream)[0]
        except ValueError as e:  # the conversation outgrew the context
            history.pop()
            print(f"saguaro: {e}; /reset to start over", file=sys.stderr)
            continue
        print()
        history.append({"role": "assistant", "content": out.text})
        if args.metrics:
            print(format_metrics(0, out.metrics), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "distill":
        from saguaro.distill.cli import cli_main

        cli_main(rest)
        return 0
    if args.command == "serve":
        from saguaro.server.serve import main as serve_main

        return serve_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "bench":
            return run_bench(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "pull":
            print(hub.pull(args.name))
        elif args.command == "twin":
            from saguaro.models.twin import TwinShape, write_twin_gguf

            print(write_twin_gguf(hub.resolve(args.source), args.out, TwinShape.parse(args.shape)))
        elif args.command == "generate":
            run_generate(args)
        else:
            run_chat(args)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"saguaro: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
