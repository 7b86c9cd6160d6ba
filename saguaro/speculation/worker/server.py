"""The draft worker process: `python -m saguaro.speculation.worker --connect HOST:PORT`.

The engine starts one on this host by default; started by hand on another host (or GPU), it
attaches to an engine that waits at the given address.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

import torch

from saguaro.models import graphs
from saguaro.models.prefix_cache import new_prefix_cache
from saguaro.models.checkpoint import is_saguaro_checkpoint, load_checkpoint
from saguaro.models.loader import load_model
from saguaro.models.pairing import fit_vocabulary
from saguaro.models.quantized import resolve_dtype
from saguaro.system import use_cores
from saguaro.speculation.protocol import (SECRET_ENV, Channel, DraftRefused, Hello, Prefill, Ready, Release, Shutdown, SparseProbs,
                                          Speculation, SpecRequest)
from saguaro.speculation.worker.speculator import Speculator


def read_draft(hello: Hello, device: str):
    draft = hello.draft
    dtype, path = resolve_dtype(draft.dtype), draft.speculative.draft
    if is_saguaro_checkpoint(path):
        return load_checkpoint(path, dtype, device, embeddings=hello.embeddings, quantization=draft.quantization)
    model = load_model(path, dtype, device, draft.quantization)
    return fit_vocabulary(model, *draft.vocabulary) if draft.vocabulary is not None else model


def load_draft_model(hello: Hello, device: str):
    return graphs.attach(read_draft(hello, device), hello.draft.cuda_graphs)


class DraftServer:
    """Turns protocol messages into speculator calls (the worker process's loop is `serve`)."""

    def __init__(self, hello: Hello, device: str):
        draft = load_draft_model(hello, device)
        spec = hello.draft.speculative
        self.speculator = Speculator(draft, spec.num_speculative_tokens, spec.fan_out, spec.saguaro_c,
                                     spec.prompt_lookup, hello.incarnation, new_prefix_cache(hello.draft.prefix_cache_mb),
                                     spec.proposal_top, spec.share_window)
        head = draft.head_token_ids.tolist() if draft.config.head_vocab_size is not None else None
        self.ready = Ready(vocab_size=draft.config.vocab_size, num_layers=draft.config.num_layers, pid=os.getpid(),
                           head_token_ids=head, reads_features=draft.reads_features)
        self.fill_time = 0.0
        self.pending: list[int] = []  # requests whose cache is to be filled after the reply

    @torch.inference_mode()
    def handle(self, message) -> Speculation | None:
        """Applies a message; returns the reply a SpecRequest needs, None otherwise."""
        if isinstance(message, Prefill):
            self.speculator.add(message.seq_ids, message.token_ids, message.params, message.max_len,
                                message.num_rows, message.features, message.processing)
        elif isinstance(message, SpecRequest):
            if message.fan_out is not None:
                self.speculator.set_fan_out(message.fan_out)
            start = time.perf_counter()
            requests = self.speculator.speculate(message.seq_ids, message.outcomes, message.backup,
                                                 message.features)
            self.pending = message.seq_ids
            if top := self.speculator.proposal_top:
                requests = [r if r.probs is None else replace(r, probs=SparseProbs.of(r.probs, top)) for r in requests]
            return Speculation(requests, self.fill_time, time.perf_counter() - start,
                               self.speculator.take_drafted_tokens())
        elif isinstance(message, Release):
            self.speculator.release(message.seq_ids)
        return None

    def fill(self) -> None:
        """Fills the speculation cache for the requests just answered (overlaps verification)."""
        if self.pending:
            self.fill_time = self.speculator.fill(self.pending)
            self.pending = []


def serve(channel: Channel, device: str) -> None:
    server = DraftServer(channel.recv(), device)
    channel.send(server.ready)
    while not isinstance(message := channel.recv(), Shutdown):
        reply = server.handle(message)
        if reply is not None:
            channel.send(reply)
            server.fill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="saguaro draft worker")
    parser.add_argument("--connect", required=True, help="HOST:PORT of the engine")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--link", choices=["nccl", "tcp"], default=None,
                        help="how messages travel: nccl between two GPUs, tcp through the host (default: nccl "
                             "where --device is a GPU); a worker on its engine's own GPU takes tcp, as NCCL "
                             "joins no two processes on one device")
    parser.add_argument("--cpus", default=None, help="CPU cores to pin to, e.g. '1' or '2,3'")
    parser.add_argument("--timeout", type=float, default=7 * 24 * 3600.0,
                        help="seconds to wait for the engine (to connect, and between messages)")
    parser.add_argument("--draft-secret", default=None,
                        help=f"the secret the engine was given (default: ${SECRET_ENV}, which, unlike this "
                             f"option, other users cannot read with ps)")
    args = parser.parse_args(argv)
    secret = args.draft_secret or os.environ.get(SECRET_ENV, "")
    if args.cpus:
        cores = {int(c) for c in args.cpus.split(",")}
        use_cores(cores, len(cores))
    host, port = args.connect.rsplit(":", 1)
    link = args.link or ("nccl" if args.device.startswith("cuda") else "tcp")
    channel = Channel(host.strip("[]"), int(port), rank=1, device=args.device if link == "nccl" else "cpu",
                      timeout_s=args.timeout).connect()
    try:
        channel.authenticate(secret)
    except DraftRefused as e:
        raise SystemExit(f"saguaro draft worker: {e}") from None
    serve(channel, args.device)


if __name__ == "__main__":
    main()
