"""The engine loop both `LLM.generate` and the server drive: its steps, its admission within a
batch cap and a KV budget; and the speculation cache."""
from __future__ import annotations

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.engine.loop import AdmissionLimits, Engine
from saguaro.models.config import ModelConfig
from saguaro.models.llama import LlamaModel
from saguaro.models.checkpoint import save_checkpoint
from saguaro.models.tokenizer import load_tokenizer
from saguaro.engine.sequence import Sequence
from saguaro.speculation.worker.cache import SpeculationCache
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


@pytest.fixture(scope="module")
def tiny_checkpoint(smollm2_path, tmp_path_factory):
    """A 2-layer random-weight model with the default model's tokenizer: 128 KV bytes a token."""
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = load_tokenizer(smollm2_path)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=8)
    model = LlamaModel(config)
    model.lm_head.weight.data.mul_(3.0)  # logits of order 1: greedy picks differ by prompt
    save_checkpoint(model, folder, dtype=torch.float32, share_embeddings=False)
    return str(folder)


def test_generate_admits_prompts_in_turns_within_the_kv_budget(tiny_checkpoint):
    """24 prompts of up to 40 tokens in a KV budget of three rows: the cache holds three rows,
    not 24, and the greedy outputs are those of unlimited admission."""
    prompts = [list(range(100 + i, 120 + i + i % 21)) for i in range(24)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    row = 40 + 8 + 1  # the longest prompt, max_tokens and AR's lookahead
    budget_mb = 3 * row * 128 / 2**20
    limited = LLM(tiny_checkpoint, method="ar", dtype="float32", kv_cache_mb=budget_mb)
    unlimited = LLM(tiny_checkpoint, method="ar", dtype="float32")
    outputs = limited.generate(prompts, params, use_tqdm=False)
    assert limited.decoder.verifier.cache.num_rows == 3
    assert [o.token_ids for o in outputs] == [o.token_ids for o in unlimited.generate(prompts, params, use_tqdm=False)]
    assert len({tuple(o.token_ids) for o in outputs}) > 1 and all(o.finish_reason == "length" for o in outputs)
    capped = LLM(tiny_checkpoint, method="ar", dtype="float32", max_num_seqs=5)
    assert [o.token_ids for o in capped.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in outputs]
    assert capped.decoder.verifier.cache.num_rows == 5
    with pytest.raises(ValueError, match="KV cache budget of 147 tokens"):
        limited.generate([list(range(100, 240))], params, use_tqdm=False)
    assert not limited.engine.has_unfinished


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


def test_a_miss_says_whether_its_accepted_length_or_its_bonus_was_not_predicted():
    cache = SpeculationCache()
    cache.store(7, [(0, 11), (0, 13), (2, 12)], [[1], [2], [3]], None, None)
    assert cache.miss_cause(7, (2, 12)) is None  # a hit
    assert cache.miss_cause(7, (0, 14)) == "bonus"  # length 0 predicted, its bonus not
    assert cache.miss_cause(7, (1, 11)) == "length"  # no branch after one accepted token
    assert cache.miss_cause(8, (0, 11)) == "unfilled"
    assert cache.take(7, (0, 14)) is None and cache.miss_cause(7, (0, 11)) == "unfilled"  # asking took nothing


def test_speculation_counters_follow_each_rounds_outcomes():
    """SD over 64 tiny requests: the engine's vLLM-named counters and each request's acceptance
    lengths agree with the outcomes the rounds' records carry; an AR round counts no draft."""
    from drafts import sd_decoder
    from test_exactness import TINY_K, sampled, tiny_model, tiny_outputs

    decoder = sd_decoder(tiny_model(seed=10, layers=2), tiny_model(seed=11, layers=1), TINY_K)
    records, step = [], decoder.step
    decoder.step = lambda seqs: records.append(step(seqs))
    tiny_outputs(decoder, sampled(1.0, rows=64))
    outcomes = [o for r in records for o in r.outcomes]
    counters = decoder.metrics()
    assert counters["spec_decode_num_rounds"] == len(records)
    assert counters["spec_decode_num_drafts"] == len(outcomes) and counters["spec_decode_num_draft_tokens"] == \
        TINY_K * len(outcomes)
    assert counters["spec_decode_num_accepted_tokens"] == sum(o.accepted_len for o in outcomes) > 0
    assert counters["spec_decode_num_accepted_tokens_per_pos"] == \
        [sum(o.accepted_len > i for o in outcomes) for i in range(TINY_K)]
    lengths = [n for r in records for n in [o.accepted_len + 1 for o in r.outcomes]]
    seqs = {id(s): s for r in records for s in r.seqs}.values()
    assert sorted(n for s in seqs for n in s.stats.acceptance_lengths) == sorted(lengths)
    ar = sd_decoder(tiny_model(seed=10, layers=2), tiny_model(seed=11, layers=1), TINY_K)
    ar.policy.choice = type(ar.policy.choice)()  # every round AR
    tiny_outputs(ar, sampled(1.0, rows=4))
    assert ar.metrics()["spec_decode_num_rounds"] > 0 and ar.metrics()["spec_decode_num_drafts"] == 0
