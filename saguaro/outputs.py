"""What `LLM.generate` returns, in the style of vLLM's RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass

from saguaro.engine.logprobs import TokenLogprobs
from saguaro.engine.sequence import SequenceStats


@dataclass
class RequestMetrics:
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float  # arrival to first token
    decode_tokens_per_s: float  # tokens after the first / time after the first
    e2e_tokens_per_s: float  # all output tokens / time from arrival, prefill included
    num_rounds: int  # target passes after prefill
    mean_acceptance_length: float | None  # SD/SSD: committed tokens per round
    per_position_acceptance: list[float] | None  # SD/SSD: share of rounds accepting draft i
    cache_hit_rate: float | None = None  # SSD only
    num_cached_tokens: int = 0  # prompt tokens whose KV entries came from the prefix cache

    @classmethod
    def of(cls, stats: SequenceStats, num_output_tokens: int, k: int | None) -> "RequestMetrics":
        t_first = stats.t_first_token or stats.t_arrival
        t_end = stats.t_finish or t_first
        decode_time = t_end - t_first
        lengths = stats.acceptance_lengths
        return cls(
            num_prompt_tokens=stats.prompt_len,
            num_output_tokens=num_output_tokens,
            ttft_s=t_first - stats.t_arrival,
            decode_tokens_per_s=(num_output_tokens - 1) / decode_time if decode_time > 0 else 0.0,
            e2e_tokens_per_s=num_output_tokens / max(t_end - stats.t_arrival, 1e-9),
            num_rounds=len(lengths) if lengths else max(num_output_tokens - 1, 0),
            mean_acceptance_length=sum(lengths) / len(lengths) if lengths else None,
            per_position_acceptance=[sum(n - 1 > i for n in lengths) / len(lengths) for i in range(k)]
            if lengths and k else None,
            cache_hit_rate=sum(stats.cache_hits) / len(stats.cache_hits) if stats.cache_hits else None,
            num_cached_tokens=stats.cached_tokens,
        )


@dataclass
class CompletionOutput:
    """One of a request's n samples."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None = None  # one per output token (SamplingParams.logprobs)


@dataclass
class RequestOutput:
    """A prompt's outputs: `outputs` holds its n samples (SamplingParams.n); text, token_ids,
    finish_reason and metrics are the first sample's, the whole answer when n = 1."""
    request_id: int
    prompt: str | list
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token, the first None
