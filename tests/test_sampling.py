"""Sampling parameters, the warped distributions, stop conditions, prompt forms and the errors
a user meets first."""
from __future__ import annotations

import json

import pytest
import torch

from saguaro import LLM, SamplingParams
from saguaro.engine.sampler import WarpParams, sample, warp
from saguaro.models.config import ModelConfig, UnsupportedModelError
from saguaro.models.llama import LlamaModel
from saguaro.models.checkpoint import save_checkpoint
from saguaro.models.hub import ModelNotFoundError
from saguaro.models.pairing import IncompatibleDraftError, load_draft


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]


# --- warped distributions ----------------------------------------------------------------------

def warped(logits: torch.Tensor, **kwargs) -> torch.Tensor:
    return warp(logits, WarpParams.of([SamplingParams(**kwargs)] * len(logits)))


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches top_p, renormalized (one row)."""
    probs = logits.softmax(-1)
    kept = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for token in probs.argsort(descending=True).tolist():
        kept[token] = True
        mass += probs[token].item()
        if mass >= top_p:
            break
    return torch.where(kept, probs, 0) / probs[kept].sum()


@pytest.fixture
def logits() -> torch.Tensor:
    return 3 * torch.randn(6, 40, generator=torch.Generator().manual_seed(0))


def test_temperature_scales_logits(logits):
    torch.testing.assert_close(warped(logits, temperature=0.5), (logits / 0.5).softmax(-1))


def test_greedy_is_a_point_mass_on_the_argmax(logits):
    probs = warped(logits, temperature=0)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 40).float())


def test_top_k_keeps_the_k_most_likely(logits):
    probs = warped(logits, top_k=5)
    top = logits.topk(5).indices
    assert ((probs > 0).sum(-1) == 5).all()
    torch.testing.assert_close(probs.gather(-1, top), logits.gather(-1, top).softmax(-1))


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_top_p_keeps_the_smallest_nucleus(logits, top_p):
    probs = warped(logits, top_p=top_p)
    for row, expected in zip(probs, logits):
        torch.testing.assert_close(row, reference_top_p(expected, top_p))


def test_rows_keep_their_own_parameters(logits):
    params = [SamplingParams(temperature=0), SamplingParams(top_k=3), SamplingParams(top_p=0.5),
              SamplingParams(temperature=2.0), SamplingParams(top_k=10, top_p=0.9), SamplingParams()]
    probs = warp(logits, WarpParams.of(params))
    for i, p in enumerate(params):
        torch.testing.assert_close(probs[i], warped(logits[i:i + 1], **vars(p))[0])


def test_sampling_never_picks_a_masked_token(logits):
    probs = warped(logits, top_k=2).repeat(500, 1)
    tokens = sample(probs, torch.rand(len(probs), generator=torch.Generator().manual_seed(1)))
    assert (probs.gather(-1, tokens[:, None]) > 0).all()
    assert torch.equal(sample(probs[:6], torch.full((6,), 0.999999)), probs[:6].nonzero()[1::2, 1])


# A tiny temperature or top_p in float32: 1e-39 is denormal (logits / T overflow, softmax gives
# NaN), 1e-46 is zero. Each samples as the limit it approaches, greedy.
TINY = [dict(temperature=1e-39), dict(temperature=1e-46), dict(temperature=1.5, top_p=1e-46),
        dict(temperature=1e-20, top_p=1e-39, top_k=5)]


@pytest.mark.parametrize("kwargs", TINY)
def test_a_tiny_temperature_or_top_p_is_a_point_mass_on_the_argmax(logits, kwargs):
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), 40).float()
    assert torch.equal(warped(logits, **kwargs), greedy)
    u = torch.rand(len(logits), generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample(warped(logits, **kwargs), u), logits.argmax(-1))


def test_mixed_rows_keep_a_tiny_temperature_greedy(logits):
    params = [SamplingParams(temperature=1e-39), SamplingParams(temperature=1.0)] * 3
    probs = warp(logits, WarpParams.of(params))
    assert torch.equal(probs[::2], torch.nn.functional.one_hot(logits[::2].argmax(-1), 40).float())
    torch.testing.assert_close(probs[1::2], logits[1::2].softmax(-1))


@pytest.mark.parametrize("bad", [float("nan"), 0.0])
def test_sampling_from_no_distribution_raises(logits, bad):
    probs = logits.softmax(-1)
    probs[3] = bad
    with pytest.raises(ValueError, match="not a distribution"):
        sample(probs, torch.full((len(probs),), 0.5))


# --- generation: seeds, stop conditions, prompt forms -----------------------------------------------

CHAT = [{"role": "user", "content": "Reply with one word: what colour is the sky on a clear day?"}]


def generate(llm: LLM, prompt, **kwargs):
    return llm.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


def test_seed_reproduces_a_request(llm):
    first = generate(llm, "My favourite animal is", temperature=1.0, seed=7, max_tokens=12)
    again = generate(llm, "My favourite animal is", temperature=1.0, seed=7, max_tokens=12)
    other = generate(llm, "My favourite animal is", temperature=1.0, seed=8, max_tokens=12)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


def test_seed_is_per_request_not_per_batch(llm):
    alone = generate(llm, "My favourite animal is", temperature=1.0, seed=7, max_tokens=12)
    batch = llm.generate(["Write a poem:", "My favourite animal is"],
                         [SamplingParams(temperature=1.0, seed=3, max_tokens=20),
                          SamplingParams(temperature=1.0, seed=7, max_tokens=12)], use_tqdm=False)
    assert batch[1].token_ids == alone.token_ids


@pytest.mark.parametrize("kwargs", TINY[:3])
def test_a_tiny_temperature_or_top_p_generates_greedily(llm, kwargs):
    greedy = generate(llm, "The capital of France is", temperature=0, max_tokens=8).token_ids
    for seed in (3, 4):
        assert generate(llm, "The capital of France is", seed=seed, max_tokens=8, **kwargs).token_ids == greedy


def test_eos_stops_and_ignore_eos_continues(llm):
    stopped = generate(llm, CHAT, temperature=0, max_tokens=48)
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 48
    assert stopped.token_ids[-1] in llm.eos_token_ids
    longer = generate(llm, CHAT, temperature=0, max_tokens=len(stopped.token_ids) + 4, ignore_eos=True)
    assert longer.finish_reason == "length" and len(longer.token_ids) == len(stopped.token_ids) + 4
    assert longer.token_ids[:len(stopped.token_ids)] == stopped.token_ids


def test_max_tokens(llm):
    out = generate(llm, "def quicksort(xs):", temperature=0, max_tokens=7)
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_stop_token_ids(llm):
    full = generate(llm, "def quicksort(xs):", temperature=0, max_tokens=24).token_ids
    stop = full[5]
    out = generate(llm, "def quicksort(xs):", temperature=0, max_tokens=24, stop_token_ids=[stop])
    assert out.finish_reason == "stop"
    assert out.token_ids == full[:full.index(stop) + 1]


def test_stop_strings_truncate_the_text(llm):
    full = generate(llm, "def quicksort(xs):", temperature=0, max_tokens=32).text
    stop = full[12:16]
    out = generate(llm, "def quicksort(xs):", temperature=0, max_tokens=32, stop=[stop, "never appears"])
    assert out.finish_reason == "stop"
    assert out.text == full[:full.index(stop)]
    assert len(out.token_ids) < 32


def test_prompt_forms(llm):
    text = "The three primary colours are"
    ids = llm.tokenizer(text)["input_ids"]
    assert llm.encode(text) == ids and llm.encode(ids) == ids
    chat_ids = llm.encode(CHAT)
    assert llm.tokenizer.decode(chat_ids).endswith("<|im_start|>assistant\n")  # generation prompt added
    outs = llm.generate([text, ids, CHAT], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[2].token_ids == generate(llm, chat_ids, temperature=0, max_tokens=6).token_ids
    assert outs[2].prompt_token_ids == chat_ids


# --- errors -------------------------------------------------------------------------------------------

def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)


def test_prompt_of_the_wrong_type(llm):
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([[1.5, 2.5]], use_tqdm=False)


def test_one_params_per_prompt(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)


def test_context_overflow(llm):
    with pytest.raises(ValueError, match="context"):
        generate(llm, "hi", max_tokens=llm.target.config.max_position_embeddings)


def test_unknown_method():
    with pytest.raises(ValueError, match="unknown method"):
        LLM("smollm2", method="magic")


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model"):
        LLM(str(tmp_path / "nothing-here"))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        LLM(str(tmp_path))


def test_draft_vocabulary_mismatch(llm, tmp_path):
    config = ModelConfig(vocab_size=100, hidden_size=llm.target.config.hidden_size, intermediate_size=64,
                         num_layers=1, num_heads=3, num_kv_heads=1, head_dim=64)
    save_checkpoint(LlamaModel(config), tmp_path, share_embeddings=False)
    with pytest.raises(IncompatibleDraftError, match="vocabulary"):
        load_draft(tmp_path, llm.target)
