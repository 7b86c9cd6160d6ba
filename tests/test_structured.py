"""Structured outputs and sampling controls are exact under every method.

A request's processed distribution (saguaro.engine.processing: logit bias, penalties,
min_tokens, a grammar's mask) is what each position samples from, whether it is decoded AR,
verified in a chain, a tree or an SSD round, or forced by the grammar (jump-forward).
Statistical checks on tiny models compare every committed token with a reference written
here, one position at a time from the committed text alone (its own llguidance matcher and
penalty counts), by the pooled PIT test of tests/stats.py. Each has a broken control that
must fail: the verifier comparing against the unprocessed target, penalties not advanced along
the draft, a forced token committed where a stop token was legal too. Greedy SD, SSD, trees and
auto commit AR's tokens on real prompts under a JSON schema, a tool_choice "required" schema, a
regex, penalties and a bias.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import llguidance
import numpy
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models

import saguaro.engine.verifier as verification
from drafts import InProcessDraft, sd_decoder, ssd_decoder, worker_config
from saguaro import LLM, SamplingParams
from saguaro.engine import structured
from saguaro.engine.processing import LogitsProcessor, chain_contexts
from saguaro.engine.runner import forward_chunks
from saguaro.engine.sampler import sample
from saguaro.engine.sequence import Sequence
from saguaro.engine import round as round_module
from saguaro.engine.round import jump_width
from saguaro.engine.rejection import verify
from saguaro.engine.structured import GrammarMatcher, StructuredOutputs, TokenMasks, grammar_tokenizer
from saguaro.models import hub
from saguaro.models.kv_cache import new_cache
from saguaro.models.llama import LlamaModel
from saguaro.models.native import bindings
from saguaro.models.tokenizer import FolderTokenizer
from saguaro.server.tools import required_calls_schema
from saguaro.speculation.build import ar_decoder
from saguaro.speculation.protocol import DraftProcessing, unsent_tokenizers
from stats import ks_pvalue, randomized_pit
from test_exactness import ALPHA, PROMPT, TINY_K, TINY_V, tiny_model
from test_trees import SHAPE, TREE, peaked_model, switching_decoder

EOS = 0
TINY_VOCAB = {"<eos>": EOS, "a": 1, "b": 2, "ab": 3, "c": 4, "x": 5, "[": 6, "]": 7}
ROWS = 2_000
NEW = 8
# Choices at most positions: c or x; then the end, "a" or "ab". After "a" only "b" is legal:
# forced, proposed without a draft and committed with probability 1.
PATTERN = "(ab[cx])+"
# After two rounds "x" or the end: where a forced-token check that ignores stop tokens breaks.
ENDING = "(ab[cx]){1,2}x?"
PENALTIES = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={EOS: -2.0, 3: 1.5, 5: -1.0})


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory) -> FolderTokenizer:
    """A byte-level BPE over TINY_VOCAB ("a" + "b" merge into "ab"), as a tokenizer folder."""
    tokenizer = Tokenizer(models.BPE(dict(TINY_VOCAB), [("a", "b")]))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return FolderTokenizer(folder)


@pytest.fixture(scope="module")
def target():
    return peaked_model()


@pytest.fixture(scope="module")
def draft():
    return tiny_model(seed=11, layers=1)


def params_of(temperature: float, rows: int, pattern: str | None = PATTERN, **options) -> list[SamplingParams]:
    constraint = StructuredOutputs(regex=pattern) if pattern else None
    return [SamplingParams(temperature=temperature, max_tokens=NEW, seed=i, structured_outputs=constraint, **options)
            for i in range(rows)]


def prompts(rows: int) -> list[list[int]]:
    return [PROMPT + [1 + i % (TINY_V - 1)] for i in range(rows)]


def decode(decoder, params: list[SamplingParams], tokenizer) -> list[list[int]]:
    seqs = [Sequence(i, prompt, p, [EOS], tokenizer) for i, (prompt, p) in enumerate(zip(prompts(len(params)), params))]
    decoder.reserve(len(seqs), len(PROMPT) + 1 + NEW + decoder.lookahead)
    decoder.prefill(seqs)
    while active := [s for s in seqs if not s.finished]:
        decoder.step(active)
        decoder.release([s for s in active if s.finished])
    return [s.output_ids for s in seqs]


def reference_probs(params: SamplingParams, prompt: list[int], output: list[int], tokenizer,
                    logits: numpy.ndarray) -> numpy.ndarray:
    """The distribution of each output token, from logits [len(output), V] at its position:
    processed here position by position in numpy (the bias, HF's repetition penalty over prompt
    and output, OpenAI's frequency and presence penalties over the output, the grammar's mask
    from a matcher of its own), then softmax at the temperature (no top-k or top-p here)."""
    matcher = None
    if params.structured_outputs is not None:
        grammar = params.structured_outputs.llguidance_grammar()
        matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer, [EOS]).llguidance(), grammar, log_level=0)
    in_prompt = numpy.isin(numpy.arange(TINY_V), prompt)
    rows = []
    for t, token in enumerate(output):
        row = logits[t].astype(numpy.float64).copy()
        for i, bias in (params.logit_bias or {}).items():
            row[i] += bias
        counts = numpy.bincount(numpy.array(output[:t], dtype=numpy.int64), minlength=TINY_V).astype(numpy.float64)
        r = params.repetition_penalty
        row = numpy.where((counts > 0) | in_prompt, numpy.where(row > 0, row / r, row * r), row)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        if matcher is not None:
            allowed = numpy.frombuffer(matcher.compute_logit_bias(), dtype=numpy.bool_)[:TINY_V]
            row[~allowed] = -numpy.inf
            assert matcher.consume_token(token), f"token {token} breaks the grammar after {output[:t]}"
        row = row / params.temperature
        e = numpy.exp(row - row.max())
        rows.append(e / e.sum())
    return numpy.stack(rows)


def pvalue(model, params: list[SamplingParams], outputs: list[list[int]], tokenizer) -> float:
    """The pooled PIT test of every output token under reference_probs, the target's logits
    teacher-forced in one pass."""
    prompt_list = prompts(len(params))
    chunks = [prompt + output[:-1] for prompt, output in zip(prompt_list, outputs)]
    cache = new_cache(model, len(chunks), max(len(c) for c in chunks) + 1)
    hidden = forward_chunks(model, cache, list(range(len(chunks))), chunks, [0] * len(chunks))
    logits = model.logits(hidden).numpy()
    probs, tokens = [], []
    for i, (prompt, p, output) in enumerate(zip(prompt_list, params, outputs)):
        start = len(prompt) - 1
        probs.append(reference_probs(p, prompt, output, tokenizer, logits[i, start:start + len(output)]))
        tokens += output
    v = torch.rand(len(tokens), generator=torch.Generator().manual_seed(0))
    return ks_pvalue(randomized_pit(torch.from_numpy(numpy.concatenate(probs)), torch.tensor(tokens), v))


def in_process_ssd(target, tmp_path_factory, draft):
    from saguaro.models.checkpoint import save_checkpoint
    folder = tmp_path_factory.mktemp("ssd-draft")
    save_checkpoint(draft, folder, dtype=torch.float32, share_embeddings=False)
    client = InProcessDraft(worker_config(str(folder), "float32", TINY_K, [1, 1, 1], 1.0, prompt_lookup=None,
                                          proposal_top=64), None)
    return ssd_decoder(target, client, "neural")


DECODERS = {
    "ar": lambda target, draft, tmp: ar_decoder(target),
    "sd": lambda target, draft, tmp: sd_decoder(target, draft, TINY_K),
    "trees": lambda target, draft, tmp: sd_decoder(target, draft, TINY_K, **SHAPE),
    "auto": lambda target, draft, tmp: switching_decoder(target, draft, [TREE, TREE, TINY_K, TREE, 0, TREE]),
    "ssd": lambda target, draft, tmp: in_process_ssd(target, tmp, draft),
}


# --- parameters, matcher, processing ------------------------------------------------------------

@pytest.mark.parametrize("bad, field", [
    (dict(structured_outputs=dict(regex="[a-")), "structured_outputs.regex"),
    (dict(structured_outputs=dict(json={"type": "nonsense"})), "structured_outputs.json"),
    (dict(structured_outputs=dict(json="{not json")), "structured_outputs.json"),
    (dict(structured_outputs=dict(grammar="start: undefined_rule")), "structured_outputs.grammar"),
    (dict(structured_outputs=dict(regex="a", choice=["b"])), "exactly one"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(min_p=1.5), "min_p"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs_mode="final"), "logprobs_mode"),
])
def test_bad_parameters_are_refused_by_name(bad, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SamplingParams(**bad)


def test_masks_follow_the_draft_and_leave_the_matcher_where_it_was(tiny_tokenizer):
    matcher = GrammarMatcher(StructuredOutputs(regex=PATTERN), grammar_tokenizer(tiny_tokenizer, [EOS]))
    illegal = matcher.masks([[], [3], [3, 4], [3, 4, 1], [3, 7, 1]]).illegal(TINY_V)
    legal = [set((~row).nonzero()[:, 0].tolist()) for row in illegal]
    assert legal[:4] == [{3}, {4, 5}, {EOS, 1, 3}, {2}]
    assert legal[4] == set(range(TINY_V))  # after an illegal draft: unreachable, left unmasked
    assert matcher.forced(5, {EOS}) == [3]  # still at the start
    assert matcher.commit(3) and matcher.forced(5, {EOS}) == []


class MatcherKeepingStaleMasks(GrammarMatcher):
    """Control: keeps the masks it knew across a commit without moving them past the committed
    token, so it serves the masks of the text before it."""

    def commit(self, token):
        known = self._known
        moved = super().commit(token)
        self._known = {**self._known, **known}
        return moved


@pytest.mark.parametrize("kind", [GrammarMatcher, MatcherKeepingStaleMasks])
def test_masks_known_from_earlier_in_the_round_equal_fresh_ones(tiny_tokenizer, kind):
    """The matcher reuses the masks it computed since the last commit (the forced-token search,
    the draft's, verification's) and, after a commit, those after the committed token. Along a
    random walk, every mask it gives equals a fresh matcher's at the same text."""
    tokenizer = grammar_tokenizer(tiny_tokenizer, [EOS])
    matcher = kind(StructuredOutputs(regex=PATTERN), tokenizer)
    rng = numpy.random.default_rng(0)
    committed, differ = [], 0
    for _ in range(12):
        fresh = GrammarMatcher(StructuredOutputs(regex=PATTERN), tokenizer)
        for token in committed:
            fresh.commit(token)
        drafts = [int(t) for t in rng.choice([1, 2, 3, 4, 5], size=3)]
        forced = matcher.forced(4, {EOS})
        contexts = [forced + drafts[:j] for j in range(len(drafts) + 1)]
        for got, want in zip(matcher.masks(contexts).illegal(TINY_V), fresh.masks(contexts).illegal(TINY_V)):
            differ += not torch.equal(got, want)
        truly_forced = fresh.forced(4, {EOS})
        differ += forced != truly_forced
        legal = (~fresh.masks([truly_forced]).illegal(TINY_V)[0]).nonzero()[:, 0].tolist()
        step = truly_forced + [int(rng.choice([t for t in legal if t != EOS]))]
        for token in step:
            matcher.commit(token)
        committed += step
    assert (differ == 0) == (kind is GrammarMatcher)


@pytest.mark.parametrize("kernel", ["apply_", "index_"])  # saguaro's kernel (where it runs), torch's indexing
@pytest.mark.parametrize("width", [2_000, 2_048, 2_100])  # narrower, as wide as, wider than the bitmask
def test_token_masks_set_minus_infinity_exactly_at_the_illegal_tokens(width, kernel):
    """Rows with few legal tokens (filled, then the legal ones put back), with most legal (the
    illegal ones set), one unreachable row (left alone), against a mask unpacked bit by bit."""
    rng = numpy.random.default_rng(0)
    words = 64  # 2,048 tokens
    legal = numpy.stack([rng.random(words * 32) < share for share in (0.002, 0.3, 0.7, 0.998, 0.5)])
    bits = (legal.reshape(5, words, 32) << numpy.arange(32, dtype=numpy.uint64)).sum(-1).astype(numpy.uint32)
    logits = torch.randn(5, width, generator=torch.Generator().manual_seed(1))
    masked = logits.clone()
    getattr(TokenMasks(bits.view(numpy.int32), unreachable=[4]), kernel)(masked)
    allowed = numpy.zeros((5, width), dtype=bool)
    allowed[:, :min(width, words * 32)] = legal[:, :width]
    allowed[4] = True
    expected = logits.masked_fill(~torch.from_numpy(allowed), float("-inf"))
    assert torch.equal(masked, expected)


@pytest.mark.skipif(not bindings.available(), reason="needs saguaro's kernels")
def test_the_mask_kernel_refuses_masks_that_do_not_fit_the_logits():
    """The kernel writes in place and reads a mask row per logit row: fewer rows is refused."""
    logits = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="one int32 mask row"):
        bindings.mask_logits(logits, numpy.zeros((2, 2), dtype=numpy.int32), numpy.zeros(3, dtype=bool))
    bindings.mask_logits(logits, numpy.zeros((3, 2), dtype=numpy.int32), numpy.zeros(3, dtype=bool))  # control
    assert bool(torch.isinf(logits).all())


@pytest.mark.skipif(not bindings.available(), reason="needs saguaro's kernels")
@pytest.mark.parametrize("broken", [False, True], ids=["kernel", "control"])
def test_a_reduced_heads_masks_hold_each_rows_bit_from_its_tokens(broken):
    """bindings.head_bits against the masks unpacked bit by bit and read at each head row's token,
    over rows of few, half and most legal tokens, unsorted ids and ids past the mask (illegal),
    into a row with spare bits (left clear). Control: ids off by one must give other masks."""
    rng = numpy.random.default_rng(2)
    words = 40  # 1,280 tokens
    legal = numpy.stack([rng.random(words * 32) < share for share in (0.01, 0.5, 0.99)])
    bits = (legal.reshape(3, words, 32) << numpy.arange(32, dtype=numpy.uint64)).sum(-1).astype(numpy.uint32)
    ids = numpy.concatenate([rng.permutation(words * 32)[:300], [words * 32, words * 32 + 7]])
    expected = numpy.zeros((3, 320), dtype=bool)
    expected[:, :300] = legal[:, ids[:300]]
    out = numpy.full((3, 10), -1, dtype=numpy.int32)
    bindings.head_bits(bits.view(numpy.int32), ids + 1 if broken else ids, out)
    got = numpy.unpackbits(out.view(numpy.uint8), axis=-1, bitorder="little").astype(bool)
    assert numpy.array_equal(got, expected) != broken
    with pytest.raises(ValueError, match="at least len"):
        bindings.head_bits(bits.view(numpy.int32), ids, numpy.zeros((3, 9), dtype=numpy.int32))


@pytest.mark.skipif(bindings.build() != "avx512", reason="needs saguaro's AVX-512 kernels, to run their AVX2 build beside")
def test_the_avx2_kernel_masks_as_the_avx512_one_does():
    """token_mask.c's AVX2 build (scalar stores) passes the same test as the AVX-512 build."""
    env = dict(os.environ, SAGUARO_NATIVE_BUILD="avx2")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k",
                             "minus_infinity_exactly and apply_"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "3 passed" in result.stdout, result.stdout[-2000:]


def test_the_ssd_worker_is_sent_a_grammar_tokenizer_once_per_connection(tiny_tokenizer):
    tokenizer = grammar_tokenizer(tiny_tokenizer, [EOS])
    entry = DraftProcessing(3, [EOS], tokenizer.key, tokenizer)
    sent: set[str] = set()
    first = unsent_tokenizers([entry, None, entry], sent)
    assert first[0].grammar_tokenizer is tokenizer and first[1] is None and first[2].grammar_tokenizer is None
    later = unsent_tokenizers([entry], sent)
    assert later[0].grammar_tokenizer is None and later[0].grammar_key == tokenizer.key
    assert unsent_tokenizers([entry], set())[0].grammar_tokenizer is tokenizer  # a new connection: sent again


def test_penalties_along_a_draft_equal_penalties_after_committing_it(tiny_tokenizer):
    params = SamplingParams(temperature=1.0, **PENALTIES)
    processor = LogitsProcessor.of(params, {EOS})
    logits = torch.randn(4, TINY_V, generator=torch.Generator().manual_seed(0))
    drafts = [3, 3, 5]
    along = processor.process(logits, PROMPT, [1], chain_contexts(drafts))
    for j in range(4):
        one = processor.process(logits[j:j + 1], PROMPT, [1] + drafts[:j], [[]])
        assert torch.equal(along[j:j + 1], one)
    assert not torch.equal(along[3], processor.process(logits[3:], PROMPT, [1], [[]])[0])


def test_no_processing_means_no_processor():
    assert LogitsProcessor.of(SamplingParams(temperature=0.8, top_p=0.9, min_p=0.1), {EOS}) is None


# --- exactness on tiny models -------------------------------------------------------------------

@pytest.mark.parametrize("method", list(DECODERS))
def test_greedy_speculation_equals_ar_under_a_grammar_and_penalties(target, draft, tiny_tokenizer, tmp_path_factory,
                                                                    method):
    params = params_of(0.0, 60, **PENALTIES)
    expected = decode(ar_decoder(target), params, tiny_tokenizer)
    assert decode(DECODERS[method](target, draft, tmp_path_factory), params, tiny_tokenizer) == expected
    assert all(o[-1] == EOS or len(o) == NEW for o in expected)


@pytest.mark.parametrize("method", list(DECODERS))
def test_each_method_samples_the_constrained_and_penalised_target(target, draft, tiny_tokenizer, tmp_path_factory,
                                                                  method):
    params = params_of(0.8, ROWS, **PENALTIES)
    outputs = decode(DECODERS[method](target, draft, tmp_path_factory), params, tiny_tokenizer)
    assert pvalue(target, params, outputs, tiny_tokenizer) > ALPHA


def test_check_catches_a_verifier_comparing_against_the_unprocessed_target(target, draft, tiny_tokenizer,
                                                                          monkeypatch):
    """Verification forgets the processing (prefill and AR rounds keep it): draws the grammar
    forbids get committed, or the distribution is off."""
    def unprocessed(logits, seqs, contexts, masked=False):
        return logits if logits.shape[1] > 1 else original(logits, seqs, contexts, masked)
    original = verification.processed
    monkeypatch.setattr(verification, "processed", unprocessed)
    params = params_of(0.8, ROWS, pattern=None, **PENALTIES)
    outputs = decode(sd_decoder(target, draft, TINY_K), params, tiny_tokenizer)
    assert pvalue(target, params, outputs, tiny_tokenizer) < ALPHA
    with pytest.raises(RuntimeError, match="breaks its grammar"):
        decode(sd_decoder(target, draft, TINY_K), params_of(0.8, 200), tiny_tokenizer)


def test_check_catches_penalties_not_advanced_along_the_draft(target, draft, tiny_tokenizer, monkeypatch):
    """Verification counts the committed tokens only, at every position of a chain of 4 drafted
    by the target itself (processed right), so that rounds reach deep positions."""
    monkeypatch.setattr(verification, "chain_contexts", lambda drafts: [[] for _ in range(len(drafts) + 1)])
    params = params_of(0.8, ROWS, pattern=None, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={EOS: -2.0})
    outputs = decode(sd_decoder(target, peaked_model(), 4), params, tiny_tokenizer)
    assert pvalue(target, params, outputs, tiny_tokenizer) < ALPHA


def forced_ignoring_stop_tokens(self, limit, stop_ids, context=()):
    """A forced-token check that does not count stop tokens as legal choices."""
    context = list(context)
    if self.matcher.validate_tokens(context) < len(context):
        return []
    self.matcher.consume_tokens(context)
    run = []
    while len(run) < limit and not self.matcher.is_stopped():
        here = numpy.empty((1, self.words), dtype=numpy.int32)
        self._fill(here[0])
        legal = ~structured.TokenMasks(here, []).illegal(self.vocab_size)[0]
        allowed = [t for t in legal.nonzero()[:, 0].tolist() if t not in stop_ids]
        if len(allowed) != 1:
            break
        self.matcher.consume_token(allowed[0])
        run.append(allowed[0])
    if context or run:
        self.matcher.rollback(len(context) + len(run))
    return run


def walk_committing_every_node(tokens, parents, target_probs, u):
    """Commits a chain's every node as certain, then samples the token after it."""
    path = list(range(len(tokens)))
    return path, int(sample(target_probs[len(path)][None], u[-1:])[0])


def verify_trusting_point_masses(draft_tokens, draft_probs, target_probs, u_accept, u_bonus):
    """Accepts every draft proposed as a point mass (a forced one, at T > 0) unchecked, unless
    the target gives it no mass at all; the rest as verification does."""
    certain = draft_probs.gather(-1, draft_tokens[..., None])[..., 0] == 1
    return verify(draft_tokens, draft_probs, target_probs, torch.where(certain, 0.0, u_accept), u_bonus)


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("method", ["ar", "sd"])
def test_jump_forward_commits_forced_tokens_exactly(target, draft, tiny_tokenizer, monkeypatch, method, broken):
    """AR rounds propose the grammar's forced tokens without a draft, SD's drafts take them
    without a draft step (as point masses). Verification accepts them with probability 1; here
    they are even committed unverified, which is exact only if each truly was the one legal
    token after the text and the drafts before it. The control's check also calls "x" forced
    where the end of the text was legal too."""
    monkeypatch.setattr(verification, "walk", walk_committing_every_node)
    monkeypatch.setattr(verification, "verify", verify_trusting_point_masses)
    if broken:
        monkeypatch.setattr(structured.GrammarMatcher, "forced", forced_ignoring_stop_tokens)
    params = params_of(0.8, ROWS, pattern=ENDING, logit_bias={EOS: -1.5})
    decoder = ar_decoder(target) if method == "ar" else sd_decoder(target, draft, TINY_K)
    outputs = decode(decoder, params, tiny_tokenizer)
    assert decoder.counters.num_forced_tokens > ROWS // 20  # "b" after "a"
    assert (pvalue(target, params, outputs, tiny_tokenizer) < ALPHA) == broken


# --- the default model ----------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "role": {"enum": ["admin", "editor", "viewer"]}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}
FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}},
    {"name": "search_web", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"]}},
]
REAL_CASES = {
    "json_schema": dict(structured_outputs=StructuredOutputs(json=SCHEMA)),
    "tool_choice_required": dict(structured_outputs=StructuredOutputs(json=required_calls_schema(FUNCTIONS, False))),
    "regex": dict(structured_outputs=StructuredOutputs(regex=r"(Yes|No), because [a-z ,]{10,60}\.")),
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={330: 5.0}),
}


@pytest.fixture(scope="module")
def real_prompts() -> list[list[dict]]:
    from saguaro.datasets import sharegpt_first_turns
    turns = sharegpt_first_turns("heldout", limit=3, seed=1, max_chars=400)
    return [[{"role": "user", "content": t + "\nAnswer as JSON."}] for t in turns]


@pytest.mark.parametrize("method", ["sd", "ssd", "trees", "auto"])
def test_greedy_methods_equal_ar_on_real_prompts(llm, real_prompts, method):
    """Each case over three held-out prompts (batch 3), against the session's AR model."""
    options = {"sd": dict(method="sd"), "ssd": dict(method="ssd"), "auto": dict(method="auto"),
               "trees": dict(method="sd", num_speculative_tokens=4, tree_topk=3, num_draft_tokens=8)}[method]
    spec = LLM(hub.DEFAULT_MODEL, dtype="float32", **options)
    try:
        for name, case in REAL_CASES.items():
            params = SamplingParams(temperature=0, max_tokens=40, **case)
            expected = [o.token_ids for o in llm.generate(real_prompts, params, use_tqdm=False)]
            got = [o.token_ids for o in spec.generate(real_prompts, params, use_tqdm=False)]
            assert got == expected, f"{method} differs from AR under {name}"
    finally:
        spec.close()


@pytest.mark.parametrize("broken", [False, True])
def test_ar_jump_forward_equals_one_token_a_round_on_the_kernels(real_prompts, monkeypatch, broken):
    """AR's batched jump-forward on saguaro's kernels (each row's forced run beside the others'
    single tokens in one pass without padding, logits after each run only) commits what AR does
    one token a round, on the default model under a JSON schema. The control takes the logits
    at each chunk's first token instead of after its run."""
    jumping = LLM(hub.DEFAULT_MODEL, method="ar", max_num_seqs=len(real_prompts))
    try:
        assert jumping.target.native_layers is not None
        params = SamplingParams(temperature=0, max_tokens=40, **REAL_CASES["json_schema"])
        monkeypatch.setattr(round_module, "JUMP_FORWARD", 0)
        expected = [o.token_ids for o in jumping.generate(real_prompts, params, use_tqdm=False)]
        monkeypatch.undo()
        if broken:
            monkeypatch.setattr(verification, "last_hidden", lambda hidden, chunks: hidden[:, 0])
        got = [o.token_ids for o in jumping.generate(real_prompts, params, use_tqdm=False)]
        assert jumping.engine.decoder.counters.num_forced_tokens > len(real_prompts)
        assert (got == expected) != broken
    finally:
        jumping.close()


@pytest.mark.parametrize("broken", [False, True])
@pytest.mark.parametrize("method,temperature", [("ar", 0.0), ("sd", 0.0), ("sd", 0.8)])
def test_masks_in_the_head_give_what_masks_after_it_give(real_prompts, monkeypatch, method, temperature, broken):
    """On the default model the grammar's masks go into the head's product (LlamaModel.logits,
    legal): outputs under a JSON schema with penalties and a bias equal those with the masks
    applied after the head, greedy and sampled with the same seeds (the same draws then see the
    same distributions). The control builds each position's mask after the committed text
    alone, forgetting the forced run or drafts before it."""
    spec = LLM(hub.DEFAULT_MODEL, method=method, max_num_seqs=len(real_prompts))
    try:
        assert spec.target.masks_in_head
        params = SamplingParams(temperature=temperature, seed=7, max_tokens=40, **REAL_CASES["json_schema"],
                                presence_penalty=0.5, logit_bias={330: 2.0})
        monkeypatch.setattr(LlamaModel, "masks_in_head", False)
        expected = [o.token_ids for o in spec.generate(real_prompts, params, use_tqdm=False)]
        monkeypatch.undo()
        if broken:
            head_masks = verification.head_masks
            monkeypatch.setattr(verification, "head_masks", lambda processors, contexts, *shape:
                                head_masks(processors, [[[]] * len(c) for c in contexts], *shape))
        try:
            got = [o.token_ids for o in spec.generate(real_prompts, params, use_tqdm=False)]
        except RuntimeError as error:  # a token its grammar forbids, committed
            assert broken and "breaks its grammar" in str(error)
            return
        assert (got == expected) != broken
    finally:
        spec.close()


@pytest.mark.parametrize("broken", [False, True])
def test_a_reduced_draft_head_under_grammars_gives_the_vocabularys_masked_logits(real_prompts, broken):
    """The shipped draft's head (8,192 of the 49,152 tokens) takes the grammars' masks in its
    own rows' order (constrained_head_logits): the same logits as processing over the whole
    vocabulary and reading its rows back, for a row under a schema (contexts with a drafted
    token, one the grammar forbids), a row under a regex and a row without a grammar. The
    control maps each head row to the next token's bit."""
    from saguaro.models import pairing
    from saguaro.speculation.local.drafters import constrained_head_logits, constraint

    llm = LLM(hub.DEFAULT_MODEL, method="ar")
    try:
        draft = pairing.load_draft(hub.default_draft(hub.DEFAULT_MODEL), llm.target, torch.bfloat16)
        assert draft.masks_in_head and draft.head_ids is not None
        tokenizer = grammar_tokenizer(llm.tokenizer, llm.eos_token_ids)
        specs = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=r"(Yes|No), because [a-z ,]{10,60}\."), None]
        seqs = [Sequence(i, [1, 2, 3], SamplingParams(temperature=0, structured_outputs=spec), set(llm.eos_token_ids),
                         llm.tokenizer) for i, spec in enumerate(specs)]
        for seq, spec in zip(seqs, specs):
            seq.processor = LogitsProcessor.of(seq.params, set(llm.eos_token_ids),
                                               None if spec is None else GrammarMatcher(spec, tokenizer))
        opening = seqs[0].processor.grammar.only_legal_token()
        contexts = [[[], [opening], [opening, 7]], [[], [], []], [[], [], []]]
        hidden = torch.randn(3, 3, draft.config.hidden_size).bfloat16()
        constrain = constraint(seqs)
        assert constrain.only_grammars
        expected = constrain(draft.logits(hidden), contexts)[..., draft.head_token_ids]
        if broken:
            ids = draft.head_token_ids
            draft.register_buffer("head_token_ids", ids + 1)
            constrain = constraint(seqs)
        got = constrained_head_logits(draft, hidden, constrain, contexts)
        if broken:
            draft.register_buffer("head_token_ids", ids)
        assert torch.isinf(expected[0, 0]).sum() > 0 and torch.isfinite(expected[2]).all()
        assert torch.equal(got, expected) != broken
    finally:
        llm.close()


# --- log-probabilities ----------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ar", "sd", "trees", "ssd"])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_are_the_targets_at_each_committed_token(target, draft, tiny_tokenizer, tmp_path_factory,
                                                          method, mode):
    """Every method's entries equal the log-softmax of the target's logits (processed ones at the
    request's temperature in "processed" mode) at the token's position, computed apart."""
    params = [SamplingParams(temperature=0.8, max_tokens=NEW, seed=i, logprobs=3, logprobs_mode=mode,
                             structured_outputs=StructuredOutputs(regex=PATTERN), **PENALTIES) for i in range(20)]
    decoder = DECODERS[method](target, draft, tmp_path_factory)
    seqs = [Sequence(i, prompt, p, [EOS], tiny_tokenizer) for i, (prompt, p) in enumerate(zip(prompts(20), params))]
    decoder.reserve(len(seqs), len(PROMPT) + 1 + NEW + decoder.lookahead)
    decoder.prefill(seqs)
    while active := [s for s in seqs if not s.finished]:
        decoder.step(active)
    for seq in seqs:
        assert [e.token_id for e in seq.logprobs] == seq.output_ids
        chunk = seq.prompt_ids + seq.output_ids[:-1]
        hidden = forward_chunks(target, new_cache(target, 1, len(chunk) + 1), [0], [chunk], [0])
        logits = target.logits(hidden[0, len(seq.prompt_ids) - 1:])
        if mode == "processed":
            processor = LogitsProcessor.of(seq.params, {EOS}, GrammarMatcher(seq.params.structured_outputs,
                                                                              grammar_tokenizer(tiny_tokenizer, [EOS])))
            logits = processor.process(logits, seq.prompt_ids, [], chain_contexts(seq.output_ids[:-1])) / 0.8
        expected = torch.log_softmax(logits.float(), -1)
        got = torch.tensor([e.logprob for e in seq.logprobs])
        assert torch.allclose(got, expected.gather(-1, torch.tensor(seq.output_ids)[:, None])[:, 0], atol=1e-4)
        assert [e.top_ids for e in seq.logprobs] == expected.topk(3, -1).indices.tolist()


def test_prompt_logprobs_cover_every_prompt_token_after_the_first(target, tiny_tokenizer):
    decoder = ar_decoder(target)
    seq = Sequence(0, PROMPT + [4, 5], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), [EOS])
    decoder.reserve(1, 16)
    decoder.prefill([seq])
    hidden = forward_chunks(target, new_cache(target, 1, 8), [0], [seq.prompt_ids], [0])
    expected = torch.log_softmax(target.logits(hidden[0, :-1]), -1)
    assert seq.prompt_logprobs[0] is None and len(seq.prompt_logprobs) == len(seq.prompt_ids)
    got = torch.tensor([e.logprob for e in seq.prompt_logprobs[1:]])
    assert torch.allclose(got, expected.gather(-1, torch.tensor(seq.prompt_ids[1:])[:, None])[:, 0], atol=1e-5)


def test_a_batched_jump_forward_pads_few_positions():
    """One row jumps its whole run; a batch jumps only as wide as most of its rows are forced
    (at batch 8 on a CPU, padded jump-forward passes cost more than the tokens they commit)."""
    assert jump_width([5]) == 5 and jump_width([0]) == 0
    assert jump_width([3] * 8) == 3
    assert jump_width([0] * 7 + [16]) == 0
    assert jump_width([4] * 7 + [0]) == 4 and jump_width([4] * 6 + [0, 0]) == 0
