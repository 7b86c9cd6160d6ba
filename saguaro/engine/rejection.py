"""The rejection-sampling rule of speculative decoding: which drafted tokens are accepted and
the bonus token, so that the committed tokens are distributed as the target's own samples."""
from __future__ import annotations

import torch

from saguaro.engine.proposal import Outcome
from saguaro.engine.sampler import sample


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
           u_accept: torch.Tensor, u_bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepts a prefix of each row's draft and picks the bonus token.

    draft_tokens [B, K]; draft_probs [B, K, V], the distributions the drafts were really
    sampled from; target_probs [B, K+1, V]; u_accept [B, K], u_bonus [B] uniforms.
    Token i is accepted with probability min(1, p(x)/q(x)); at the first rejection the bonus
    comes from norm(max(p - q, 0)), after K acceptances from p at position K+1. The committed
    tokens are then distributed exactly as sampling from p alone.
    Returns accepted_len [B] in 0..K and bonus_token [B].
    """
    B, K = draft_tokens.shape
    index = draft_tokens[..., None]
    p_x = target_probs[:, :K].gather(-1, index)[..., 0]
    q_x = draft_probs.gather(-1, index)[..., 0]
    accepted = u_accept * q_x < p_x  # u < p/q without dividing by a zero q
    accepted_len = accepted.int().cumprod(-1).sum(-1)
    rows = torch.arange(B, device=draft_tokens.device)
    p_at = target_probs[rows, accepted_len]
    q_at = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, accepted_len]
    residual = (p_at - q_at).clamp_(min=0)
    # Float round-off can leave an all-zero residual when p == q; p itself is then exact.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p_at, residual)
    return accepted_len, sample(residual, u_bonus)


def verify_greedy(draft_tokens: list[list[int]], target_tokens: list[list[int]]) -> list[Outcome]:
    """`verify` for a greedy target, whose distributions are point masses on target_tokens
    [B][K+1] (its argmaxes): whatever the draft's distribution, a draft is accepted iff it
    equals the argmax, and the bonus is the argmax after the accepted prefix. Returns each
    row's (accepted_len, bonus_token). On lists: a handful of ints, where each small torch
    operation right after the target's pass would run cold."""
    outcomes = []
    for drafts, targets in zip(draft_tokens, target_tokens):
        accepted_len = 0
        while accepted_len < len(drafts) and drafts[accepted_len] == targets[accepted_len]:
            accepted_len += 1
        outcomes.append(Outcome(accepted_len, targets[accepted_len]))
    return outcomes


def verify_argmax(draft_tokens: torch.Tensor, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_greedy` on the device: draft_tokens [B, K], the target's argmaxes [B, K+1] ->
    accepted_len [B], bonus_token [B], with no wait for the host."""
    accepted_len = (draft_tokens == argmax[:, :-1]).int().cumprod(-1).sum(-1)
    return accepted_len, argmax.gather(1, accepted_len[:, None].long())[:, 0]


def point_masses(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, K] tokens -> [B, K, V] distributions with all mass on each token."""
    return torch.zeros(*tokens.shape, vocab_size, device=tokens.device).scatter_(-1, tokens[..., None], 1.0)
