"""The engine loop both `LLM.generate` and the server drive: its steps, its admission within a
batch cap and a KV budget; and the speculation cache."""
from __future__ import annotations

import pytest
import torch

from saguaro import SamplingParams
from saguaro.engine.loop import AdmissionLimits, Engine
from saguaro.engine.sequence import Sequence
from saguaro.speculation.cache import SpeculationCache
from test_scheduler import CountingDecoder, CountingTokenizer


def seq(seq_id: int, max_tokens: int) -> Sequence:
    return Sequence(seq_id, [5, 6], SamplingParams(temperature=0, max_tokens=max_tokens), [], CountingTokenizer())


def counting_engine(limits: AdmissionLimits = AdmissionLimits()) -> tuple[Engine, CountingDecoder]:
    decoder = CountingDecoder()  # its prefill fails where no reserved row is free
    return Engine(decoder, limits), decoder


def run(engine: Engine) -> list[int]:
    """Steps the engine until every sequence has finished; returns the ids in the order they
    were admitted."""
    admitted = []
    while engine.has_unfinished:
        waiting = [s.seq_id for s in engine.waiting]
        engine.step()
        still = {s.seq_id for s in engine.waiting}
        admitted += [i for i in waiting if i not in still]
    return admitted


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


@pytest.mark.parametrize("limits", [AdmissionLimits(max_num_seqs=2), AdmissionLimits(kv_cache_tokens=2 * 9 + 8)])
def test_sequences_wait_for_a_place_and_are_admitted_in_arrival_order(limits):
    """Two places, by the cap or by the KV budget (rows of 2 + 6 + 1 slots): five sequences run
    in turns, each joining as one leaves, and commit what they would alone."""
    engine, decoder = counting_engine(limits)
    seqs = [seq(i, n) for i, n in enumerate((3, 6, 2, 5, 4))]
    engine.add(seqs)
    assert run(engine) == [0, 1, 2, 3, 4]
    assert max(map(len, decoder.batches)) == 2 and decoder.num_rows == 2
    assert decoder.batches[:3] == [[0, 1], [0, 1], [1, 2]]  # 2 joins as soon as 0 (3 tokens) has left
    assert [s.output_ids for s in seqs] == [list(range(1, s.params.max_tokens + 1)) for s in seqs]
    assert decoder.rows == {}


def test_a_sequence_longer_than_the_kv_budget_is_refused_and_nothing_is_added():
    engine, _ = counting_engine(AdmissionLimits(kv_cache_tokens=16))
    with pytest.raises(ValueError, match="KV cache budget of 16 tokens"):
        engine.add([seq(0, 4), seq(1, 14)])  # 2 + 14 + 1 slots
    assert not engine.has_unfinished


def test_rows_are_as_long_as_the_longest_waiting_sequence_needs():
    """A long sequence queued behind short ones sets the rows' length from the start: the
    budget's 40 slots make 2 rows of 2 + 16 + 1, not 4 of 9 regrown later."""
    engine, decoder = counting_engine(AdmissionLimits(kv_cache_tokens=40))
    engine.add([seq(0, 6), seq(1, 6), seq(2, 6), seq(3, 16)])
    assert run(engine) == [0, 1, 2, 3]
    assert max(map(len, decoder.batches)) == 2 and decoder.num_rows == 2
    assert engine.row_len == 19


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
