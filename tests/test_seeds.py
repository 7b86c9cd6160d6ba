"""A seeded request's output does not depend on what shares its batch: a batch of seeded sampled
requests of different lengths, parameters and prompts, decoded together, commits for each
exactly what the same request commits alone, in every method where that can hold (AR; SD with
chains, prompt lookup and token trees; SSD with a fixed fan-out and backup). Where it cannot
(auto; SSD's re-fitted fan-out and chosen backup), docs/DESIGN.md section 2.7 says why."""
from __future__ import annotations

import pytest
import torch

from drafts import InProcessDraft, sd_decoder, ssd_decoder, worker_config
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.models.checkpoint import save_checkpoint
from saguaro.speculation import build
from test_exactness import PROMPT, TINY_K, TINY_V, tiny_model

REQUESTS = 8
PROMPTS = [PROMPT + [i % TINY_V, (3 * i) % TINY_V] for i in range(REQUESTS)]
PARAMS = [SamplingParams(temperature=(0.7, 1.0, 1.3)[i % 3], top_k=(0, 4)[i % 2], max_tokens=8 + 3 * i, seed=100 + i)
          for i in range(REQUESTS)]
TREE = dict(tree_topk=3, num_draft_tokens=6)
FAN_OUT = [3, 2, 2]  # K + 1 = 3 counts: hits and misses mix

METHODS = {  # name: (decoder options; ssd: (backup, prompt_lookup))
    "ar": None,
    "sd": dict(prompt_lookup=None),
    "sd-lookup": dict(prompt_lookup=1),  # a one-token match is common in 8 tokens: lookups beside drafts
    "sd-tree": dict(prompt_lookup=None, **TREE),
    "sd-tree-lookup": dict(prompt_lookup=1, **TREE),  # a lookup's chain of K nodes beside trees of 6
    "ssd-neural": ("neural", None),
    "ssd-fast": ("fast", None),
    "ssd-neural-lookup": ("neural", 1),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, draft = tiny_model(seed=10, layers=2), tiny_model(seed=11, layers=1)
    folder = tmp_path_factory.mktemp("seeds-draft")
    save_checkpoint(draft, folder, dtype=torch.float32, share_embeddings=False)
    return target, draft, folder


def decoder_for(method: str, models):
    target, draft, folder = models
    options = METHODS[method]
    if options is None:
        return build.ar_decoder(target)
    if method.startswith("sd"):
        return sd_decoder(target, draft, TINY_K, **options)
    backup, lookup = options
    return ssd_decoder(target, InProcessDraft(worker_config(str(folder), "float32", TINY_K, FAN_OUT,
                                                            prompt_lookup=lookup), None), backup)


def outputs(method: str, models, requests: list[int]) -> dict[int, list[int]]:
    """The requests decoded together by a new decoder, finished ones leaving the batch."""
    decoder = decoder_for(method, models)
    seqs = [Sequence(i, PROMPTS[i], PARAMS[i], []) for i in requests]
    decoder.reserve(len(seqs), max(len(p) for p in PROMPTS) + max(p.max_tokens for p in PARAMS) + decoder.lookahead)
    decoder.prefill(seqs)
    while active := [s for s in seqs if not s.finished]:
        decoder.step(active)
        decoder.release([s for s in active if s.finished])
    decoder.close()
    return {s.seq_id: s.output_ids for s in seqs}


@pytest.mark.parametrize("method", list(METHODS))
def test_a_seeded_request_commits_in_a_batch_what_it_commits_alone(models, method):
    together = outputs(method, models, list(range(REQUESTS)))
    alone = {i: outputs(method, models, [i])[i] for i in range(REQUESTS)}
    assert len(set(map(tuple, together.values()))) == REQUESTS  # the seeds differ, so do the outputs
    assert [i for i in range(REQUESTS) if together[i] != alone[i]] == []
