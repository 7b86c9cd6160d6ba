"""Streamed text and stop strings: the detokenizer hands out whole characters only, and never
text that a stop string may still take back; a stop string ends AR, SD and SSD at the same
token, the one in which it completes, so their text, token ids and finish reasons agree.
(tests/test_server.py checks the same over HTTP.)"""
from __future__ import annotations

import pytest

from saguaro import LLM, SamplingParams
from saguaro.engine.detokenizer import Detokenizer, stop_prefix_length
from saguaro.models import hub

K = 5
MULTI_BYTE = "Café 🌵 ok"
EMOJI_CHAT = [{"role": "user", "content": f"Repeat exactly: {MULTI_BYTE}"}]


def byte_tokens(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: byte-level BPE spells byte b as one printable character, b
    itself where that is printable, else chr(256 + n) for the n-th byte that is not."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in
                                                 enumerate(b for b in range(256) if b not in printable)}
    return tokenizer.convert_tokens_to_ids([spelled[b] for b in text.encode()])


def stream(detokenizer: Detokenizer, tokens: list[int]) -> list[str]:
    """What each token lets through, then what finishing lets through."""
    pieces = []
    for token in tokens:
        if detokenizer.add(token):
            break
        pieces.append(detokenizer.take_stream())
    detokenizer.finish()
    return pieces + [detokenizer.take_stream()]


def test_byte_tokens_stream_whole_characters(llm):
    ids = byte_tokens(llm.tokenizer, MULTI_BYTE)
    assert len(ids) == len(MULTI_BYTE.encode()) and llm.tokenizer.decode(ids) == MULTI_BYTE
    pieces = stream(Detokenizer(llm.tokenizer), ids)
    assert [p for p in pieces if p] == list(MULTI_BYTE)  # each character once it is whole
    assert pieces[:5] == ["C", "a", "f", "", "é"]


def test_a_partial_character_at_the_end_is_final_as_decoding_shows_it(llm):
    ids = byte_tokens(llm.tokenizer, MULTI_BYTE)[:-4]  # "Café " and the cactus's first byte
    detokenizer = Detokenizer(llm.tokenizer)
    assert "".join(stream(detokenizer, ids)) == detokenizer.text == llm.tokenizer.decode(ids) == "Café \ufffd"


def test_text_that_may_begin_a_stop_string_is_held_back(llm):
    ids = llm.tokenizer("ok, o k ok ok! done")["input_ids"]
    detokenizer = Detokenizer(llm.tokenizer, stop=["ok!", "never"])
    pieces = stream(detokenizer, ids)
    assert detokenizer.stopped and detokenizer.text == "ok, o k ok "
    assert "".join(pieces) == detokenizer.text
    assert all(not p.endswith(("ok", "o")) for p in pieces[:-1])


def test_stop_prefix_length():
    assert stop_prefix_length("say hel", ["hello", "lo"]) == 3
    assert stop_prefix_length("say hell", ["hello", "lo"]) == 4
    assert stop_prefix_length("say hello", ["hello"]) == 0  # a whole stop string is not held back: it stops
    assert stop_prefix_length("abc", ["x"]) == 0


def test_streamed_pieces_add_up_to_the_text(llm):
    pieces: dict[int, list[str]] = {0: [], 1: []}
    outputs = llm.generate([EMOJI_CHAT, "Le café est très "], SamplingParams(temperature=0, max_tokens=24),
                           use_tqdm=False, on_token=lambda i, text: pieces[i].append(text))
    assert "🌵" in outputs[0].text and "û" in outputs[1].text  # the model does write multi-byte characters
    for i, out in enumerate(outputs):
        assert "".join(pieces[i]) == out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert not any("\ufffd" in p for p in pieces[i][:-1])


@pytest.fixture(scope="module")
def methods(llm):
    """AR (the session's model), SD and SSD on the same target and shipped draft."""
    sd = LLM(hub.DEFAULT_MODEL, method="sd", num_speculative_tokens=K, dtype="float32")
    with LLM(hub.DEFAULT_MODEL, method="ssd", num_speculative_tokens=K, dtype="float32") as ssd:
        yield {"ar": llm, "sd": sd, "ssd": ssd}


@pytest.fixture(scope="module")
def stop_requests(llm, prompts) -> list[tuple[list[int], SamplingParams]]:
    """Real prompts with a stop string from the middle of their greedy text (three characters,
    so it completes anywhere in a round), and with "\\n"."""
    chosen = prompts[:4]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    texts = [o.text for o in llm.generate(chosen, greedy, use_tqdm=False)]
    requests = [(p, SamplingParams(temperature=0, max_tokens=32, stop=[t[len(t) // 2:len(t) // 2 + 3]]))
                for p, t in zip(chosen, texts)]
    return requests + [(p, SamplingParams(temperature=0, max_tokens=32, stop=["\n"])) for p in chosen]


def test_stop_strings_end_every_method_at_the_same_token(llm, methods, stop_requests):
    results = {}
    for name, engine in methods.items():
        pieces: dict[int, list[str]] = {i: [] for i in range(len(stop_requests))}
        outputs = engine.generate([p for p, _ in stop_requests], [sp for _, sp in stop_requests], use_tqdm=False,
                                  on_token=lambda i, text: pieces[i].append(text))
        results[name] = [(o.text, o.token_ids, o.finish_reason) for o in outputs]
        for i, out in enumerate(outputs):
            assert "".join(pieces[i]) == out.text, f"{name}: request {i} streamed other text"
    stopped = 0
    for (_, params), (text, ids, reason) in zip(stop_requests, results["ar"]):
        decoded = llm.tokenizer.decode(ids, skip_special_tokens=True)
        if ids[-1] not in llm.eos_token_ids and params.stop[0] in decoded:
            stopped += 1
            assert reason == "stop" and text == decoded[:decoded.index(params.stop[0])]
            assert params.stop[0] not in llm.tokenizer.decode(ids[:-1], skip_special_tokens=True)
    assert stopped >= len(stop_requests) // 2  # most end at their stop string, not at EOS or max_tokens
    for name in ("sd", "ssd"):
        differ = [i for i, (a, b) in enumerate(zip(results["ar"], results[name])) if a != b]
        assert not differ, f"{name} differs from AR on requests {differ}: {[results[name][i] for i in differ]}"
