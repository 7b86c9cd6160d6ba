"""A tensor-parallel target (saguaro.models.tensor_parallel): the slices reassemble the model,
two ranks (real processes, gloo, fp32) give TP = 1's logits within fp32 rounding and its greedy
tokens, SD and SSD on a two-rank target equal AR, and the SD distribution test (with its
broken-rule control) passes through a two-rank target."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import NEW_TOKENS
from drafts import sd_decoder
from saguaro import LLM, SamplingParams
from saguaro.config import SpeculativeConfig
import saguaro.engine.verifier as verification
from saguaro.engine.loop import Engine
from saguaro.engine.runner import forward_chunks
from saguaro.models import hub
from saguaro.models.config import ModelConfig
from saguaro.models.kv_cache import new_cache
from saguaro.models.llama import LlamaModel
from saguaro.models.checkpoint import save_checkpoint
from saguaro.models.tensor_parallel import shard_config, shard_state, split, tensor_parallel
from saguaro.models.pairing import load_paired_draft, resolve_model
from saguaro.speculation.build import make_decoder, ssd_decoder, ssd_proposer
from stats import ks_pvalue, teacher_forced_pit
from test_exactness import ALPHA, TINY_K, TINY_V, residual_is_p, sampled, tiny_model, tiny_outputs, tiny_prompts


def test_uneven_splits_give_every_rank_whole_kv_heads():
    assert split(3, 2) == [(0, 1), (1, 3)]
    config = ModelConfig(vocab_size=8, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                         num_kv_heads=3, head_dim=64)
    shards = [shard_config(config, r, 2) for r in range(2)]
    assert [(s.num_heads, s.num_kv_heads, s.intermediate_size) for s in shards] == [(3, 1, 768), (6, 2, 768)]
    with pytest.raises(ValueError, match="KV heads"):
        shard_config(config, 0, 4)


@pytest.mark.parametrize("world", [2, 3])
def test_the_slices_reassemble_each_projection(world):
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=8, hidden_size=24, intermediate_size=10, num_layers=1, num_heads=6,
                         num_kv_heads=3, head_dim=4, attention_bias=True)
    model = LlamaModel(config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    shards = [shard_state(config, state, r, world) for r in range(world)]
    D, H, Hkv, I = 4, 6, 3, 10
    for kind in ("weight", "bias"):
        whole = state[f"layers.0.self_attn.qkv_proj.{kind}"]
        q, k, v = whole.split([H * D, Hkv * D, Hkv * D])
        parts = [s[f"layers.0.self_attn.qkv_proj.{kind}"] for s in shards]
        sizes = [shard_config(config, r, world) for r in range(world)]
        pieces = [p.split([c.num_heads * D, c.num_kv_heads * D, c.num_kv_heads * D]) for p, c in zip(parts, sizes)]
        for j, reference in enumerate((q, k, v)):
            assert torch.equal(torch.cat([p[j] for p in pieces]), reference)
    assert torch.equal(torch.cat([s["layers.0.self_attn.o_proj.weight"] for s in shards], 1),
                       state["layers.0.self_attn.o_proj.weight"])
    gate_up = [s["layers.0.mlp.gate_up_proj.weight"].chunk(2) for s in shards]
    assert torch.equal(torch.cat([g for g, _ in gate_up] + [u for _, u in gate_up]), state["layers.0.mlp.gate_up_proj.weight"])
    assert torch.equal(torch.cat([s["layers.0.mlp.down_proj.weight"] for s in shards], 1),
                       state["layers.0.mlp.down_proj.weight"])
    assert all(torch.equal(s["embed_tokens.weight"], state["embed_tokens.weight"]) for s in shards)
    assert I == sum(c.intermediate_size for c in (shard_config(config, r, world) for r in range(world)))


@pytest.fixture(scope="module")
def tp_llm():
    """The default model in fp32 on two ranks: this process and one worker."""
    with LLM(hub.DEFAULT_MODEL, method="ar", dtype="float32", tensor_parallel_size=2) as llm:
        yield llm


def test_two_ranks_give_one_ranks_logits_within_fp32_rounding(tp_llm, llm, prompts):
    chunks = prompts[:3]
    logits = []
    for model in (tp_llm.target, llm.target):
        cache = new_cache(model, len(chunks), max(map(len, chunks)))
        hidden = forward_chunks(model, cache, list(range(len(chunks))), chunks, [0] * len(chunks))
        logits.append(model.logits(hidden[:, :min(map(len, chunks))]))
    error = (logits[0] - logits[1]).abs().max() / logits[1].abs().max()
    assert 0 < error < 1e-5  # different sums in the same dtype: close, not identical


def test_two_ranks_decode_one_ranks_greedy_tokens(tp_llm, prompts, ar_greedy):
    outputs = tp_llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outputs] == ar_greedy[:4]


def speculative_outputs(llm: LLM, decoder, prompts) -> list[list[int]]:
    try:
        with llm.decoding_with(Engine(decoder)):
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    finally:
        decoder.close()
    return [o.token_ids for o in outputs]


def test_sd_and_ssd_on_two_ranks_equal_ar(tp_llm, prompts, ar_greedy):
    spec = SpeculativeConfig(method="sd", num_speculative_tokens=4)
    model = resolve_model(hub.DEFAULT_MODEL)
    sd = make_decoder(tp_llm.target, spec, model, load_paired_draft(model, tp_llm.target))
    assert speculative_outputs(tp_llm, sd, prompts[4:6]) == ar_greedy[4:6]
    ssd = ssd_decoder(ssd_proposer(tp_llm.target, replace(spec, method="ssd"), model.draft, None), tp_llm.target)
    assert speculative_outputs(tp_llm, ssd, prompts[6:8]) == ar_greedy[6:8]
    assert ssd.metrics()["cache_hits"] > 0


@pytest.fixture(scope="module")
def tiny_two_ranks(tmp_path_factory):
    """A tiny random target with two KV heads, whole (the reference) and on two ranks."""
    whole = tiny_model(seed=10, layers=2)
    config = replace(whole.config, num_kv_heads=2)
    torch.manual_seed(10)
    whole = LlamaModel(config).eval().requires_grad_(False)
    whole.lm_head.weight.mul_(3.0)
    folder = tmp_path_factory.mktemp("tiny-tp")
    save_checkpoint(whole, folder, dtype=torch.float32, share_embeddings=False)
    ranks = tensor_parallel(folder, torch.float32, 2)
    yield whole, ranks
    ranks.tensor_parallel.close()


def tp_pvalue(tiny_two_ranks) -> float:
    whole, ranks = tiny_two_ranks
    params = sampled(1.0)
    outputs = tiny_outputs(sd_decoder(ranks, tiny_model(seed=11, layers=1), TINY_K), params)
    return ks_pvalue(teacher_forced_pit(whole, tiny_prompts(len(params)), outputs, params))


def test_sd_on_two_ranks_samples_the_whole_targets_distribution(tiny_two_ranks):
    assert tiny_two_ranks[1].config.num_kv_heads == 1 and TINY_V == tiny_two_ranks[1].config.vocab_size
    assert tp_pvalue(tiny_two_ranks) > ALPHA


def test_sd_on_two_ranks_check_catches_a_broken_acceptance_rule(tiny_two_ranks, monkeypatch):
    monkeypatch.setattr(verification, "verify", residual_is_p)
    assert tp_pvalue(tiny_two_ranks) < ALPHA


def test_tensor_parallel_refuses_quantized_weights():
    with pytest.raises(ValueError, match="full-precision"):
        LLM(hub.DEFAULT_MODEL, method="ar", quantization="int4", tensor_parallel_size=2)


@pytest.mark.parametrize("arch", ["smollm3", "phi3", "gemma2", "gemma3_text"])
def test_two_ranks_run_the_other_architectures(arch, tmp_path):
    """Per-head features (q/k norms, soft caps, partial or absent rope, windows) slice with the
    heads, and the sandwich norms read the summed outputs: two ranks give transformers' logits."""
    from test_parity import hf_logits, max_diff, saguaro_logits, tiny_model

    hf = tiny_model(arch)
    hf.save_pretrained(tmp_path)
    ranks = tensor_parallel(tmp_path, torch.float32, 2)
    try:
        assert ranks.config.num_kv_heads == 1
        tokens = list(range(3, 83))
        assert max_diff(saguaro_logits(ranks, tokens), hf_logits(hf, tokens)) < 1e-4
    finally:
        ranks.tensor_parallel.close()
