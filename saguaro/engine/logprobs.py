"""Log-probabilities of committed tokens, as the API returns them (OpenAI's logprobs,
vLLM's prompt_logprobs), computed from the target's logits at the positions they came from."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    """One output (or prompt) position."""
    token_id: int
    logprob: float
    top_ids: list[int]  # the top k by log-probability, k = SamplingParams.logprobs
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, temperature: float = 1.0
                   ) -> list[TokenLogprobs]:
    """logits [N, V] at the positions tokens [N] were chosen at -> each token's entry: its
    log-probability under softmax(logits / temperature) and the top `top`."""
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1).cpu()
    chosen = log_probs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    if top:
        values, ids = log_probs.topk(top, dim=-1)
        values, ids = values.tolist(), ids.tolist()
    else:
        values = ids = [[] for _ in tokens]
    return [TokenLogprobs(t, c, i, v) for t, c, i, v in zip(tokens, chosen, ids, values)]
