"""Test helpers: SD and SSD decoders built from a draft in a few words, and SSD's draft side
run in this process (every message takes the worker's path, nothing overlaps)."""
from __future__ import annotations

import torch

from saguaro.config import Backup, SpeculativeConfig
from saguaro.engine.decoder import Decoder
from saguaro.models.llama import LlamaModel
from saguaro.speculation import build
from saguaro.speculation.local.drafters import Drafter
from saguaro.speculation.policy.auto import AutoPolicy
from saguaro.speculation.policy.planning import GeometricPlan
from saguaro.speculation.protocol import DraftSpec, Hello, Prefill, Release, Speculation, SpecRequest, unsent_tokenizers
from saguaro.speculation.remote.client import DraftClient, WorkerConfig
from saguaro.speculation.remote.pool import DraftPool
from saguaro.speculation.remote.proposer import RemoteProposer
from saguaro.speculation.worker.server import DraftServer


def sd_decoder(target: LlamaModel, draft: LlamaModel, k: int, prompt_lookup: int | None = None,
               **options) -> Decoder:
    """options: SpeculativeConfig's (a token tree's tree_topk, num_draft_tokens)."""
    spec = SpeculativeConfig("sd", num_speculative_tokens=k, prompt_lookup=prompt_lookup, **options)
    return build.sd_decoder(target, build.sd_drafter(draft, spec))


def worker_config(draft: str, dtype: str, k: int, fan_out: list[int], saguaro_c: float = 1.0, *,
                  prompt_lookup: int | None = None, address: str | None = None, proposal_top: int = 256,
                  share_window: int = 0, prefix_cache_mb: float = 0.0, **worker) -> WorkerConfig:
    spec = SpeculativeConfig("ssd", draft, k, prompt_lookup, fan_out, saguaro_c=saguaro_c, draft_address=address,
                             proposal_top=proposal_top, share_window=share_window)
    return WorkerConfig(DraftSpec(spec, dtype, prefix_cache_mb), **worker)


def ssd_decoder(target: LlamaModel, clients: DraftClient | InProcessDraft | list, backup: Backup | str = Backup.AUTO,
                plan: GeometricPlan | None = None) -> Decoder:
    """SSD over one worker (or a list of several), as the engine builds it."""
    pool = DraftPool(clients if isinstance(clients, list) else [clients])
    return build.ssd_decoder(RemoteProposer(pool, backup, plan, target.config.vocab_size), target)


def ssd_of(decoder: Decoder) -> RemoteProposer:
    """The SSD proposer of a decoder built by ssd_decoder (or of method="ssd")."""
    return decoder.policy.choice.proposer


class InProcessDraft:
    """A DraftClient stand-in that runs the worker's DraftServer in this process."""

    def __init__(self, config: WorkerConfig, embeddings: torch.Tensor | None, target_device: str = "cpu",
                 incarnation: int = 0):
        # the signature of DraftClient's, so that the pool's restart can start one (test_ssd.py)
        self.config, self.embeddings, self.target_device, self.incarnation = config, embeddings, target_device, incarnation
        self.server = DraftServer(Hello(config.draft, embeddings, incarnation), config.draft.speculative.draft_device)
        self.ready = self.server.ready
        self.alive = True
        self.sent_tokenizers: set[str] = set()  # as DraftClient: a grammar's tokenizer goes once

    def prefill(self, seq_ids, token_ids, params, max_len, num_rows, features=None, processing=None) -> None:
        self.server.handle(Prefill(seq_ids, token_ids, params, max_len, num_rows, features,
                                   unsent_tokenizers(processing, self.sent_tokenizers)))

    def ask(self, request: SpecRequest) -> Speculation:
        reply = self.server.handle(request)
        self.server.fill()
        return reply

    def answer(self, reply: Speculation, patient: bool = False) -> Speculation:
        return reply

    def release(self, seq_ids: list[int]) -> None:
        self.server.handle(Release(seq_ids))

    def abandon(self) -> None:
        self.alive = False

    def close(self) -> None:
        self.alive = False


def worker_of(decoder: Decoder, lane: int = 0) -> DraftClient:
    """The client of an SSD decoder's worker (its first, or the lane-th)."""
    return ssd_of(decoder).pool.lanes[lane].client


def drafter_of(decoder: Decoder) -> Drafter:
    """The drafter of an SD or auto decoder."""
    policy = decoder.policy
    return (policy.draft if isinstance(policy, AutoPolicy) else policy.choice.proposer).drafter
