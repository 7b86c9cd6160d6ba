"""Continuous batching: requests join and leave the running batch between decoding rounds.

One thread owns the LLM and drives its engine loop (saguaro.engine.loop, the one
`LLM.generate` drives): it hands the engine the waiting requests that fit the batch, runs a
step (their prefill, then one round for the whole running batch), sends each request the text
that became final, and aborts cancelled requests. A request's tokens do not depend on the
others in the batch; each keeps its own sampling parameters and random stream. Other threads
only submit and cancel, under a lock.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from saguaro.engine.sampler import SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.llm import LLM

TOKENS_PER_S_WINDOW_S = 10.0


class QueueFull(RuntimeError):
    """The running batch and the waiting queue are both full."""


class ShuttingDown(RuntimeError):
    """The scheduler takes no new requests."""


@dataclass
class Update:
    """What a request receives after a round: the text that became final since the last update.
    A finish reason ("stop", "length") or an error (shutdown, engine failure) ends it."""
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV entries came from the prefix cache

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_update: Callable[[Update], None]  # runs on the scheduler thread: must return at once
    arrival: float = field(default_factory=time.perf_counter)
    request_id: int = -1  # set by submit


@dataclass
class SchedulerStats:
    """Counters since start and the current state, for /metrics."""
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("stop", "length", "cancelled", "error"), 0))  # requests, by how they ended
    rejected: int = 0  # queue full
    prompt_tokens: int = 0
    generation_tokens: int = 0
    rounds: int = 0  # decoding rounds of the running batch (prefills not counted)
    batch_size_sum: int = 0  # running requests, summed over rounds
    acceptance_length_sum: int = 0  # SD/SSD: committed tokens per request-round
    acceptance_length_count: int = 0
    cache_hits: int = 0  # SSD
    cache_lookups: int = 0
    running: int = 0
    waiting: int = 0
    tokens_per_s: float = 0.0  # generated tokens over the last TOKENS_PER_S_WINDOW_S


@dataclass
class _Running:
    request: Request
    seq: Sequence
    tokens_counted: int = 0  # output tokens, acceptance lengths and cache hits already in the stats
    rounds_counted: int = 0
    hits_counted: int = 0


class Scheduler:
    """max_batch_size: requests decoded together; max_waiting: requests queued beyond the
    free batch places before submit raises QueueFull; max_model_len: prompt + output tokens
    one request may reach (the KV cache is reserved for max_batch_size such requests)."""

    def __init__(self, llm: LLM, max_batch_size: int = 32, max_waiting: int = 128,
                 max_model_len: int | None = None):
        if max_batch_size < 1 or max_waiting < 0:
            raise ValueError("max_batch_size must be >= 1 and max_waiting >= 0")
        self.llm = llm
        self.engine = llm.engine
        self.decoder = llm.decoder
        context = llm.target.config.max_position_embeddings
        self.max_model_len = min(max_model_len or context, context)
        self.max_batch_size, self.max_waiting = max_batch_size, max_waiting
        self.decoder.reserve(max_batch_size, self.max_model_len)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: deque[Request] = deque()
        self._cancelled: set[int] = set()
        self._running: dict[int, _Running] = {}  # request_id -> state; the scheduler thread's own
        self._num_running = 0  # places taken in the batch, readable under the lock
        self._deadline: float | None = None  # set by shutdown: abort what is left after it
        self._stats = SchedulerStats()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent rounds
        self._thread: threading.Thread | None = None

    # --- any thread -----------------------------------------------------------------------

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt may generate (<= 0: the prompt is too long)."""
        return self.max_model_len - prompt_len - self.decoder.lookahead

    def submit(self, request: Request) -> int:
        """Queues a request; returns its id. Raises ValueError when it cannot fit the context,
        QueueFull or ShuttingDown."""
        if request.params.max_tokens > self.max_new_tokens(len(request.prompt_ids)):
            raise ValueError(f"{len(request.prompt_ids)} prompt tokens + max_tokens {request.params.max_tokens} "
                             f"exceed the context of {self.max_model_len} tokens")
        with self._lock:
            if self._deadline is not None:
                raise ShuttingDown("the server is shutting down")
            free = self.max_batch_size - self._num_running
            if len(self._waiting) >= self.max_waiting + free:
                self._stats.rejected += 1
                raise QueueFull(f"{self._num_running} requests running and {len(self._waiting)} waiting")
            request.request_id = next(self._ids)
            self._waiting.append(request)
            self._wakeup.notify()
        return request.request_id

    def cancel(self, request_id: int) -> None:
        """Drops a request (its client went away): it gets no more updates, and its cache row
        is freed before the next round."""
        with self._lock:
            for request in self._waiting:
                if request.request_id == request_id:
                    self._waiting.remove(request)
                    self._stats.finished["cancelled"] += 1
                    return
            self._cancelled.add(request_id)
            self._wakeup.notify()

    def stats(self) -> SchedulerStats:
        with self._lock:
            self._forget_old_rounds()
            s = self._stats
            return SchedulerStats(**{**s.__dict__, "finished": dict(s.finished), "running": self._num_running,
                                     "waiting": len(self._waiting),
                                     "tokens_per_s": sum(n for _, n in self._recent) / TOKENS_PER_S_WINDOW_S})

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="saguaro-scheduler", daemon=True)
        self._thread.start()

    def shutdown(self, grace_s: float = 0.0, wait: bool = True) -> None:
        """Takes no new requests; those admitted or queued may finish within grace_s, the rest
        end with an error update. wait: return once the scheduler thread has stopped."""
        with self._lock:
            deadline = time.perf_counter() + grace_s
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)
            self._wakeup.notify()
        if wait and self._thread is not None:
            self._thread.join()

    # --- the scheduler thread -------------------------------------------------------------

    def run(self) -> None:
        while (work := self._next_round()) is not None:
            admitted, cancelled = work
            self._drop([r for rid, r in self._running.items() if rid in cancelled], "cancelled")
            try:
                self._step(admitted)
            except Exception as e:  # a failed round fails its requests, not the server
                self._drop(list(self._running.values()), "error", f"engine error: {e!r}")
        self._drop(list(self._running.values()), "error", "the server is shutting down")

    def _next_round(self) -> tuple[list[Request], set[int]] | None:
        """Waits for work; returns the requests to admit and the ids cancelled, or None when
        it is time to stop (shutdown: nothing left, or the grace period is over)."""
        with self._lock:
            while True:
                if self._deadline is not None:
                    if not (self._waiting or self._running) or time.perf_counter() >= self._deadline:
                        for request in self._waiting:
                            self._send(request, Update("", len(request.prompt_ids), 0,
                                                       error="the server is shutting down"))
                            self._stats.finished["error"] += 1
                        self._waiting.clear()
                        return None
                if self._waiting or self._running or self._cancelled:
                    break
                self._wakeup.wait(None if self._deadline is None else self._deadline - time.perf_counter())
            cancelled = self._cancelled & self._running.keys()  # the others have finished already
            self._cancelled = set()
            free = self.max_batch_size - len(self._running) + len(cancelled)
            admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            self._num_running = len(self._running) + len(admitted)
            return admitted, cancelled

    def _step(self, requests: list[Request]) -> None:
        """Admits the requests (a prefill commits their first token), runs one engine step,
        then sends each request its new text; a finished one is already out of the batch."""
        admitted = []
        for request in requests:
            seq = self.llm.new_sequence(request.prompt_ids, request.params)
            seq.stats.t_arrival = request.arrival
            admitted.append(_Running(request, seq))
            self._running[request.request_id] = admitted[-1]
        if requests:
            with self._lock:
                self._stats.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.engine.add([r.seq for r in admitted])
        result = self.engine.step()
        by_seq = {r.seq.seq_id: r for r in self._running.values()}
        running = [by_seq[u.seq.seq_id] for u in result.updates]
        updates = [(by_seq[u.seq.seq_id].request, Update(u.new_text, len(u.seq.prompt_ids), len(u.seq.output_ids),
                                                         u.seq.finish_reason,
                                                         num_cached_tokens=u.seq.stats.cached_tokens))
                   for u in result.updates if u.new_text or u.seq.finished]
        self._record(running)
        finished = [r for r in running if r.seq.finished]
        for r in finished:
            del self._running[r.request.request_id]
        with self._lock:
            if result.decoded:
                self._stats.rounds += 1
                self._stats.batch_size_sum += result.decoded
            for r in finished:
                self._stats.finished[r.seq.finish_reason] += 1
            self._num_running -= len(finished)
        for request, update in updates:
            self._send(request, update)

    def _record(self, running: list[_Running]) -> None:
        with self._lock:
            s, new_tokens = self._stats, 0
            for r in running:
                st = r.seq.stats
                lengths = st.acceptance_lengths[r.rounds_counted:]
                hits = st.cache_hits[r.hits_counted:]
                new_tokens += len(r.seq.output_ids) - r.tokens_counted
                s.acceptance_length_sum += sum(lengths)
                s.acceptance_length_count += len(lengths)
                s.cache_hits += sum(hits)
                s.cache_lookups += len(hits)
                r.tokens_counted, r.rounds_counted, r.hits_counted = (
                    len(r.seq.output_ids), len(st.acceptance_lengths), len(st.cache_hits))
            s.generation_tokens += new_tokens
            self._recent.append((time.perf_counter(), new_tokens))
            self._forget_old_rounds()

    def _forget_old_rounds(self) -> None:
        old = time.perf_counter() - TOKENS_PER_S_WINDOW_S
        while self._recent and self._recent[0][0] < old:
            self._recent.popleft()

    def _drop(self, running: list[_Running], reason: str, error: str | None = None) -> None:
        """Ends requests early: cancelled (no update) or failed (an error update)."""
        if not running:
            return
        for r in running:
            self._running.pop(r.request.request_id, None)
            if error is not None:
                self._send(r.request, Update("", len(r.seq.prompt_ids), len(r.seq.output_ids), error=error))
        try:
            self.engine.abort([r.seq for r in running])
        finally:
            with self._lock:
                self._stats.finished[reason] += len(running)
                self._num_running -= len(running)

    @staticmethod
    def _send(request: Request, update: Update) -> None:
        try:
            request.on_update(update)
        except Exception:  # a client that cannot take updates any more is cancelled by its side
            pass
