"""The target's handle on the draft worker: starts (or awaits) it, speaks the protocol, notices
when it stops answering, and starts (or awaits) a new one."""
from __future__ import annotations

import atexit
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace

import torch

from saguaro.engine.sampler import SamplingParams
from saguaro.speculation.protocol import (SECRET_ENV, Channel, DraftProcessing, DraftSpec, DraftUnavailable, Hello, Prefill, Ready,
                                          Release, Shutdown, Speculation, SpecRequest, unsent_tokenizers)

MEASURED_ROUNDS = 3  # replies measured before the timeout follows them
RESTART_BACKOFF_S = (1.0, 60.0)  # first and longest wait between failed restarts


@dataclass
class WorkerConfig:
    """A worker to start or await: what it loads (sent in the Hello), and what the engine's
    side alone needs to know of it."""
    draft: DraftSpec
    cpus: str | None = None  # cores to pin a local CPU worker to
    # How long the worker may stay silent before it counts as gone (then it is replaced):
    timeout_s: float = 60.0  # until MEASURED_ROUNDS replies are measured (loading, warm-up)
    min_timeout_s: float = 1.0  # afterwards timeout_rounds typical rounds, never less than this,
    timeout_rounds: float = 4.0
    prefill_s_per_token: float = 0.002  # plus this for each prompt token it has not run yet
    startup_timeout_s: float = 300.0
    # The secret a worker attached by address must know (default: $SAGUARO_DRAFT_SECRET); a
    # local worker gets a fresh random one through its environment.
    secret: str | None = field(default=None, repr=False)


def cpu_seconds(pid: int) -> float | None:
    """The CPU time a process has run so far (Linux's /proc); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, ValueError, IndexError):
        return None


def same_gpu(a: str, b: str) -> bool:
    """Whether two device names are one GPU ("cuda" is "cuda:0")."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type == "cuda" and (a.index or 0) == (b.index or 0)


def _stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class DraftClient:
    def __init__(self, config: WorkerConfig, embeddings: torch.Tensor | None, target_device: str = "cpu",
                 incarnation: int = 0):
        self.config, self.embeddings, self.target_device = config, embeddings, target_device
        self.incarnation = incarnation
        device, address = config.draft.speculative.draft_device, config.draft.speculative.draft_address
        # NCCL between two GPUs; a worker on the target's own GPU talks through the host
        nccl = device.startswith("cuda") and str(target_device).startswith("cuda") and not same_gpu(device,
                                                                                                  target_device)
        host, port = (address.rsplit(":", 1) if address else ("127.0.0.1", "0"))
        host = host.strip("[]")  # an IPv6 address: [::1]:PORT
        secret = secrets.token_urlsafe(32) if address is None else config.secret or os.environ.get(SECRET_ENV)
        if not secret:
            raise ValueError(f"a draft worker attached by address needs a shared secret: set {SECRET_ENV} (or "
                             f"--draft-secret) to the same value for the engine and the worker")
        self.channel = Channel(host, int(port), rank=0, device=str(target_device) if nccl else "cpu",
                               timeout_s=config.startup_timeout_s)
        self.process: subprocess.Popen | None = None
        if address is None:
            command = [sys.executable, "-m", "saguaro.speculation.worker", "--connect",
                       f"127.0.0.1:{self.channel.port}", "--device", device, "--link", "nccl" if nccl else "tcp"]
            if config.cpus:
                command += ["--cpus", config.cpus]
            # The secret goes through the environment: argv is visible to every user (ps).
            self.process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1", SECRET_ENV: secret})
            self._finalizer = weakref.finalize(self, _stop_process, self.process)
            atexit.register(self._finalizer)
        self.exchange_s: deque[float] = deque(maxlen=32)  # recent request -> reply times
        self.fill_s: deque[float] = deque(maxlen=32)  # recent cache fills, which a Release or Prefill may wait out
        self.slow_answers = 0  # timeouts a running worker outlasted (_await_reply)
        self.unseen_tokens = 0  # prompt tokens sent since the last reply: prefill work the worker has
        self.sent_tokenizers: set[str] = set()  # the grammar tokenizers this worker was sent (their keys)
        try:
            # A local worker that dies before it joins is noticed by polling it; one that dies
            # afterwards, by its connection closing.
            self.channel.connect(alive=None if self.process is None else lambda: self.process.poll() is None)
            self.channel.authenticate(secret)
            self.channel.send(Hello(config.draft, embeddings, incarnation), config.startup_timeout_s)
            self.ready: Ready = self.channel.recv(timeout_s=config.startup_timeout_s)
        except Exception as e:
            self.abandon()  # kills and reaps a local worker
            if self.process is not None and isinstance(e, DraftUnavailable):
                raise DraftUnavailable(f"the draft worker exited with code {self.process.returncode} while "
                                       f"starting ({e})") from e
            raise
        self.alive = True

    def timeout_s(self) -> float:
        """How long the worker may take to take a message or answer one before it counts as
        gone: a few typical exchanges or cache fills (the worker takes no message while it
        fills), at least min_timeout_s, plus time for the prompts it has not run yet."""
        c = self.config
        if len(self.exchange_s) < MEASURED_ROUNDS:
            base = c.timeout_s
        else:
            typical = max(statistics.median(self.exchange_s), statistics.median(self.fill_s))
            base = max(c.min_timeout_s, c.timeout_rounds * typical)
        return base + self.unseen_tokens * c.prefill_s_per_token

    def prefill(self, seq_ids: list[int], token_ids: list[list[int]], params: list[SamplingParams],
                max_len: int, num_rows: int, features: list[torch.Tensor] | None = None,
                processing: list[DraftProcessing | None] | None = None) -> None:
        self._send(Prefill(seq_ids, token_ids, params, max_len, num_rows, features,
                           unsent_tokenizers(processing, self.sent_tokenizers)))
        self.unseen_tokens += sum(len(ids) for ids in token_ids)

    def speculate(self, request: SpecRequest) -> Speculation:
        return self.answer(self.ask(request))

    def ask(self, request: SpecRequest) -> tuple[float, float]:
        """Sends a request (its reply comes from `answer`, so several workers can draft at
        once); returns when it was sent and the reply's deadline."""
        start = time.perf_counter()
        deadline = start + self.timeout_s()
        self._send(request, deadline)
        return start, deadline

    def answer(self, asked: tuple[float, float], patient: bool = False) -> Speculation:
        """The reply to `ask`. patient: wait as long as for a worker's first replies (a
        replacement loading beside this worker may slow it for seconds)."""
        start, deadline = asked
        if patient:
            deadline = max(deadline, start + self.config.timeout_s)
        try:
            deadline = self._await_reply(start, deadline)
            reply = self.channel.recv(timeout_s=max(deadline - time.perf_counter(), self.config.min_timeout_s))
        except DraftUnavailable:
            self.alive = False
            raise
        self.exchange_s.append(time.perf_counter() - start)
        self.fill_s.append(reply.fill_time_s)
        self.unseen_tokens = 0
        return reply

    def _await_reply(self, start: float, deadline: float) -> float:
        """Waits for the reply to start arriving; returns the deadline it is held to. A local
        worker past its deadline that ran on a core meanwhile is slow, not hung (on a loaded
        machine it may get little of a core for a second or more): it gets another timeout, for
        as long as it keeps running, up to config.timeout_s in all. One that did not run
        (stopped, deadlocked) is gone at its deadline, as is a worker elsewhere."""
        ran = None if self.process is None else cpu_seconds(self.process.pid)
        while not self.channel.readable(deadline - time.perf_counter()):
            running = None if ran is None else cpu_seconds(self.process.pid)
            if running is None or running <= ran or time.perf_counter() - start >= self.config.timeout_s:
                raise DraftUnavailable("no answer within the timeout")
            ran, deadline = running, time.perf_counter() + self.timeout_s()
            self.slow_answers += 1
        return deadline

    def release(self, seq_ids: list[int]) -> None:
        if self.alive and seq_ids:
            self._send(Release(seq_ids))

    def _send(self, message, deadline: float | None = None) -> None:
        if not self.alive:
            raise DraftUnavailable("the draft worker is gone")
        timeout = self.timeout_s() if deadline is None else deadline - time.perf_counter()
        try:
            self.channel.send(message, max(timeout, 1e-3))
        except DraftUnavailable:
            self.alive = False
            raise

    def abandon(self) -> None:
        """Drops a worker that stopped answering or died: a local one is killed (a stopped one
        too, which would never act on a polite request), and the channel closed, so that its
        address can take a new worker."""
        self.alive = False
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.channel.close()

    def close(self) -> None:
        if self.alive:
            try:
                self.channel.send(Shutdown(), self.timeout_s())
            except DraftUnavailable:
                pass
            self.alive = False
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._finalizer()


def replace_worker(lost: DraftClient, fan_out: list[int]) -> Future[DraftClient]:
    """Starts a new worker (or, for one attached by address, awaits one there) on a thread of
    its own, retrying with a growing pause until one is ready; the engine decodes without a
    draft meanwhile. Cancelling the future stops the retries and closes a late worker."""
    future: Future[DraftClient] = Future()
    draft = lost.config.draft
    config = replace(lost.config, draft=replace(draft, speculative=replace(draft.speculative, fan_out=list(fan_out))))

    def run() -> None:
        pause = RESTART_BACKOFF_S[0]
        while not future.cancelled():
            try:
                client = DraftClient(config, lost.embeddings, lost.target_device, lost.incarnation + 1)
            except Exception as e:  # no worker came, or it failed to start: try again later
                warnings.warn(f"draft worker restart failed ({e}); retrying in {pause:.0f} s", RuntimeWarning)
                time.sleep(pause)
                pause = min(2 * pause, RESTART_BACKOFF_S[1])
                continue
            try:
                future.set_result(client)
            except InvalidStateError:  # cancelled meanwhile
                client.close()
            return

    threading.Thread(target=run, name="saguaro-draft-restart", daemon=True).start()
    return future
