"""The draft worker process: `python -m saguaro.draft.worker --connect HOST:PORT`.

The engine starts one on this host by default; started by hand on another host (or GPU), it
attaches to an engine that waits at the given address.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from saguaro.draft.protocol import (Channel, Hello, Prefill, Ready, Release, Shutdown, Speculation,
                                    SpecRequest)
from saguaro.draft.speculator import Speculator
from saguaro.llm import resolve_dtype
from saguaro.models.loader import is_saguaro_checkpoint, load_checkpoint, load_model


def load_draft_model(hello: Hello, device: str):
    dtype = resolve_dtype(hello.dtype)
    if is_saguaro_checkpoint(hello.draft):
        return load_checkpoint(hello.draft, dtype, device, embeddings=hello.embeddings)
    return load_model(hello.draft, dtype, device)


@torch.inference_mode()
def serve(channel: Channel, device: str) -> None:
    hello: Hello = channel.recv()
    draft = load_draft_model(hello, device)
    speculator = Speculator(draft, hello.num_speculative_tokens, hello.fan_out, hello.saguaro_c)
    channel.send(Ready(vocab_size=draft.config.vocab_size, num_layers=draft.config.num_layers, pid=os.getpid()))
    fill_time = 0.0
    while True:
        message = channel.recv()
        if isinstance(message, Prefill):
            speculator.add(message.seq_ids, message.token_ids, message.params, message.max_len)
        elif isinstance(message, SpecRequest):
            if message.fan_out is not None:
                speculator.fan_out = list(message.fan_out)
            start = time.perf_counter()
            tokens, hits, probs = speculator.speculate(message.seq_ids, message.outcomes, message.backup)
            backup_time = time.perf_counter() - start
            channel.send(Speculation(tokens, hits, probs, fill_time, backup_time))
            fill_time = speculator.fill(message.seq_ids)
        elif isinstance(message, Release):
            speculator.release(message.seq_ids)
        elif isinstance(message, Shutdown):
            return


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="saguaro draft worker")
    parser.add_argument("--connect", required=True, help="HOST:PORT of the engine")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cpus", default=None, help="CPU cores to pin to, e.g. '1' or '2,3'")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the engine")
    args = parser.parse_args(argv)
    if args.cpus:
        cores = {int(c) for c in args.cpus.split(",")}
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    host, port = args.connect.rsplit(":", 1)
    channel = Channel(host, int(port), rank=1, device=args.device, timeout_s=args.timeout).connect()
    serve(channel, args.device)


if __name__ == "__main__":
    main()
