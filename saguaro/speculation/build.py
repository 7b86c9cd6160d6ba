"""The decoder a SpeculativeConfig describes: the verifier, and the policy with its proposers
(AR: none; SD: the draft in this process; SSD: the draft workers; auto: both, chosen by round)."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from saguaro.config import SpeculativeConfig, TreeShape
from saguaro.engine.round import Choice, Decoder, FixedPolicy
from saguaro.engine.verifier import Verifier
from saguaro.models import graphs, hub
from saguaro.models.config import ModelConfig
from saguaro.models.llama import LlamaModel
from saguaro.models.loader import IncompatibleDraftError, check_pair, draft_embeddings, load_draft
from saguaro.models.prefix_cache import PrefixCache, new_prefix_cache
from saguaro.speculation.local.drafters import Drafter, PromptLookupDrafter, model_drafter
from saguaro.speculation.local.proposer import DraftProposer
from saguaro.speculation.policy.auto import AutoPolicy, SSDLauncher, auto_trees
from saguaro.speculation.policy.planning import GeometricPlan, geometric_fan_out, uniform_fan_out
from saguaro.speculation.protocol import DraftSpec
from saguaro.speculation.remote.client import DraftClient, WorkerConfig
from saguaro.speculation.remote.pool import DraftPool
from saguaro.speculation.remote.proposer import RemoteProposer
from saguaro.system import CoreShare, split_cores, usable_cores, use_cores


def draft_path(spec: SpeculativeConfig, model: str) -> Path | None:
    """The draft checkpoint: the one named, else the target's shipped distilled draft (auto
    may have none: it then decodes autoregressively)."""
    path = hub.resolve(spec.draft) if spec.draft else hub.default_draft(str(model))
    if path is None and spec.method != "auto":
        raise ValueError(f"method {spec.method!r} needs a draft model (no shipped draft for {model!r})")
    return path


def ssd_draft_path(spec: SpeculativeConfig, model: str, draft: Path) -> Path:
    """SSD's draft: the one named for SSD, else (where no draft was named) the target's shipped
    SSD draft, else SD's `draft`."""
    if spec.ssd_draft:
        return hub.resolve(spec.ssd_draft)
    return (None if spec.draft else hub.default_draft(str(model), ssd=True)) or draft


def reads_target_features(path: Path) -> bool:
    """Whether a draft checkpoint is EAGLE-style, reading the target's hidden states."""
    config = path / "config.json"
    return config.is_file() and ModelConfig.load(config).eagle


def sd_drafter(draft: LlamaModel, spec: SpeculativeConfig, prefix_cache_mb: float = 0.0) -> Drafter:
    """The draft model's drafter, behind prompt lookup when it is on."""
    drafter = model_drafter(draft, spec.num_speculative_tokens, prefix_cache=new_prefix_cache(prefix_cache_mb),
                            tree=spec.tree)
    return PromptLookupDrafter(drafter.k, spec.prompt_lookup, drafter) if spec.prompt_lookup else drafter


def fan_out_plan(spec: SpeculativeConfig) -> tuple[list[int], GeometricPlan | None]:
    """The first fan-out (K+1 counts), and the plan that re-fits a geometric one as it runs."""
    k = spec.num_speculative_tokens
    if spec.fan_out == "geometric":
        return (geometric_fan_out(spec.fan_out_budget, k, spec.acceptance_rate, spec.power_law_r),
                GeometricPlan(spec.fan_out_budget, spec.power_law_r))
    if spec.fan_out == "uniform":
        return uniform_fan_out(spec.fan_out_budget, k), None
    return list(spec.fan_out), None


def start_workers(target: LlamaModel, spec: SpeculativeConfig, path: Path, cpus: str | None,
                  prefix_cache_mb: float = 0.0, tokens: int | None = None) -> DraftPool:
    """New draft workers: spec.num_draft_workers on this machine (pinned to `cpus`), or one at
    each of spec.draft_address's comma-separated addresses. prefix_cache_mb: each draft's
    prefix cache. tokens: the tokenizer draft and target share (check_pair), to which a draft
    padded otherwise is fitted."""
    fan_out, _ = fan_out_plan(spec)
    vocabulary = None if tokens is None else (target.config.vocab_size, tokens)
    addresses = spec.draft_address.split(",") if spec.draft_address else [None] * spec.num_draft_workers
    configs = [WorkerConfig(DraftSpec(replace(spec, draft=str(path), fan_out=fan_out, draft_address=address,
                                              draft_secret=None),  # the Hello carries no secret
                                      str(target.dtype).removeprefix("torch."), prefix_cache_mb, target.quantization,
                                      vocabulary, target.cuda_graphs),
                            cpus, secret=spec.draft_secret)
               for address in addresses]
    embeddings = draft_embeddings(target).cpu()
    with ThreadPoolExecutor(len(configs)) as starting:  # the workers load at once
        futures = [starting.submit(DraftClient, config, embeddings, str(target.device)) for config in configs]
    clients = [f.result() for f in futures if f.exception() is None]
    failed = [f.exception() for f in futures if f.exception() is not None]
    vocab = {c.ready.vocab_size for c in clients}
    if failed or vocab != {target.config.vocab_size}:
        for client in clients:
            client.close()
        if failed:
            raise failed[0]
        raise IncompatibleDraftError(f"the draft's vocabulary ({vocab.pop()} tokens) does not "
                                     f"match the target's ({target.config.vocab_size})")
    return DraftPool(clients)


def ssd_proposer(target: LlamaModel, spec: SpeculativeConfig, path: Path, cpus: str | None,
                 prefix_cache_mb: float = 0.0, cores: CoreShare | None = None,
                 tokens: int | None = None) -> RemoteProposer:
    """SSD's proposer over new draft workers (see start_workers)."""
    pool = start_workers(target, spec, path, cpus, prefix_cache_mb, tokens)
    return RemoteProposer(pool, spec.backup, fan_out_plan(spec)[1], target.config.vocab_size, cores)


def ar_decoder(target: LlamaModel, prefix_cache: PrefixCache | None = None) -> Decoder:
    return Decoder(Verifier(target, prefix_cache))


def sd_decoder(target: LlamaModel, drafter: Drafter, prefix_cache: PrefixCache | None = None) -> Decoder:
    return Decoder(Verifier(target, prefix_cache),
                   FixedPolicy(Choice(DraftProposer(drafter), drafter.k, "sd", drafter.tree)))


def ssd_decoder(proposer: RemoteProposer, target: LlamaModel, prefix_cache: PrefixCache | None = None) -> Decoder:
    return Decoder(Verifier(target, prefix_cache), FixedPolicy(Choice(proposer, proposer.k, "ssd")))


def auto_decoder(target: LlamaModel, drafter: Drafter, ssd: SSDLauncher | None = None,
                 prefix_cache: PrefixCache | None = None, profile: Path | None = None,
                 trees: list[TreeShape] = ()) -> Decoder:
    """trees: the token trees auto may choose besides chains."""
    return Decoder(Verifier(target, prefix_cache), AutoPolicy(DraftProposer(drafter), ssd, profile, trees))


def auto_ssd(target: LlamaModel, spec: SpeculativeConfig, path: Path,
             prefix_cache_mb: float = 0.0, tokens: int | None = None) -> SSDLauncher | None:
    """SSD for method="auto", its worker started on a thread of its own while auto decodes
    without it: on the draft's own device or host, or on this machine's last core where it has
    two or more (None where SSD has no hardware of its own)."""
    elsewhere = spec.draft_address is not None or spec.draft_device != "cpu"
    cores = sorted(usable_cores())
    if not elsewhere and (target.device.type != "cpu" or len(cores) < 2):
        return None
    cpus = None if elsewhere else str(cores[-1])

    cores = CoreShare.of(cpus)

    def start() -> Future[RemoteProposer]:
        future: Future[RemoteProposer] = Future()

        def run() -> None:
            try:
                proposer = ssd_proposer(target, spec, path, cpus, prefix_cache_mb, None if elsewhere else cores,
                                        tokens)
            except Exception as e:
                if not future.cancelled():
                    future.set_exception(e)
                return
            try:
                future.set_result(proposer)
            except InvalidStateError:  # auto closed meanwhile
                proposer.close()

        threading.Thread(target=run, name="saguaro-auto-ssd", daemon=True).start()
        return future

    return SSDLauncher(start, cores, max(1, sum(fan_out_plan(spec)[0])))


def auto_profile_path(target: LlamaModel, spec: SpeculativeConfig, model: str, draft: Path,
                      ssd_draft: Path) -> Path | None:
    """Where method="auto" keeps what it measured for the next process with the same models,
    settings, threads and CPU (None where SAGUARO_AUTO_PROFILE=0)."""
    if os.environ.get("SAGUARO_AUTO_PROFILE", "1") == "0":
        return None
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    key = json.dumps([str(model), str(draft), str(ssd_draft), spec.num_speculative_tokens, spec.prompt_lookup,
                      target.quantization, str(target.dtype), str(target.device), torch.get_num_threads(), cpu])
    return hub.cache_dir() / "auto" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def make_decoder(target: LlamaModel, spec: SpeculativeConfig, model: str, prefix_cache_mb: float = 0.0,
                 keep_profile: bool = True) -> Decoder:
    """model: the target's name or path, which picks its shipped draft. prefix_cache_mb: the
    budget of the target's prefix cache and of the draft's (0: no prefix caching). A draft
    that reads the target's hidden states needs them over whole prompts: neither gets one.
    keep_profile: auto starts from what an earlier process measured, and keeps what it measures."""
    path = None if spec.method == "ar" else draft_path(spec, model)
    if path is None:
        return ar_decoder(target, new_prefix_cache(prefix_cache_mb))
    tokens = check_pair(path, hub.resolve(model))
    ssd_path = ssd_draft_path(spec, model, path)
    ssd_tokens = tokens if ssd_path == path else check_pair(ssd_path, hub.resolve(model))
    if spec.method == "auto" and ssd_path != path and reads_target_features(ssd_path):
        raise ValueError("method auto shares one prefix cache between SD's and SSD's rounds: an SSD draft "
                         "that reads the target's hidden states needs method ssd")
    if spec.tree is not None and target.tensor_parallel is not None:
        raise ValueError("token trees move KV entries that a tensor-parallel target's other ranks hold; "
                         "use chains (tree_topk 1) with tensor_parallel_size > 1")
    if spec.method in ("sd", "auto"):
        draft = graphs.attach(load_draft(path, target, tokens=tokens), target.cuda_graphs)
        drafter = sd_drafter(draft, spec, prefix_cache_mb)
        prefix_cache = None if drafter.reads_target_features else new_prefix_cache(prefix_cache_mb)
        if spec.method == "sd":
            return sd_decoder(target, drafter, prefix_cache)
        ssd = None if drafter.reads_target_features else auto_ssd(target, spec, ssd_path, prefix_cache_mb,
                                                                  ssd_tokens)
        profile = auto_profile_path(target, spec, model, path, ssd_path) if keep_profile else None
        return auto_decoder(target, drafter, ssd, prefix_cache, profile, [] if drafter.reads_target_features
                            else auto_trees(spec.num_speculative_tokens, spec.tree_topk, spec.tree,
                                            target.device.type))
    cpus, cores_before = (None, None) if spec.draft_address else split_cores(spec.draft_device,
                                                                              spec.num_draft_workers)
    try:
        proposer = ssd_proposer(target, spec, ssd_path, cpus, prefix_cache_mb, tokens=ssd_tokens)
    except BaseException:
        if cores_before is not None:
            use_cores(*cores_before)
        raise
    proposer.cores_before = cores_before
    prefix_cache = None if proposer.reads_target_features else new_prefix_cache(prefix_cache_mb)
    return ssd_decoder(proposer, target, prefix_cache)
