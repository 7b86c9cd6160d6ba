"""The continuous-batching scheduler's bookkeeping, with a stand-in model whose rounds commit
one known token and last as long as a test needs: batch and queue limits, requests joining and
leaving between rounds, cancellation, stop strings held back while streaming, a failing round,
shutdown with and without a grace period. (tests/test_server.py runs it on the real model.)"""
from __future__ import annotations

import itertools
import queue
import time
from types import SimpleNamespace

import pytest

from saguaro import SamplingParams
from saguaro.engine.loop import AdmissionLimits, Engine
from saguaro.engine.sequence import Sequence
from saguaro.server.scheduler import QueueFull, Request, Scheduler, ShuttingDown, Update

CONTEXT = 64


class CountingDecoder:
    """Commits token n at a sequence's n-th output position; records each round's batch."""
    lookahead = 1

    def __init__(self):
        self.rows: dict[int, int] = {}
        self.batches: list[list[int]] = []
        self.round_s = 0.0
        self.fail_next_round = False

    def reserve(self, num_rows: int, num_slots: int) -> None:
        self.num_rows = num_rows

    def prefill(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.rows[seq.seq_id] = min(set(range(self.num_rows)) - set(self.rows.values()))
            seq.commit([1])

    def step(self, seqs: list[Sequence]) -> None:
        time.sleep(self.round_s)
        self.batches.append([s.seq_id for s in seqs])
        if self.fail_next_round:
            self.fail_next_round = False
            raise RuntimeError("the round failed")
        for seq in seqs:
            seq.commit([len(seq.output_ids) + 1])

    def release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            del self.rows[seq.seq_id]


class CountingTokenizer:
    """Token n reads "n "."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"{t} " for t in token_ids)


class StandInLLM:
    """What the scheduler uses of an LLM: by default an engine that runs two requests at once."""

    def __init__(self, limits: AdmissionLimits = AdmissionLimits(max_num_seqs=2)):
        self.decoder = CountingDecoder()
        self.engine = Engine(self.decoder, limits)
        self.target = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=CONTEXT))
        self._ids = itertools.count()

    def new_sequence(self, prompt_ids: list[int], params: SamplingParams, arrival: float | None = None) -> Sequence:
        return Sequence(next(self._ids), prompt_ids, params, eos_token_ids=[], tokenizer=CountingTokenizer(),
                        arrival=arrival)


class Client:
    """A request and the updates it received."""

    def __init__(self, scheduler: Scheduler, max_tokens: int, stop: list[str] | None = None):
        self.updates: queue.Queue[Update] = queue.Queue()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop or [])
        self.id = scheduler.submit(Request([5, 6, 7], params, self.updates.put))

    def result(self, timeout_s: float = 30) -> tuple[str, Update]:
        """All text received and the last update."""
        text = ""
        while True:
            update = self.updates.get(timeout=timeout_s)
            text += update.text
            if update.done:
                return text, update


@pytest.fixture
def llm():
    return StandInLLM()


@pytest.fixture
def scheduler(llm):
    scheduler = Scheduler(llm, max_waiting=1, max_model_len=CONTEXT)
    scheduler.start()
    yield scheduler
    scheduler.shutdown()


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_requests_join_and_leave_between_rounds(llm, scheduler):
    llm.decoder.round_s = 0.01
    clients = [Client(scheduler, n) for n in (2, 6, 3)]  # the third waits for the first to leave
    results = [c.result() for c in clients]
    assert [r[0] for r in results] == ["1 2 ", "1 2 3 4 5 6 ", "1 2 3 "]
    assert [(u.finish_reason, u.num_output_tokens) for _, u in results] == [("length", 2), ("length", 6),
                                                                           ("length", 3)]
    assert max(len(b) for b in llm.decoder.batches) == 2
    first, second, third = (c.id for c in clients)  # request ids are the sequence ids here
    assert any(third in b and second in b for b in llm.decoder.batches)  # it joined a running request
    assert not any(third in b and first in b for b in llm.decoder.batches)
    assert llm.decoder.rows == {}
    stats = scheduler.stats()
    assert stats.finished["length"] == 3 and stats.generation_tokens == 11 and stats.running == 0


def test_full_batch_and_queue_refuse_requests(llm, scheduler):
    llm.decoder.round_s = 0.01
    running = [Client(scheduler, CONTEXT - 5) for _ in range(2)]
    wait_until(lambda: scheduler.stats().running == 2)
    waiting = Client(scheduler, 1)
    with pytest.raises(QueueFull):
        Client(scheduler, 1)
    assert scheduler.stats().rejected == 1 and scheduler.stats().waiting == 1
    scheduler.cancel(running[0].id)
    assert waiting.result()[1].finish_reason == "length"  # its place came free


def test_request_too_long_for_the_context_is_refused(scheduler):
    with pytest.raises(ValueError, match="context"):
        Client(scheduler, CONTEXT - 3)  # 3 prompt tokens + lookahead 1 leave CONTEXT - 4
    assert scheduler.max_new_tokens(3) == CONTEXT - 4


def test_the_batch_is_what_the_engines_kv_budget_holds():
    """Room for three requests of the whole context: three run, whatever max_num_seqs says, and
    the cache is reserved for them up front; a budget under one request's context is refused."""
    llm = StandInLLM(AdmissionLimits(max_num_seqs=8, kv_cache_tokens=3 * CONTEXT + 10))
    scheduler = Scheduler(llm, max_waiting=0, max_model_len=CONTEXT)
    assert scheduler.max_batch_size == 3 and llm.decoder.num_rows == 3
    scheduler.start()
    try:
        llm.decoder.round_s = 0.01
        running = [Client(scheduler, CONTEXT - 5) for _ in range(3)]
        with pytest.raises(QueueFull):
            Client(scheduler, 1)
        wait_until(lambda: scheduler.stats().running == 3)
        for client in running:
            scheduler.cancel(client.id)
    finally:
        scheduler.shutdown()
    with pytest.raises(ValueError, match="KV cache budget"):
        Scheduler(StandInLLM(AdmissionLimits(kv_cache_tokens=CONTEXT - 1)), max_model_len=CONTEXT)


def test_cancelling_frees_the_row_and_stops_updates(llm, scheduler):
    llm.decoder.round_s = 0.01
    running = [Client(scheduler, CONTEXT - 5) for _ in range(2)]
    waiting = Client(scheduler, CONTEXT - 5)
    wait_until(lambda: scheduler.stats().running == 2 and scheduler.stats().waiting == 1)
    scheduler.cancel(waiting.id)
    wait_until(lambda: scheduler.stats().waiting == 0)  # the engine drops it before the next round
    scheduler.cancel(running[0].id)
    wait_until(lambda: len(llm.decoder.rows) == 1)
    rounds = len(llm.decoder.batches)
    wait_until(lambda: len(llm.decoder.batches) > rounds)
    assert llm.decoder.batches[-1] == [running[1].id]
    while not running[0].updates.empty():
        assert not running[0].updates.get().done  # it was dropped, not finished
    time.sleep(0.05)
    assert running[0].updates.empty()
    assert scheduler.stats().finished["cancelled"] == 2


def test_stop_strings_are_never_streamed(scheduler):
    text, last = Client(scheduler, 9, stop=["4 5"]).result()
    assert text == "1 2 3 " and last.finish_reason == "stop"


def test_a_failed_round_fails_its_requests_and_serving_goes_on(llm, scheduler):
    llm.decoder.fail_next_round = True
    text, last = Client(scheduler, 4).result()
    assert "the round failed" in last.error and last.finish_reason is None
    assert llm.decoder.rows == {}
    assert Client(scheduler, 2).result()[1].finish_reason == "length"


def test_shutdown_lets_requests_finish_within_the_grace_period(llm, scheduler):
    llm.decoder.round_s = 0.01
    client = Client(scheduler, 20)
    wait_until(lambda: scheduler.stats().running == 1)
    scheduler.shutdown(30.0, wait=False)
    with pytest.raises(ShuttingDown):
        Client(scheduler, 1)
    assert client.result()[1].finish_reason == "length"
    scheduler.shutdown(30.0)  # returns once the scheduler thread has ended


def test_shutdown_ends_what_is_left_with_an_error(llm, scheduler):
    llm.decoder.round_s = 0.01
    clients = [Client(scheduler, CONTEXT - 5) for _ in range(3)]  # two run, one waits
    wait_until(lambda: scheduler.stats().running == 2)
    scheduler.shutdown(0.0)
    for c in clients:
        assert "shutting down" in c.result()[1].error
    assert llm.decoder.rows == {}
