"""Any draft file for any target file of the same tokenizer: two tiny random Llama models written
as GGUF files with SmolLM2's tokenizer make a pair that SD, SSD and auto decode with exactly as
AR does, as do drafts whose vocabulary is padded to fewer or more rows than the target's (one
tokenizer); drafts whose tokenizer differs in a token, in EOS or in size are refused, the
message naming the difference."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from saguaro import LLM, SamplingParams
import saguaro.engine.verifier as verification
from saguaro.engine.rejection import verify
from saguaro.models.gguf_file import read_gguf_file
from saguaro.models.llama import LlamaModel
from saguaro.models.pairing import IncompatibleDraftError, fit_vocabulary, resolve_model
from saguaro.models.tokenizer import load_tokenizer
from test_exactness import ALPHA, TINY_V, residual_is_p, sampled, sd_pvalue, tiny_model
from test_gguf import TOKENIZER_WRITERS, write_gguf

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            initializer_range=0.1, max_position_embeddings=256)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 24


def tiny_llama(vocab_size: int, layers: int, seed: int):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab_size, num_hidden_layers=layers, **TINY)
    return transformers.LlamaForCausalLM(config).eval().requires_grad_(False)


def write_pair_gguf(path, model, tokenizer: dict, tokens: list[str] | None = None, eos: int | None = None):
    """`model` as a llama GGUF file with the tokenizer metadata `tokenizer` (SmolLM2's fields),
    its token strings or EOS id replaced where given; the vocabulary is the model's rows."""
    fields = {key: tokenizer[key] for key in TOKENIZER_WRITERS} | {
        "tokenizer.ggml.tokens": tokens or tokenizer["tokenizer.ggml.tokens"],
        "tokenizer.ggml.eos_token_id": tokenizer["tokenizer.ggml.eos_token_id"] if eos is None else eos}
    return write_gguf(path, model, "llama", "tiny", keys={"vocab_size": model.config.vocab_size}, tokenizer=fields)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path) -> dict:
    return {k: v for k, v in read_gguf_file(smollm2_path).fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def files(smollm2_tokenizer, tmp_path_factory):
    """(target, draft) GGUF files of one tokenizer; the tokenizers converted from them are cached
    in a cache of the module's own."""
    folder = tmp_path_factory.mktemp("pair")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SAGUARO_CACHE", str(folder / "cache"))
        vocab = len(smollm2_tokenizer["tokenizer.ggml.tokens"])
        yield (write_pair_gguf(folder / "target.gguf", tiny_llama(vocab, 2, 0), smollm2_tokenizer),
               write_pair_gguf(folder / "draft.gguf", tiny_llama(vocab, 1, 1), smollm2_tokenizer))


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def ar_tokens(files):
    with LLM(str(files[0]), method="ar", dtype="float32") as llm:
        return greedy(llm)


@pytest.mark.parametrize("method", ["sd", "ssd", "auto"])
def test_pair_decodes_as_ar(files, ar_tokens, method):
    target, draft = files
    with LLM(str(target), method=method, draft=str(draft), dtype="float32") as llm:
        assert greedy(llm) == ar_tokens
        assert llm.decoder.counters.num_draft_tokens > 0  # the draft proposed
    assert all(len(tokens) == NEW_TOKENS for tokens in ar_tokens)


def worker_drafts(llm: LLM) -> list[str]:
    """The draft each SSD worker loaded."""
    return [lane.client.config.draft.speculative.draft for lane in llm.decoder.policy.choice.proposer.pool.lanes]


def test_ssd_drafts_with_a_draft_of_its_own(files, ar_tokens, smollm2_tokenizer, tmp_path):
    """SSD's worker loads --ssd-draft (deeper here), SD's the draft; both decode as AR does."""
    target, draft = files
    deeper = write_pair_gguf(tmp_path / "deeper.gguf", tiny_llama(len(smollm2_tokenizer["tokenizer.ggml.tokens"]), 2, 2),
                             smollm2_tokenizer)
    with LLM(str(target), method="ssd", draft=str(draft), ssd_draft=str(deeper), dtype="float32") as llm:
        assert greedy(llm) == ar_tokens
        assert worker_drafts(llm) == [str(deeper)]
        assert llm.decoder.counters.num_draft_tokens > 0
    with LLM(str(target), method="ssd", draft=str(draft), dtype="float32") as llm:
        assert worker_drafts(llm) == [str(draft)]  # without one of its own, SSD drafts with --draft


def test_an_ssd_draft_of_another_tokenizer_is_refused(files, smollm2_tokenizer, tmp_path):
    eos = smollm2_tokenizer["tokenizer.ggml.eos_token_id"]
    other = write_pair_gguf(tmp_path / "other.gguf", tiny_llama(len(smollm2_tokenizer["tokenizer.ggml.tokens"]), 1, 1),
                            smollm2_tokenizer, eos=eos + 1)
    with pytest.raises(IncompatibleDraftError, match="EOS"):
        LLM(str(files[0]), method="ssd", draft=str(files[1]), ssd_draft=str(other), dtype="float32")


def refusal(files, smollm2_tokenizer, tmp_path, **changes) -> str:
    vocab = changes.pop("vocab", len(smollm2_tokenizer["tokenizer.ggml.tokens"]))
    draft = write_pair_gguf(tmp_path / "draft.gguf", tiny_llama(vocab, 1, 1), smollm2_tokenizer, **changes)
    with pytest.raises(IncompatibleDraftError) as refused:
        LLM(str(files[0]), method="sd", draft=str(draft), dtype="float32")
    return str(refused.value)


def test_a_changed_token_is_named(files, smollm2_tokenizer, tmp_path):
    tokens = list(smollm2_tokenizer["tokenizer.ggml.tokens"])
    original, tokens[1234] = tokens[1234], "foo"
    message = refusal(files, smollm2_tokenizer, tmp_path, tokens=tokens)
    assert f"token 1234 is 'foo' in the draft and {original!r} in the target" in message


def test_a_different_eos_is_named(files, smollm2_tokenizer, tmp_path):
    eos = smollm2_tokenizer["tokenizer.ggml.eos_token_id"]
    message = refusal(files, smollm2_tokenizer, tmp_path, eos=eos + 1)
    assert f"EOS is {eos + 1} in the draft and {eos} in the target" in message


def test_a_different_vocabulary_size_is_named(files, smollm2_tokenizer, tmp_path):
    tokens = list(smollm2_tokenizer["tokenizer.ggml.tokens"])[:-64]
    tokenizer = smollm2_tokenizer | {"tokenizer.ggml.token_type": smollm2_tokenizer["tokenizer.ggml.token_type"][:-64]}
    message = refusal(files, tokenizer, tmp_path, tokens=tokens, vocab=len(tokens))
    assert f"the draft's vocabulary has {len(tokens)} tokens, the target's tokenizer {len(tokens) + 64}" in message


@pytest.fixture(scope="module")
def padded_target(files, smollm2_tokenizer, tmp_path_factory):
    """A target whose embedding has 64 rows beyond its tokenizer's tokens, as Qwen 2.5's larger
    models pad theirs (its smaller ones, the drafts, less), and its AR tokens."""
    vocab = len(smollm2_tokenizer["tokenizer.ggml.tokens"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SAGUARO_CACHE", str(tmp_path_factory.mktemp("padded-cache")))
        target = write_pair_gguf(tmp_path_factory.mktemp("padded") / "padded.gguf", tiny_llama(vocab + 64, 2, 0),
                                 smollm2_tokenizer)
        with LLM(str(target), method="ar", dtype="float32") as llm:
            yield target, greedy(llm)


@pytest.mark.parametrize("method", ["sd", "ssd", "auto"])
def test_a_draft_padded_less_than_the_target_decodes_as_ar(files, padded_target, method):
    target, ar = padded_target
    with LLM(str(target), method=method, draft=str(files[1]), dtype="float32") as llm:
        assert greedy(llm) == ar
        assert llm.decoder.counters.num_draft_tokens > 0  # the draft proposed


def test_a_draft_padded_beyond_the_target_decodes_as_ar(files, ar_tokens, smollm2_tokenizer, tmp_path):
    vocab = len(smollm2_tokenizer["tokenizer.ggml.tokens"])
    draft = write_pair_gguf(tmp_path / "draft.gguf", tiny_llama(vocab + 128, 1, 1), smollm2_tokenizer)
    with LLM(str(files[0]), method="sd", draft=str(draft), dtype="float32") as llm:
        assert greedy(llm) == ar_tokens
        assert llm.decoder.counters.num_accepted_tokens > 0


def short_draft(rows: int) -> LlamaModel:
    """The tiny target of test_exactness with its vocabulary cut to its first `rows` tokens and
    noise on its head: a draft of a tokenizer padded to fewer rows than the target's."""
    full = tiny_model(seed=10, layers=2)
    draft = LlamaModel(replace(full.config, vocab_size=rows)).eval().requires_grad_(False)
    state = full.state_dict()
    for name in ("embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][:rows]
    draft.load_state_dict(state)
    draft.lm_head.weight.add_(0.5 * torch.randn(draft.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)))
    return draft


@pytest.mark.parametrize("rule, exact", [(verify, True), (residual_is_p, False)])
def test_sd_with_a_draft_padded_less_than_the_target_is_exact(rule, exact, monkeypatch):
    """The target (8 rows) samples its last two tokens too, which the 6-row draft cannot propose
    and embeds as zeros; its distributions are widened to 8 rows with zeros."""
    target, draft = tiny_model(seed=10, layers=2), fit_vocabulary(short_draft(TINY_V - 2), TINY_V, TINY_V - 2)
    assert draft.config.vocab_size == TINY_V and draft.embed_tokens.weight.shape[0] == TINY_V
    monkeypatch.setattr(verification, "verify", rule)
    assert (sd_pvalue(target, draft, sampled(1.0)) > ALPHA) == exact


@pytest.fixture(scope="module")
def hf_draft(files, tmp_path_factory):
    """The draft file's model as a Hugging Face folder, with the target file's tokenizer."""
    folder = tmp_path_factory.mktemp("hf-draft")
    tiny_llama(len(load_tokenizer(files[0])), 1, 1).save_pretrained(folder)
    load_tokenizer(files[0]).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("method", ["sd", "ssd"])
def test_a_hugging_face_draft_for_a_gguf_target_decodes_as_ar(files, ar_tokens, hf_draft, method):
    """Tokenizers compared across formats: a folder's tokenizer against a GGUF file's fields."""
    assert resolve_model(str(files[0]), str(hf_draft)).draft.tokens == len(load_tokenizer(files[0]))
    with LLM(str(files[0]), method=method, draft=str(hf_draft), dtype="float32") as llm:
        assert greedy(llm) == ar_tokens
        assert llm.decoder.counters.num_draft_tokens > 0


def test_a_hugging_face_draft_with_another_token_is_named(files, hf_draft, tmp_path):
    tokenizer = load_tokenizer(hf_draft)  # a Hugging Face folder: transformers' tokenizer
    tokenizer.add_tokens(["<brand-new-token>"])
    tokenizer.save_pretrained(tmp_path)
    tiny_llama(len(tokenizer), 1, 1).save_pretrained(tmp_path)
    with pytest.raises(IncompatibleDraftError, match="tokens"):
        LLM(str(files[0]), method="sd", draft=str(tmp_path), dtype="float32")
