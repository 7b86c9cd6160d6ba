"""Speculative decoding is exact: what it commits is distributed as sampling from the target
alone, for any draft. Checked statistically, against distributions computed exactly, with
broken acceptance rules as negative controls (they must be caught, or the test proves nothing).

The noise bound for the total variation (TV) between an empirical distribution of N samples
and the truth: E[TV] <= 1/2 sum_x sqrt(p(x)(1 - p(x)) / N) (Jensen), and TV moves by at most
1/N per sample, so by McDiarmid it exceeds its mean by t with probability <= exp(-2 N t^2).
"""
from __future__ import annotations

import math

import pytest
import torch

from saguaro.engine import decoders
from saguaro.engine.decoders import SDDecoder
from saguaro.engine.sampler import SamplingParams, WarpParams, sample, warp
from saguaro.engine.sequence import Sequence
from saguaro.engine.verify import verify, verify_greedy
from saguaro.models.config import ModelConfig
from saguaro.models.llama import LlamaModel

FAILURE_PROBABILITY = 1e-6


def tv_bound(p: torch.Tensor, n: int) -> float:
    """TV(empirical of n exact samples, p) stays below this except with FAILURE_PROBABILITY."""
    p = p.double().flatten()
    mean_bound = 0.5 * (p * (1 - p) / n).sqrt().sum().item()
    return mean_bound + math.sqrt(math.log(1 / FAILURE_PROBABILITY) / (2 * n))


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    counts = counts.double().flatten()
    return 0.5 * (counts / counts.sum() - p.double().flatten()).abs().sum().item()


def accept_always(draft_tokens, draft_probs, target_probs, u_accept, u_bonus):
    """Broken: every draft token is accepted (u = 0 < p(x))."""
    return verify(draft_tokens, draft_probs, target_probs, torch.zeros_like(u_accept), u_bonus)


def residual_is_p(draft_tokens, draft_probs, target_probs, u_accept, u_bonus):
    """Broken: the bonus after a rejection comes from p instead of norm(max(p - q, 0))."""
    accepted_len, _ = verify(draft_tokens, draft_probs, target_probs, u_accept, u_bonus)
    p_at = target_probs[torch.arange(len(accepted_len)), accepted_len]
    return accepted_len, sample(p_at, u_bonus)


BROKEN_RULES = [accept_always, residual_is_p]

# --- (a) verify alone: Markov chains as target and draft ------------------------------------------

V, K, L, N = 10, 3, 2, 200_000  # vocabulary, draft length, tokens compared, rows


def markov_chain(temperature: float, seed: int) -> torch.Tensor:
    """Next-token distributions [position, previous token, V] for L + K positions."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn((L + K) * V, V, generator=g)
    params = WarpParams.of([SamplingParams(temperature=temperature)] * len(logits))
    return warp(logits, params).view(L + K, V, V)


def speculative_chains(p: torch.Tensor, q: torch.Tensor, rule, n: int, seed: int) -> torch.Tensor:
    """n sequences of L tokens (after token 0) decoded by rounds of drafting K tokens from q and
    verifying them against p with `rule`; [n, L]."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n, L + K + 1, dtype=torch.long)
    length = torch.zeros(n, dtype=torch.long)
    while bool((length < L).any()):
        rows = (length < L).nonzero()[:, 0]
        b, start = len(rows), length[rows]
        prev = torch.where(start > 0, out[rows, (start - 1).clamp(min=0)], 0)
        drafts, draft_probs, target_probs = [], [], []
        for i in range(K + 1):
            target_probs.append(p[start + i, prev])
            if i < K:
                draft_probs.append(q[start + i, prev])
                prev = sample(draft_probs[-1], torch.rand(b, generator=g))
                drafts.append(prev)
        drafts_t = torch.stack(drafts, 1)
        accepted_len, bonus = rule(drafts_t, torch.stack(draft_probs, 1), torch.stack(target_probs, 1),
                                   torch.rand(b, K, generator=g), torch.rand(b, generator=g))
        committed = torch.cat([drafts_t, bonus[:, None]], 1)
        committed[torch.arange(b), accepted_len] = bonus
        for i in range(K + 1):
            keep = i <= accepted_len
            out[rows[keep], start[keep] + i] = committed[keep, i]
        length[rows] += accepted_len + 1
    return out[:, :L]


def exact_chain(p: torch.Tensor) -> torch.Tensor:
    """P(x1, x2) = p[0, 0, x1] p[1, x1, x2]: [V, V]."""
    return p[0, 0][:, None] * p[1]


def chain_tvs(temperature: float, rule) -> tuple[float, float, float, float]:
    """(TV of the first token, its bound, TV of the first L tokens, its bound)."""
    p, q = markov_chain(temperature, seed=1), markov_chain(temperature, seed=2)
    samples = speculative_chains(p, q, rule, N, seed=3)
    joint = exact_chain(p)
    first = torch.bincount(samples[:, 0], minlength=V)
    pairs = torch.bincount(samples[:, 0] * V + samples[:, 1], minlength=V * V)
    return tv(first, joint.sum(1)), tv_bound(joint.sum(1), N), tv(pairs, joint), tv_bound(joint, N)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_verify_is_exact(temperature):
    tv_first, bound_first, tv_joint, bound_joint = chain_tvs(temperature, verify)
    assert tv_first < bound_first
    assert tv_joint < bound_joint


@pytest.mark.parametrize("rule", BROKEN_RULES)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_verify_check_catches_broken_rules(temperature, rule):
    tv_first, bound_first, tv_joint, bound_joint = chain_tvs(temperature, rule)
    assert tv_joint > bound_joint


def test_greedy_verify_is_the_rule_for_point_mass_targets():
    """At temperature 0 the engine skips the distributions: the outcome must be the one
    `verify` gives for one-hot targets, whatever (smooth or point-mass) draft proposed."""
    g = torch.Generator().manual_seed(5)
    B, K, vocab = 4000, 4, 3
    target_tokens = torch.randint(vocab, (B, K + 1), generator=g)
    draft_probs = torch.rand(B, K, vocab, generator=g).softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.flatten(0, 1), 1, generator=g).view(B, K)
    target_probs = torch.nn.functional.one_hot(target_tokens, vocab).float()
    u = torch.rand(B, K + 1, generator=g)
    expected = verify(draft_tokens, draft_probs, target_probs, u[:, :K], u[:, K])
    got = verify_greedy(draft_tokens, target_tokens)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert set(got[0].tolist()) == set(range(K + 1))  # every accepted length occurs
    shifted = verify_greedy(draft_tokens, target_tokens.roll(1, dims=1))
    assert not torch.equal(shifted[0], expected[0])  # the comparison can fail


def test_noise_bound_holds_for_exact_samples():
    """The bound is not loose by construction: exact samples land well inside, not far."""
    joint = exact_chain(markov_chain(1.0, seed=1)).flatten()
    samples = torch.multinomial(joint, N, replacement=True, generator=torch.Generator().manual_seed(4))
    observed = tv(torch.bincount(samples, minlength=V * V), joint)
    assert 0.2 * tv_bound(joint, N) < observed < tv_bound(joint, N)


# --- (b) end to end: SDDecoder with a tiny random target and a different tiny draft -------------

TINY_V, TINY_K, ROWS, NEW = 8, 2, 20_000, 3
PROMPT = [1, 5, 2]


# A reduced draft head (as the shipped draft has): 6 of the 8 tokens, in no particular order.
REDUCED_HEAD = [7, 0, 3, 5, 1, 6]


def tiny_model(seed: int, layers: int, head_token_ids: list[int] | None = None) -> LlamaModel:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=TINY_V, hidden_size=16, intermediate_size=32, num_layers=layers,
                         num_heads=2, num_kv_heads=1, head_dim=8,
                         head_vocab_size=len(head_token_ids) if head_token_ids else None)
    model = LlamaModel(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(3)  # logits of order 1: distributions neither flat nor one-hot
    if head_token_ids:
        model.head_token_ids.copy_(torch.tensor(head_token_ids))
    return model


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(seed=10, layers=2)


@pytest.fixture(scope="module")
def draft() -> LlamaModel:
    return tiny_model(seed=11, layers=1)


def exact_continuations(model: LlamaModel, temperature: float) -> torch.Tensor:
    """P(t1, t2, t3 | PROMPT) by enumerating every continuation: [V, V, V]."""
    pairs = torch.cartesian_prod(torch.arange(TINY_V), torch.arange(TINY_V))
    tokens = torch.cat([torch.tensor(PROMPT).expand(len(pairs), -1), pairs], 1)
    T = tokens.shape[1]
    cache = decoders.new_cache(model, len(tokens), T)
    logits = model.logits(model(tokens, torch.arange(T).expand(len(tokens), T), cache))[:, -3:]
    params = WarpParams.of([SamplingParams(temperature=temperature)] * (len(tokens) * 3))
    probs = warp(logits.reshape(-1, TINY_V), params).view(len(tokens), 3, TINY_V)
    p1 = probs[0, 0]
    p2 = probs[::TINY_V, 1]  # rows whose t2 is 0: the distribution depends only on t1
    p3 = probs[:, 2].view(TINY_V, TINY_V, TINY_V)
    return p1[:, None, None] * p2[:, :, None] * p3


def sd_continuations(target: LlamaModel, draft: LlamaModel, temperature: float,
                     prompt_lookup: int | None = None) -> torch.Tensor:
    """ROWS sequences decoded together by SDDecoder, each with its own seed: [ROWS, NEW]."""
    decoder = SDDecoder(target, draft, TINY_K, prompt_lookup)
    seqs = [Sequence(i, PROMPT, SamplingParams(temperature=temperature, max_tokens=NEW, seed=i), [])
            for i in range(ROWS)]
    decoder.reserve(ROWS, len(PROMPT) + NEW + decoder.lookahead)
    decoder.prefill(seqs)
    while active := [s for s in seqs if not s.finished]:
        decoder.step(active)
    return torch.tensor([s.output_ids for s in seqs])


def decoder_tv(target: LlamaModel, draft: LlamaModel, temperature: float,
               prompt_lookup: int | None = None) -> tuple[float, float]:
    exact = exact_continuations(target, temperature)
    out = sd_continuations(target, draft, temperature, prompt_lookup)
    counts = torch.bincount((out[:, 0] * TINY_V + out[:, 1]) * TINY_V + out[:, 2], minlength=TINY_V ** 3)
    return tv(counts, exact), tv_bound(exact, ROWS)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sd_decoder_is_exact(target, draft, temperature):
    observed, bound = decoder_tv(target, draft, temperature)
    assert observed < bound


def test_sd_decoder_is_exact_with_a_reduced_draft_head(target):
    """The draft samples over its head rows only; the target still reaches every token."""
    observed, bound = decoder_tv(target, tiny_model(seed=11, layers=1, head_token_ids=REDUCED_HEAD), 1.0)
    assert observed < bound


def test_sd_decoder_is_exact_with_prompt_lookup(target, draft):
    """A one-token match is common in this 8-token vocabulary: lookups and drafts mix."""
    observed, bound = decoder_tv(target, draft, 1.0, prompt_lookup=1)
    assert observed < bound


def test_prompt_lookup_check_catches_a_misreported_proposal(target, draft, monkeypatch):
    """Lookups reported as uniform proposals instead of the point masses they are."""
    monkeypatch.setattr(decoders, "point_masses", lambda tokens, v: torch.full((*tokens.shape, v), 1.0 / v))
    observed, bound = decoder_tv(target, draft, 1.0, prompt_lookup=1)
    assert observed > bound


@pytest.mark.parametrize("rule", BROKEN_RULES)
def test_sd_decoder_check_catches_broken_rules(target, draft, rule, monkeypatch):
    monkeypatch.setattr(decoders, "verify", rule)
    observed, bound = decoder_tv(target, draft, 1.0)
    assert observed > bound
