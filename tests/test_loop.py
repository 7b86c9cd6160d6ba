"""The engine loop both `LLM.generate` and the server drive, and the speculation cache."""
from __future__ import annotations

import torch

from saguaro import SamplingParams
from saguaro.engine.loop import Engine
from saguaro.engine.sequence import Sequence
from saguaro.speculation.worker.cache import SpeculationCache
from test_scheduler import CountingDecoder, CountingTokenizer


def seq(seq_id: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id, [5, 6], SamplingParams(temperature=0, max_tokens=max_tokens), [], CountingTokenizer())


def counting_engine() -> tuple[Engine, CountingDecoder]:
    decoder = CountingDecoder()
    decoder.reserve(4, 64)
    return Engine(decoder), decoder


def test_a_step_prefills_new_sequences_then_decodes_every_running_one():
    engine, decoder = counting_engine()
    first, second = seq(0, 3), seq(1, 2)
    engine.add([first])
    result = engine.step()  # prefill (token 1), then a round (token 2)
    assert first.output_ids == [1, 2] and result.decoded == 1
    assert [(u.seq.seq_id, u.new_text) for u in result.updates] == [(0, "1 2 ")]
    engine.add([second])
    result = engine.step()  # second joins: prefilled, then decoded with first
    assert decoder.batches[-1] == [0, 1]
    assert first.finished and second.finished and not engine.has_unfinished
    assert decoder.rows == {}  # released once, when they finished
    assert {u.seq.seq_id: u.new_text for u in result.updates} == {0: "3 ", 1: "1 2 "}


def test_abort_drops_waiting_and_running_sequences_and_frees_their_rows():
    engine, decoder = counting_engine()
    running, waiting = seq(0, 10), seq(1, 10)
    engine.add([running])
    engine.step()
    engine.add([waiting])
    engine.abort([running, waiting])
    assert not engine.has_unfinished and decoder.rows == {}
    assert engine.step().updates == []


def test_speculation_cache_answers_one_outcome_per_round():
    cache = SpeculationCache()
    probs = torch.rand(2, 3, 4)
    cache.store(7, [(0, 11), (2, 12)], [[1, 2, 3], [4, 5, 6]], probs, None)
    branch = cache.take(7, (2, 12))
    assert branch.tokens == [4, 5, 6] and torch.equal(branch.probs, probs[1])
    assert branch.probs.untyped_storage().nbytes() == probs[1].numel() * 4  # a copy, not a view of all branches
    assert cache.take(7, (0, 11)) is None  # the round's other branches are gone
    cache.store(7, [(0, 11)], [[1, 2, 3]], None, None)
    assert cache.take(7, (1, 11)) is None and len(cache) == 0  # a miss forgets them too
    cache.store(8, [(0, 11)], [[1, 2, 3]], None, None)
    cache.drop(8)
    assert cache.take(8, (0, 11)) is None
