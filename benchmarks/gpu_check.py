"""The GPU path checked in one run: python benchmarks/gpu_check.py --device cuda --model FILE --out DIR

What a GPU machine lent for minutes must prove, in the order it matters, each check printing
its progress and landing in DIR/gpu_check.json. The target of checks 2, 4 and 5 is the paper's
regime with real acceptance: a twin of the default model (saguaro.models.twin) at Llama-3-8B's
cost, built on the device from the 135M file (it computes what the 135M model computes), verified
by the shipped draft made for the 135M model, whose acceptance is therefore real.

1. logits: the default model on the device, fp32 and bf16, against CPU fp32;
   twin: the twin at full size (the 8B one on a GPU; on the CPU one of SmolLM2-1.7B's widths, built
   by the same code) against its source in bf16: logits along real prompts, greedy tokens;
2. greedy: AR, SD and SSD on the twin (the SSD worker on --draft-device, by default the same
   GPU as a second process; on a GPU also on the host's idle CPU cores), equal to AR on real prompts;
3. exactness: sampled SD on the device through captured passes, the PIT test on tiny models,
   with its negative control (every draft accepted), which must fail;
4. speed: AR, SD, SSD (both worker placements) and auto tok/s on the twin at each batch size,
   greedy and at T = 0.7, a tokens/s-per-GPU table (the host's cores charged nothing), AR with
   batch invariance off (what the invariant kernels cost), and transformers' `generate` at batch 1;
5. costs: the twin's pass and the draft's step by rows, what they predict for AR, SD and SSD,
   and DIR/profile.json with DIR/plan.md (`saguaro plan --profile` of those costs and the run's
   SSD hit rate), beside the measurement.

Nothing is downloaded: the model comes as --model FILE, the shipped draft from the tree, the
prompts from this file. A check that would start past --budget-s is skipped and says so. With
--device cpu the same checks run on the CPU, shorter, captured passes emulated and a small
twin measured (the twin check's a 1.7B-size one): CI's way of keeping the path alive
(tests/test_gpu_check.py), a shape's bug found there and not in a lent GPU's minutes.
"""
from __future__ import annotations

import argparse
import json
import os
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
from saguaro.models.kv_cache import new_cache  # noqa: E402
from saguaro.models.llama import LlamaModel  # noqa: E402
from saguaro.models.loader import load_model  # noqa: E402
from saguaro.models.pairing import load_draft  # noqa: E402
from saguaro.models.tokenizer import load_tokenizer  # noqa: E402
from saguaro.models.twin import TwinShape, load_twin  # noqa: E402
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
    new_tokens: int  # the greedy check's
    speed_tokens: int  # each timed run's (and its warm-up's)
    batch_sizes: list[int]
    pit_rows: int
    twin: TwinShape  # the target that checks 2, 4 and 5 measure
    full_twin: TwinShape | None  # the twin check's; None: `twin` (on a GPU, already full size)
    sampled_batch_sizes: list[int]  # the speed check at T = 0.7 too
    cost_rows: list[int]
    cost_repeats: int
    draft_rows: list[int]
    context: int
    results: dict = field(default_factory=dict)


# Llama-3-8B's projections exactly: hidden 4096, 64 query heads of SmolLM2's 64 dimensions over 16
# kv heads (q and o 4096 x 4096, k and v 4096 x 1024, the same 1,024 kv values a token as 8B's 8 x
# 128), FFN 14336, 32 layers (two of them zero blocks): 6.98 G weights a token in the layers, 8B's
# 6.98 G; the head reads 49,152 x 4096 (0.20 G) where 8B's reads 128,256 x 4096 (0.53 G), so a
# token reads 7.18 G weights against 7.50 G: 96% of Llama-3-8B's cost. (32 heads of 64 would be
# 2048 wide and halve the attention's projections.)
TWIN_8B = TwinShape(hidden_size=4096, num_heads=64, num_kv_heads=16, intermediate_size=14336, num_layers=32)
# The CPU's dry run: what 2 cores decode within CI's 3 minutes, every method at each batch size
# and temperature: 1.34x the 135M model's layer weights (a 1.7B-size twin decodes at a few tokens
# a second on one core, too slow for that). Query heads 12 of 64 (768) over a 640 residual.
TWIN_CPU = TwinShape(hidden_size=640, num_heads=12, num_kv_heads=4, intermediate_size=1792)
# The CPU's twin check: SmolLM2-1.7B's widths (hidden 2048, 32 query heads of 64, FFN 8192; the
# vocabulary is the source's 49,152 as 1.7B's) over 8 kv heads, not 1.7B's 32: the source's 3
# query heads a kv head stay together (twin.layout), and of 32 heads only 4 or 8 kv heads hold 3;
# 32 layers as the 8B twin (the source's 30 and two zero blocks; 1.7B's 24 are fewer than the
# source's): 2.06 G weights, 4.1 GB in bf16 (8.9 GB at the build's peak: build_model holds the
# unfused projections while it fuses them); the check took 31 s of CPU, 15 s of it the build.
TWIN_1_7B = TwinShape(hidden_size=2048, num_heads=32, num_kv_heads=8, intermediate_size=8192, num_layers=32)


def plan_for(device: str) -> Plan:
    if device.startswith("cuda"):
        return Plan(prompts=8, new_tokens=64, speed_tokens=64, batch_sizes=[1, 4, 16], pit_rows=20000, twin=TWIN_8B,
                    full_twin=None,
                    sampled_batch_sizes=[1, 4, 16], cost_rows=[1, 2, 4, 6, 8, 16, 32, 64, 96],
                    cost_repeats=10, draft_rows=[1, 4, 16, 64], context=512)
    # the dry run proves the path, not a speed: the greedy check as on a GPU but for its size (every
    # method, several rows), the speed check each engine at two batch sizes and T = 0.7 over a few
    # rounds (a pass of the twin costs ~0.1 s of CPU; at 16 tokens and batch 4 the speed check took
    # 44% of the checks' CPU)
    return Plan(prompts=4, new_tokens=16, speed_tokens=8, batch_sizes=[1, 2], pit_rows=3000, twin=TWIN_CPU,
                full_twin=TWIN_1_7B,
                sampled_batch_sizes=[1], cost_rows=[1, 6, 12], cost_repeats=3, draft_rows=[1, 8], context=64)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (SSD's workers once closed): on a shared
    machine the wall clock says how crowded it was, this what the check cost."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


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
            same = dtype == torch.float32 and torch.device(args.device).type == "cpu"  # the reference itself
            logits = reference if same else logits_of(load_model(args.model, dtype, args.device, "none"))
            rel = float((logits - reference).abs().max() / reference.abs().max())
            agree = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
            result[name] = {"max_rel_error": rel, "argmax_agreement": agree, "passed": rel <= max_rel and agree >= min_agree}
            say(f"logits {name} on {args.device} vs CPU fp32: max relative error {rel:.2e}, argmax agreement {agree:.3f}")
    result["passed"] = all(result[n]["passed"] for n in ("fp32", "bf16"))
    return result


# --- the twin ---------------------------------------------------------------------------------

# How far a bf16 twin's logits may be from its bf16 source's, relative to the largest: its norms
# (their weights scaled) and longer sums round differently (on the CPU 0.024 at 768 wide, 0.031
# at 2048, and 0.031 at the 8B twin's 4096 with 64 heads over 16, FFN 1536), while a twin that
# does not compute its source (norms not rescaled, a query head on another kv head) is off by
# 0.49 to 2.4 (tests/test_gpu_check.py, tests/test_twin.py).
TWIN_LOGIT_TOLERANCE = 0.1


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def build_twin(args, shape: TwinShape, **controls) -> LlamaModel:
    """The twin of --model at `shape`, in bf16 on the device: every twin this script runs;
    controls: twin.layout's (tests/test_gpu_check.py's twins that are not their source)."""
    started = time.monotonic()
    twin = load_twin(args.model, shape, torch.bfloat16, args.device, **controls)
    say(f"twin of {Path(args.model).name} on {args.device}: {vars(shape)}, built in {time.monotonic() - started:.1f} s")
    return twin


def check_twin(args, plan: Plan, **controls) -> dict:
    """The twin at full size decodes what its source decodes: logits along the source's greedy
    tokens within TWIN_LOGIT_TOLERANCE of the source's in bf16 built the same way (dequantized,
    dense), and greedy tokens through the engine that part from the source's only where its best
    two are a near-tie (closer than twice the twin's largest logit difference there), as any
    change of rounding may part them."""
    from test_twin import logits_along

    shape = plan.full_twin or plan.twin
    twin = args.twin if shape == plan.twin and not controls else build_twin(args, shape, **controls)
    prompts = (PROMPTS * plan.prompts)[:plan.prompts]
    params = SamplingParams(temperature=0, max_tokens=plan.new_tokens, ignore_eos=True)
    source = load_model(args.model, torch.bfloat16, args.device, "none")
    decoded = {}
    for name, target in (("source", source), ("twin", twin)):
        with LLM(args.model, method="ar", device=args.device, target=target) as llm:
            decoded[name] = llm.generate(prompts, params, use_tqdm=False)
    errors, differences, near_ties = [], [], []
    for expected, got in zip(decoded["source"], decoded["twin"]):
        reference = logits_along(source, expected.prompt_token_ids, expected.token_ids)
        difference = (logits_along(twin, expected.prompt_token_ids, expected.token_ids) - reference).abs()
        errors.append(float(difference.max() / reference.abs().max()))
        parted = first_difference(got.token_ids, expected.token_ids)
        differences.append(parted)
        if parted is not None:
            best = reference[parted].topk(2).values
            near_ties.append(float(best[0] - best[1]) <= 2 * float(difference[parted].max()))
    result = {"shape": vars(shape), "hidden_size": twin.config.hidden_size, "num_layers": twin.config.num_layers,
              "prompts": len(prompts), "tokens": plan.new_tokens, "max_relative_logit_error": max(errors),
              "first_differences": differences, "parted_at_near_ties": near_ties,
              "passed": max(errors) <= TWIN_LOGIT_TOLERANCE and all(near_ties)}
    say(f"twin at {shape.hidden_size} wide, {twin.config.num_layers} layers, vs its source in bf16, {len(prompts)} prompts "
        f"x {plan.new_tokens} tokens: logits within {max(errors):.3g} of the largest (tolerance {TWIN_LOGIT_TOLERANCE});"
        f" greedy tokens first differ at {differences}, at near-ties: {near_ties}")
    return result


# --- 2. greedy --------------------------------------------------------------------------------

def engine(args, method: str, draft_device: str | None = None, **options) -> LLM:
    """An engine on the twin, which every engine shares (built once, on the device)."""
    return LLM(args.model, target=args.twin, method=method, device=args.device, draft=args.draft,
               draft_device=draft_device or args.draft_device, cuda_graphs=args.cuda_graphs, **options)


def worker_placements(args) -> dict[str, str]:
    """SSD's worker beside the target ("ssd": --draft-device) and, where the target is on a GPU,
    on the host's idle CPU cores ("ssd_host"), which a GPU server leaves idle while decoding."""
    return {"ssd": args.draft_device} | ({"ssd_host": "cpu"} if args.device.startswith("cuda") else {})


def check_greedy(args, plan: Plan) -> dict:
    prompts = (PROMPTS * plan.prompts)[:plan.prompts]
    params = SamplingParams(temperature=0, max_tokens=plan.new_tokens)
    outputs, result = {}, {}
    methods = {"ar": None, "sd": None} | worker_placements(args)
    for name, draft_device in methods.items():
        method = name.split("_")[0]
        with engine(args, method, draft_device) as llm:
            llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # caches grow next
            outputs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            captured = llm.target.step_graphs
            result[f"{name}_captured_passes"] = None if captured is None else captured.replays
            result[f"{name}_draft_losses"] = llm.metrics().get("draft_losses", 0)
        if name != "ar":
            differences = [first_difference(o, a) for o, a in zip(outputs[name], outputs["ar"])]
            result[name] = {"equal_to_ar": all(d is None for d in differences), "first_differences": differences}
            say(f"greedy {name} == AR on the twin, {len(prompts)} prompts x {plan.new_tokens} tokens: "
                f"{result[name]['equal_to_ar']} (first differences {differences})")
        if result[f"{name}_draft_losses"]:
            say(f"greedy {name}: the draft worker was lost {result[f'{name}_draft_losses']} times")
    result["passed"] = all(result[n]["equal_to_ar"] and not result[f"{n}_draft_losses"] for n in methods if n != "ar")
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

def decode_rate(llm: LLM, prompts: list, new_tokens: int, temperature: float = 0.0) -> float:
    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True, seed=0)
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


def conditional_acceptance(metrics: dict) -> list[float] | None:
    """a_1..a_K, draft position i accepted given the ones before it were, from an engine's counts."""
    per_position, drafts = metrics.get("spec_decode_num_accepted_tokens_per_pos"), metrics.get("spec_decode_num_drafts")
    if not per_position or not drafts:
        return None
    before = [drafts] + list(per_position[:-1])
    return [min(1.0, max(1e-3, a / b)) if b else 1e-3 for a, b in zip(per_position, before)]


def per_gpu_table(rates: dict[str, dict[int, float]], device: str) -> str:
    """Tokens/s per GPU: every configuration here holds one GPU (SSD's worker on the same GPU, or
    on the host's CPU cores, which a GPU server leaves idle and which cost no GPU)."""
    batches = sorted({b for r in rates.values() for b in r})
    lines = [f"| {device} | GPUs | " + " | ".join(f"batch {b} tok/s per GPU" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    for name, by_batch in rates.items():
        lines.append(f"| {name} | 1 | " + " | ".join(f"{by_batch[b]:.1f}" if b in by_batch else "" for b in batches) + " |")
    return "\n".join(lines)


def check_speed(args, plan: Plan, budget: Budget) -> dict:
    prompts = [p for p in PROMPTS if isinstance(p, str)]
    rates: dict[str, dict[int, float]] = {}
    sampled: dict[str, dict[int, float]] = {}  # T = 0.7
    figures: dict[str, dict] = {}  # each engine's metrics: hit rate, tokens a round, worker losses
    waits: dict[str, float | None] = {}
    on_gpu = args.device.startswith("cuda")
    configurations = ([("ar", None, {})] + ([("ar_variant", None, {"batch_invariant": False})] if on_gpu else [])
                      + [("sd", None, {})] + [(n, d, {}) for n, d in worker_placements(args).items()]
                      + [("auto", None, {})])
    failures: dict[str, str] = {}
    for name, draft_device, options in configurations:
        if budget.left() < 20:
            say(f"speed: out of time before {name}")
            break
        try:
            measure_configuration(args, plan, name, draft_device, options, prompts, rates, sampled, figures, waits)
        except Exception as e:  # noqa: BLE001 - one configuration's failure costs the loan none of the others
            failures[name] = f"{type(e).__name__}: {e}"
            say(f"speed {name}: FAILED with {failures[name]}")
    result = {"twin": vars(plan.twin), "tok_s": rates, "tok_s_t07": sampled, "metrics": figures,
              "host_waits_per_round": waits, "per_gpu_table": per_gpu_table(rates, args.device), "failures": failures}
    (Path(args.out) / "speed.md").write_text(result["per_gpu_table"] + "\n")
    say("speed, greedy, tokens/s per GPU:\n" + result["per_gpu_table"])
    if on_gpu and budget.left() > 20:
        result["transformers_batch1_tok_s"] = transformers_rate(args, prompts[0], plan.speed_tokens)
        say(f"speed transformers generate batch 1 (the 135M model): {result['transformers_batch1_tok_s']:.1f} tok/s")
    for name in rates:
        if name != "ar" and "ar" in rates:
            result[f"{name}_over_ar"] = {b: rates[name][b] / rates["ar"][b] for b in rates[name] if b in rates["ar"]}
    if "sd" in rates:
        result["ssd_over_sd"] = {n: {b: rates[n][b] / rates["sd"][b] for b in rates[n] if b in rates["sd"]}
                                 for n in worker_placements(args) if n in rates}
    if "ar_variant" in rates and "ar" in rates:
        result["invariance_cost"] = {b: rates["ar_variant"][b] / rates["ar"][b] for b in rates["ar"] if b in rates["ar_variant"]}
    workers_kept = not any(f.get("draft_losses") for f in figures.values())
    result["passed"] = workers_kept and not failures and {"ar", "sd", "ssd", "auto"} <= set(rates)
    return result


def measure_configuration(args, plan: Plan, name: str, draft_device: str | None, options: dict, prompts: list,
                          rates: dict, sampled: dict, figures: dict, waits: dict) -> None:
    """One engine's rates at each batch size, greedy and sampled, and its metrics, into the tables."""
    with engine(args, name.split("_")[0], draft_device, **options) as llm:
        if name == "auto":
            llm.wait_for_ssd(start=True)  # SSD among its choices from the first round
        rates[name], sampled[name] = {}, {}
        for batch in plan.batch_sizes:
            rates[name][batch] = decode_rate(llm, (prompts * batch)[:batch], plan.speed_tokens)
            say(f"speed {name} batch {batch}: {rates[name][batch]:.1f} tok/s")
        acceptance = conditional_acceptance(llm.metrics())
        for batch in plan.sampled_batch_sizes if name != "ar_variant" else []:
            sampled[name][batch] = decode_rate(llm, (prompts * batch)[:batch], plan.speed_tokens, 0.7)
            say(f"speed {name} batch {batch} T = 0.7: {sampled[name][batch]:.1f} tok/s")
        figures[name] = {k: v for k, v in llm.metrics().items() if isinstance(v, (int, float))}
        if acceptance:
            figures[name]["greedy_acceptance"] = acceptance
        waits[name] = host_waits_per_round(llm, prompts[0])
        if waits[name] is not None:
            say(f"speed {name}: {waits[name]:.2f} waits for the device a round")
        if figures[name].get("draft_losses"):
            say(f"speed {name}: the draft worker was lost {figures[name]['draft_losses']} times")


# --- 5. costs ---------------------------------------------------------------------------------

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


def measured_profile(name: str, target_s: dict, draft_s: dict, speed: dict, draft_on_host: bool) -> dict:
    """A `saguaro plan --profile` file of this run: its costs, SD's measured greedy acceptance and
    SSD's hit rate (nominal 0.7 and 0.86 where the speed check did not run)."""
    metrics = speed.get("metrics", {})
    acceptance = metrics.get("sd", {}).get("greedy_acceptance") or [0.7] * 5
    ssd = metrics.get("ssd_host" if draft_on_host else "ssd", {})
    hits, lookups = ssd.get("spec_decode_num_cache_hits"), ssd.get("spec_decode_num_cache_lookups")
    return {"name": name, "target_pass_s": target_s, "draft_step_s": draft_s, "acceptance": acceptance,
            "hit_rate": hits / lookups if hits is not None and lookups else 0.86, "draft_on_host": draft_on_host}


def plan_forecast(profile_file: Path, batch_sizes: list[int]) -> str:
    """What `saguaro plan --profile FILE` prints."""
    from saguaro.bench.plan import forecast_markdown
    from saguaro.speculation.policy.planning import HardwareProfile

    return forecast_markdown(HardwareProfile.from_json(json.loads(profile_file.read_text())), batch_sizes)


def check_costs(args, plan: Plan, budget: Budget, speed: dict) -> dict:
    """The twin's pass and the draft's step by rows on the device (and, on a GPU, the draft's on
    the host's cores, where SSD's worker may run), and the plan they forecast."""
    result: dict = {"twin": vars(plan.twin)}
    drafts = {"draft_step_s": args.device} | ({"draft_host_step_s": "cpu"} if args.device.startswith("cuda") else {})
    with torch.inference_mode():
        models = [("target_pass_s", "twin", lambda: args.twin, plan.cost_rows, False)]
        models += [(key, f"draft on {device}", lambda device=device: load_draft(args.draft, args.twin, device=device),
                    plan.draft_rows, True) for key, device in drafts.items()]
        for key, name, make, rows_list, batch_of in models:
            model = make()
            if model.device.type == torch.device(args.device).type:  # captured passes, as the engines run it
                graphs.attach(model, args.cuda_graphs)
            table = {}
            for rows in rows_list:
                if budget.left() < 10:
                    break
                batch, tokens = (rows, 1) if batch_of else (1, rows)
                table[rows] = pass_seconds(model, batch, tokens, plan.context, repeats=plan.cost_repeats)
                say(f"costs {name}: {'step over ' + str(rows) + ' rows' if batch_of else 'pass over ' + str(rows) + ' tokens'}"
                    f" {table[rows] * 1e3:.2f} ms")
            result[key] = table
            del model
    if result.get("target_pass_s") and result.get("draft_step_s"):
        result["what_if_batch1"] = what_if(result["target_pass_s"], result["draft_step_s"])
        out = Path(args.out)
        for key, file, on_host in (("draft_step_s", "profile.json", False), ("draft_host_step_s", "profile_host.json", True)):
            if result.get(key):
                name = (f"twin of {Path(args.model).name} at {plan.twin.hidden_size} wide and its draft "
                        f"{'on the host' if on_host else 'beside it'} on {args.device}")
                (out / file).write_text(json.dumps(measured_profile(name, result["target_pass_s"], result[key], speed,
                                                                    on_host), indent=1))
                forecast_text = plan_forecast(out / file, plan.batch_sizes)
                (out / file.replace("profile", "plan").replace(".json", ".md")).write_text(forecast_text + "\n")
                say(f"saguaro plan --profile {out / file}:\n{forecast_text}")
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
    parser.add_argument("--draft", default=str(hub.DRAFTS_DIR / "smollm2"),
                        help="(default: the draft shipped for the default model, made for the 135M model)")
    parser.add_argument("--cuda-graphs", default=None, choices=graphs.SETTINGS,
                        help="(default: auto on a GPU, emulated on the CPU)")
    parser.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.json")
    parser.add_argument("--budget-s", type=float, default=None, help="(default: 450 on a GPU, 170 on the CPU)")
    parser.add_argument("--checks", default="logits,twin,greedy,exactness,speed,costs")
    parser.add_argument("--twin-shape", default=None, metavar="HIDDEN,HEADS,KV_HEADS,FFN[,LAYERS]",
                        help="the twin target's widths (default: Llama-3-8B's on a GPU, 640,12,4,1792 on the CPU)")
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
    shape = plan.twin if args.twin_shape is None else TwinShape.parse(args.twin_shape)
    plan.twin = shape
    args.twin = build_twin(args, shape)
    runs = {"logits": lambda: check_logits(args, plan), "twin": lambda: check_twin(args, plan),
            "greedy": lambda: check_greedy(args, plan),
            "exactness": lambda: check_exactness(args, plan), "speed": lambda: check_speed(args, plan, budget),
            "costs": lambda: check_costs(args, plan, budget, report["checks"].get("speed", {}))}
    for name in args.checks.split(","):
        if budget.left() < 15:
            report["checks"][name] = {"passed": None, "skipped": "out of time"}
            say(f"{name}: skipped, out of time")
            continue
        say(f"{name} ...")
        started, cpu_started = time.monotonic(), cpu_seconds()
        try:
            report["checks"][name] = runs[name]()
        except Exception as e:  # noqa: BLE001 - a failed check is reported, the others still run
            report["checks"][name] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
            say(f"{name}: FAILED with {type(e).__name__}: {e}")
        report["checks"][name]["seconds"] = round(time.monotonic() - started, 1)
        report["checks"][name]["cpu_seconds"] = round(cpu_seconds() - cpu_started, 1)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        say(f"{name}: {'passed' if report['checks'][name]['passed'] else 'FAILED'} "
            f"in {report['checks'][name]['seconds']} s ({report['checks'][name]['cpu_seconds']} s of CPU)")
    report["passed"] = all(c.get("passed") for c in report["checks"].values())
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    say(f"gpu_check {'passed' if report['passed'] else 'FAILED'}; {out / 'gpu_check.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
