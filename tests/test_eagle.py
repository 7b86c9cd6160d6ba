"""EAGLE-style drafts read the target's hidden states: SD, auto and SSD must hand the draft the
right ones (h_{t-1} with token t) and stay exact. Tiny random-weight models, in seconds."""
from __future__ import annotations

import itertools

import pytest
import torch

from drafts import InProcessDraft, drafter_of, sd_decoder, ssd_decoder, ssd_of, worker_config
from saguaro.config import SpeculativeConfig
from saguaro.engine.decoder import Decoder
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.models.config import ModelConfig
from saguaro.models.eagle import EagleDraft
from saguaro.models.kv_cache import KVCache
from saguaro.models.checkpoint import load_checkpoint
from saguaro.speculation.build import ar_decoder, auto_decoder
from saguaro.speculation.local.drafters import sd_drafter
from test_exactness import TINY_V, tiny_model
from test_ssd import ALPHA, NO_CANDIDATES, SSD_K, decode_all, saved_draft, ssd_pvalue

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [2, 2, 2, 2, 2, 1]]
K = 3


def tiny_eagle(seed: int = 3) -> EagleDraft:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=TINY_V, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, eagle=True)
    draft = EagleDraft(config).eval().requires_grad_(False)
    draft.lm_head.weight.mul_(3)
    return draft


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=10, layers=2)


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory):
    return saved_draft(tmp_path_factory, "eagle-draft", tiny_eagle())


@torch.no_grad()
def first_choices(target, draft, tokens: list[int], features_from_target: bool = True) -> list[int]:
    """The draft's greedy guess of token t+1 at every t, over the whole text at once, reading the
    target's hidden state at t-1 (or zeros: the negative control)."""
    n = len(tokens)
    ids, positions = torch.tensor([tokens]), torch.arange(n)[None]
    hidden = target(ids, positions, KVCache(target.config, 1, n, torch.float32))
    features = torch.cat((torch.zeros_like(hidden[:, :1]), hidden[:, :-1]), dim=1)
    if not features_from_target:
        features = torch.zeros_like(features)
    out = draft(ids, positions, KVCache(draft.config, 1, n, torch.float32), features=features)
    return draft.head_logits(out).argmax(-1)[0].tolist()


def greedy(decoder, prompts=PROMPTS) -> list[Sequence]:
    seqs = [Sequence(i, p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), [])
            for i, p in enumerate(prompts)]
    decoder.reserve(len(seqs), 64)
    decode_all(decoder, seqs)
    return seqs


def proposals_match(target, draft, seqs, proposed, features_from_target=True) -> bool:
    """Each round's first draft token is the draft's guess after the committed text."""
    for seq_id, length, token in proposed:
        tokens = seqs[seq_id].token_ids
        if first_choices(target, draft, tokens, features_from_target)[length - 1] != token:
            return False
    return True


def auto_after_ar_rounds(target, draft, k: int) -> Decoder:
    """auto whose first two rounds are AR: the drafter first runs each prompt after them, with
    the hidden states the target kept meanwhile."""
    decoder = auto_decoder(target, sd_drafter(draft, SpeculativeConfig(num_speculative_tokens=k, prompt_lookup=0)))
    choices = itertools.chain([0, 0], itertools.cycle([k, 1, 0]))
    controller = decoder.policy.controller
    controller.choose = lambda batch, can_try=True: controller.pick(next(choices))
    return decoder


@pytest.mark.parametrize("make_decoder", [sd_decoder, auto_after_ar_rounds])
def test_sd_drafts_from_the_targets_hidden_states(target, make_decoder):
    draft = tiny_eagle()
    decoder = make_decoder(target, draft, K)
    proposed = []
    drafter = drafter_of(decoder)
    propose = drafter.propose

    def recording(seqs):
        proposal = propose(seqs)
        proposed.extend((s.seq_id, len(s), t) for s, t in zip(seqs, proposal.tokens[:, 0].tolist()))
        return proposal

    drafter.propose = recording
    seqs = greedy(decoder)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in greedy(ar_decoder(target))]
    assert len(proposed) > len(PROMPTS) * 3
    assert proposals_match(target, draft, seqs, proposed)
    assert not proposals_match(target, draft, seqs, proposed, features_from_target=False)  # the check can fail


def test_ssd_worker_gets_the_targets_hidden_states(target, eagle_dir):
    """Every round misses (nothing cached), so each speculation is the neural backup's,
    drafted after the committed text from the features the target sent."""
    client = InProcessDraft(worker_config(str(eagle_dir), "float32", SSD_K, NO_CANDIDATES, 1.0), None)
    assert client.ready.reads_features
    decoder = ssd_decoder(target, client, backup="neural")
    proposed = []
    ask = client.ask

    def recording(request):
        reply = ask(request)
        proposed.extend((sid, len(seq_by_id[sid]), r.tokens[0]) for sid, r in zip(request.seq_ids, reply.requests))
        return reply

    client.ask = recording
    seq_by_id = {}
    prefill = decoder.prefill

    def remember(seqs):
        seq_by_id.update({s.seq_id: s for s in seqs})
        prefill(seqs)

    decoder.prefill = remember
    seqs = greedy(decoder)
    draft = load_checkpoint(eagle_dir)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in greedy(ar_decoder(target))]
    assert proposals_match(target, draft, seqs, proposed)
    assert not proposals_match(target, draft, seqs, proposed, features_from_target=False)


@pytest.mark.parametrize("backup", ["neural", "fast"])
def test_ssd_with_an_eagle_draft_equals_ar_when_greedy(target, eagle_dir, backup):
    fan_out = [TINY_V - 1] * (K + 1)  # every outcome cached: every round after the first hits
    decoder = ssd_decoder(target, InProcessDraft(worker_config(str(eagle_dir), "float32", K, fan_out, 1.0), None), backup)
    seqs = greedy(decoder)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in greedy(ar_decoder(target))]
    stats = ssd_of(decoder).stats
    assert stats.hit_lengths and not stats.miss_lengths[backup]


@pytest.mark.parametrize("path", ["hit-c0.5", "miss-neural"])
def test_ssd_with_an_eagle_draft_is_exact(target, eagle_dir, path):
    pvalue, _ = ssd_pvalue(target, eagle_dir, 0.7, path)
    assert pvalue > ALPHA


def test_features_cross_the_wire_to_a_worker_process(target, eagle_dir):
    from saguaro.speculation.remote.client import DraftClient

    config = worker_config(str(eagle_dir), "float32", K, [TINY_V - 1] * (K + 1), timeout_s=30)
    decoder = ssd_decoder(target, DraftClient(config, None), backup="neural")
    try:
        assert [s.output_ids for s in greedy(decoder)] == [s.output_ids for s in greedy(ar_decoder(target))]
        assert ssd_of(decoder).stats.hit_lengths and ssd_of(decoder).pool.losses == 0
    finally:
        decoder.close()


def test_a_request_that_ends_at_prefill_does_not_break_the_worker(target, eagle_dir):
    """It never reaches the worker: a sequence is handed over at its first round, with the
    target's hidden states kept for it until then."""
    decoder = ssd_decoder(target, InProcessDraft(worker_config(str(eagle_dir), "float32", K, [1] * (K + 1), 1.0), None))
    seqs = [Sequence(i, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), [])
            for i, (p, n) in enumerate(zip(PROMPTS, (1, 12, 12)))]
    decoder.reserve(len(seqs), 64)
    decode_all(decoder, seqs)
    assert ssd_of(decoder).pool.losses == 0 and 0 not in ssd_of(decoder).outcomes
    assert [s.output_ids for s in seqs] == [s.output_ids[:n] for s, n in zip(greedy(ar_decoder(target)), (1, 12, 12))]


def test_sd_with_an_eagle_draft_is_exact(target, monkeypatch):
    import saguaro.engine.verifier as verification
    from test_exactness import residual_is_p, sampled, sd_pvalue

    assert sd_pvalue(target, tiny_eagle(), sampled(1.0)) > ALPHA
    monkeypatch.setattr(verification, "verify", residual_is_p)  # a broken acceptance rule must show
    assert sd_pvalue(target, tiny_eagle(), sampled(1.0)) < ALPHA
