"""Test helpers: SD and SSD decoders built from a draft in a few words, and SSD's draft side
run in this process (every message takes the worker's path, nothing overlaps)."""
from __future__ import annotations

import torch

from saguaro.config import SpeculativeConfig
from saguaro.models.llama import LlamaModel
from saguaro.speculation.build import sd_drafter
from saguaro.speculation.remote.client import WorkerConfig
from saguaro.speculation.protocol import Hello, Prefill, Release, Speculation, SpecRequest
from saguaro.speculation.sd import SDDecoder
from saguaro.speculation.worker.server import DraftServer


def sd_decoder(target: LlamaModel, draft: LlamaModel, k: int, prompt_lookup: int | None = None) -> SDDecoder:
    return SDDecoder(target, sd_drafter(draft, SpeculativeConfig(num_speculative_tokens=k,
                                                                 prompt_lookup=prompt_lookup)))


def worker_config(draft: str, dtype: str, k: int, fan_out: list[int], saguaro_c: float = 1.0, *,
                  prompt_lookup: int | None = None, address: str | None = None, proposal_top: int = 256,
                  share_window: int = 0, **worker) -> WorkerConfig:
    spec = SpeculativeConfig("ssd", draft, k, prompt_lookup, fan_out, saguaro_c=saguaro_c, draft_address=address,
                             proposal_top=proposal_top, share_window=share_window)
    return WorkerConfig(spec, dtype, **worker)


class InProcessDraft:
    """A DraftClient stand-in that runs the worker's DraftServer in this process."""

    def __init__(self, config: WorkerConfig, embeddings: torch.Tensor | None):
        self.config = config
        self.server = DraftServer(Hello(config.speculative, config.dtype, embeddings), config.speculative.draft_device)
        self.ready = self.server.ready
        self.alive = True

    def prefill(self, seq_ids, token_ids, params, max_len, num_rows, features=None) -> None:
        self.server.handle(Prefill(seq_ids, token_ids, params, max_len, num_rows, features))

    def speculate(self, request: SpecRequest) -> Speculation:
        reply = self.server.handle(request)
        self.server.fill()
        return reply

    def release(self, seq_ids: list[int]) -> None:
        self.server.handle(Release(seq_ids))

    def close(self) -> None:
        self.alive = False
