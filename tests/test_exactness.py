"""Speculative decoding is exact: what it commits is distributed as sampling from the target
alone, for any draft. Checked statistically against the target's own conditional
distributions (tests/stats.py: the PIT of every committed token, pooled into one KS test),
with broken rules as negative controls (they must be caught, or the test proves nothing),
down to a rule whose committed tokens are off by 0.02 in total variation.

Every compared span reaches past a round of K accepted drafts, so the bonus drawn after them
is observed too.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from drafts import sd_decoder
import saguaro.engine.verifier as verification
import saguaro.engine.sampler as sampler
from saguaro.engine.sampler import SamplingParams, WarpParams, sample, warp
from saguaro.engine.sequence import Sequence
from saguaro.engine.rejection import verify, verify_greedy
from saguaro.models.native import bindings, layers
from saguaro.models.config import ModelConfig
from saguaro.models.llama import Execution, LlamaModel
from saguaro.models.quantized import quantized_linear
from saguaro.speculation.local import drafters
from stats import MisreportedProposal, ks_pvalue, randomized_pit, reference_warp, teacher_forced_pit

# A test of an exact decoder fails with this probability (its KS p-value falls below it by
# chance); negative controls must land below it.
ALPHA = 1e-5


def accept_always(draft_tokens, draft_probs, target_probs, u_accept, u_bonus):
    """Broken: every draft token is accepted (u = 0 < p(x))."""
    return verify(draft_tokens, draft_probs, target_probs, torch.zeros_like(u_accept), u_bonus)


def residual_is_p(draft_tokens, draft_probs, target_probs, u_accept, u_bonus):
    """Broken: the bonus after a rejection comes from p instead of norm(max(p - q, 0))."""
    accepted_len, _ = verify(draft_tokens, draft_probs, target_probs, u_accept, u_bonus)
    p_at = target_probs[torch.arange(len(accepted_len)), accepted_len]
    return accepted_len, sample(p_at, u_bonus)


def bonus_from_residual(draft_tokens, draft_probs, target_probs, u_accept, u_bonus):
    """Broken: after all K drafts are accepted, the bonus comes from norm(max(p - q, 0)) with the
    last draft's q, as after a rejection, instead of from p."""
    accepted_len, bonus = verify(draft_tokens, draft_probs, target_probs, u_accept, u_bonus)
    K = draft_tokens.shape[1]
    residual = (target_probs[:, K] - draft_probs[:, K - 1]).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_probs[:, K])
    return accepted_len, torch.where(accepted_len == K, sample(residual, u_bonus), bonus)


BROKEN_RULES = [accept_always, residual_is_p, bonus_from_residual]

# --- (a) verify alone: Markov chains as target and draft ------------------------------------------

V, K, N = 10, 3, 40_000  # vocabulary, draft length, rows
L = 3 * (K + 1)  # tokens compared: three rounds of K accepted drafts and their bonus at least


def chain_logits(seed: int) -> torch.Tensor:
    return 2 * torch.randn((L + K) * V, V, generator=torch.Generator().manual_seed(seed))


def markov_chain(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Next-token distributions [position, previous token, V] for L + K positions."""
    params = WarpParams.of([SamplingParams(temperature=temperature)] * len(logits))
    return warp(logits, params).view(L + K, V, V)


def target_and_draft(temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft near the target (its logits plus noise): all K drafts are often accepted."""
    logits = chain_logits(seed=1)
    return markov_chain(logits, temperature), markov_chain(logits + chain_logits(seed=2) / 2, temperature)


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


def chain_pit(p: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """The PIT of every sampled token under p given the token before it: [n * L]."""
    n = len(samples)
    prev = torch.cat([torch.zeros(n, 1, dtype=torch.long), samples[:, :-1]], 1)
    probs = p[torch.arange(L).expand(n, L), prev]
    return randomized_pit(probs.flatten(0, 1), samples.flatten(), torch.rand(n * L, generator=torch.Generator().manual_seed(4)))


def chain_pvalue(temperature: float, rule) -> float:
    p, q = target_and_draft(temperature)
    return ks_pvalue(chain_pit(p, speculative_chains(p, q, rule, N, seed=3)))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_verify_is_exact(temperature):
    assert chain_pvalue(temperature, verify) > ALPHA


@pytest.mark.parametrize("rule", BROKEN_RULES)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_verify_check_catches_broken_rules(temperature, rule):
    assert chain_pvalue(temperature, rule) < ALPHA


def test_verify_check_catches_a_bias_of_two_percent():
    rule = MisreportedProposal(1.09)
    assert chain_pvalue(1.0, rule) < ALPHA
    assert 0.015 < rule.mean_tv < 0.03


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
    expected = list(zip(expected[0].tolist(), expected[1].tolist()))
    got = verify_greedy(draft_tokens.tolist(), target_tokens.tolist())
    assert got == expected
    assert {n for n, _ in got} == set(range(K + 1))  # every accepted length occurs
    shifted = verify_greedy(draft_tokens.tolist(), target_tokens.roll(1, dims=1).tolist())
    assert [n for n, _ in shifted] != [n for n, _ in expected]  # the comparison can fail


def test_pit_check_passes_exact_samples_and_only_them():
    """Tokens drawn from p itself pass; from a mixture of p and its sharpened self, 0.02 away
    in TV, they fail (the check is not loose by construction)."""
    g = torch.Generator().manual_seed(6)
    p = markov_chain(chain_logits(seed=1), 1.0).flatten(0, 1)[torch.randint(V * (L + K), (N * L,), generator=g)]
    v = torch.rand(N * L, generator=g)
    sharp = p ** 2 / (p ** 2).sum(-1, keepdim=True)
    biased = p + (sharp - p) * 0.02 / (0.5 * (sharp - p).abs().sum(-1, keepdim=True))
    assert ks_pvalue(randomized_pit(p, sample(p, torch.rand(N * L, generator=g)), v)) > ALPHA
    assert ks_pvalue(randomized_pit(p, sample(biased, torch.rand(N * L, generator=g)), v)) < ALPHA


def test_ks_pvalue_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(8)
    for n, shift in [(50, 0.0), (2000, 0.0), (2000, 0.04), (100_000, 0.005)]:
        u = (torch.rand(n, generator=g, dtype=torch.float64) * (1 + shift)).clamp(max=1)
        expected = stats.kstest(u.numpy(), "uniform", method="asymp").pvalue
        assert ks_pvalue(u) == pytest.approx(expected, rel=0.1, abs=1e-12)  # Stephens: a few % off


# --- (b) end to end: the SD decoder with a tiny random target and a different tiny draft -------------

TINY_V, TINY_K, ROWS = 8, 2, 10_000
NEW = 1 + 2 * (TINY_K + 1)  # the target's first token, then two rounds of K drafts and a bonus
PROMPT = [1, 5, 2]


# A reduced draft head (as the shipped draft has): 6 of the 8 tokens, in no particular order.
REDUCED_HEAD = [7, 0, 3, 5, 1, 6]


def tiny_model(seed: int, layers: int, head_token_ids: list[int] | None = None, head_scale: float = 3.0) -> LlamaModel:
    """head_scale 3 gives logits of order 1: distributions neither flat nor one-hot."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=TINY_V, hidden_size=16, intermediate_size=32, num_layers=layers,
                         num_heads=2, num_kv_heads=1, head_dim=8,
                         head_vocab_size=len(head_token_ids) if head_token_ids else None)
    model = LlamaModel(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(head_scale)
    if head_token_ids:
        model.head_token_ids.copy_(torch.tensor(head_token_ids))
    return model


def int4_pair() -> tuple[LlamaModel, LlamaModel]:
    """A target whose projections run as int4 in bf16 (the default for a Q4 GGUF), wide enough
    for torch's int4 kernel, its layers in one C call each where saguaro's kernels run (as the
    loader attaches them), and as draft its own dense fp32 weights with a sharpened head."""
    torch.manual_seed(12)
    config = ModelConfig(vocab_size=TINY_V, hidden_size=64, intermediate_size=64, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=32)
    dense = LlamaModel(config).eval().requires_grad_(False)
    dense.lm_head.weight.mul_(3.0)
    target = LlamaModel(config).eval().requires_grad_(False)
    target.load_state_dict(dense.state_dict())
    target.to(torch.bfloat16)
    for name, module in list(target.named_modules()):
        if name.endswith("_proj"):
            target.set_submodule(name, quantized_linear(module.weight, None, "int4", torch.bfloat16))
    target.use(Execution(native_layers=layers.native_layers(target)))
    assert (target.native_layers is not None) == bindings.available()
    dense.lm_head.weight.mul_(1.5)
    return target, dense


def sharpened_target() -> LlamaModel:
    """The target itself with 1.5 times its logits: a peaked draft, all of whose guesses are
    often accepted."""
    return tiny_model(seed=10, layers=2, head_scale=4.5)


@pytest.fixture(scope="module")
def target() -> LlamaModel:
    return tiny_model(seed=10, layers=2)


@pytest.fixture(scope="module")
def draft() -> LlamaModel:
    return tiny_model(seed=11, layers=1)


def tiny_prompts(rows: int) -> list[list[int]]:
    return [PROMPT + [i % TINY_V] for i in range(rows)]


def sd_outputs(target: LlamaModel, draft: LlamaModel, params: list[SamplingParams],
               prompt_lookup: int | None = None) -> list[list[int]]:
    """One sequence per params, decoded together by the SD decoder, each with its own seed."""
    return tiny_outputs(sd_decoder(target, draft, TINY_K, prompt_lookup), params)


def tiny_outputs(decoder, params: list[SamplingParams]) -> list[list[int]]:
    """One sequence per params on the tiny prompts, decoded together, each with its own seed."""
    seqs = [Sequence(i, prompt, p, []) for i, (prompt, p) in enumerate(zip(tiny_prompts(len(params)), params))]
    decoder.reserve(len(seqs), len(PROMPT) + 1 + NEW + decoder.lookahead)
    decoder.prefill(seqs)
    while active := [s for s in seqs if not s.finished]:
        decoder.step(active)
    return [s.output_ids for s in seqs]


def sampled(temperature: float, rows: int = ROWS, **options) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=NEW, seed=i, **options) for i in range(rows)]


def sd_pvalue(target: LlamaModel, draft: LlamaModel, params: list[SamplingParams],
              prompt_lookup: int | None = None) -> float:
    outputs = sd_outputs(target, draft, params, prompt_lookup)
    return ks_pvalue(teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params))


def test_sd_decoder_is_exact(target, draft):
    assert sd_pvalue(target, draft, sampled(0.7)) > ALPHA


def test_sd_decoder_is_exact_with_top_k_and_top_p(target):
    params = sampled(0.8, top_k=5)[::2] + sampled(1.0, top_p=0.8)[1::2]
    assert sd_pvalue(target, sharpened_target(), params) > ALPHA


def test_sd_decoder_is_exact_with_a_reduced_draft_head(target):
    """The draft samples over its head rows only; the target still reaches every token."""
    assert sd_pvalue(target, tiny_model(seed=11, layers=1, head_token_ids=REDUCED_HEAD), sampled(1.0)) > ALPHA


def test_sd_decoder_is_exact_with_an_int4_target():
    assert sd_pvalue(*int4_pair(), sampled(1.0)) > ALPHA


def test_sd_decoder_check_catches_a_broken_rule_with_an_int4_target(monkeypatch):
    monkeypatch.setattr(verification, "verify", residual_is_p)
    assert sd_pvalue(*int4_pair(), sampled(1.0)) < ALPHA


def test_sd_decoder_is_exact_with_prompt_lookup(target, draft):
    """A one-token match is common in this 8-token vocabulary: lookups and drafts mix."""
    assert sd_pvalue(target, draft, sampled(1.0), prompt_lookup=1) > ALPHA


def test_prompt_lookup_check_catches_a_misreported_proposal(target, draft, monkeypatch):
    """Lookups reported as uniform proposals instead of the point masses they are."""
    uniform = lambda tokens, v: torch.full((*tokens.shape, v), 1.0 / v)  # noqa: E731
    monkeypatch.setattr(verification, "point_masses", uniform)
    monkeypatch.setattr(drafters, "point_masses", uniform)
    assert sd_pvalue(target, draft, sampled(1.0), prompt_lookup=1) < ALPHA


@pytest.mark.parametrize("rule", [residual_is_p, bonus_from_residual])
def test_sd_decoder_check_catches_broken_rules(target, rule, monkeypatch):
    monkeypatch.setattr(verification, "verify", rule)
    assert sd_pvalue(target, sharpened_target(), sampled(1.0)) < ALPHA


def test_sd_decoder_check_catches_a_bias_of_two_percent(target, monkeypatch):
    """q^1.1 reported for q moves the first token of each round by about 0.02 in TV (measured)."""
    rule = MisreportedProposal(1.1)
    monkeypatch.setattr(verification, "verify", rule)
    assert sd_pvalue(target, sharpened_target(), sampled(1.0)) < ALPHA
    assert 0.015 < rule.mean_tv < 0.03


def test_sd_decoder_is_exact_when_every_draft_is_accepted(target):
    """The target as its own draft: every round ends in the bonus after K accepted drafts."""
    assert sd_pvalue(target, tiny_model(seed=10, layers=2), sampled(1.0, rows=4_000)) > ALPHA


def test_sd_decoder_check_catches_a_bonus_from_the_residual_after_full_acceptance(target, monkeypatch):
    monkeypatch.setattr(verification, "verify", bonus_from_residual)
    assert sd_pvalue(target, tiny_model(seed=10, layers=2), sampled(1.0, rows=4_000)) < ALPHA


# --- rows of one batch with very different settings --------------------------------------------------

def mixed_settings(rows: int) -> list[SamplingParams]:
    """T 0.5 with top-k 3 beside T 1.5, alternating: a row verified with its neighbour's
    parameters commits from a very different distribution."""
    sharp, flat = dict(temperature=0.5, top_k=3), dict(temperature=1.5)
    return [SamplingParams(max_tokens=NEW, seed=i, **(sharp if i % 2 == 0 else flat)) for i in range(rows)]


def tiled(self, n: int) -> WarpParams:
    """Broken: the batch's parameters tiled n times (repeat) where each row's should be
    repeated n times in a row (repeat_interleave): the target's distributions of a row's K + 1
    positions are warped with the parameters of other rows."""
    return replace(self, temperature=self.temperature.repeat(n), top_k=self.top_k.repeat(n),
                   top_p=self.top_p.repeat(n))


@pytest.mark.parametrize("broken", [False, True])
def test_sd_decoder_check_of_rows_with_very_different_settings(target, draft, broken, monkeypatch):
    """Exact with each row's own parameters; caught (p = 1e-25) with a neighbour's."""
    if broken:
        monkeypatch.setattr(WarpParams, "repeat", tiled)
    params = mixed_settings(2_000)
    assert (sd_pvalue(target, draft, params) > ALPHA) != broken


# --- top-p against a nucleus computed apart from warp -------------------------------------------------

def nucleus_without_the_crossing_token(scaled, top_k, top_p):
    """Broken: top-p keeps the tokens whose mass *with* them stays below top_p, dropping the one
    that crosses it (the most likely token is kept)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    sorted_logits = sorted_logits.masked_fill((top_k[:, None] > 0) & (ranks >= top_k[:, None]), float("-inf"))
    mass_with = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    sorted_logits = sorted_logits.masked_fill((mass_with >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


@pytest.mark.parametrize("broken", [False, True])
def test_sd_decoder_check_of_top_p_against_a_nucleus_computed_apart(target, draft, broken, monkeypatch):
    """The teacher-forced PIT with `warp` as reference cannot see a bug in warp (both sides share
    it): here the reference is `reference_warp`, written from the definitions. A nucleus that
    drops the token crossing top_p is caught at p = 1e-48."""
    if broken:
        monkeypatch.setattr(sampler, "_mask_top_k_top_p", nucleus_without_the_crossing_token)
    params = [SamplingParams(max_tokens=NEW, seed=i, top_p=(0.5, 0.8, 0.95)[i % 3]) for i in range(1_000)]
    outputs = sd_outputs(target, draft, params)
    pits = teacher_forced_pit(target, tiny_prompts(len(params)), outputs, params, warp_rows=reference_warp)
    assert (ks_pvalue(pits) > ALPHA) != broken
