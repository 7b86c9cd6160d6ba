"""The decoder a SpeculativeConfig describes: AR, SD with its drafter, or SSD with its worker."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from saguaro.config import SpeculativeConfig
from saguaro.engine.decoders import ARDecoder, Decoder
from saguaro.models import hub
from saguaro.models.llama import LlamaModel
from saguaro.models.loader import IncompatibleDraftError, load_draft
from saguaro.speculation.auto import AutoDecoder
from saguaro.speculation.client import DraftClient, WorkerConfig, split_cores, use_cores
from saguaro.speculation.drafters import Drafter, PromptLookupDrafter, model_drafter
from saguaro.speculation.planning import GeometricPlan, geometric_fan_out, uniform_fan_out
from saguaro.speculation.sd import SDDecoder
from saguaro.speculation.ssd import SSDDecoder


def draft_path(spec: SpeculativeConfig, model: str) -> Path | None:
    """The draft checkpoint: the one named, else the target's shipped distilled draft (auto
    may have none: it then decodes autoregressively)."""
    path = hub.resolve(spec.draft) if spec.draft else hub.default_draft(str(model))
    if path is None and spec.method != "auto":
        raise ValueError(f"method {spec.method!r} needs a draft model (no shipped draft for {model!r})")
    return path


def sd_drafter(draft: LlamaModel, spec: SpeculativeConfig) -> Drafter:
    """The draft model's drafter, behind prompt lookup when it is on."""
    drafter = model_drafter(draft, spec.num_speculative_tokens)
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


def make_decoder(target: LlamaModel, spec: SpeculativeConfig, model: str) -> Decoder:
    """model: the target's name or path, which picks its shipped draft."""
    if spec.method == "ar":
        return ARDecoder(target)
    path = draft_path(spec, model)
    if path is None:
        return ARDecoder(target)
    if spec.method == "sd":
        return SDDecoder(target, sd_drafter(load_draft(path, target), spec))
    if spec.method == "auto":
        return AutoDecoder(target, sd_drafter(load_draft(path, target), spec))
    fan_out, plan = fan_out_plan(spec)
    worker_spec = replace(spec, draft=str(path), fan_out=fan_out)
    cpus, cores_before = (None, None) if spec.draft_address else split_cores(spec.draft_device)
    config = WorkerConfig(worker_spec, str(target.dtype).removeprefix("torch."), cpus)
    try:
        client = DraftClient(config, target.embed_tokens.weight.detach().cpu(), str(target.device))
        if client.ready.vocab_size != target.config.vocab_size:
            client.close()
            raise IncompatibleDraftError(f"the draft's vocabulary ({client.ready.vocab_size} tokens) does not "
                                         f"match the target's ({target.config.vocab_size})")
    except BaseException:
        if cores_before is not None:
            use_cores(*cores_before)
        raise
    decoder = SSDDecoder(target, client, spec.backup, plan)
    decoder.cores_before = cores_before
    return decoder
