"""Exactness checks against the target's own conditional probabilities.

Comparing a sampled set with a distribution cell by cell needs samples in proportion to the
number of cells. Here each sampled token is instead mapped through the target's warped
conditional distribution at its position (given the sampled prefix, computed exactly or by
teacher forcing): the randomized probability integral transform (PIT). Under exactness the
PIT values of one sequence are i.i.d. Uniform(0, 1) (Rosenblatt), so every position of every
sample pools into one Kolmogorov-Smirnov test.

Tokens are ordered by decreasing target probability before the transform: the usual biases
(too sharp, too flat, mass on the wrong tokens) then move the PIT's distribution one way, which
the KS statistic sees at its full size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from saguaro.engine.runner import forward_chunks
from saguaro.engine.sampler import SamplingParams, WarpParams, warp
from saguaro.engine.rejection import verify
from saguaro.models.kv_cache import new_cache
from saguaro.models.llama import LlamaModel


def ks_pvalue(values: torch.Tensor) -> float:
    """Asymptotic p-value of the one-sample KS test of values against Uniform(0, 1), with
    Stephens' small-sample correction of the statistic."""
    u = values.double().flatten().sort().values
    n = len(u)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = max((i / n - u).max().item(), (u - (i - 1) / n).max().item())
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 0.2:  # Kolmogorov's Q(0.2) = 1 - 1e-20; its series converges too slowly below
        return 1.0
    j = torch.arange(1, 101, dtype=torch.float64)
    q = 2 * ((-1) ** (j - 1) * torch.exp(-2 * j ** 2 * lam ** 2)).sum().item()
    return min(max(q, 0.0), 1.0)


def randomized_pit(probs: torch.Tensor, tokens: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs [N, V], tokens [N], v [N] uniforms -> F(x-) + v p(x) [N], with tokens ordered by
    decreasing probability (ties by token id). A token of probability zero lands at F(x-)."""
    probs = probs.double()
    probs = probs / probs.sum(-1, keepdim=True)
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = (order == tokens[:, None]).int().argmax(-1, keepdim=True)
    before = (ordered.cumsum(-1) - ordered).gather(-1, rank)[:, 0]
    return (before + v.double() * probs.gather(-1, tokens[:, None])[:, 0]).clamp(0, 1)


def chi_square_pvalue(groups: list[tuple[torch.Tensor, torch.Tensor]], min_expected: float = 5.0) -> float:
    """Pearson's chi-square test that each group's tokens [n] were drawn from its distribution p
    [V], pooled over the groups (statistics and degrees of freedom add). Tokens expected fewer
    than min_expected times in a group share one cell; a token of probability zero drawn even
    once gives 0."""
    statistic, dof = 0.0, 0
    for tokens, p in groups:
        p = p.double() / p.double().sum()
        counts = torch.bincount(tokens, minlength=len(p)).double()
        if (counts[p == 0] > 0).any():
            return 0.0
        expected = len(tokens) * p
        rare = expected < min_expected
        observed = torch.cat((counts[~rare], counts[rare].sum()[None]))
        expected = torch.cat((expected[~rare], expected[rare].sum()[None]))
        kept = expected > 0
        statistic += ((observed - expected)[kept] ** 2 / expected[kept]).sum().item()
        dof += int(kept.sum()) - 1
    half = torch.tensor([dof / 2, statistic / 2], dtype=torch.float64)
    return torch.special.gammaincc(half[0], half[1]).item()  # the chi-square survival function


def reference_warp(logits: torch.Tensor, params: WarpParams) -> torch.Tensor:
    """`warp` written from the definitions, row by row in float64, to check warp itself against:
    the softmax at the temperature, its top_k most likely tokens, then the smallest set of the
    most likely of those whose mass reaches top_p, renormalized; a point mass at temperature 0."""
    rows = []
    for row, t, k, top_p in zip(logits.double(), params.temperature.tolist(), params.top_k.tolist(),
                                params.top_p.tolist()):
        if t == 0:
            rows.append(torch.nn.functional.one_hot(row.argmax(), len(row)).double())
            continue
        probs = (row / t).softmax(-1)
        ranked = probs.argsort(descending=True, stable=True).tolist()
        ranked = ranked[:k] if k > 0 else ranked
        mass = probs[ranked].sum().item()
        nucleus, covered = [], 0.0
        for token in ranked:
            nucleus.append(token)
            covered += probs[token].item() / mass
            if covered >= top_p:
                break
        kept = torch.zeros_like(probs)
        kept[nucleus] = probs[nucleus]
        rows.append(kept / kept.sum())
    return torch.stack(rows)


def proposal_pvalues(tokens: torch.Tensor, probs: torch.Tensor, seed: int = 0) -> tuple[float, float]:
    """Draft tokens [N, K] and the distributions reported for them [N, K, V]: what rejection
    sampling assumes of a proposal, that token i was drawn from its reported q_i with a random
    number of its own. Each token's randomized PIT in token-id order (the order `sample` inverts)
    is then Uniform(0, 1), independent of the PIT of the token before it. Returns the KS
    p-value of all PITs and the two-sided p-value of the correlation between consecutive ones
    (a uniform reused along a chain makes them nearly equal)."""
    probs = probs.double() / probs.double().sum(-1, keepdim=True)
    v = torch.rand(tokens.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    before = (probs.cumsum(-1) - probs).gather(-1, tokens[..., None])[..., 0]
    pit = (before + v * probs.gather(-1, tokens[..., None])[..., 0]).clamp(0, 1)
    centred = pit - 0.5
    products = centred[:, 1:] * centred[:, :-1]  # mean 0, variance 1/144 each, uncorrelated
    z = products.sum().item() / math.sqrt(products.numel() / 144)
    return ks_pvalue(pit), math.erfc(abs(z) / math.sqrt(2))


@torch.inference_mode()
def teacher_forced_probs(model: LlamaModel, prompts: list[list[int]], outputs: list[list[int]],
                         params: list[SamplingParams], rows_per_pass: int = 2048, warp_rows=warp
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every output token of the sampled rows (greedy rows, point masses, carry no information
    and are left out) with the model's warped conditional distribution given its prompt and the
    output before it: (row index [N], token [N], probs [N, V]), row by row in order. warp_rows:
    what warps the logits (`reference_warp` to check `warp` itself)."""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    rows_out, tokens_out, probs_out = [], [], []
    for start in range(0, len(sampled), rows_per_pass):
        batch = sampled[start:start + rows_per_pass]
        chunks = [prompts[i] + outputs[i][:-1] for i in batch]
        cache = new_cache(model, len(batch), max(len(c) for c in chunks))
        hidden = forward_chunks(model, cache, list(range(len(batch))), chunks, [0] * len(batch))
        index = [(row, len(prompts[i]) - 1 + t) for row, i in enumerate(batch) for t in range(len(outputs[i]))]
        rows, positions = torch.tensor(index).T
        logits = model.logits(hidden[rows, positions])
        warp_params = WarpParams.of([params[batch[r]] for r in rows.tolist()], logits.device)
        rows_out.append(torch.tensor(batch)[rows])
        tokens_out.append(torch.tensor([t for i in batch for t in outputs[i]]))
        probs_out.append(warp_rows(logits, warp_params))
    return torch.cat(rows_out), torch.cat(tokens_out), torch.cat(probs_out)


def teacher_forced_pit(model: LlamaModel, prompts: list[list[int]], outputs: list[list[int]],
                       params: list[SamplingParams], seed: int = 0, warp_rows=warp) -> torch.Tensor:
    """The PIT of every output token under the model's warped conditional distribution given
    its prompt and the output before it, pooled over all positions of all sampled rows."""
    _, tokens, probs = teacher_forced_probs(model, prompts, outputs, params, warp_rows=warp_rows)
    v = torch.rand(len(tokens), generator=torch.Generator().manual_seed(seed))
    return randomized_pit(probs, tokens, v)


def repeat_pvalue(model: LlamaModel, prompts: list[list[int]], outputs: list[list[int]],
                  params: list[SamplingParams]) -> float:
    """One-sided p-value of "output tokens repeat earlier output tokens of their row more often
    than the model predicts". Random numbers drawn twice (a stream reseeded, a worker's restarted)
    make a draft repeat what the same numbers drew before, a dependence between positions that
    the pooled PIT, which sees each position alone, misses. Under exactness, the count of
    earlier copies of each token less its conditional expectation given the prefix is a
    martingale difference: their sum over a row and over rows is about normal."""
    rows, tokens, probs = teacher_forced_probs(model, prompts, outputs, params)
    probs = probs.double() / probs.double().sum(-1, keepdim=True)
    onehot = torch.nn.functional.one_hot(tokens, probs.shape[-1]).double()
    seen = onehot.cumsum(0) - onehot  # copies of each token before this one, in all rows
    row_start = torch.ones_like(rows, dtype=torch.bool)
    row_start[1:] = rows[1:] != rows[:-1]
    starts = torch.cumsum(row_start, 0) - 1  # which row segment each token is in
    seen -= seen[row_start.nonzero()[:, 0]][starts]  # ... in its own row only
    expected = (seen * probs).sum(-1)
    excess = seen.gather(-1, tokens[:, None])[:, 0] - expected
    variance = (seen ** 2 * probs).sum(-1) - expected ** 2
    z = excess.sum() / variance.sum().clamp_min(1e-30).sqrt()
    return 0.5 * math.erfc(z.item() / math.sqrt(2))


def sharpen(probs: torch.Tensor, power: float) -> torch.Tensor:
    """q^power, renormalised over the last dimension (point masses stay point masses)."""
    powered = probs.double() ** power
    return (powered / powered.sum(-1, keepdim=True)).to(probs.dtype)


def first_token_tv(q: torch.Tensor, reported: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Exact TV between p and the distribution of the first token a round commits when its
    draft is sampled from q but verified as if from `reported`: accepted with probability
    min(1, p/reported), else replaced by a draw from norm(max(p - reported, 0)). [B, V] -> [B]."""
    q, reported, p = q.double(), reported.double(), p.double()
    kept = q * torch.where(reported > 0, (p / reported).clamp(max=1), 1.0)
    residual = (p - reported).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    committed = kept + (1 - kept.sum(-1, keepdim=True)) * residual / residual.sum(-1, keepdim=True)
    return 0.5 * (committed - p).abs().sum(-1)


@dataclass
class MisreportedProposal:
    """A broken acceptance rule: each draft was sampled from q, but verification is told it
    came from q^power. Records the exact TV by which each round's first committed token is off."""
    power: float
    tvs: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, draft_tokens, draft_probs, target_probs, u_accept, u_bonus):
        reported = sharpen(draft_probs, self.power)
        self.tvs.append(first_token_tv(draft_probs[:, 0], reported[:, 0], target_probs[:, 0]))
        return verify(draft_tokens, reported, target_probs, u_accept, u_bonus)

    @property
    def mean_tv(self) -> float:
        return torch.cat(self.tvs).mean().item()

