"""Runs every method on the same target, draft and prompts, interleaved.

Methods take turns batch by batch (the order rotates), so drift of a shared, noisy machine
hits them alike. By default every method has the same hardware, all the cores: AR, SD, auto and
transformers run on all of them, SSD's target on all but the one its draft worker holds.
`threads` gives AR, SD and transformers fewer (1: the old one-core-per-model comparison).
`tokens/s per device` divides by the cores a method held.
"""
from __future__ import annotations

import os
import platform
import random
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from saguaro.bench import peers, report
from saguaro.config import METHODS as SPECULATIVE_METHODS, SpeculativeConfig
from saguaro.engine.loop import Engine
from saguaro.engine.decoder import Decoder
from saguaro.engine.sampler import SamplingParams
from saguaro.llm import LLM
from saguaro.models import hub
from saguaro.models.pairing import load_draft, load_paired_draft, resolve_model
from saguaro.speculation.build import make_decoder
from saguaro.speculation.policy.auto import AutoPolicy
from saguaro.speculation.remote.proposer import RemoteProposer
from saguaro.system import usable_cores, use_cores

METHODS = (*SPECULATIVE_METHODS, "hf", "hf-assisted", "llamacpp")
DATASETS = ("humaneval", "sharegpt", "random")


@dataclass
class BenchConfig:
    model: str = hub.DEFAULT_MODEL
    # the draft and how SD and SSD speculate (its method is ignored: see methods)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    datasets: list[str] = field(default_factory=lambda: ["humaneval"])
    num_prompts: int = 10
    max_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7, 1.0])
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8])
    fan_out_sweep: list[int] = field(default_factory=list)  # uniform fan-outs whose hit rate is measured
    dtype: str = "bfloat16"
    quantization: str = "auto"  # saguaro's; see saguaro.models.quantized
    chat_template: bool = True
    ignore_eos: bool = True  # every request decodes max_tokens: equal work for every method
    seed: int = 0
    threads: int | None = None  # torch threads of AR, SD, auto and transformers (None: every core)

    def __post_init__(self):
        unknown = set(self.methods) - set(METHODS) | set(self.datasets) - set(DATASETS)
        if unknown:
            raise ValueError(f"unknown methods or datasets: {sorted(unknown)}; methods are {', '.join(METHODS)}, "
                             f"datasets {', '.join(DATASETS)}")
        if self.fan_out_sweep and "ssd" not in self.methods:
            raise ValueError("the fan-out sweep measures SSD: add ssd to the methods")


def quick(config: BenchConfig) -> BenchConfig:
    """A smoke run of every method, dataset and plot in about a minute (greedy: the sampled
    paths are the same code with other parameters)."""
    return replace(config, num_prompts=2, max_tokens=16, temperatures=[0.0], batch_sizes=[1, 2],
                   fan_out_sweep=[1, 2])


def bench_prompts(llm: LLM, dataset: str, config: BenchConfig) -> list[list[int]]:
    """Token ids of the benchmark prompts; held-out ShareGPT turns only (never trained on)."""
    from saguaro.datasets import humaneval_prompts, sharegpt_first_turns

    if dataset == "random":
        rng = random.Random(config.seed)
        vocab = llm.target.config.vocab_size
        return [[rng.randrange(vocab) for _ in range(64)] for _ in range(config.num_prompts)]
    if dataset == "humaneval":
        texts = humaneval_prompts()[: config.num_prompts]
    else:
        texts = sharegpt_first_turns("heldout", limit=config.num_prompts, seed=config.seed, max_chars=1500)
    if config.chat_template:
        return [llm.encode([{"role": "user", "content": t}]) for t in texts]
    return [llm.encode(t) for t in texts]


@dataclass
class Engines:
    generate: dict  # name -> generate(prompts, params) -> per-request records, on the method's cores
    held: dict[str, int]  # name -> the cores it holds
    decoders: dict[str, Decoder]  # saguaro's methods, each built as LLM builds it

    @property
    def auto(self) -> AutoPolicy | None:
        return self.decoders["auto"].policy if "auto" in self.decoders else None

    @property
    def ssd(self) -> RemoteProposer | None:
        return self.decoders["ssd"].policy.choice.proposer if "ssd" in self.decoders else None

    def close(self) -> None:
        for decoder in self.decoders.values():
            decoder.close()


def build_engines(llm: LLM, config: BenchConfig, cores: dict[str, tuple[set[int], int]],
                  longest_prompt: int) -> Engines:
    """One saguaro target is shared by AR, SD, auto and SSD, each decoder built as `LLM` builds
    it (without prefix caching, and auto without a kept profile: every method starts cold).
    cores: "all" (affinity, threads); SSD's share is added once its workers hold theirs."""
    spec = config.speculative
    model = resolve_model(config.model, spec.draft, spec.ssd_draft)  # llm runs AR: its own has no drafts
    use_cores(*cores["all"])
    decoders = {}
    for name in ("ssd", "ar", "sd", "auto"):  # SSD first: its workers take their cores
        if name in config.methods:
            method = spec.as_method(name)
            draft = load_paired_draft(model, llm.target) if method.drafts_in_process else None
            decoders[name] = make_decoder(llm.target, method, model, draft, keep_profile=False)
            if name == "ssd":
                cores["ssd"] = usable_cores(), torch.get_num_threads()
                use_cores(*cores["all"])  # auto's SSD shares out what it finds
    if "auto" in decoders:
        decoders["auto"].wait_for_ssd()
    auto = decoders["auto"].policy if "auto" in decoders else None
    held = {name: cores["all"][1] for name in config.methods}
    if "ssd" in held:
        held["ssd"] = cores["ssd"][1] + (spec.draft_device == "cpu" and not spec.draft_address)
    if isinstance(auto, AutoPolicy) and auto.placement is not None and auto.placement.share.ssd != auto.placement.share.all:
        held["auto"] = max(held["auto"], auto.placement.share.ssd[1] + 1)

    def saguaro_engine(name: str, engine: Engine):
        def generate(prompts, params):
            use_cores(*cores[name if name == "ssd" else "all"])
            with llm.decoding_with(engine):
                outputs = llm.generate(prompts, params, use_tqdm=False)
            return [asdict(out.metrics) for out in outputs]
        return generate

    engines = {name: saguaro_engine(name, Engine(d)) for name, d in decoders.items()}
    assisted = "hf-assisted" in config.methods
    if assisted and model.draft is None:
        raise ValueError(f"hf-assisted needs a draft model (no shipped draft for {config.model!r})")
    draft = load_draft(model.draft.path, llm.target, tokens=model.draft.tokens, config=model.draft.config) if assisted else None
    if assisted and draft.reads_features:
        warnings.warn("hf-assisted skipped: transformers' assisted generation cannot run an EAGLE draft, "
                      "which reads the target's hidden states (pass a standalone --draft to compare)")
        assisted = False
    if "hf" in config.methods or assisted:
        hf_target = peers.load_target(hub.resolve(config.model), llm.dtype)
        assistant = peers.as_transformers(draft) if assisted else None
        pad_id = llm.eos_token_ids[0]

        def transformers_engine(helper):
            def generate(prompts, params):
                use_cores(*cores["all"])
                return [{k: v for k, v in r.items() if k != "token_ids"}
                        for r in peers.generate(hf_target, prompts, params, pad_id, helper,
                                                spec.num_speculative_tokens)]
            return generate

        for name, helper in (("hf", None), ("hf-assisted", assistant)):
            if name in config.methods and (name == "hf" or assisted):
                engines[name] = transformers_engine(helper)
    if "llamacpp" in config.methods:
        context = longest_prompt + config.max_tokens
        llama = peers.load_llamacpp(hub.resolve(config.model), cores["all"][1], context)

        def llamacpp_engine(prompts, params):
            use_cores(*cores["all"])
            return [{k: v for k, v in r.items() if k != "token_ids"} for r in peers.generate_llamacpp(llama, prompts, params)]

        engines["llamacpp"] = llamacpp_engine
    return Engines({name: engines[name] for name in config.methods if name in engines}, held, decoders)


def runnable(method: str, batch: int) -> bool:
    """transformers' assisted generation and llama-cpp-python decode one sequence at a time."""
    return not (method in ("hf-assisted", "llamacpp") and batch > 1)


def run(config: BenchConfig, out_dir: Path | None = None) -> dict:
    if out_dir is not None:
        report.require_matplotlib()
    torch.manual_seed(config.seed)
    everything = usable_cores(), config.threads or torch.get_num_threads()
    # no prefix caching: every method prefills every prompt, however often the bench repeats it
    llm = LLM(config.model, config.speculative.as_method("ar"), dtype=config.dtype,
              quantization=config.quantization, enable_prefix_caching=False)
    cores = {"all": everything}
    steps = [(d, t, b, i) for d in config.datasets for t in config.temperatures for b in config.batch_sizes
             for i in range(0, config.num_prompts, b)]
    sweep_runs = len(config.fan_out_sweep) * config.num_prompts
    records, engine_stats, auto_choices, built = [], {}, {}, None
    try:
        prompts = {d: bench_prompts(llm, d, config) for d in config.datasets}
        built = build_engines(llm, config, cores, max(len(p) for ps in prompts.values() for p in ps))
        engines, held = built.generate, built.held
        total = sum(runnable(m, b) for _, _, b, _ in steps for m in engines) + sweep_runs
        with tqdm(total=total, desc="bench", unit="run") as bar:
            for turn, (dataset, temperature, batch, start) in enumerate(steps):
                if start == 0 and built.ssd is not None:
                    built.ssd.reset_stats()
                if start == 0 and built.auto is not None:
                    built.auto.controller.reset_stats()  # what it chose in this group
                names = [m for m in engines if runnable(m, batch)]
                names = names[turn % len(names):] + names[:turn % len(names)]
                batch_prompts = prompts[dataset][start:start + batch]
                for name in names:
                    params = SamplingParams(temperature=temperature, max_tokens=config.max_tokens,
                                            ignore_eos=config.ignore_eos, seed=config.seed + start)
                    began = time.perf_counter()
                    results = engines[name](batch_prompts, params)
                    wall = time.perf_counter() - began
                    for j, result in enumerate(results):
                        records.append({"method": name, "dataset": dataset, "temperature": temperature,
                                        "batch": batch, "prompt": start + j, "batch_wall_s": wall, "cores": held[name],
                                        "batch_tokens": sum(r["num_output_tokens"] for r in results), **result})
                    bar.update()
                if start + batch >= config.num_prompts and built.ssd is not None:
                    engine_stats[report.key(dataset, temperature, batch)] = built.ssd.stats.summary()
                if start + batch >= config.num_prompts and built.auto is not None:
                    chosen = built.auto.controller.summary()["auto_rounds_by_k"]
                    auto_choices[report.key(dataset, temperature, batch)] = chosen
            built.close()  # the sweep's worker needs the draft core now; closing again below is a no-op
            sweep = fan_out_sweep(config, prompts[config.datasets[0]], bar) if config.fan_out_sweep else None
    finally:
        llm.close()
        if built is not None:
            built.close()
        use_cores(*everything)
    result = {"config": asdict(config), "environment": environment(), "records": records,
              "ssd_engine": engine_stats, "auto_rounds_by_choice": auto_choices, "fan_out_sweep": sweep,
              "summary": report.summarize(records, engine_stats)}
    if out_dir is not None:
        report.write(result, out_dir)
    return result


def fan_out_sweep(config: BenchConfig, prompts: list[list[int]], bar: tqdm | None = None,
                  temperature: float = 0.0) -> dict:
    """SSD's cache hit rate against a uniform fan-out F (F candidates per accepted length,
    batch 1), and the power law 1 - p_hit = F^-r fitted to it (Definition 11)."""
    from saguaro.speculation.policy.planning import fit_power_law

    fan_outs, k = config.fan_out_sweep, config.speculative.num_speculative_tokens
    llm = LLM(config.model, config.speculative.as_method("ssd", fan_out=[max(fan_outs)] * (k + 1)),
              dtype=config.dtype, quantization=config.quantization, enable_prefix_caching=False)
    points = []
    ssd: RemoteProposer = llm.decoder.policy.choice.proposer
    try:
        for f in fan_outs:
            ssd.set_fan_out([f] * (k + 1))
            ssd.reset_stats()
            params = SamplingParams(temperature=temperature, max_tokens=config.max_tokens,
                                    ignore_eos=config.ignore_eos, seed=config.seed)
            for prompt in prompts:
                llm.generate([prompt], params, use_tqdm=False)
                if bar is not None:
                    bar.update()
            summary = ssd.stats.summary()
            points.append({"fan_out": f, "cache_hit_rate": summary["cache_hit_rate"],
                           "t_p_median": summary["t_p_median"]})
    finally:
        llm.close()
    misses = [(p["fan_out"], 1 - p["cache_hit_rate"]) for p in points if p["cache_hit_rate"] is not None]
    r = fit_power_law([f for f, _ in misses], [m for _, m in misses]) if len(misses) > 1 else None
    return {"temperature": temperature, "points": points, "power_law_r": r}


def environment() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "processor": _cpu_model() or platform.processor(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)

