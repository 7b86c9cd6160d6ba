"""Sampling parameters and the warped next-token distributions every decoder samples from.

Greedy rows (temperature 0) get a point mass on the argmax. Verification then needs no
special case: rejection sampling between two point masses accepts exactly when the argmaxes
agree and its residual is the target's argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from saguaro.engine.structured import StructuredOutputs


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
    # processing (saguaro.engine.processing), applied alike to the target and the drafts
    presence_penalty: float = 0.0  # OpenAI's, [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's, [-2, 2]
    repetition_penalty: float = 1.0  # HF's, > 0; 1: off
    logit_bias: dict[int, float] | None = None  # token id -> added to its raw logit, [-100, 100]
    min_p: float = 0.0  # tokens below min_p times the likeliest one's probability dropped
    min_tokens: int = 0  # stop tokens masked before this many output tokens
    logprobs: int | None = None  # the chosen token's log-probability and the top k (0..20); None: none
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    logprobs_mode: str = "raw"  # "raw": the target's log-softmax; "processed": after processing (see LLM.generate)
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_processing()
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

    @property
    def processes_logits(self) -> bool:
        """Whether logits need processing before `warp` (min_p is part of warp)."""
        return self.adjusts_logits or self.structured_outputs is not None

    @property
    def adjusts_logits(self) -> bool:
        """Whether processing other than a grammar's masks applies: penalties, a bias, min_tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map token ids to numbers") from None
            bad = [k for k, v in self.logit_bias.items() if k < 0 or not -100 <= v <= 100]
            if bad:
                raise ValueError(f"logit_bias: token ids must be >= 0 and biases in [-100, 100] (token {bad[0]})")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be in 0..20, got {value}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {self.logprobs_mode!r}")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)


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
    min_p: torch.Tensor | None = None  # [N]; None: no row has min-p

    @classmethod
    def of(cls, params: list[SamplingParams], device="cpu") -> "WarpParams":
        def column(values: list) -> torch.Tensor:  # a copy that does not wait for the device's queue
            return torch.tensor(values).to(device, non_blocking=True)
        return cls(column([0.0 if p.greedy else p.temperature for p in params]), column([p.top_k for p in params]),
                   column([p.top_p for p in params]),
                   all(p.greedy for p in params), any(p.greedy for p in params),
                   any(p.top_k > 0 or p.top_p < 1 for p in params),
                   column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None)

    def repeat(self, n: int) -> "WarpParams":
        """Each row's parameters n times in a row (for [B, n, V] logits flattened to [B*n, V])."""
        return replace(self, temperature=self.temperature.repeat_interleave(n),
                       top_k=self.top_k.repeat_interleave(n), top_p=self.top_p.repeat_interleave(n),
                       min_p=None if self.min_p is None else self.min_p.repeat_interleave(n))


def warp(logits: torch.Tensor, params: WarpParams) -> torch.Tensor:
    """fp32 logits [N, V] -> the distribution each row samples from, [N, V]."""
    logits = logits.float()
    greedy = params.temperature == 0
    scaled = logits / torch.where(greedy, 1.0, params.temperature)[:, None]
    if params.any_filter:
        scaled = _mask_top_k_top_p(scaled, params.top_k, params.top_p)
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p is not None:
        probs = _min_p(probs, params.min_p)
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


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops the tokens below min_p times the likeliest one's probability, renormalized."""
    kept = probs.masked_fill(probs < min_p[:, None] * probs.max(-1, keepdim=True).values, 0.0)
    return kept / kept.sum(-1, keepdim=True)


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
