"""Sampling parameters and the warped next-token distributions every decoder samples from.

Greedy rows (temperature 0) get a point mass on the argmax. Verification then needs no
special case: rejection sampling between two point masses accepts exactly when the argmaxes
agree and its residual is the target's argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


SEED_STRIDE = 0x9E3779B97F4A7C15  # odd: the n seeds derived from one seed are distinct
# A temperature below this samples as its limit, greedy: logits / T overflow float32 from about
# 1e-37 (softmax then gives NaN), and long before that the softmax is a point mass on the argmax.
MIN_TEMPERATURE = 1e-30


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # independent samples of the prompt

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    def samples(self) -> list[SamplingParams]:
        """Each of the n samples' parameters, n = 1 each. A seed gives sample j a seed of its
        own derived from it (sample 0 keeps it), so the samples are independent and the whole
        request reproducible; without one each sample draws a random seed."""
        return [replace(self, n=1, seed=None if self.seed is None else (self.seed + j * SEED_STRIDE) % 2 ** 63)
                for j in range(self.n)]

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass
class WarpParams:
    """Per-row sampling parameters as tensors, built once per batch."""
    temperature: torch.Tensor  # [N]; 0 means greedy (SamplingParams.greedy)
    top_k: torch.Tensor  # [N]; <= 0 means off
    top_p: torch.Tensor  # [N]
    all_greedy: bool  # every row greedy: drafts are argmaxes, their distributions point masses
    # known on the host, so that warping never waits for the device to say so
    any_greedy: bool = True
    any_filter: bool = True  # some row has top-k or top-p

    @classmethod
    def of(cls, params: list[SamplingParams], device="cpu") -> "WarpParams":
        def column(values: list) -> torch.Tensor:  # a copy that does not wait for the device's queue
            return torch.tensor(values).to(device, non_blocking=True)
        return cls(column([0.0 if p.greedy else p.temperature for p in params]), column([p.top_k for p in params]),
                   column([p.top_p for p in params]),
                   all(p.greedy for p in params), any(p.greedy for p in params),
                   any(p.top_k > 0 or p.top_p < 1 for p in params))

    def repeat(self, n: int) -> "WarpParams":
        """Each row's parameters n times in a row (for [B, n, V] logits flattened to [B*n, V])."""
        return replace(self, temperature=self.temperature.repeat_interleave(n),
                       top_k=self.top_k.repeat_interleave(n), top_p=self.top_p.repeat_interleave(n))


def warp(logits: torch.Tensor, params: WarpParams) -> torch.Tensor:
    """fp32 logits [N, V] -> the distribution each row samples from, [N, V]."""
    logits = logits.float()
    greedy = params.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, params.temperature)[:, None]
    if params.any_filter:
        scaled = _mask_top_k_top_p(scaled, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if params.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _mask_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = (top_k[:, None] > 0) & (ranks >= top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs  # keep the smallest prefix whose mass reaches top_p
    # ... and the most likely token whatever top_p is: a tiny one (0 in float32) is its limit, greedy
    sorted_logits = sorted_logits.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def uniforms(generators: list[torch.Generator], n: int) -> torch.Tensor:
    """n uniform numbers in [0, 1) for each row, each row from its own request's generator."""
    return torch.stack([torch.rand(n, generator=g) for g in generators])


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs [N, V] from u [N] in [0, 1).
    Tokens of probability zero are never chosen. A row that is no distribution (NaN, or no
    mass) raises rather than fall to the last token: on the CPU at once, on an accelerator
    at its next synchronization (the check does not wait for the device)."""
    cdf = probs.cumsum(-1)
    valid = (cdf[:, -1] > 0).all()  # NaN anywhere in a row makes its total NaN
    if probs.device.type == "cpu":
        if not valid:
            raise ValueError("sampling from a row that is not a distribution (NaN or no mass)")
    else:
        torch._assert_async(valid, "sampling from a row that is not a distribution (NaN or no mass)")
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].to(cdf.dtype), right=True)[:, 0]
    return tokens.clamp_(max=probs.shape[-1] - 1)
