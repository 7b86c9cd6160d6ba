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
from saguaro.engine.decoder import Decoder
from saguaro.engine.round import Choice, FixedPolicy
from saguaro.engine.verifier import Verifier
from saguaro.models import hub
from saguaro.models.llama import LlamaModel
from saguaro.models.checkpoint import draft_embeddings
from saguaro.models.pairing import DraftPairing, IncompatibleDraftError, ResolvedModel
from saguaro.models.prefix_cache import PrefixCache, new_prefix_cache
from saguaro.speculation.local.drafters import Drafter, sd_drafter
from saguaro.speculation.local.proposer import DraftProposer
from saguaro.speculation.policy.auto import AutoPolicy, SSDLauncher, auto_trees
from saguaro.speculation.policy.planning import GeometricPlan, geometric_fan_out, uniform_fan_out
from saguaro.speculation.protocol import DraftSpec
from saguaro.speculation.remote.client import DraftClient, WorkerConfig
from saguaro.speculation.remote.pool import DraftPool
from saguaro.speculation.remote.proposer import RemoteProposer
from saguaro.system import CorePlacement, CoreShare, usable_cores


def fan_out_plan(spec: SpeculativeConfig) -> tuple[list[int], GeometricPlan | None]:
    """The first fan-out (K+1 counts), and the plan that re-fits a geometric one as it runs."""
    k = spec.num_speculative_tokens
    if spec.fan_out == "geometric":
        return (geometric_fan_out(spec.fan_out_budget, k, spec.acceptance_rate, spec.power_law_r),
                GeometricPlan(spec.fan_out_budget, spec.power_law_r))
    if spec.fan_out == "uniform":
        return uniform_fan_out(spec.fan_out_budget, k), None
    return list(spec.fan_out), None


def ssd_proposer(target: LlamaModel, spec: SpeculativeConfig, draft: DraftPairing, cpus: str | None,
                 prefix_cache_mb: float = 0.0, placement: CorePlacement | None = None) -> RemoteProposer:
    """SSD's proposer over new draft workers running `draft`: spec.num_draft_workers on this
    machine (pinned to `cpus`), or one at each of spec.draft_address's comma-separated
    addresses. prefix_cache_mb: each draft's prefix cache. A draft padded to other rows than the
    target's is fitted to the tokenizer both share (draft.tokens). placement: the target's cores
    while SSD runs and after it closes (None: the workers hold none of this machine's)."""
    fan_out, plan = fan_out_plan(spec)
    vocabulary = None if draft.tokens is None else (target.config.vocab_size, draft.tokens)
    addresses = spec.draft_address.split(",") if spec.draft_address else [None] * spec.num_draft_workers
    configs = [WorkerConfig(DraftSpec(replace(spec, draft=str(draft.path), fan_out=fan_out, draft_address=address,
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
    return RemoteProposer(DraftPool(clients), spec.backup, plan, target.config.vocab_size, placement)


def sd_policy(drafter: Drafter) -> FixedPolicy:
    return FixedPolicy(Choice(DraftProposer(drafter), drafter.k, "sd", drafter.tree))


def ssd_policy(proposer: RemoteProposer) -> FixedPolicy:
    return FixedPolicy(Choice(proposer, proposer.k, "ssd"))


def ar_decoder(target: LlamaModel, prefix_cache: PrefixCache | None = None) -> Decoder:
    return Decoder(Verifier(target, prefix_cache))


def sd_decoder(target: LlamaModel, drafter: Drafter, prefix_cache: PrefixCache | None = None) -> Decoder:
    return Decoder(Verifier(target, prefix_cache), sd_policy(drafter))


def ssd_decoder(proposer: RemoteProposer, target: LlamaModel, prefix_cache: PrefixCache | None = None) -> Decoder:
    return Decoder(Verifier(target, prefix_cache), ssd_policy(proposer))


def auto_decoder(target: LlamaModel, drafter: Drafter, ssd: SSDLauncher | None = None,
                 prefix_cache: PrefixCache | None = None, profile: Path | None = None,
                 trees: list[TreeShape] = ()) -> Decoder:
    """trees: the token trees auto may choose besides chains."""
    return Decoder(Verifier(target, prefix_cache), AutoPolicy(DraftProposer(drafter), ssd, profile, trees))


def auto_ssd(target: LlamaModel, spec: SpeculativeConfig, draft: DraftPairing,
             prefix_cache_mb: float = 0.0) -> SSDLauncher | None:
    """SSD for method="auto", its worker started on a thread of its own while auto decodes
    without it: on the draft's own device or host, or on this machine's last core where it has
    two or more (None where SSD has no hardware of its own)."""
    elsewhere = spec.draft_address is not None or spec.draft_device != "cpu"
    cores = sorted(usable_cores())
    if not elsewhere and (target.device.type != "cpu" or len(cores) < 2):
        return None
    cpus = None if elsewhere else str(cores[-1])
    placement = CorePlacement(CoreShare.of(cpus))
    branches = max(1, sum(fan_out_plan(spec)[0]))

    def start() -> Future[RemoteProposer]:
        future: Future[RemoteProposer] = Future()

        def run() -> None:
            try:
                proposer = ssd_proposer(target, spec, draft, cpus, prefix_cache_mb, None if elsewhere else placement)
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

    return SSDLauncher(start, placement, branches)


def auto_profile_path(target: LlamaModel, spec: SpeculativeConfig, model: ResolvedModel) -> Path | None:
    """Where method="auto" keeps what it measured for the next process with the same models,
    settings, threads and CPU (None where SAGUARO_AUTO_PROFILE=0)."""
    if os.environ.get("SAGUARO_AUTO_PROFILE", "1") == "0":
        return None
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    key = json.dumps([model.name, str(model.draft.path), str(model.ssd_draft.path), spec.num_speculative_tokens, spec.prompt_lookup,
                      target.quantization, str(target.dtype), str(target.device), torch.get_num_threads(), cpu])
    return hub.cache_dir() / "auto" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def make_decoder(target: LlamaModel, spec: SpeculativeConfig, model: ResolvedModel, draft: LlamaModel | None = None,
                 prefix_cache_mb: float = 0.0, keep_profile: bool = True) -> Decoder:
    """model: the target as resolved with its drafts (pairing.resolve_model); draft: its SD
    draft, loaded where spec.drafts_in_process (pairing.load_paired_draft). prefix_cache_mb:
    the budget of the target's prefix cache and of the draft's (0: no prefix caching). A draft
    that reads the target's hidden states needs them over whole prompts: neither gets one.
    keep_profile: auto starts from what an earlier process measured, and keeps what it measures."""
    policy = make_policy(target, spec, model, draft, prefix_cache_mb, keep_profile)
    reads_features = policy is not None and any(p.reads_target_features for p in policy.proposers())
    return Decoder(Verifier(target, None if reads_features else new_prefix_cache(prefix_cache_mb)), policy)


def make_policy(target: LlamaModel, spec: SpeculativeConfig, model: ResolvedModel, draft: LlamaModel | None = None,
                prefix_cache_mb: float = 0.0, keep_profile: bool = True) -> FixedPolicy | AutoPolicy | None:
    """The policy and proposers spec.method asks for (None: AR); see make_decoder."""
    ssd_draft = model.ssd_draft
    if spec.method == "ar" or model.draft is None:
        if spec.method not in ("ar", "auto"):
            raise ValueError(f"method {spec.method!r} needs a draft model (no shipped draft for {model.name!r})")
        return None
    if spec.method == "auto" and ssd_draft != model.draft and ssd_draft.reads_target_features:
        raise ValueError("method auto shares one prefix cache between SD's and SSD's rounds: an SSD draft "
                         "that reads the target's hidden states needs method ssd")
    if spec.tree is not None and target.tensor_parallel is not None:
        raise ValueError("token trees move KV entries that a tensor-parallel target's other ranks hold; "
                         "use chains (tree_topk 1) with tensor_parallel_size > 1")
    if spec.method == "ssd":
        return ssd_policy(ssd_on_this_machine(target, spec, ssd_draft, prefix_cache_mb))
    if spec.method == "sd":
        return sd_policy(sd_drafter(draft, spec, prefix_cache_mb))
    reads_features = draft.reads_features  # no SSD or trees beside it: see make_decoder
    profile = auto_profile_path(target, spec, model) if keep_profile else None
    ssd = None if reads_features else auto_ssd(target, spec, ssd_draft, prefix_cache_mb)
    trees = [] if reads_features else auto_trees(spec.num_speculative_tokens, spec.tree_topk, spec.tree,
                                                 target.device.type)
    return AutoPolicy(DraftProposer(sd_drafter(draft, spec, prefix_cache_mb)), ssd, profile, trees)


def split_cores(draft_device: str, workers: int = 1) -> tuple[str | None, CorePlacement | None]:
    """On CPU, the draft workers get the last cores (one each, as far as one core is left) and
    this process keeps the others, so drafting and verifying really run in parallel. Returns
    the workers' cores and the placement that pins this process to the rest now and gives all
    back when SSD closes, or Nones."""
    cores = sorted(usable_cores())
    if draft_device != "cpu" or len(cores) < 2:
        return None, None
    kept = max(1, len(cores) - workers)
    placement = CorePlacement(CoreShare((set(cores), torch.get_num_threads()), (set(cores[:kept]), kept)))
    placement.for_ssd()
    return ",".join(map(str, cores[kept:])), placement


def ssd_on_this_machine(target: LlamaModel, spec: SpeculativeConfig, draft: DraftPairing,
                        prefix_cache_mb: float = 0.0) -> RemoteProposer:
    """method="ssd"'s proposer, its workers on cores split off this process's (none taken
    where they run at spec.draft_address); the cores come back if they fail to start."""
    cpus, placement = (None, None) if spec.draft_address else split_cores(spec.draft_device,
                                                                           spec.num_draft_workers)
    try:
        return ssd_proposer(target, spec, draft, cpus, prefix_cache_mb, placement)
    except BaseException:
        if placement is not None:
            placement.for_all()
        raise
