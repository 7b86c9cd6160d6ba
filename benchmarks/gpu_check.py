"""The GPU path checked in one run: python benchmarks/gpu_check.py --device cuda --model FILE --out DIR

What a GPU machine lent for minutes must prove, in the order it matters, each check printing
its progress and landing in DIR/gpu_check.json:

1. logits: the default model on the device, fp32 and bf16, against CPU fp32;
2. greedy: AR, SD and SSD on the device (the SSD worker on --draft-device, by default the same
   GPU as a second process), SD and SSD equal to AR on real prompts;
3. exactness: sampled SD on the device through captured passes, the PIT test on tiny models,
   with its negative control (every draft accepted), which must fail;
4. speed: AR, SD, SSD and auto tok/s at each batch size, AR with batch invariance off too
   (what the invariant kernels cost), and transformers' `generate` at batch 1;
5. costs: a random-weight target of Llama-3-8B's shape and a draft of Llama-3.2-1B's (bf16):
   the target's pass and the draft's step by rows, and what they predict for AR, SD and SSD.

Nothing is downloaded: the model comes as --model FILE, the shipped draft from the tree, the
prompts from this file. A check that would start past --budget-s is skipped and says so. With
--device cpu the same checks run on the CPU, shorter, captured passes emulated and a small
stand-in for the cost profile's shapes: CI's way of keeping the path alive (tests/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' tiny models and statistics

from saguaro import LLM, SamplingParams  # noqa: E402
from saguaro.engine.runner import forward_chunks  # noqa: E402
from saguaro.models import graphs, hub  # noqa: E402
from saguaro.models.config import ModelConfig  # noqa: E402
from saguaro.models.kv_cache import new_cache  # noqa: E402
from saguaro.models.llama import LlamaModel  # noqa: E402
from saguaro.models.loader import load_model  # noqa: E402
from saguaro.models.tokenizer import load_tokenizer  # noqa: E402
from saguaro.speculation.policy.auto import AutoPolicy  # noqa: E402
from saguaro.speculation.policy.planning import HardwareProfile, forecast  # noqa: E402

PROMPTS = [  # code and chat, written for this check (the datasets' packages may be missing there)
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}],
    "import re\n\n\ndef is_valid_email(address: str) -> bool:\n    \"\"\"Return True if address looks like an email.\"\"\"\n",
    [{"role": "user", "content": "Give me three tips for writing a good cover letter."}],
    "class Stack:\n    \"\"\"A last-in, first-out stack.\"\"\"\n\n    def __init__(self):\n",
    [{"role": "user", "content": "What is the difference between a list and a tuple in Python?"}],
    "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    [{"role": "user", "content": "Write a short poem about autumn leaves."}],
]


@dataclass
class Plan:
    """How big each check runs: on a GPU as the issue asks, on the CPU small enough for CI."""
    prompts: int
    new_tokens: int
    batch_sizes: list[int]
    pit_rows: int
    cost_shapes: dict[str, ModelConfig]
    cost_rows: list[int]
    draft_rows: list[int]
    context: int
    results: dict = field(default_factory=dict)


def llama_shape(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, rope_theta=500000.0)


def plan_for(device: str) -> Plan:
    if device.startswith("cuda"):
        return Plan(prompts=8, new_tokens=64, batch_sizes=[1, 8, 32], pit_rows=20000,
                    cost_shapes={"target (Llama-3-8B shape)": llama_shape(4096, 32, 32, 8, 14336, 128256),
                                 "draft (Llama-3.2-1B shape)": llama_shape(2048, 16, 32, 8, 8192, 128256)},
                    cost_rows=[1, 2, 4, 6, 8, 16, 32, 64, 128, 256], draft_rows=[1, 8, 32, 64], context=512)
    return Plan(prompts=4, new_tokens=16, batch_sizes=[1, 4], pit_rows=3000,
                cost_shapes={"target (8B stand-in, 1/16 wide)": llama_shape(256, 4, 4, 2, 896, 8192),
                             "draft (1B stand-in, 1/16 wide)": llama_shape(128, 2, 4, 2, 512, 8192)},
                cost_rows=[1, 2, 6, 16], draft_rows=[1, 8], context=64)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# --- 1. logits --------------------------------------------------------------------------------

def check_logits(args, plan: Plan) -> dict:
    tokenizer = load_tokenizer(args.model)
    text = " ".join(p if isinstance(p, str) else p[0]["content"] for p in PROMPTS)
    ids = tokenizer(text)["input_ids"][:256]

    def logits_of(model: LlamaModel) -> torch.Tensor:
        cache = new_cache(model, 1, len(ids))
        return model.logits(forward_chunks(model, cache, [0], [ids], [0])[0]).float().cpu()

    with torch.inference_mode():
        reference = logits_of(load_model(args.model, torch.float32, "cpu", "none"))
        result = {"tokens": len(ids)}
        for name, dtype, max_rel, min_agree in (("fp32", torch.float32, 1e-3, 0.99), ("bf16", torch.bfloat16, 0.1, 0.9)):
            logits = logits_of(load_model(args.model, dtype, args.device, "none"))
            rel = float((logits - reference).abs().max() / reference.abs().max())
            agree = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
            result[name] = {"max_rel_error": rel, "argmax_agreement": agree, "passed": rel <= max_rel and agree >= min_agree}
            say(f"logits {name} on {args.device} vs CPU fp32: max relative error {rel:.2e}, argmax agreement {agree:.3f}")
    result["passed"] = all(result[n]["passed"] for n in ("fp32", "bf16"))
    return result


# --- 2. greedy --------------------------------------------------------------------------------

def engine(args, method: str, **options) -> LLM:
    return LLM(args.model, method=method, device=args.device, draft=args.draft, draft_device=args.draft_device,
               cuda_graphs=args.cuda_graphs, **options)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check_greedy(args, plan: Plan) -> dict:
    prompts = (PROMPTS * plan.prompts)[:plan.prompts]
    params = SamplingParams(temperature=0, max_tokens=plan.new_tokens)
    outputs, result = {}, {}
    for method in ("ar", "sd", "ssd"):
        with engine(args, method) as llm:
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # caches grow next
            outputs[method] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            captured = llm.target.step_graphs
            result[f"{method}_captured_passes"] = None if captured is None else captured.replays
            result[f"{method}_draft_losses"] = llm.metrics().get("draft_losses", 0)
        if method != "ar":
            differences = [first_difference(o, a) for o, a in zip(outputs[method], outputs["ar"])]
            result[method] = {"equal_to_ar": all(d is None for d in differences), "first_differences": differences}
            say(f"greedy {method} == AR on {len(prompts)} prompts x {plan.new_tokens} tokens: "
                f"{result[method]['equal_to_ar']} (first differences {differences})")
    if result["ssd_draft_losses"]:
        say(f"greedy ssd: the draft worker was lost {result['ssd_draft_losses']} times")
    result["passed"] = result["sd"]["equal_to_ar"] and result["ssd"]["equal_to_ar"] and not result["ssd_draft_losses"]
    return result


# --- 3. exactness -----------------------------------------------------------------------------

def pit_pvalue(device: str, setting: str, rows: int, broken: bool) -> float:
    import saguaro.engine.verifier as verification
    from drafts import sd_decoder
    from stats import ks_pvalue, randomized_pit, teacher_forced_probs
    from test_exactness import TINY_K, accept_always, sampled, tiny_model, tiny_outputs, tiny_prompts
    from test_trees import peaked_model

    target = graphs.attach(peaked_model().to(device), setting)
    draft = graphs.attach(tiny_model(1, 1).to(device), setting)
    params = sampled(0.8, rows=rows)
    verify = verification.verify
    verification.verify = accept_always if broken else verify
    try:
        outputs = tiny_outputs(sd_decoder(target, draft, TINY_K), params)
    finally:
        verification.verify = verify
    graphs.attach(target, "off")
    _, tokens, probs = teacher_forced_probs(target, tiny_prompts(rows), outputs, params)
    v = torch.rand(len(tokens), generator=torch.Generator().manual_seed(0))
    return ks_pvalue(randomized_pit(probs.cpu(), tokens, v))


def check_exactness(args, plan: Plan) -> dict:
    from test_exactness import ALPHA

    setting = "emulated" if args.cuda_graphs == "emulated" or not args.device.startswith("cuda") else "auto"
    with torch.inference_mode():
        exact = pit_pvalue(args.device, setting, plan.pit_rows, broken=False)
        control = pit_pvalue(args.device, setting, plan.pit_rows, broken=True)
    say(f"sampled SD on {args.device} ({plan.pit_rows} rows, T = 0.8): PIT p = {exact:.3g}; control (every draft "
        f"accepted) p = {control:.3g}; alpha {ALPHA}")
    return {"rows": plan.pit_rows, "pvalue": exact, "control_pvalue": control, "alpha": ALPHA,
            "passed": exact > ALPHA and control < ALPHA}


# --- 4. speed ---------------------------------------------------------------------------------

def decode_rate(llm: LLM, prompts: list, new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: every shape the timed run meets is captured
    synchronize(str(llm.target.device))
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(str(llm.target.device))
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started)


def host_waits_per_round(llm: LLM, prompt: str) -> float | None:
    """The times a batch-1 round waits for the device (what torch's sync debug mode sees: a
    transfer to the host, a blocking copy), per round; the goal is one. None off CUDA."""
    if llm.target.device.type != "cuda":
        return None
    rounds = llm.metrics()["spec_decode_num_rounds"]
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    waits = [w for w in caught if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]
    return len(waits) / max(1, llm.metrics()["spec_decode_num_rounds"] - rounds)


def transformers_rate(args, prompt: str, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()
    path = Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
    model = model.to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(args.device)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        synchronize(args.device)
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        synchronize(args.device)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - started)


def check_speed(args, plan: Plan, budget: Budget) -> dict:
    prompts = [p for p in PROMPTS if isinstance(p, str)]
    rates: dict[str, dict[int, float]] = {}
    figures: dict[str, dict] = {}  # each engine's metrics: hit rate, tokens a round, worker losses
    waits: dict[str, float | None] = {}
    configurations = [("ar", {}), ("ar_variant", {"batch_invariant": False}), ("sd", {}), ("ssd", {}), ("auto", {})]
    for name, options in configurations:
        if budget.left() < 20:
            say(f"speed: out of time before {name}")
            break
        with engine(args, name.split("_")[0], **options) as llm:
            if name == "auto" and isinstance(llm.decoder.policy, AutoPolicy):
                llm.wait_for_ssd(start=True)  # SSD among its choices from the first round
            rates[name] = {}
            for batch in plan.batch_sizes:
                rates[name][batch] = decode_rate(llm, (prompts * batch)[:batch], plan.new_tokens)
                say(f"speed {name} batch {batch}: {rates[name][batch]:.1f} tok/s")
            figures[name] = {k: v for k, v in llm.metrics().items() if isinstance(v, (int, float))}
            waits[name] = host_waits_per_round(llm, prompts[0])
            if waits[name] is not None:
                say(f"speed {name}: {waits[name]:.2f} waits for the device a round")
            if figures[name].get("draft_losses"):
                say(f"speed {name}: the draft worker was lost {figures[name]['draft_losses']} times")
    result = {"tok_s": rates, "metrics": figures, "host_waits_per_round": waits}
    if budget.left() > 20:
        result["transformers_batch1_tok_s"] = transformers_rate(args, prompts[0], plan.new_tokens)
        say(f"speed transformers generate batch 1: {result['transformers_batch1_tok_s']:.1f} tok/s")
    if "ar" in rates and "transformers_batch1_tok_s" in result:
        result["ar_over_transformers_batch1"] = rates["ar"][plan.batch_sizes[0]] / result["transformers_batch1_tok_s"]
    for name in ("sd", "ssd", "auto"):
        if name in rates:
            result[f"{name}_over_ar"] = {b: rates[name][b] / rates["ar"][b] for b in rates[name]}
    if "ar_variant" in rates:
        result["invariance_cost"] = {b: rates["ar_variant"][b] / rates["ar"][b] for b in rates["ar"]}
    # on a GPU the goal: AR >= 3x transformers at batch 1; elsewhere nothing to hold
    workers_kept = not any(f.get("draft_losses") for f in figures.values())
    result["passed"] = workers_kept and (result.get("ar_over_transformers_batch1", 0) >= 3.0
                                         if args.device.startswith("cuda") else bool(rates))
    return result


# --- 5. costs ---------------------------------------------------------------------------------

def random_model(config: ModelConfig, device: str) -> LlamaModel:
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.data.normal_(0.0, 0.02, generator=generator) if p.dim() > 1 else p.data.fill_(1.0)
    model.reset_rope(device)
    return model.eval().requires_grad_(False)


def pass_seconds(model: LlamaModel, batch: int, tokens: int, context: int, repeats: int) -> float:
    """Median seconds of one pass of `tokens` tokens in each of `batch` rows after `context`
    cached ones, with their logits (what a verification or a draft step costs)."""
    device = str(model.device)
    cache = new_cache(model, batch, context + tokens)
    rows, starts = list(range(batch)), [context] * batch
    chunk = [[1] * tokens for _ in rows]
    times = []
    for i in range(repeats + 2):
        synchronize(device)
        started = time.perf_counter()
        model.logits(forward_chunks(model, cache, rows, chunk, starts))
        synchronize(device)
        if i >= 2:  # the first passes capture
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def what_if(target_s: dict[int, float], draft_s: dict[int, float], k: int = 5) -> list[dict]:
    """What `saguaro plan --profile` forecasts at batch 1 for a pair with these costs, by per-token
    acceptance a and SSD hit rate h (the worker on a device of its own)."""
    rows = []
    for a in (0.6, 0.7, 0.8):
        for h in (0.6, 0.9):
            f = forecast(HardwareProfile("what-if", target_s, draft_s, [a] * k, h), 1)
            rows.append({"acceptance": a, "hit_rate": h, "ar_tok_s": f.ar_tok_s, "sd_tok_s": f.sd_tok_s,
                         "ssd_tok_s": f.ssd_tok_s, "ssd_over_sd": f.ssd_tok_s / f.sd_tok_s})
    return rows


def check_costs(args, plan: Plan, budget: Budget) -> dict:
    (target_name, target_config), (draft_name, draft_config) = plan.cost_shapes.items()
    result = {"shapes": {target_name: vars(target_config), draft_name: vars(draft_config)}}
    with torch.inference_mode():
        for name, config, rows_list, batch_of in ((target_name, target_config, plan.cost_rows, False),
                                                  (draft_name, draft_config, plan.draft_rows, True)):
            model = graphs.attach(random_model(config, args.device), args.cuda_graphs)
            table = {}
            for rows in rows_list:
                if budget.left() < 10:
                    break
                batch, tokens = (rows, 1) if batch_of else (1, rows)
                table[rows] = pass_seconds(model, batch, tokens, plan.context, repeats=10)
                say(f"costs {name}: {'step over ' + str(rows) + ' rows' if batch_of else 'pass over ' + str(rows) + ' tokens'}"
                    f" {table[rows] * 1e3:.2f} ms")
            result["target_pass_s" if not batch_of else "draft_step_s"] = table
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if result.get("target_pass_s") and result.get("draft_step_s"):
        result["what_if_batch1"] = what_if(result["target_pass_s"], result["draft_step_s"])
        profile = {"name": f"{target_name} and {draft_name} on {args.device}", "target_pass_s": result["target_pass_s"],
                   "draft_step_s": result["draft_step_s"], "acceptance": [0.7] * 5, "hit_rate": 0.86}
        (Path(args.out) / "profile.json").write_text(json.dumps(profile, indent=1))  # for saguaro plan --profile
    result["passed"] = bool(result.get("what_if_batch1"))
    return result


# --- the run ----------------------------------------------------------------------------------

def environment(args) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": args.device}
    if args.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(args.device)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(args.device)))
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    info["commit"] = git("rev-parse", "--short", "HEAD") or None
    # a copy of a working tree may carry older git metadata than its files (as the device tool's did)
    changed = git("status", "--porcelain", "--untracked-files=no")
    info["files_differ_from_commit"] = None if changed is None else bool(changed)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--draft-device", default=None, help="the SSD worker's device (default: --device)")
    parser.add_argument("--model", default=None, help="the default model's GGUF file (default: saguaro's cache)")
    parser.add_argument("--draft", default=str(hub.DRAFTS_DIR / "smollm2"), help="(default: the shipped draft)")
    parser.add_argument("--cuda-graphs", default=None, choices=graphs.SETTINGS,
                        help="(default: auto on a GPU, emulated on the CPU)")
    parser.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=None, help="(default: 450 on a GPU, 170 on the CPU)")
    parser.add_argument("--checks", default="logits,greedy,exactness,speed,costs")
    args = parser.parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    args.model = args.model or str(hub.resolve(hub.DEFAULT_MODEL))
    args.draft_device = args.draft_device or args.device
    args.cuda_graphs = args.cuda_graphs or ("auto" if on_gpu else "emulated")
    budget = Budget(args.budget_s or (450.0 if on_gpu else 170.0))
    plan = plan_for(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"environment": environment(args), "checks": {}}
    say(f"gpu_check on {args.device}: {report['environment']}")
    runs = {"logits": lambda: check_logits(args, plan), "greedy": lambda: check_greedy(args, plan),
            "exactness": lambda: check_exactness(args, plan), "speed": lambda: check_speed(args, plan, budget),
            "costs": lambda: check_costs(args, plan, budget)}
    for name in args.checks.split(","):
        if budget.left() < 15:
            report["checks"][name] = {"passed": None, "skipped": "out of time"}
            say(f"{name}: skipped, out of time")
            continue
        say(f"{name} ...")
        started = time.monotonic()
        try:
            report["checks"][name] = runs[name]()
        except Exception as e:  # noqa: BLE001 - a failed check is reported, the others still run
            report["checks"][name] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
            say(f"{name}: FAILED with {type(e).__name__}: {e}")
        report["checks"][name]["seconds"] = round(time.monotonic() - started, 1)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        say(f"{name}: {'passed' if report['checks'][name]['passed'] else 'FAILED'} "
            f"in {report['checks'][name]['seconds']} s")
    report["passed"] = all(c.get("passed") for c in report["checks"].values())
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    say(f"gpu_check {'passed' if report['passed'] else 'FAILED'}; {out / 'gpu_check.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
