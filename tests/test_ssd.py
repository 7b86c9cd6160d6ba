"""SSD is exact on every path a round can take: a cache hit (with Saguaro sampling at several
C), a miss answered by the neural backup, a miss answered by the fast backup; and it survives
the loss of its draft worker without losing or repeating a token.

Statistical checks run the speculator in-process (same protocol messages, no overlap) so the
negative controls can break it; greedy equality and the fault test use a real worker process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import statistics
import time
import warnings
from dataclasses import replace

import pytest
import torch

from conftest import NEW_TOKENS
import netns
from drafts import InProcessDraft, ssd_decoder, ssd_of, worker_config, worker_of
from saguaro import SamplingParams
import saguaro.engine.verifier as verification
from saguaro.engine.loop import Engine
from saguaro.engine.sequence import Sequence
from saguaro.models import hub
from saguaro.models.llama import scatter_to_vocab
from saguaro.models.checkpoint import save_checkpoint
from saguaro.engine.decoder import Decoder
from saguaro.engine.sampler import sample
from saguaro.engine.rejection import verify
from saguaro.speculation.build import ar_decoder
from saguaro.speculation.worker import speculator
from saguaro.speculation.remote import client as remote_client
from saguaro.speculation.remote.client import DraftClient
from saguaro.speculation.worker.speculator import saguaro_sigma
from saguaro.speculation.protocol import DraftUnavailable, SparseProbs, dense_probs
from saguaro.speculation.remote import proposer as remote_proposer
from saguaro.speculation.local import drafters
from saguaro.speculation.worker.cache import SpeculationCache
from saguaro.engine.sampler import uniforms
from saguaro.speculation.remote.proposer import SSDStats
from stats import MisreportedProposal, ks_pvalue, proposal_pvalues, repeat_pvalue, sharpen, teacher_forced_pit
from test_exactness import ALPHA, PROMPT, REDUCED_HEAD, TINY_V, bonus_from_residual, residual_is_p, tiny_model

ROWS = 4_000
SSD_K = 1  # with 3 new tokens, a first-round rejection leaves a second round to the tested path
NEW = 3
ALL_CANDIDATES = [TINY_V - 1] * (SSD_K + 1)  # every possible bonus is cached: every round hits
NO_CANDIDATES = [0] * (SSD_K + 1)  # nothing is cached: every round misses

PATHS = {  # name: (fan_out, backup, saguaro_c, prompt_lookup)
    "hit-c1": (ALL_CANDIDATES, "neural", 1.0, None),
    "hit-c0.5": (ALL_CANDIDATES, "neural", 0.5, None),
    "hit-c0.1": (ALL_CANDIDATES, "neural", 0.1, None),
    "miss-neural": (NO_CANDIDATES, "neural", 1.0, None),
    "miss-fast": (NO_CANDIDATES, "fast", 1.0, None),
    "lookup": (NO_CANDIDATES, "neural", 1.0, 1),  # a one-token match is common with 8 tokens
    # Saguaro sampling that moves the proposal: C = 0.1 on the top 2 of 8 tokens (with all 7
    # candidates cached, sigma is nearly q); hits and neural backups mix
    "mixed-c0.1": ([2, TINY_V - 1], "neural", 0.1, None),
    "lookup-hit": (ALL_CANDIDATES, "neural", 1.0, 1),  # a lookup replaces a cache hit
}
# K = 3 (the fan-out's length less one), outside the parametrized paths above
K3_PATHS = {"miss-neural-k3": ([0] * 4, "neural", 1.0, None), "hit-k3": ([TINY_V - 1] * 4, "neural", 1.0, None)}
K3_NEW = 1 + 2 * 4  # the first round's neural draft, then a hit's


@pytest.fixture(scope="module")
def draft_path():
    """The distilled draft shipped for the default model: right often, not always."""
    path = hub.default_draft(hub.DEFAULT_MODEL)
    assert path is not None
    return path


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_model(seed=10, layers=2)


def saved_draft(tmp_path_factory, name: str, draft) -> object:
    """A tiny draft as a checkpoint folder, which is what a worker loads."""
    folder = tmp_path_factory.mktemp(name)
    save_checkpoint(draft, folder, dtype=torch.float32, share_embeddings=False)
    return folder


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    return saved_draft(tmp_path_factory, "tiny-draft", tiny_model(seed=11, layers=1))


@pytest.fixture(scope="module")
def reduced_draft_dir(tmp_path_factory):
    """As the shipped draft: a reduced head, here 6 of the 8 tokens."""
    return saved_draft(tmp_path_factory, "reduced-draft", tiny_model(seed=11, layers=1, head_token_ids=REDUCED_HEAD))


def decode_all(decoder, seqs: list[Sequence]) -> None:
    """What LLM.generate does: prefill, then rounds until every sequence has finished."""
    decoder.prefill(seqs)
    while active := [s for s in seqs if not s.finished]:
        decoder.step(active)
        decoder.release([s for s in active if s.finished])


def ssd_decode(target, draft_dir, temperature: float, path: str, proposal_top: int = 64, rows: int = ROWS,
               new: int = NEW, options: list[dict] | None = None, step=None,
               client_type: type[InProcessDraft] = InProcessDraft) -> tuple[list[Sequence], Decoder]:
    """`rows` continuations of `new` tokens decoded in-process along `path`; K is the fan-out's
    length less one. Row i samples with options[i % len] (top_k, top_p) besides the
    temperature; step(decoder, seqs) runs each round if given."""
    fan_out, backup, c, prompt_lookup = PATHS[path] if path in PATHS else K3_PATHS[path]
    client = client_type(worker_config(str(draft_dir), "float32", len(fan_out) - 1, fan_out, c,
                                       prompt_lookup=prompt_lookup, proposal_top=proposal_top), None)
    decoder = ssd_decoder(target, client, backup)
    options = options or [{}]
    params = [SamplingParams(temperature=temperature, max_tokens=new, seed=i, **options[i % len(options)])
              for i in range(rows)]
    seqs = [Sequence(i, PROMPT, p, []) for i, p in enumerate(params)]
    decoder.reserve(rows, len(PROMPT) + new + decoder.lookahead)
    if step is None:
        decode_all(decoder, seqs)
    else:
        decoder.prefill(seqs)
        while active := [s for s in seqs if not s.finished]:
            step(decoder, active)
            decoder.release([s for s in active if s.finished])
    return seqs, decoder


def ssd_pvalue(target, draft_dir, temperature: float, path: str, **decode) -> tuple[float, Decoder]:
    """The KS p-value (tests/stats.py) of ssd_decode's continuations."""
    seqs, decoder = ssd_decode(target, draft_dir, temperature, path, **decode)
    pits = teacher_forced_pit(target, [PROMPT] * len(seqs), [s.output_ids for s in seqs], [s.params for s in seqs])
    return ks_pvalue(pits), decoder


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("path", list(PATHS))
def test_ssd_is_exact_on_every_path(tiny_target, tiny_draft_dir, path, temperature):
    pvalue, decoder = ssd_pvalue(tiny_target, tiny_draft_dir, temperature, path)
    assert pvalue > ALPHA
    stats = ssd_of(decoder).stats
    misses = stats.miss_lengths[PATHS[path][1]]
    if path == "lookup":
        assert len(stats.lookup_lengths) > ROWS // 10 and misses  # lookups and neural drafts mix
    elif path == "lookup-hit":
        assert stats.cache.lookup_hits > ROWS // 10  # lookups over cache hits
    elif path.startswith("mixed"):
        assert stats.hit_lengths and len(misses) > ROWS // 10
    elif path.startswith("hit"):
        assert len(stats.hit_lengths) > ROWS // 10 and not misses  # the path under test really ran
    else:
        assert len(misses) > ROWS // 10 and not stats.hit_lengths


@pytest.mark.parametrize("path", list(PATHS))
def test_ssd_check_catches_a_broken_acceptance_rule(tiny_target, tiny_draft_dir, path, monkeypatch):
    monkeypatch.setattr(verification, "verify", residual_is_p)
    pvalue, _ = ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, path)
    assert pvalue < ALPHA


def test_ssd_check_catches_lookups_reported_as_other_proposals(tiny_target, tiny_draft_dir, monkeypatch):
    uniform = lambda tokens, v: torch.full((*tokens.shape, v), 1.0 / v)  # noqa: E731
    monkeypatch.setattr(verification, "point_masses", uniform)
    monkeypatch.setattr(remote_proposer, "point_masses", uniform)
    pvalue, _ = ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, "lookup")
    assert pvalue < ALPHA


@pytest.mark.parametrize("path", ["hit-c1", "hit-c0.5"])
def test_ssd_check_catches_a_proposal_other_than_the_one_reported(tiny_target, tiny_draft_dir, path, monkeypatch):
    """The classic Saguaro-sampling bug: drafting from one distribution, verifying against another."""
    def sample_elsewhere(probs, u):
        return sample(saguaro_sigma(probs, probs.log(), top=2, c=0.1), u)

    monkeypatch.setattr(speculator, "sample", sample_elsewhere)
    pvalue, _ = ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, path)
    assert pvalue < ALPHA


@pytest.mark.parametrize("path", ["hit-c0.5", "miss-neural"])
def test_ssd_is_exact_with_a_reduced_draft_head(tiny_target, reduced_draft_dir, path):
    """The worker samples and sends distributions over its head rows only; the target widens
    them, and still reaches the tokens the draft cannot propose."""
    pvalue, decoder = ssd_pvalue(tiny_target, reduced_draft_dir, 1.0, path)
    assert pvalue > ALPHA
    stats = ssd_of(decoder).stats
    ran = stats.hit_lengths if path.startswith("hit") else stats.miss_lengths["neural"]
    assert len(ran) > ROWS // 10


@pytest.mark.parametrize("path", ["hit-c0.5", "miss-neural"])
def test_ssd_is_exact_when_the_worker_drafts_from_its_top_tokens(tiny_target, tiny_draft_dir, path, monkeypatch):
    """proposal_top = 2 of 8 tokens: the worker drafts from its 2 most likely tokens and sends
    them as (token, probability) pairs; the target rebuilds the proposal it was drawn from."""
    sent = []
    monkeypatch.setattr(SparseProbs, "dense", lambda self, dense=SparseProbs.dense: sent.append(self) or dense(self))
    pvalue, decoder = ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, path, proposal_top=2)
    assert pvalue > ALPHA
    assert sent and all(s.indices.shape[-1] == 2 for s in sent)


def test_ssd_check_catches_top_tokens_kept_without_renormalizing(tiny_target, tiny_draft_dir, monkeypatch):
    def unnormalized(probs, top):  # sampling normalizes by itself; the reported proposal is off
        values, indices = probs.topk(top, dim=-1)
        return torch.zeros_like(probs).scatter_(-1, indices, values)

    monkeypatch.setattr(speculator, "keep_top", unnormalized)
    pvalue, _ = ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, "hit-c1", proposal_top=2)
    assert pvalue < ALPHA


def test_ssd_check_catches_draft_distributions_placed_on_the_wrong_tokens(tiny_target, reduced_draft_dir,
                                                                           monkeypatch):
    def sorted_map(probs, token_ids, vocab_size, fill=0.0):
        return scatter_to_vocab(probs, token_ids.sort().values, vocab_size, fill)

    monkeypatch.setattr(remote_proposer, "scatter_to_vocab", sorted_map)
    pvalue, _ = ssd_pvalue(tiny_target, reduced_draft_dir, 1.0, "hit-c1")
    assert pvalue < ALPHA


# --- bugs the paths above cannot see (issue 34): each path that can, with its control -----------

def sigma_sampled_q_reported(monkeypatch, where: str) -> None:
    """Broken Saguaro sampling: drafts drawn from sigma but reported as the plain q, in the tree
    ("tree") or in the neural backup ("backup"); the other one drafts from q and reports it."""
    shaped = {}

    def plain(self, position, probs, logits):
        shaped.update(top=self.fan_out[position], c=self.saguaro_c)
        return speculator.keep_top(probs, self.proposal_top)

    def from_sigma(probs, u):
        return sample(saguaro_sigma(probs, probs.log(), shaped["top"], shaped["c"]), u)

    monkeypatch.setattr(speculator.Speculator, "_sigma", plain)
    monkeypatch.setattr(speculator if where == "tree" else drafters, "sample", from_sigma)


# Saguaro sampling over many hits: at 3 tokens a row too few tokens come from the tree to see it
# drafted from one distribution and reported as another (p = 0.005); at 17, p = 4e-20 (the
# neural backup's: 1e-52).
SIGMA_ROWS, SIGMA_NEW = 2_000, 17


def test_ssd_is_exact_with_saguaro_sampling_over_many_hits(tiny_target, tiny_draft_dir):
    pvalue, decoder = ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, "mixed-c0.1", rows=SIGMA_ROWS, new=SIGMA_NEW)
    assert pvalue > ALPHA
    assert len(ssd_of(decoder).stats.hit_lengths) > 2 * SIGMA_ROWS


@pytest.mark.parametrize("where", ["tree", "backup"])
def test_ssd_check_catches_saguaro_sampling_reported_as_q(tiny_target, tiny_draft_dir, where, monkeypatch):
    sigma_sampled_q_reported(monkeypatch, where)
    assert ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, "mixed-c0.1", rows=SIGMA_ROWS, new=SIGMA_NEW)[0] < ALPHA


def lookup_keeps_branch_probs(monkeypatch) -> None:
    """Broken: a lookup replaces a cache hit's tokens, but the branch's distributions are sent."""
    taken, take, speculate = {}, SpeculationCache.take, speculator.Speculator.speculate

    def recording(self, seq_id, outcome):
        taken[seq_id] = take(self, seq_id, outcome)
        return taken[seq_id]

    def keeping(self, seq_ids, outcomes, backup, features=None):
        taken.clear()
        replies = speculate(self, seq_ids, outcomes, backup, features)
        for sid, reply in zip(seq_ids, replies):
            if reply.lookup and taken.get(sid) is not None:
                reply.probs = taken[sid].probs
        return replies

    monkeypatch.setattr(SpeculationCache, "take", recording)
    monkeypatch.setattr(speculator.Speculator, "speculate", keeping)


def test_ssd_check_catches_a_lookup_sent_with_its_hits_distributions(tiny_target, tiny_draft_dir, monkeypatch):
    lookup_keeps_branch_probs(monkeypatch)
    assert ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, "lookup-hit")[0] < ALPHA


TOP_OPTIONS = [{"top_k": 2}, {"top_p": 0.3}]  # what a misreport of the truncation moves the most
TOP_ROWS = 8_000  # the control's p: 3e-6 at 4,000 rows, too near ALPHA; 9e-12 at 8,000


def test_ssd_neural_backup_is_exact_with_top_k_and_top_p(tiny_target, tiny_draft_dir):
    pvalue, decoder = ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, "miss-neural-k3", rows=TOP_ROWS, new=K3_NEW,
                                 options=TOP_OPTIONS)
    assert pvalue > ALPHA
    assert len(ssd_of(decoder).stats.miss_lengths["neural"]) > TOP_ROWS // 10


def backup_reports_temperature_only(monkeypatch) -> None:
    """Broken: the neural backup drafts from the top-k / top-p distribution but reports the
    softmax at the temperature alone."""
    draft = drafters.autoregressive_draft

    def misreporting(model, cache, rows, chunks, starts, params, k, u, reshape=None, features=None, constrain=None):
        reported = []

        def recording(i, q, logits):
            reported.append(torch.softmax(logits.float() / params.temperature[:, None], -1))
            return q if reshape is None else reshape(i, q, logits)

        tokens, probs, hidden = draft(model, cache, rows, chunks, starts, params, k, u, recording, features, constrain)
        return tokens, None if probs is None else torch.stack(reported, 1), hidden

    monkeypatch.setattr(drafters, "autoregressive_draft", misreporting)


def test_ssd_check_catches_top_k_and_top_p_misreported_by_the_neural_backup(tiny_target, tiny_draft_dir,
                                                                            monkeypatch):
    backup_reports_temperature_only(monkeypatch)
    pvalue, _ = ssd_pvalue(tiny_target, tiny_draft_dir, 1.0, "miss-neural-k3", rows=TOP_ROWS, new=K3_NEW,
                           options=TOP_OPTIONS)
    assert pvalue < ALPHA


@pytest.fixture(scope="module")
def twin_draft_dir(tmp_path_factory):
    """The target itself as draft: every draft is accepted, every round ends in the bonus after K."""
    return saved_draft(tmp_path_factory, "twin-draft", tiny_model(seed=10, layers=2))


TWIN_NEW = 1 + 2 * (SSD_K + 1)  # the first round's neural draft and bonus, then a hit's


def test_ssd_is_exact_when_every_draft_is_accepted(tiny_target, twin_draft_dir):
    pvalue, decoder = ssd_pvalue(tiny_target, twin_draft_dir, 1.0, "hit-c1", new=TWIN_NEW)
    assert pvalue > ALPHA
    assert sum(n == SSD_K + 1 for n in ssd_of(decoder).stats.hit_lengths) > ROWS // 2


def test_ssd_check_catches_a_bonus_from_the_residual_after_full_acceptance(tiny_target, twin_draft_dir,
                                                                          monkeypatch):
    monkeypatch.setattr(verification, "verify", bonus_from_residual)
    assert ssd_pvalue(tiny_target, twin_draft_dir, 1.0, "hit-c1", new=TWIN_NEW)[0] < ALPHA


# --- K = 3, nearly every round after the first a hit ---------------------------------------------------------

K3_ROWS = 500


def recorded_proposals(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each round's draft tokens and reported distributions, as verification gets them."""
    proposals = []

    def recording(draft_tokens, draft_probs, target_probs, u_accept, u_bonus):
        proposals.append((draft_tokens, draft_probs))
        return verify(draft_tokens, draft_probs, target_probs, u_accept, u_bonus)

    monkeypatch.setattr(verification, "verify", recording)
    return proposals


def one_uniform_per_branch(monkeypatch) -> None:
    """Broken: each cached branch draws every depth with the uniform of its first."""
    drawn = speculator.Speculator._uniforms

    def reused(self, seqs, n):
        u = drawn(self, seqs, n).view(len(seqs), -1, self.k)
        return u[:, :, :1].expand_as(u).reshape(len(seqs), n)

    monkeypatch.setattr(speculator.Speculator, "_uniforms", reused)


@pytest.mark.parametrize("broken", [False, True])
def test_ssd_check_of_cached_branches_drawing_each_depth_afresh(tiny_target, tiny_draft_dir, broken, monkeypatch):
    """The SSD paths above run at K = 1, where one uniform per branch changes nothing. At K = 3
    with nearly every round after the first a hit, each cached draft's PIT under its reported
    distribution must be uniform and independent of the one before it (stats.proposal_pvalues);
    a uniform reused along the branch is caught at p = 1e-186 from 500 rows."""
    proposals = recorded_proposals(monkeypatch)
    if broken:
        one_uniform_per_branch(monkeypatch)
    _, decoder = ssd_decode(tiny_target, tiny_draft_dir, 1.0, "hit-k3", rows=K3_ROWS, new=K3_NEW)
    stats = ssd_of(decoder).stats
    assert len(stats.hit_lengths) > 4 * K3_ROWS > 100 * len(stats.miss_lengths["neural"])
    hits = proposals[1:]  # the first round's is the neural backup's; later ones are hits but a few rows
    pvalues = proposal_pvalues(torch.cat([t for t, _ in hits]), torch.cat([q for _, q in hits]))
    assert (min(pvalues) > ALPHA) != broken, pvalues


def served_by_accepted_length(monkeypatch) -> None:
    """Broken: a hit is served the first branch drafted for its accepted length, whatever its
    bonus token."""
    take = SpeculationCache.take

    def by_length(self, seq_id, outcome):
        branches = self._requests.get(seq_id)
        if branches is not None and outcome is not None:
            outcome = next((o for o in branches.index if o[0] == outcome[0]), outcome)
        return take(self, seq_id, outcome)

    monkeypatch.setattr(SpeculationCache, "take", by_length)


@pytest.mark.parametrize("broken", [False, True])
def test_ssd_check_of_a_hit_serving_the_branch_of_its_own_outcome(tiny_target, twin_draft_dir, broken, monkeypatch):
    """A branch served for the right accepted length but another bonus token is still exact (it
    is verified against the distributions it was drawn from), so no test of the output's
    distribution can see it. Its drafts follow the wrong text, though: with the target as its
    own draft (q = p, every draft accepted) a hit's K drafts are accepted whole exactly when its
    branch was drafted after the outcome it serves. Broken: 69% of hits are (measured)."""
    if broken:
        served_by_accepted_length(monkeypatch)
    _, decoder = ssd_decode(tiny_target, twin_draft_dir, 1.0, "hit-k3", rows=K3_ROWS, new=K3_NEW)
    lengths = ssd_of(decoder).stats.hit_lengths
    assert len(lengths) > K3_ROWS * 0.9
    whole = sum(n == len(K3_PATHS["hit-k3"][0]) for n in lengths) / len(lengths)
    assert (whole > 0.99) != broken, whole


# Many rounds per row on a hit every round: what a random number used twice shows up in. The
# repeat statistic (tests/stats.py) sees a tree reseeded every fill at p = 1e-17 here; the pooled
# PIT at p = 0.01 (it needs 1,000 rows x 40 tokens for 4e-8).
REUSE_ROWS, REUSE_NEW = 500, 30


def ssd_pvalues(target, draft_dir, path: str, **decode) -> tuple[float, float, Decoder]:
    """The KS and repeat p-values (tests/stats.py) of ssd_decode's continuations at T = 1."""
    seqs, decoder = ssd_decode(target, draft_dir, 1.0, path, **decode)
    sampled = ([PROMPT] * len(seqs), [s.output_ids for s in seqs], [s.params for s in seqs])
    return ks_pvalue(teacher_forced_pit(target, *sampled)), repeat_pvalue(target, *sampled), decoder


def test_ssd_is_exact_over_many_rounds(tiny_target, tiny_draft_dir):
    ks, repeats, decoder = ssd_pvalues(tiny_target, tiny_draft_dir, "hit-c1", rows=REUSE_ROWS, new=REUSE_NEW)
    assert ks > ALPHA and repeats > ALPHA
    assert len(ssd_of(decoder).stats.hit_lengths) > 10 * REUSE_ROWS


def test_ssd_check_catches_a_tree_reseeded_every_fill(tiny_target, tiny_draft_dir, monkeypatch):
    """Broken: each fill draws its tree's uniforms from a generator seeded afresh from the request."""
    def reseeded(self, seqs, n):
        return uniforms([torch.Generator().manual_seed(s.seq_id) for s in seqs], n).to(self.draft.device)

    monkeypatch.setattr(speculator.Speculator, "_uniforms", reseeded)
    _, repeats, _ = ssd_pvalues(tiny_target, tiny_draft_dir, "hit-c1", rows=REUSE_ROWS, new=REUSE_NEW)
    assert repeats < ALPHA


# Across restarts: each worker answers one request, is lost at its second and replaced (in-process,
# through the pool's own restart), so every other round drafts from a new worker's first random
# numbers. Reused, they make drafts repeat: the repeat statistic sees it (p = 9e-23), the pooled
# PIT does not (p = 0.14).
RESTART_ROWS, RESTART_NEW = 4_000, 25


class ShortLivedDraft(InProcessDraft):
    """An in-process worker that is lost when asked for its `lifetime`-th speculation."""
    lifetime = 2

    def ask(self, request):
        self.asked = getattr(self, "asked", 0) + 1
        if self.asked >= self.lifetime:
            raise DraftUnavailable("lost on purpose")
        return super().ask(request)


def restarted_pvalues(target, draft_dir, monkeypatch, client_type: type[InProcessDraft]
                      ) -> tuple[float, float, Decoder]:
    """ssd_pvalues along the neural backup with client_type's workers, each round waiting for a
    lost worker's replacement, so that every replacement drafts."""
    monkeypatch.setattr(remote_client, "DraftClient", client_type)

    def step(decoder, active):
        lane = ssd_of(decoder).pool.lanes[0]
        if lane.restart is not None:
            lane.restart.result(timeout=60)
        decoder.step(active)

    with pytest.warns(RuntimeWarning, match="draft worker lost"):
        return ssd_pvalues(target, draft_dir, "miss-neural", rows=RESTART_ROWS, new=RESTART_NEW, step=step,
                           client_type=client_type)


def test_ssd_is_exact_across_worker_restarts(tiny_target, tiny_draft_dir, monkeypatch):
    ks, repeats, decoder = restarted_pvalues(tiny_target, tiny_draft_dir, monkeypatch, ShortLivedDraft)
    assert ks > ALPHA and repeats > ALPHA
    assert ssd_of(decoder).pool.restarts > 5  # many replacements drafted


class ForgetfulDraft(ShortLivedDraft):
    """Broken: every replacement counts itself the first worker, and so repeats its random streams."""

    def __init__(self, config, embeddings, target_device="cpu", incarnation=0):
        super().__init__(config, embeddings, target_device, 0)


def test_ssd_check_catches_a_restarted_worker_reusing_its_random_streams(tiny_target, tiny_draft_dir, monkeypatch):
    ks, repeats, _ = restarted_pvalues(tiny_target, tiny_draft_dir, monkeypatch, ForgetfulDraft)
    assert repeats < ALPHA


# --- a real worker process at K = 3: the tree, the wire, mixed batches -------------------------

WORKER_K = 3
WORKER_NEW = 1 + 3 * (WORKER_K + 1)  # the first token, then three rounds of K drafts and a bonus
WORKER_FAN_OUT = [3, 3, 3, 4]  # most outcomes cached; the rest answered by the neural backup
WORKER_ROWS = 4_000
MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4),
         SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)]


@pytest.fixture(scope="module")
def peaked_draft_dir(tmp_path_factory):
    """The target with 1.5 times its logits: peaked proposals, whose misreports show, and
    often all accepted, so rounds hit the deep branches of the tree."""
    from test_exactness import sharpened_target

    return saved_draft(tmp_path_factory, "peaked-draft", sharpened_target())


def worker_prompts() -> list[list[int]]:
    return [PROMPT + [i % TINY_V] for i in range(WORKER_ROWS)]


def mixed_params() -> list[SamplingParams]:
    """Greedy and sampled requests (temperature, top-k, top-p) in turn, each with its seed."""
    return [replace(MIXED[i % len(MIXED)], max_tokens=WORKER_NEW, seed=i) for i in range(WORKER_ROWS)]


def sampled_params() -> list[SamplingParams]:
    """Temperature 1 everywhere, where a misreported proposal moves the output the most."""
    return [SamplingParams(temperature=1.0, max_tokens=WORKER_NEW, seed=i) for i in range(WORKER_ROWS)]


def worker_outputs(target, draft_dir, params: list[SamplingParams]) -> tuple[list[list[int]], SSDStats]:
    """One batch decoded by SSD with its draft in a worker process."""
    config = worker_config(str(draft_dir), "float32", WORKER_K, WORKER_FAN_OUT, timeout_s=300)
    decoder = ssd_decoder(target, DraftClient(config, None), "neural")
    try:
        seqs = [Sequence(i, prompt, p, []) for i, (prompt, p) in enumerate(zip(worker_prompts(), params))]
        decoder.reserve(len(seqs), len(PROMPT) + 1 + WORKER_NEW + decoder.lookahead)
        decode_all(decoder, seqs)
    finally:
        decoder.close()
    return [s.output_ids for s in seqs], ssd_of(decoder).stats


def worker_pvalue(target, draft_dir, params: list[SamplingParams]) -> tuple[float, list[list[int]], SSDStats]:
    outputs, stats = worker_outputs(target, draft_dir, params)
    return ks_pvalue(teacher_forced_pit(target, worker_prompts(), outputs, params)), outputs, stats


# SSD at temperature > 0 does not repeat from its seeds (timing decides hit or backup): an exact
# decoder fails each statistical test below with probability WORKER_ALPHA, by chance. The 0.02-TV
# control gave p = 2.5e-6 at 3000 rows; KS's log p grows about linearly with the rows.
WORKER_ALPHA = 1e-4

def test_worker_ssd_is_exact_in_mixed_batches(tiny_target, peaked_draft_dir):
    pvalue, outputs, stats = worker_pvalue(tiny_target, peaked_draft_dir, mixed_params())
    assert pvalue > WORKER_ALPHA
    greedy = [i for i, p in enumerate(mixed_params()) if p.greedy]
    reference = ar_decoder(tiny_target)
    seqs = [Sequence(i, worker_prompts()[i], mixed_params()[i], []) for i in greedy]
    reference.reserve(len(seqs), len(PROMPT) + 1 + WORKER_NEW + reference.lookahead)
    decode_all(reference, seqs)
    assert [outputs[i] for i in greedy] == [s.output_ids for s in seqs]
    assert len(stats.hit_lengths) > WORKER_ROWS and stats.miss_lengths["neural"]  # cached branches ran ...
    assert sum(n == WORKER_K + 1 for n in stats.hit_lengths) > WORKER_ROWS // 10  # ... to their full depth


def sharpen_cached_proposals(monkeypatch, power: float) -> None:
    """Broken: the proposals of cache hits arrive as q^power (renormalised) while their tokens
    were drawn from q; the target verifies against the wrong distribution."""
    answer = DraftClient.answer

    def misreporting(self, asked, patient=False):
        spec = answer(self, asked, patient)
        for request in spec.requests:
            if request.hit and request.probs is not None:
                request.probs = sharpen(dense_probs(request.probs), power)
        return spec

    monkeypatch.setattr(DraftClient, "answer", misreporting)


def test_worker_check_catches_sharpened_proposals_of_cached_branches(tiny_target, peaked_draft_dir, monkeypatch):
    sharpen_cached_proposals(monkeypatch, 1.3)
    assert worker_pvalue(tiny_target, peaked_draft_dir, sampled_params())[0] < WORKER_ALPHA


def test_worker_check_catches_a_bias_of_two_percent(tiny_target, peaked_draft_dir, monkeypatch):
    """q^1.1 verified for q moves the first token of each round by about 0.02 in TV (measured)."""
    rule = MisreportedProposal(1.1)
    monkeypatch.setattr(verification, "verify", rule)
    assert worker_pvalue(tiny_target, peaked_draft_dir, sampled_params())[0] < WORKER_ALPHA
    assert 0.015 < rule.mean_tv < 0.03


# --- the real model and a real worker process ---------------------------------------------------

def real_ssd_decoder(llm, draft_dir, backup: str, budget: int = 4, prompt_lookup: int | None = None) -> Decoder:
    from saguaro.speculation.policy.planning import uniform_fan_out

    config = worker_config(str(draft_dir), "float32", 4, uniform_fan_out(budget, 4), cpus=None, timeout_s=60,
                          prompt_lookup=prompt_lookup)
    client = DraftClient(config, llm.target.embed_tokens.weight.detach())
    return ssd_decoder(llm.target, client, backup)


@pytest.fixture
def with_ssd(llm):
    """Swaps the shared LLM's decoder for an SSD one and restores it afterwards."""
    made = []
    with contextlib.ExitStack() as swapped:

        def install(decoder):
            made.append(decoder)
            swapped.enter_context(llm.decoding_with(Engine(decoder)))
            return llm

        yield install
    for decoder in made:
        decoder.close()


@pytest.mark.parametrize("batch, count, backup", [(1, 4, "neural"), (4, 12, "neural"), (4, 12, "fast")])
def test_ssd_greedy_equals_ar(with_ssd, llm, draft_path, prompts, ar_greedy, backup, batch, count):
    ssd_llm = with_ssd(real_ssd_decoder(llm, draft_path, backup))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    outputs = []
    for i in range(0, count, batch):
        outputs += ssd_llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    mismatches = [i for i, out in enumerate(outputs) if out.token_ids != ar_greedy[i]]
    assert not mismatches, f"SSD differs from AR on prompts {mismatches}"
    stats = ssd_of(ssd_llm.decoder).stats
    summary = stats.summary()
    assert summary["cache_hit_rate"] is not None and 0 < summary["cache_hit_rate"]
    misses = sum(len(v) for v in stats.miss_lengths.values())  # every miss has its cause
    assert misses > 0 and sum(summary[f"misses_{c}"] for c in remote_proposer.MISS_CAUSES) == misses


def test_ssd_with_prompt_lookup_equals_ar(with_ssd, llm, draft_path, prompts, ar_greedy):
    ssd_llm = with_ssd(real_ssd_decoder(llm, draft_path, "fast", prompt_lookup=2))
    outputs = []
    for i in range(0, 8, 4):
        outputs += ssd_llm.generate(prompts[i:i + 4], SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                                    use_tqdm=False)
    mismatches = [i for i, out in enumerate(outputs) if out.token_ids != ar_greedy[i]]
    assert not mismatches, f"SSD with prompt lookup differs from AR on prompts {mismatches}"
    assert ssd_of(ssd_llm.decoder).stats.summary()["lookup_rate"] > 0


FAULT_AFTER_ROUNDS = 4  # SSD rounds before the fault: the worker's reply times are measured by then
FAULT_TOKENS = 40
RESUMED_TOKENS = 16


@pytest.fixture(scope="module")
def ar_reference(llm, prompts) -> list[list[int]]:
    """AR greedy continuations of the six prompts the fault test decodes."""
    params = SamplingParams(temperature=0, max_tokens=FAULT_TOKENS)
    return [o.token_ids for o in llm.generate(prompts[:6], params, use_tqdm=False)]


@pytest.mark.parametrize("sig, temperature", [(signal.SIGSTOP, 0.0), (signal.SIGKILL, 0.0), (signal.SIGSTOP, 0.7),
                                              (signal.SIGKILL, 0.7)],
                         ids=["stop-greedy", "kill-greedy", "stop-t0.7", "kill-t0.7"])
def test_a_lost_draft_worker_stalls_briefly_and_is_replaced(with_ssd, llm, draft_path, prompts, ar_reference, sig,
                                                            temperature):
    """A worker that dies (SIGKILL) or stops answering (SIGSTOP) in the middle of a batch: the
    batch goes on within seconds, loses and repeats nothing (greedy: equal to AR), a new worker
    takes over and the next batch hits its cache again."""
    decoder = real_ssd_decoder(llm, draft_path, "neural")
    ssd_llm = with_ssd(decoder)
    ssd, pool = ssd_of(decoder), ssd_of(decoder).pool
    worker = worker_of(decoder).process
    streamed, rounds_ended, fault = {}, [], []
    step = decoder.step

    def timed_step(seqs) -> None:
        step(seqs)
        rounds_ended.append(time.perf_counter())

    decoder.step = timed_step

    def fault_after_some_rounds(index: int, text: str) -> None:
        streamed[index] = streamed.get(index, "") + text
        if not fault and len(ssd.stats.verify_s) >= FAULT_AFTER_ROUNDS:
            os.kill(worker.pid, sig)
            fault.append(time.perf_counter())

    greedy = temperature == 0
    params = SamplingParams(temperature=temperature, max_tokens=FAULT_TOKENS, seed=None if greedy else 7,
                            ignore_eos=not greedy)
    try:
        with pytest.warns(RuntimeWarning, match="draft worker lost"):
            outputs = ssd_llm.generate(prompts[:3], params, use_tqdm=False, on_token=fault_after_some_rounds)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert fault and worker.poll() is not None  # a stopped worker was killed, not left behind
    rounds = [(b - a, b > fault[0]) for a, b in zip(rounds_ended, rounds_ended[1:])]
    stall = max(took for took, after in rounds if after)
    usual = statistics.median(took for took, after in rounds if not after)  # a busy machine's rounds are slow
    assert stall < 5.0 + 3 * usual, f"decoding stalled {stall:.1f} s after the worker was lost"
    assert all(streamed[i] == outputs[i].text for i in range(3))
    if greedy:
        assert [o.token_ids for o in outputs] == ar_reference[:3]
    else:
        assert all(len(o.token_ids) == FAULT_TOKENS for o in outputs)

    if pool.lanes[0].restart is not None:
        pool.lanes[0].restart.result(timeout=120)  # the new worker is ready (the first batch may have ended first)
    before = ssd_llm.metrics()
    outputs = ssd_llm.generate(prompts[3:6], dataclasses.replace(params, max_tokens=RESUMED_TOKENS), use_tqdm=False)
    after = ssd_llm.metrics()
    assert after["draft_losses"] == 1 and after["draft_restarts"] == 1
    assert worker_of(decoder).process.pid != worker.pid and pool.lanes[0].live
    assert after["cache_hits"] > before["cache_hits"]  # SSD resumed
    if greedy:
        assert [o.token_ids for o in outputs] == [t[:RESUMED_TOKENS] for t in ar_reference[3:6]]
    else:
        assert all(len(o.token_ids) == RESUMED_TOKENS for o in outputs)


# --- the worker process: ports, attaching, clean exits ---------------------------------------------

def greedy_tiny(decoder, count: int = 3) -> list[list[int]]:
    seqs = [Sequence(i, PROMPT + [i % TINY_V], SamplingParams(temperature=0, max_tokens=6), []) for i in range(count)]
    decoder.reserve(count, len(PROMPT) + 1 + 6 + decoder.lookahead)
    decode_all(decoder, seqs)
    return [s.output_ids for s in seqs]


SECRET = "a-secret-the-tests-share"  # a worker attached by address needs one
WITH_SECRET = {**os.environ, "SAGUARO_DRAFT_SECRET": SECRET}


def tiny_worker_config(draft_dir, address: str | None = None):
    return worker_config(str(draft_dir), "float32", 2, [1, 1, 1], address=address, timeout_s=30,
                         secret=SECRET if address else None)


SLOW_ROWS = 400  # a batch whose fills take the worker longer than the timeout below


@pytest.mark.parametrize("seen_running", [True, False])
def test_a_worker_slower_than_its_timeout_is_kept_while_it_runs(tiny_target, tiny_draft_dir, seen_running,
                                                                 monkeypatch):
    """On a loaded machine a worker may get little of a core for a second or more, past a
    timeout fitted to its quiet rounds. Here every answer takes longer than a 0.03 s timeout
    (three ticks of the CPU clock /proc counts in, so a running worker's time visibly grows): a
    worker seen running meanwhile (its CPU time grows) is kept; one seen not running (control:
    its CPU time read as constant, as a stopped or deadlocked worker's is) is lost."""
    if not seen_running:
        monkeypatch.setattr(remote_client, "cpu_seconds", lambda pid: 1.0)
    client = DraftClient(worker_config(str(tiny_draft_dir), "float32", 2, [7, 7, 7], timeout_s=30), None)
    monkeypatch.setattr(client, "timeout_s", lambda: 0.03)
    decoder = ssd_decoder(tiny_target, client, "neural")
    seqs = [Sequence(i, PROMPT + [i % TINY_V], SamplingParams(temperature=1.0, max_tokens=6, seed=i), [])
            for i in range(SLOW_ROWS)]
    decoder.reserve(SLOW_ROWS, len(PROMPT) + 8 + decoder.lookahead)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode_all(decoder, seqs)
    decoder.close()
    lost = ssd_of(decoder).pool.losses
    if seen_running:
        assert client.slow_answers > 0 and lost == 0, [str(w.message) for w in caught]
    else:
        assert lost > 0


def test_two_engines_share_a_host_and_leave_no_process(tiny_target, tiny_draft_dir):
    reference = greedy_tiny(ar_decoder(tiny_target))
    engines = [ssd_decoder(tiny_target, DraftClient(tiny_worker_config(tiny_draft_dir), None)) for _ in range(2)]
    assert worker_of(engines[0]).channel.port != worker_of(engines[1]).channel.port
    for engine in engines:
        assert greedy_tiny(engine) == reference
    processes = [worker_of(e).process for e in engines]
    for engine in engines:
        engine.close()
    assert all(p.poll() is not None for p in processes)


def test_a_worker_started_elsewhere_attaches_by_address(tiny_target, tiny_draft_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = subprocess.Popen([sys.executable, "-m", "saguaro.speculation.worker", "--connect", f"127.0.0.1:{port}"],
                              env=WITH_SECRET)
    try:
        engine = ssd_decoder(tiny_target, DraftClient(tiny_worker_config(tiny_draft_dir, f"127.0.0.1:{port}"), None))
        assert worker_of(engine).process is None and worker_of(engine).ready.pid == worker.pid
        assert greedy_tiny(engine) == greedy_tiny(ar_decoder(tiny_target))
        engine.close()
        assert worker.wait(timeout=10) == 0
    finally:
        if worker.poll() is None:
            worker.kill()


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_a_draft_on_another_host_attaches_over_the_network(tmp_path_factory, tiny_draft_dir):
    """The engine in one network namespace, the worker in another, joined by a veth pair: SSD
    greedy equals AR, and the messages crossed the veth."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    target_dir = saved_draft(tmp_path_factory, "tiny-target", tiny_model(seed=10, layers=2))
    prompts = [PROMPT + [i % TINY_V] for i in range(4)]
    with netns.two_hosts() as hosts:
        address = f"{hosts.target_ip}:29511"
        worker = subprocess.Popen(hosts.command(hosts.draft_ns, [sys.executable, "-m", "saguaro.speculation.worker",
                                                                  "--connect", address, "--timeout", "60"]),
                                  env=WITH_SECRET)
        try:
            engine = subprocess.run(hosts.command(hosts.target_ns, [
                sys.executable, str(Path(__file__).parent / "remote_engine.py"), str(target_dir), str(tiny_draft_dir),
                address, json.dumps(prompts)]), capture_output=True, text=True, timeout=180, env=WITH_SECRET)
            assert engine.returncode == 0, engine.stderr[-3000:]
            report = json.loads(engine.stdout.splitlines()[-1])
            assert worker.wait(timeout=30) == 0 and report["worker_pid"] == worker.pid
            veth_bytes = hosts.target_veth_bytes()
        finally:
            if worker.poll() is None:
                worker.kill()
    assert report["ssd"] == report["ar"]
    assert report["listening"] == [hosts.target_ip]  # the named address only, not every interface
    assert report["rounds"] > 0 and report["bytes_sent"] > 0 and report["bytes_received"] > 0
    assert veth_bytes > report["bytes_sent"] + report["bytes_received"]


def test_a_worker_attached_by_address_is_awaited_again_after_a_loss(tiny_target, tiny_draft_dir):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_worker = lambda: subprocess.Popen([sys.executable, "-m", "saguaro.speculation.worker",  # noqa: E731
                                             "--connect", f"127.0.0.1:{port}"], env=WITH_SECRET)
    reference = greedy_tiny(ar_decoder(tiny_target))
    workers = [start_worker()]
    try:
        engine = ssd_decoder(tiny_target, DraftClient(tiny_worker_config(tiny_draft_dir, f"127.0.0.1:{port}"), None))
        ssd = ssd_of(engine)
        workers[0].kill()
        with pytest.warns(RuntimeWarning, match="draft worker lost"):
            assert greedy_tiny(engine) == reference
        assert ssd.pool.lanes[0].restart is not None and ssd.pool.losses == 1
        workers.append(start_worker())  # the engine waits for one at the same address
        ssd.pool.lanes[0].restart.result(timeout=60)
        rounds = len(ssd.stats.verify_s)
        assert greedy_tiny(engine) == reference
        assert ssd.pool.restarts == 1 and worker_of(engine).ready.pid == workers[1].pid
        assert len(ssd.stats.verify_s) > rounds  # SSD rounds again
        engine.close()
        assert workers[1].wait(timeout=10) == 0
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()


def test_ssd_starts_where_cores_cannot_be_pinned(monkeypatch, draft_path):
    """macOS has no sched_getaffinity / sched_setaffinity: SSD splits thread counts instead."""
    from saguaro import LLM

    if len(os.sched_getaffinity(0)) != os.cpu_count() or os.cpu_count() < 2:
        pytest.skip("needs two or more cores, all of them usable here (the worker still pins on this OS)")
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.delattr(os, "sched_setaffinity")
    threads, cores = torch.get_num_threads(), os.cpu_count()
    llm = LLM("smollm2", draft=str(draft_path), method="ssd", dtype="float32", num_speculative_tokens=3)
    try:
        assert worker_of(llm.decoder).config.cpus == str(cores - 1)
        assert torch.get_num_threads() == cores - 1
        out = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        assert len(out.token_ids) == 8 and ssd_of(llm.decoder).pool.losses == 0
    finally:
        llm.close()
    assert torch.get_num_threads() == threads


# --- what the rendezvous exposes -----------------------------------------------------------------

def test_the_rendezvous_and_the_connection_listen_only_on_loopback_also_after_a_restart(tiny_target, tiny_draft_dir):
    """A local worker's TCPStore (no authentication) and its connection, on both sides, listen
    on 127.0.0.1 only, not on every interface; so does the next worker's."""
    engine = ssd_decoder(tiny_target, DraftClient(tiny_worker_config(tiny_draft_dir), None))
    reference = greedy_tiny(ar_decoder(tiny_target))
    ssd = ssd_of(engine)
    try:
        assert greedy_tiny(engine) == reference
        first = worker_of(engine).process
        seen = [netns.listening_addresses(os.getpid()), netns.listening_addresses(first.pid)]
        first.kill()
        with pytest.warns(RuntimeWarning, match="draft worker lost"):
            assert greedy_tiny(engine) == reference
        ssd.pool.lanes[0].restart.result(timeout=120)
        assert greedy_tiny(engine) == reference and ssd.pool.restarts == 1
        seen += [netns.listening_addresses(os.getpid()), netns.listening_addresses(worker_of(engine).process.pid)]
    finally:
        engine.close()
    assert seen[0], "the engine's rendezvous port was not found"
    assert all(addresses <= {"127.0.0.1"} for addresses in seen), f"listening on {seen}"


def test_a_worker_without_the_secret_is_refused(tiny_target, tiny_draft_dir):
    """A stranger who reaches the rendezvous cannot pose as the worker: a worker with a wrong
    secret (or none) is refused before the engine unpickles anything from it, and says why."""
    import socket
    import subprocess
    import sys

    from saguaro.speculation.protocol import DraftRefused

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "SAGUARO_DRAFT_SECRET"}
    for secret in ("not-the-secret", None):
        worker = subprocess.Popen([sys.executable, "-m", "saguaro.speculation.worker", "--connect",
                                   f"127.0.0.1:{port}", "--timeout", "60"], stderr=subprocess.PIPE, text=True,
                                  env=env if secret is None else {**env, "SAGUARO_DRAFT_SECRET": secret})
        try:
            config = tiny_worker_config(tiny_draft_dir, f"127.0.0.1:{port}")
            with pytest.raises(DraftRefused, match="secret"):
                DraftClient(replace(config, secret="the-secret"), None)
            assert worker.wait(timeout=30) != 0
            assert "secret" in worker.stderr.read()
        finally:
            if worker.poll() is None:
                worker.kill()


def worker_children() -> dict[int, str]:
    """This process's child processes running a draft worker, by pid, with their state (Z: a
    zombie, dead but not reaped)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == os.getpid() and (b"saguaro.speculation.worker" in cmdline or state == "Z"):
            children[int(entry)] = state
    return children


@pytest.mark.parametrize("when", ["importing", "loading"])
def test_a_replacement_killed_while_it_starts_is_replaced_at_once(with_ssd, llm, draft_path, prompts, monkeypatch,
                                                                    when):
    """The worker dies, then its replacement dies while it starts (importing, before it joins;
    or loading the draft, after the Hello): the engine notices each exit at once, reaps the
    child and starts another, which serves SSD within seconds, not at the 300 s rendezvous
    timeout; no zombie stays and the counters agree."""
    import threading

    from saguaro.speculation.protocol import Channel, Hello

    decoder = real_ssd_decoder(llm, draft_path, "neural")
    ssd_llm = with_ssd(decoder)
    pool = ssd_of(decoder).pool
    params = SamplingParams(temperature=0, max_tokens=8)
    ssd_llm.generate(prompts[:2], params, use_tqdm=False)
    hello_sent = threading.Event()
    send = Channel.send

    def noting_hellos(self, message, timeout_s=None):
        send(self, message, timeout_s)
        if isinstance(message, Hello) and message.incarnation == 1:
            hello_sent.set()

    monkeypatch.setattr(Channel, "send", noting_hellos)
    first = worker_of(decoder).process
    replacements = []

    def kill_the_replacement() -> None:
        """Kills the first worker's replacement as soon as it starts, or once it got its Hello."""
        end = time.perf_counter() + 60
        while not (started := set(worker_children()) - {first.pid}) and time.perf_counter() < end:
            time.sleep(0.005)
        if started:
            replacements.append(started.pop())
            if when == "loading":
                hello_sent.wait(timeout=60)
            os.kill(replacements[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_the_replacement)
    killer.start()
    first.kill()
    killed = time.perf_counter()
    deadline = killed + 60
    with pytest.warns(RuntimeWarning, match="draft worker lost"):
        ssd_llm.generate(prompts[:1], params, use_tqdm=False)  # notices the loss; the replacement starts
    killer.join()
    assert replacements, "no replacement was started"
    second = replacements[0]
    if when == "loading":
        assert hello_sent.is_set(), "the replacement never got its Hello"
    while not pool.live and time.perf_counter() < deadline:
        time.sleep(0.05)
    took = time.perf_counter() - killed
    assert pool.live, "no worker serves SSD 60 s after the loss"
    third = worker_of(decoder).process
    assert third.pid not in (first.pid, second)
    assert took < 30, f"a third worker serves only {took:.1f} s after the first was killed"
    before = ssd_llm.metrics()
    ssd_llm.generate(prompts[2:4], params, use_tqdm=False)
    after = ssd_llm.metrics()
    assert after["cache_hits"] > before["cache_hits"]  # SSD resumed
    assert after["draft_losses"] == after["draft_restarts"] == 1
    children = worker_children()  # one snapshot: a live worker's state changes between reads
    assert set(children) == {third.pid} and "Z" not in children.values()


def test_the_wire_carries_messages_of_every_length_whole_and_in_order():
    """Over the TCP connection a message goes as its length and its bytes: lengths from empty to
    far past a socket buffer arrive whole, in order, and the byte counts are what crossed."""
    import pickle
    import threading

    from saguaro.speculation.protocol import FRAME_BYTES, Channel

    engine = Channel("127.0.0.1", 0, 0, timeout_s=30)
    worker = Channel("127.0.0.1", engine.port, 1, timeout_s=30)
    joined = threading.Thread(target=worker.connect)
    joined.start()
    engine.connect()
    joined.join()
    messages = [bytes([n % 251]) * n for n in range(FRAME_BYTES - 40, FRAME_BYTES + 8)] + [b"y" * 3_000_000, b""]
    echo = threading.Thread(target=lambda: [worker.send(worker.recv(timeout_s=30)) for _ in messages])
    echo.start()
    for message in messages:
        engine.send(message, timeout_s=30)
        assert engine.recv(timeout_s=30) == message
    echo.join()
    assert engine.bytes_sent == engine.bytes_received == sum(8 + len(pickle.dumps(m, protocol=5)) for m in messages)
    engine.close()
    worker.close()
