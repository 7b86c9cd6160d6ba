"""Continuous batching: requests join and leave the running batch between decoding rounds.

One thread owns the LLM and drives its engine loop (saguaro.engine.loop, the one
`LLM.generate` drives), which keeps the waiting and running requests and admits them within its
limits: this thread hands it the requests submitted since the last step, runs a step (the
prefill of what it admits, then one round for the whole running batch), sends each request the
text that became final, and aborts cancelled requests. What is the server's own stays here:
the requests' update callbacks, cancellation, and refusing requests once the batch and the
waiting queue are full. A request's tokens do not depend on the others in the batch; each
keeps its own sampling parameters and random stream. Other threads only submit and cancel,
under a lock.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from saguaro.engine.logprobs import TokenLogprobs
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
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of the tokens committed since the last update
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the first update, when asked for

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
    seq: Sequence | None = None  # what the engine decodes, made by submit

    def admit(self, request_id: int, seq: Sequence) -> None:
        """Takes the id and the sequence the scheduler gives it when it accepts it."""
        self.request_id, self.seq = request_id, seq


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
    running: int = 0
    waiting: int = 0
    tokens_per_s: float = 0.0  # generated tokens over the last TOKENS_PER_S_WINDOW_S


@dataclass
class _Tracked:
    """A request the engine holds (waiting or running), and what of it the stats have counted."""
    request: Request
    seq: Sequence
    tokens_counted: int = 0  # output tokens already in the stats
    logprobs_sent: int = -1  # entries of seq.logprobs already sent; -1: nothing sent yet

    def count_new_tokens(self) -> int:
        """The output tokens committed since the last count (the stats add them)."""
        new, self.tokens_counted = len(self.seq.output_ids) - self.tokens_counted, len(self.seq.output_ids)
        return new

    def update(self, text: str) -> Update:
        """The update that sends `text` and what else is new since the last one."""
        seq = self.seq
        first = self.logprobs_sent < 0
        self.logprobs_sent = max(self.logprobs_sent, 0)
        logprobs = seq.logprobs[self.logprobs_sent:]
        self.logprobs_sent += len(logprobs)
        return Update(text, len(seq.prompt_ids), len(seq.output_ids), seq.finish_reason,
                      num_cached_tokens=seq.stats.cached_tokens, logprobs=logprobs,
                      prompt_logprobs=seq.prompt_logprobs if first else None)


class Scheduler:
    """max_waiting: requests queued beyond the free batch places before submit raises
    QueueFull; max_model_len: prompt + output tokens one request may reach. The batch is the
    LLM engine's: its KV cache is reserved up front for as many requests of max_model_len as
    its limits (max_num_seqs, kv_cache_mb) allow, max_batch_size."""

    def __init__(self, llm: LLM, max_waiting: int = 128, max_model_len: int | None = None):
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.llm = llm
        self.engine = llm.engine
        self.decoder = llm.decoder
        context = llm.target.config.max_position_embeddings
        self.max_model_len = min(max_model_len or context, context)
        self.max_waiting = max_waiting
        self.max_batch_size = self.engine.reserve(self.max_model_len)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._submitted: deque[Request] = deque()  # not yet handed to the engine
        self._cancelled: set[int] = set()
        self._tracked: dict[int, _Tracked] = {}  # request_id -> what the engine holds; the scheduler thread's own
        self._num_unfinished = 0  # submitted and not yet ended, readable under the lock
        self._num_running = 0  # of them, those in the running batch after the last step
        self._deadline: float | None = None  # set by shutdown: abort what is left after it
        self._stats = SchedulerStats()
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent rounds
        self._thread: threading.Thread | None = None

    # --- any thread -----------------------------------------------------------------------

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most tokens a request with this prompt may generate (<= 0: the prompt is too long)."""
        return self.max_model_len - prompt_len - self.decoder.lookahead

    def submit(self, request: Request) -> int:
        """Queues a request; returns its id. Raises ValueError when it cannot fit the context or
        its parameters cannot be decoded (a grammar llguidance cannot compile with this
        tokenizer), QueueFull or ShuttingDown. Its sequence is made here, in the caller's
        thread, so that such an error is the caller's, not the round's."""
        if request.params.max_tokens > self.max_new_tokens(len(request.prompt_ids)):
            raise ValueError(f"{len(request.prompt_ids)} prompt tokens + max_tokens {request.params.max_tokens} "
                             f"exceed the context of {self.max_model_len} tokens")
        seq = self.llm.new_sequence(request.prompt_ids, request.params, request.arrival)
        with self._lock:
            if self._deadline is not None:
                raise ShuttingDown("the server is shutting down")
            if self._num_unfinished >= self.max_batch_size + self.max_waiting:
                self._stats.rejected += 1
                raise QueueFull(f"{self._num_running} requests running and "
                                f"{self._num_unfinished - self._num_running} waiting")
            request.admit(next(self._ids), seq)
            self._submitted.append(request)
            self._num_unfinished += 1
            self._wakeup.notify()
        return request.request_id

    def cancel(self, request_id: int) -> None:
        """Drops a request (its client went away): it gets no more updates, and its place in
        the engine (and cache row) is freed before the next round."""
        with self._lock:
            for request in self._submitted:
                if request.request_id == request_id:
                    self._submitted.remove(request)
                    self._stats.finished["cancelled"] += 1
                    self._num_unfinished -= 1
                    return
            self._cancelled.add(request_id)
            self._wakeup.notify()

    def stats(self) -> SchedulerStats:
        with self._lock:
            self._forget_old_rounds()
            s = self._stats
            return SchedulerStats(**{**s.__dict__, "finished": dict(s.finished), "running": self._num_running,
                                     "waiting": self._num_unfinished - self._num_running,
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
            submitted, cancelled = work
            self._drop([self._tracked[rid] for rid in cancelled], "cancelled")
            try:
                self._step(submitted)
            except Exception as e:  # a failed round fails its requests, not the server
                waiting = {s.seq_id for s in self.engine.waiting}  # not in the round: they wait on
                in_round = [t for t in self._tracked.values() if t.seq.seq_id not in waiting]
                self._drop(in_round, "error", f"engine error: {e!r}")
        self._drop(list(self._tracked.values()), "error", "the server is shutting down")

    def _next_round(self) -> tuple[list[Request], set[int]] | None:
        """Waits for work; returns the requests submitted since the last round and the ids
        cancelled, or None when it is time to stop (shutdown: nothing left, or the grace period
        is over)."""
        with self._lock:
            while True:
                if self._deadline is not None:
                    unfinished = self._submitted or self.engine.has_unfinished
                    if not unfinished or time.perf_counter() >= self._deadline:
                        for request in self._submitted:
                            self._send(request, Update("", len(request.prompt_ids), 0,
                                                       error="the server is shutting down"))
                            self._stats.finished["error"] += 1
                        self._num_unfinished -= len(self._submitted)
                        self._submitted.clear()
                        return None
                if self._submitted or self.engine.has_unfinished or self._cancelled:
                    break
                self._wakeup.wait(None if self._deadline is None else self._deadline - time.perf_counter())
            cancelled = self._cancelled & self._tracked.keys()  # the others have finished already
            self._cancelled = set()
            submitted = list(self._submitted)
            self._submitted.clear()
            return submitted, cancelled

    def _step(self, requests: list[Request]) -> None:
        """Hands the engine the new requests, runs one engine step (it admits what fits, a
        prefill committing their first token, then decodes the running batch), then sends each
        request its new text; a finished one is already out of the engine."""
        new = []
        for request in requests:
            new.append(_Tracked(request, request.seq))
            self._tracked[request.request_id] = new[-1]
        if requests:
            with self._lock:
                self._stats.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.engine.add([t.seq for t in new])
        result = self.engine.step()
        by_seq = {t.seq.seq_id: t for t in self._tracked.values()}
        took_part = [by_seq[u.seq.seq_id] for u in result.updates]
        updates = [(by_seq[u.seq.seq_id].request, by_seq[u.seq.seq_id].update(u.new_text))
                   for u in result.updates if u.new_text or u.seq.finished]
        self._record(took_part)
        finished = [t for t in took_part if t.seq.finished]
        for t in finished:
            del self._tracked[t.request.request_id]
        with self._lock:
            if result.decoded:
                self._stats.rounds += 1
                self._stats.batch_size_sum += result.decoded
            for t in finished:
                self._stats.finished[t.seq.finish_reason] += 1
            self._num_unfinished -= len(finished)
            self._num_running = len(self.engine.running)
        for request, update in updates:
            self._send(request, update)

    def _record(self, took_part: list[_Tracked]) -> None:
        with self._lock:
            s, new_tokens = self._stats, 0
            for r in took_part:
                new_tokens += r.count_new_tokens()
            s.generation_tokens += new_tokens
            self._recent.append((time.perf_counter(), new_tokens))
            self._forget_old_rounds()

    def _forget_old_rounds(self) -> None:
        old = time.perf_counter() - TOKENS_PER_S_WINDOW_S
        while self._recent and self._recent[0][0] < old:
            self._recent.popleft()

    def _drop(self, tracked: list[_Tracked], reason: str, error: str | None = None) -> None:
        """Ends requests early, waiting or running: cancelled (no update) or failed (an error
        update)."""
        if not tracked:
            return
        for t in tracked:
            self._tracked.pop(t.request.request_id, None)
            if error is not None:
                self._send(t.request, Update("", len(t.seq.prompt_ids), len(t.seq.output_ids), error=error))
        try:
            self.engine.abort([t.seq for t in tracked])
        finally:
            with self._lock:
                self._stats.finished[reason] += len(tracked)
                self._num_unfinished -= len(tracked)
                self._num_running = len(self.engine.running)

    @staticmethod
    def _send(request: Request, update: Update) -> None:
        try:
            request.on_update(update)
        except Exception:  # a client that cannot take updates any more is cancelled by its side
            pass
