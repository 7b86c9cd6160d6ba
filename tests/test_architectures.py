"""Decoding on the architectures beyond Llama's layers: cached one-token AR equals recomputing the
whole text at every step, and greedy SD and SSD (whose worker drafts trees) commit AR's tokens,
on tiny random Gemma 3 and SmolLM3 models whose texts run well past their sliding windows."""
from __future__ import annotations

import pytest
import torch
import transformers

from drafts import InProcessDraft, sd_decoder, ssd_decoder, ssd_of, worker_config
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.sequence import Sequence
from saguaro.models.kv_cache import KVCache
from saguaro.models.checkpoint import load_checkpoint, save_checkpoint
from saguaro.models.loader import load_model
from saguaro.speculation.build import ar_decoder
from test_parity import CONFIGS, FOUR_LAYERS, SMALL, TOKEN_IDS, hf_logits, saguaro_logits
from test_ssd import decode_all

K = 3
NEW = 30  # tokens per sequence: prompt and continuation span many windows of 4
PROMPTS = [[5, 17, 33, 2, 60, 71], [9, 9, 40], [88, 3, 12, 54, 21, 7, 30, 66, 1]]

# Two-layer drafts of the same architecture: one layer with a window, one without (or without rope).
DRAFT_CONFIGS = {
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=4, query_pre_attn_scalar=24, attn_implementation="eager",
        layer_types=["sliding_attention", "full_attention"]),
    "smollm3": lambda: transformers.SmolLM3Config(**SMALL | TOKEN_IDS, no_rope_layer_interval=2),
}
# SmolLM3 with its window on the layers without rope, as its config builds the layer types.
CONFIGS_WITH_WINDOWS = {
    "gemma3_text": CONFIGS["gemma3_text"],
    "smollm3": lambda: transformers.SmolLM3Config(**FOUR_LAYERS | TOKEN_IDS, no_rope_layer_interval=2,
                                                  use_sliding_window=True, sliding_window=4),
}


def saved(folder, hf) -> str:
    hf.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=list(CONFIGS_WITH_WINDOWS))
def models(request, tmp_path_factory):
    """(target, draft folder, the target itself as a folder, the transformers target): a random
    draft, whose proposals are mostly rejected, and the target as its own draft, whose proposals
    are all accepted."""
    arch = request.param
    torch.manual_seed(0)
    target_hf = transformers.AutoModelForCausalLM.from_config(CONFIGS_WITH_WINDOWS[arch]()).eval().requires_grad_(False)
    target_dir = saved(tmp_path_factory.mktemp(f"{arch}-target"), target_hf)
    torch.manual_seed(1)
    draft_hf = transformers.AutoModelForCausalLM.from_config(DRAFT_CONFIGS[arch]()).eval()
    draft_dir = saved(tmp_path_factory.mktemp(f"{arch}-draft"), draft_hf)
    target = load_model(target_dir)
    assert target.config.sliding_layers and target.config.sliding_window == 4
    return target, draft_dir, target_dir, target_hf


def greedy(decoder) -> list[list[int]]:
    seqs = [Sequence(i, p, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), [])
            for i, p in enumerate(PROMPTS)]
    decoder.reserve(len(seqs), max(map(len, PROMPTS)) + NEW + 2 * (K + 1))
    decode_all(decoder, seqs)
    return [s.output_ids for s in seqs]


def recomputed_greedy(model, prompt: list[int]) -> list[int]:
    """Greedy decoding that runs the whole text from an empty cache at every step."""
    tokens = list(prompt)
    for _ in range(NEW):
        tokens.append(int(saguaro_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def test_the_target_matches_transformers(models):
    target, target_hf = models[0], models[3]
    tokens = (PROMPTS[2] * 9)[:80]
    assert (saguaro_logits(target, tokens) - hf_logits(target_hf, tokens)).abs().max() < 1e-4


def test_a_saguaro_checkpoint_keeps_the_features(models, tmp_path):
    """Drafts are saved as saguaro checkpoints (config.json of ModelConfig's fields)."""
    target = models[0]
    save_checkpoint(target, tmp_path, dtype=torch.float32, share_embeddings=False)
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == target.config
    tokens = PROMPTS[2] * 3
    assert torch.equal(saguaro_logits(loaded, tokens), saguaro_logits(target, tokens))


def test_cached_ar_equals_recomputing_the_text(models):
    target = models[0]
    assert greedy(ar_decoder(target)) == [recomputed_greedy(target, p) for p in PROMPTS]


@pytest.mark.parametrize("draft", ["random", "itself"])
def test_sd_greedy_equals_ar(models, draft):
    target, draft_dir, target_dir, _ = models
    drafter = load_model(draft_dir if draft == "random" else target_dir)
    assert greedy(sd_decoder(target, drafter, K)) == greedy(ar_decoder(target))


def test_ssd_greedy_equals_ar(models):
    """The worker drafts a tree of branches per round (fan-out 3 at each depth), so the draft's
    windows apply through tree masks."""
    target, _, target_dir, _ = models
    worker = InProcessDraft(worker_config(target_dir, "float32", K, [3] * (K + 1)), None)
    decoder = ssd_decoder(target, worker, "neural")
    assert greedy(decoder) == greedy(ar_decoder(target))
    assert ssd_of(decoder).stats.hit_lengths  # some rounds used the cached tree


def test_tree_branches_equal_their_own_texts(models):
    """Two branches over a shared prefix in one pass, their nodes interleaved depth-major as the
    SSD worker lays them out (so slot distances are not position distances): each branch's
    logits are those of its own text run alone, windows included."""
    target = models[0]
    prefix, branches = PROMPTS[2] * 2, [[4, 8, 15, 16, 23, 42], [50, 51, 52, 53, 54, 55]]
    P, D = len(prefix), len(branches[0])
    depth = torch.arange(D).repeat_interleave(2)  # node i: depth i // 2 of branch i % 2
    branch = torch.arange(2).repeat(D)
    slots = torch.cat([torch.arange(P), P + torch.arange(2 * D)])
    positions = torch.cat([torch.arange(P), P + depth])
    tokens = prefix + [branches[b][d] for d, b in zip(depth.tolist(), branch.tolist())]
    sees = torch.arange(P + 2 * D) < P  # every node sees the prefix ...
    tree = (branch[:, None] == branch[None]) & (depth[None] <= depth[:, None])  # ... and its ancestors
    mask = torch.cat([torch.arange(P + 2 * D)[None] <= torch.arange(P)[:, None],
                      sees[None].expand(2 * D, -1).clone()])
    mask[P:, P:] = tree
    cache = KVCache(target.config, 1, P + 2 * D, target.dtype)
    hidden = target(torch.tensor([tokens]), positions[None], cache, slots=slots[None], mask=mask[None])
    logits = target.logits(hidden)[0, P:]
    for b in range(2):
        alone = saguaro_logits(target, prefix + branches[b])[P:]
        assert (logits[branch == b] - alone).abs().max() < 1e-4


def test_control_ar_without_the_window_decodes_differently(models):
    """So the equalities above compare decodings that the window shapes."""
    target = models[0]
    sliding = target.config.sliding_layers
    try:
        target.config.sliding_layers = []
        for layer in target.layers:
            layer.sliding = False
        unwindowed = greedy(ar_decoder(target))
    finally:
        target.config.sliding_layers = sliding
        for i, layer in enumerate(target.layers):
            layer.sliding = i in sliding
    assert unwindowed != greedy(ar_decoder(target))
