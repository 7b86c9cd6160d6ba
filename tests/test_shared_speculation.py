"""Branches shared across requests (speculation/cache.py): a request that missed takes another
request's unused branch drafted after the same last tokens. Exact (the distribution test, with
a broken-rule control), and requests stay independent: samples of one prompt agree on a token
no more often than independent draws from the target would (control: a branch served to every
request that wants it ties them together, and fails)."""
from __future__ import annotations

import math


from drafts import InProcessDraft, ssd_decoder, ssd_of, worker_config
import saguaro.engine.verifier as verification
from saguaro.engine.decoder import Decoder
from saguaro.engine.runner import forward_chunks
from saguaro.engine.sampler import SamplingParams, WarpParams, warp
from saguaro.engine.sequence import Sequence
from saguaro.models.kv_cache import new_cache
from saguaro.speculation.worker.cache import SpeculationCache
from saguaro.speculation.build import ar_decoder
from stats import ks_pvalue, teacher_forced_pit
from test_exactness import ALPHA, PROMPT, residual_is_p
from test_ssd import decode_all, tiny_draft_dir, tiny_target  # noqa: F401

ROWS, K, NEW = 3_000, 2, 7
FAN_OUT = [2, 1, 0]  # few outcomes cached per request: misses that another request's branch may serve


def test_a_branch_left_by_its_request_serves_one_other_request_in_its_round():
    cache = SpeculationCache()
    cache.store(0, [(0, 5), (1, 6)], [[1, 2], [3, 4]], None, None, keys=[(9, 5), (9, 7, 6)])
    assert cache.take(0, (0, 5)).tokens == [1, 2]  # its own hit
    assert cache.take_shared((9, 7, 6)).tokens == [3, 4]  # left unused: another request may take it
    assert cache.take_shared((9, 7, 6)) is None  # once
    assert cache.take_shared((9, 5)) is None  # the branch its own request took is not shared
    cache.store(1, [(0, 5)], [[1, 2]], None, None, keys=[(9, 5)])
    cache.take(1, None)
    cache.end_round()
    assert cache.take_shared((9, 5)) is None  # a round's leftovers do not outlive it


def shared_outputs(target, draft_dir, share_window: int) -> tuple[list[list[int]], list[SamplingParams], Decoder]:
    """ROWS samples of one prompt at T = 1, decoded together by SSD with its draft in this process."""
    client = InProcessDraft(worker_config(str(draft_dir), "float32", K, FAN_OUT, share_window=share_window), None)
    decoder = ssd_decoder(target, client, "neural")
    params = [SamplingParams(temperature=1.0, max_tokens=NEW, seed=i) for i in range(ROWS)]
    seqs = [Sequence(i, PROMPT, p, []) for i, p in enumerate(params)]
    decoder.reserve(ROWS, len(PROMPT) + NEW + decoder.lookahead)
    decode_all(decoder, seqs)
    return [s.output_ids for s in seqs], params, decoder


def agreement_z(target, outputs: list[list[int]], params: list[SamplingParams]) -> float:
    """Samples with the same first t tokens are paired up; their token t agrees with probability
    sum_x p(x)^2 if they are independent. The z-score of the agreements counted over every such
    pair and t >= 2 (the positions speculation proposed) against that expectation."""
    observed = expected = variance = 0.0
    for t in range(2, NEW):
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, out in enumerate(outputs):
            groups.setdefault(tuple(out[:t]), []).append(i)
        prefixes = [prefix for prefix, rows in groups.items() if len(rows) > 1]
        if not prefixes:
            continue
        chunks = [PROMPT + list(prefix) for prefix in prefixes]
        cache = new_cache(target, len(chunks), len(chunks[0]))
        hidden = forward_chunks(target, cache, list(range(len(chunks))), chunks, [0] * len(chunks))
        p = warp(target.logits(hidden[:, -1]), WarpParams.of([params[0]] * len(chunks), hidden.device)).double()
        same = (p ** 2).sum(-1)
        for g, prefix in enumerate(prefixes):
            rows = groups[prefix]
            for a, b in zip(rows[::2], rows[1::2]):
                observed += outputs[a][t] == outputs[b][t]
                expected += float(same[g])
                variance += float(same[g] * (1 - same[g]))
    return (observed - expected) / math.sqrt(variance)


def test_shared_branches_keep_samples_exact_and_independent(tiny_target, tiny_draft_dir):
    outputs, params, decoder = shared_outputs(tiny_target, tiny_draft_dir, share_window=1)
    assert ssd_of(decoder).stats.shared_hits > ROWS // 10  # many misses were served by another request's branch
    assert ks_pvalue(teacher_forced_pit(tiny_target, [PROMPT] * ROWS, outputs, params)) > ALPHA
    assert agreement_z(tiny_target, outputs, params) < 3.5


def test_sharing_check_catches_a_branch_served_to_many_requests(tiny_target, tiny_draft_dir, monkeypatch):
    """Broken: a shared branch is not used up, so every request that wants it verifies it."""
    def not_used_up(self, key):
        left = self._unused.get(key)
        return left[-1][0].branch(left[-1][1]) if left else None

    monkeypatch.setattr(SpeculationCache, "take_shared", not_used_up)
    outputs, params, _ = shared_outputs(tiny_target, tiny_draft_dir, share_window=1)
    assert agreement_z(tiny_target, outputs, params) > 3.5


def test_sharing_check_catches_a_broken_acceptance_rule(tiny_target, tiny_draft_dir, monkeypatch):
    monkeypatch.setattr(verification, "verify", residual_is_p)
    outputs, params, _ = shared_outputs(tiny_target, tiny_draft_dir, share_window=1)
    assert ks_pvalue(teacher_forced_pit(tiny_target, [PROMPT] * ROWS, outputs, params)) < ALPHA


def test_sharing_off_shares_nothing(tiny_target, tiny_draft_dir):
    _, _, decoder = shared_outputs(tiny_target, tiny_draft_dir, share_window=0)
    assert ssd_of(decoder).stats.shared_hits == 0 and decoder.metrics()["draft_tokens_per_committed_token"] > 0


def test_greedy_with_shared_branches_equals_ar(tiny_target, tiny_draft_dir):
    client = InProcessDraft(worker_config(str(tiny_draft_dir), "float32", K, FAN_OUT, share_window=1), None)
    decoder = ssd_decoder(tiny_target, client, "neural")
    prompts = [PROMPT + [i % 8, (i // 8) % 8] for i in range(200)]
    params = SamplingParams(temperature=0, max_tokens=NEW)
    outputs = []
    for d in (decoder, ar_decoder(tiny_target)):
        seqs = [Sequence(i, p, params, []) for i, p in enumerate(prompts)]
        d.reserve(len(seqs), len(prompts[0]) + NEW + d.lookahead)
        decode_all(d, seqs)
        outputs.append([s.output_ids for s in seqs])
    assert outputs[0] == outputs[1]
    assert ssd_of(decoder).stats.shared_hits > 0
