"""The target's handle on the draft worker: starts (or awaits) it and speaks the protocol."""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import weakref
from dataclasses import dataclass

import torch

from saguaro.draft.protocol import (Channel, DraftUnavailable, Hello, Prefill, Ready, Release, Shutdown,
                                    Speculation, SpecRequest)
from saguaro.engine.sampler import SamplingParams


@dataclass
class WorkerConfig:
    draft: str  # checkpoint path, as the worker's host sees it
    dtype: str
    num_speculative_tokens: int
    fan_out: list[int]
    saguaro_c: float = 1.0
    device: str = "cpu"  # the draft's device: "cpu", "cuda:1", ...
    cpus: str | None = None  # cores to pin a local CPU worker to
    address: str | None = None  # "HOST:PORT" to await a worker started elsewhere
    timeout_s: float = 60.0  # a reply slower than this means the worker is gone
    startup_timeout_s: float = 300.0
    prompt_lookup: int | None = None  # n-gram length whose earlier match is speculated instead


def _stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class DraftClient:
    def __init__(self, config: WorkerConfig, embeddings: torch.Tensor | None, target_device: str = "cpu"):
        self.config = config
        nccl = config.device.startswith("cuda") and str(target_device).startswith("cuda")
        host, port = (config.address.rsplit(":", 1) if config.address else ("127.0.0.1", "0"))
        self.channel = Channel(host, int(port), rank=0, device=str(target_device) if nccl else "cpu",
                               timeout_s=config.startup_timeout_s)
        self.process: subprocess.Popen | None = None
        if config.address is None:
            command = [sys.executable, "-m", "saguaro.draft.worker", "--connect", f"127.0.0.1:{self.channel.port}",
                       "--device", config.device]
            if config.cpus:
                command += ["--cpus", config.cpus]
            self.process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self._finalizer = weakref.finalize(self, _stop_process, self.process)
            atexit.register(self._finalizer)
        self.channel.connect()
        self.channel.send(Hello(config.draft, config.dtype, config.num_speculative_tokens, config.fan_out,
                                config.saguaro_c, embeddings, config.prompt_lookup))
        self.ready: Ready = self.channel.recv(timeout_s=config.startup_timeout_s)
        self.alive = True

    def prefill(self, seq_ids: list[int], token_ids: list[list[int]], params: list[SamplingParams],
                max_len: int, num_rows: int, features: list[torch.Tensor] | None = None) -> None:
        self._send(Prefill(seq_ids, token_ids, params, max_len, num_rows, features))

    def speculate(self, request: SpecRequest) -> Speculation:
        self._send(request)
        try:
            return self.channel.recv(timeout_s=self.config.timeout_s)
        except DraftUnavailable:
            self.alive = False
            raise

    def release(self, seq_ids: list[int]) -> None:
        if self.alive and seq_ids:
            self._send(Release(seq_ids))

    def _send(self, message) -> None:
        if not self.alive:
            raise DraftUnavailable("the draft worker is gone")
        try:
            self.channel.send(message)
        except DraftUnavailable:
            self.alive = False
            raise

    def close(self) -> None:
        if self.alive:
            try:
                self.channel.send(Shutdown())
            except DraftUnavailable:
                pass
            self.alive = False
        if self.process is not None:
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self._finalizer()


class InProcessDraft:
    """The same speculator and protocol without a worker process: nothing overlaps, but every
    message takes the same path. For tests and for debugging on one core."""

    def __init__(self, config: WorkerConfig, embeddings: torch.Tensor | None):
        from saguaro.draft.worker import DraftServer

        self.config = config
        self.server = DraftServer(Hello(config.draft, config.dtype, config.num_speculative_tokens,
                                        config.fan_out, config.saguaro_c, embeddings, config.prompt_lookup),
                                  config.device)
        self.ready = self.server.ready
        self.alive = True

    def prefill(self, seq_ids: list[int], token_ids: list[list[int]], params: list[SamplingParams],
                max_len: int, num_rows: int, features: list[torch.Tensor] | None = None) -> None:
        self.server.handle(Prefill(seq_ids, token_ids, params, max_len, num_rows, features))

    def speculate(self, request: SpecRequest) -> Speculation:
        reply = self.server.handle(request)
        self.server.fill()
        return reply

    def release(self, seq_ids: list[int]) -> None:
        self.server.handle(Release(seq_ids))

    def close(self) -> None:
        self.alive = False
