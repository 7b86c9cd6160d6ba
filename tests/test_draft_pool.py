"""Several draft workers for one target (saguaro.speculation.remote.pool): requests are shared out, the
output stays exact (greedy equality with AR on real prompts; the distribution test, with a lost
worker's requests on n-gram speculation, and its control), and a worker's loss touches only its
own requests."""
from __future__ import annotations

import os
import signal

import pytest

from drafts import ssd_decoder, ssd_of, worker_config
from saguaro import SamplingParams
import saguaro.engine.verifier as verification
from saguaro.engine.decoder import Decoder
from saguaro.engine.sequence import Sequence
from saguaro.speculation.remote.client import DraftClient
from saguaro.speculation.policy.planning import uniform_fan_out
from stats import ks_pvalue, teacher_forced_pit
from test_exactness import ALPHA, residual_is_p
from test_ssd import (WORKER_FAN_OUT, WORKER_K, WORKER_NEW, decode_all, draft_path, peaked_draft_dir,  # noqa: F401
                      sampled_params, tiny_target, with_ssd, worker_prompts)


TOKENS = 40  # of the 64 greedy AR tokens each prompt has in conftest


def pool_decoder(target, draft_dir, k: int, fan_out: list[int], workers: int = 2, dtype: str = "float32",
                 embeddings=None) -> Decoder:
    config = worker_config(str(draft_dir), dtype, k, fan_out, timeout_s=120)
    return ssd_decoder(target, [DraftClient(config, embeddings) for _ in range(workers)], "neural")


def test_two_workers_share_the_requests_and_equal_ar(with_ssd, llm, draft_path, prompts, ar_greedy):
    decoder = pool_decoder(llm.target, draft_path, 4, uniform_fan_out(4, 4), embeddings=llm.target.embed_tokens.weight)
    ssd_llm = with_ssd(decoder)
    shares = []
    step = decoder.step
    decoder.step = lambda seqs: (step(seqs), shares.append(decoder.metrics()["requests_per_draft_worker"]))
    outputs = ssd_llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [t[:TOKENS] for t in ar_greedy[:4]]
    assert shares[0] == [2, 2]
    assert decoder.metrics()["cache_hits"] > 0 and decoder.metrics()["draft_losses"] == 0


def test_a_lost_worker_takes_only_its_own_requests_off_ssd(with_ssd, llm, draft_path, prompts, ar_greedy):
    decoder = pool_decoder(llm.target, draft_path, 4, uniform_fan_out(4, 4), embeddings=llm.target.embed_tokens.weight)
    ssd_llm = with_ssd(decoder)
    ssd, pool = ssd_of(decoder), ssd_of(decoder).pool
    lost, kept = pool.lanes[0].client.process, pool.lanes[1].client.process
    owner, hits_after_fault = {}, {}  # request -> its worker; the hits of its rounds after the loss
    step = decoder.step

    def fault_after_two_rounds(seqs):
        if len(ssd.stats.verify_s) == 2:
            os.kill(lost.pid, signal.SIGKILL)
        step(seqs)
        owner.update({s.seq_id: pool.lanes.index(pool.lane_of[s.seq_id]) for s in seqs if s.seq_id not in owner})
        if len(ssd.stats.verify_s) > 3:
            for seq in seqs:
                hits_after_fault.setdefault(owner[seq.seq_id], []).append(seq.stats.cache_hits[-1])

    decoder.step = fault_after_two_rounds
    with pytest.warns(RuntimeWarning, match=r"draft worker lost \(worker 0 of 2"):
        outputs = ssd_llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [t[:TOKENS] for t in ar_greedy[:4]]
    assert pool.losses == 1 and kept.poll() is None and pool.lanes[1].client.process is kept
    assert sorted(owner.values()) == [0, 0, 1, 1]
    assert any(hits_after_fault[1])  # the other worker's requests still hit its cache
    assert not any(hits_after_fault[0][:4])  # the lost worker's are on n-gram guesses (until a new one is up)
    assert ssd.stats.miss_causes["lost"] > 0 and None not in ssd.stats.miss_causes  # ... misses of their own cause
    decoder.step = step
    if pool.lanes[0].restart is not None:
        pool.lanes[0].restart.result(timeout=120)
    outputs = ssd_llm.generate(prompts[4:8], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [t[:16] for t in ar_greedy[4:8]]
    assert pool.restarts == 1 and pool.lanes[0].client.process.pid != lost.pid


def pool_pvalue(target, draft_dir) -> float:
    """The worker distribution test (tests/test_ssd.py) over two workers, the first killed after
    the prompts: its requests run on n-gram guesses, the others on the tree."""
    decoder = pool_decoder(target, draft_dir, WORKER_K, WORKER_FAN_OUT)
    params = sampled_params()
    seqs = [Sequence(i, prompt, p, []) for i, (prompt, p) in enumerate(zip(worker_prompts(), params))]
    try:
        decoder.reserve(len(seqs), len(worker_prompts()[0]) + 1 + WORKER_NEW + decoder.lookahead)
        decoder.prefill(seqs)
        first = ssd_of(decoder).pool.lanes[0]
        first.client.process.kill()
        first.client.process.wait()
        with pytest.warns(RuntimeWarning, match=r"draft worker lost \(worker 0 of 2"):
            while active := [s for s in seqs if not s.finished]:
                decoder.step(active)
                decoder.release([s for s in active if s.finished])
        assert ssd_of(decoder).stats.hit_lengths  # the live worker's cache served
    finally:
        decoder.close()
    return ks_pvalue(teacher_forced_pit(target, worker_prompts(), [s.output_ids for s in seqs], params))


def test_two_workers_one_lost_sample_the_targets_distribution(tiny_target, peaked_draft_dir):
    assert pool_pvalue(tiny_target, peaked_draft_dir) > 1e-4  # test_ssd.WORKER_ALPHA: timing is not seeded


def test_two_workers_check_catches_a_broken_acceptance_rule(tiny_target, peaked_draft_dir, monkeypatch):
    monkeypatch.setattr(verification, "verify", residual_is_p)
    assert pool_pvalue(tiny_target, peaked_draft_dir) < ALPHA
