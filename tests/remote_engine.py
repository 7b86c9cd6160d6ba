"""An SSD engine whose draft worker attaches from another host: `python tests/remote_engine.py
TARGET_DIR DRAFT_DIR HOST:PORT PROMPTS_JSON` decodes each prompt greedily with SSD (the worker
awaited at HOST:PORT) and with AR, as one batch each, and prints both with the wire's figures as
JSON. tests/test_ssd.py runs it in one network namespace, the worker in another."""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from saguaro.config import SpeculativeConfig
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.models.checkpoint import load_checkpoint
from saguaro.speculation.build import ar_decoder
from saguaro.speculation.protocol import DraftSpec
from saguaro.speculation.remote.client import DraftClient, WorkerConfig

from drafts import ssd_decoder, ssd_of
from netns import listening_addresses

NEW_TOKENS = 8


def greedy(decoder, prompts: list[list[int]]) -> list[list[int]]:
    seqs = [Sequence(i, p, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), []) for i, p in enumerate(prompts)]
    decoder.reserve(len(seqs), max(map(len, prompts)) + NEW_TOKENS + decoder.lookahead)
    decoder.prefill(seqs)
    while active := [s for s in seqs if not s.finished]:
        decoder.step(active)
    return [s.output_ids for s in seqs]


def main(target_dir: str, draft_dir: str, address: str, prompts_json: str) -> None:
    torch.set_num_threads(1)
    target = load_checkpoint(target_dir, torch.float32)
    prompts = json.loads(prompts_json)
    spec = SpeculativeConfig("ssd", draft_dir, 2, fan_out=[1, 1, 1], draft_address=address)
    client = DraftClient(WorkerConfig(DraftSpec(spec, "float32"), timeout_s=60, startup_timeout_s=60), None)
    ssd = ssd_decoder(target, client, backup="neural")
    try:
        got = greedy(ssd, prompts)
        listening = sorted(listening_addresses(os.getpid()))  # the rendezvous store's and the connection's
        stats = ssd_of(ssd).stats
        report = {"ssd": got, "ar": greedy(ar_decoder(target), prompts), "rounds": len(stats.verify_s),
                  "bytes_sent": client.channel.bytes_sent, "bytes_received": client.channel.bytes_received,
                  "wait_s_median": statistics.median(stats.wait_s), "worker_pid": client.ready.pid,
                  "listening": listening}
    finally:
        ssd.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
