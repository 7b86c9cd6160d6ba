"""`saguaro serve` on loopback: the official openai client gets what offline LLM.generate gives;
32 concurrent streams all finish with offline generation's text; every bad input gets its 4xx
and the server keeps serving; a client that goes away frees its place; losing the SSD draft
worker mid-stream loses nothing; shutdown lets requests finish and stops the draft worker.

The AR server runs in a thread of this process on the session's fp32 model, an SSD one in
another thread, and the `saguaro serve` command in a subprocess."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from drafts import ssd_of
from saguaro import LLM, SamplingParams
from saguaro.models import hub
from saguaro.models.llama import LlamaModel
from saguaro.models.checkpoint import save_checkpoint
from saguaro.server.app import ServerConfig
from saguaro.server.serve import build_server

KEY = "test-key"
MODEL = "smollm2"
CONTEXT = 256
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "import numpy as np\n", "Water boils at", "My favourite book is", "SELECT name FROM"]
CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a large planet."}]
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7)  # a request with its own sampling and seed
CONCURRENT = 32
TIMEOUT_S = 180


def concurrent_request(i: int) -> tuple[str, SamplingParams]:
    """The i-th of the 32 concurrent requests: prompts, lengths and sampling differ, so requests
    leave the batch at different rounds and others join."""
    params = dict(SAMPLED, seed=i) if i % 8 == 7 else dict(temperature=0)
    return PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=8 + 4 * (i % 3), **params)


@pytest.fixture(scope="module")
def offline(llm) -> dict:
    """Every reference text, computed before any server takes the model."""
    greedy, long = SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=24)
    requests = [(p, greedy) for p in PROMPTS] + [(CHAT, greedy)] + [(p, long) for p in PROMPTS[:3]]
    requests += [concurrent_request(i) for i in range(CONCURRENT)]
    outputs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)  # one batch
    n = len(PROMPTS)
    chat, long = outputs[n].text, [o.text for o in outputs[n + 1:n + 4]]
    stop_cases = [(p, 24, middle(t)) for p, t in zip(PROMPTS[:3], long)] + [(CHAT, 12, middle(chat))]
    stopped = llm.generate([p for p, _, _ in stop_cases], [SamplingParams(temperature=0, max_tokens=m, stop=[s])
                                                          for _, m, s in stop_cases], use_tqdm=False)
    return {"completion": [o.text for o in outputs[:n]], "completion_ids": [o.token_ids for o in outputs[:n]],
            "chat": chat, "long": long, "concurrent": [o.text for o in outputs[n + 4:]],
            "stopped": [(*case, o.text, o.finish_reason, len(o.token_ids)) for case, o in zip(stop_cases, stopped)]}


def middle(text: str) -> str:
    """A stop string from the middle of a text: three characters, so that under SD and SSD it
    may complete anywhere in a round."""
    return text[len(text) // 2:len(text) // 2 + 3]


class LiveServer:
    """A uvicorn server on a free loopback port, in a thread of this process."""

    def __init__(self, llm: LLM, config: ServerConfig, max_model_len: int = CONTEXT, **limits):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.llm = llm
        self.server = build_server(llm, config, max_model_len=max_model_len, **limits)
        self.scheduler = self.server.scheduler
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def ar_server(offline):
    """The session's model again, with the server's batch of 32 (its KV cache is reserved for all)."""
    llm = LLM(MODEL, method="ar", dtype="float32", max_num_seqs=32)
    server = LiveServer(llm, ServerConfig(MODEL, api_key=KEY, max_body_bytes=64 << 10), max_waiting=64)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(ar_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=ar_server.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def http(ar_server):
    with httpx.Client(base_url=ar_server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S) as c:
        yield c


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text.splitlines():
        if line.startswith(f"saguaro_{name} "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# --- the openai client against the AR server ------------------------------------------------------

def test_completion_equals_offline_generation(client, llm, offline):
    for prompt, text, ids in zip(PROMPTS[:3], offline["completion"], offline["completion_ids"]):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert out.choices[0].text == text
        assert out.choices[0].finish_reason == ("stop" if len(ids) < 12 else "length")
        assert out.usage.completion_tokens == len(ids)
        assert out.usage.prompt_tokens == len(llm.encode(prompt))


def test_streamed_completion_equals_offline_generation(client, offline):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline["completion"][1]
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # really streamed
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(offline["completion_ids"][1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_chat_equals_offline_generation(client, offline):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == offline["chat"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_chat_equals_offline_generation(client, offline):
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline["chat"]
    assert chunks[-1].usage.completion_tokens > 0


def test_models_health_and_metrics(client, ar_server, http):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/health").json()["status"] == "ok"
    before = metric(ar_server.url, "generation_tokens_total")
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    assert metric(ar_server.url, "generation_tokens_total") == before + 3
    text = http.get("/metrics").text
    for name in ("requests_total", "generation_tokens_per_second", "requests_waiting", "requests_running",
                 "batch_size_sum", "acceptance_length_mean", "speculation_cache_hit_rate", "spec_decode_num_drafts_total",
                 "spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"# TYPE saguaro_{name} " in text


def test_n_samples_are_choices_each_reproducible_from_its_own_seed(client, ar_server):
    """n = 3 at T = 0.8: choice j is what an n = 1 request with sample j's seed gives, on both
    endpoints, whole and streamed; usage counts the prompt once and every sample's tokens."""
    seeds = [p.seed for p in SamplingParams(n=3, seed=SAMPLED["seed"]).samples()]
    hits_before = metric(ar_server.url, "prefix_cache_hits_total")
    for chat in (False, True):
        create = client.chat.completions.create if chat else client.completions.create
        request = dict(model=MODEL, max_tokens=10, temperature=0.8, top_p=0.9, extra_body={"ignore_eos": True},
                       **({"messages": CHAT} if chat else {"prompt": PROMPTS[2] * 6}))
        out = create(**request, n=3, seed=SAMPLED["seed"])
        texts = [c.message.content if chat else c.text for c in out.choices]
        assert [c.index for c in out.choices] == [0, 1, 2] and len(set(texts)) > 1
        assert out.usage.completion_tokens == 30 and out.usage.total_tokens == out.usage.prompt_tokens + 30
        singles = [create(**request, n=1, seed=seed) for seed in seeds]
        assert texts == [(o.choices[0].message.content if chat else o.choices[0].text) for o in singles]
        assert all(o.usage.prompt_tokens_details.cached_tokens > 0 for o in singles)  # the prompt was cached
        chunks = list(create(**request, n=3, seed=SAMPLED["seed"], stream=True, stream_options={"include_usage": True}))
        streamed = ["".join((c.choices[0].delta.content or "") if chat else c.choices[0].text
                            for c in chunks if c.choices and c.choices[0].index == j) for j in range(3)]
        assert streamed == texts and chunks[-1].usage.completion_tokens == 30
    assert metric(ar_server.url, "prefix_cache_hits_total") > hits_before


# --- continuous batching -------------------------------------------------------------------------

def test_32_concurrent_streams_match_offline_generation(ar_server, offline):
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        await asyncio.sleep(0.02 * i)  # arrivals spread over rounds: requests join a running batch
        prompt, sp = concurrent_request(i)
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=sp.max_tokens,
                                            temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=ar_server.url + "/v1", api_key=KEY, max_retries=0,
                                      timeout=TIMEOUT_S) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(CONCURRENT))), TIMEOUT_S)

    rounds, batch_sum = metric(ar_server.url, "rounds_total"), metric(ar_server.url, "batch_size_sum")
    texts = asyncio.run(all_of_them())
    assert texts == offline["concurrent"]
    assert metric(ar_server.url, "requests_running") == 0
    rounds = metric(ar_server.url, "rounds_total") - rounds
    mean_batch = (metric(ar_server.url, "batch_size_sum") - batch_sum) / rounds
    assert mean_batch > 4  # they really ran together


# --- bad input -------------------------------------------------------------------------------------

GOOD = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT_GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD = {  # name: (path, JSON body or raw bytes, headers, status)
    "malformed JSON": ("/v1/completions", b'{"model": "smollm2", "prompt": ', {}, 400),
    "not an object": ("/v1/completions", b"[1, 2]", {}, 400),
    "missing prompt": ("/v1/completions", {"model": MODEL}, {}, 400),
    "missing model": ("/v1/completions", {"prompt": "Hello"}, {}, 400),
    "missing messages": ("/v1/chat/completions", {"model": MODEL}, {}, 400),
    "prompt of wrong type": ("/v1/completions", {**GOOD, "prompt": 5}, {}, 400),
    "temperature of wrong type": ("/v1/completions", {**GOOD, "temperature": "hot"}, {}, 400),
    "max_tokens as a string": ("/v1/completions", {**GOOD, "max_tokens": "2"}, {}, 400),
    "stream of wrong type": ("/v1/completions", {**GOOD, "stream": "yes"}, {}, 400),
    "negative max_tokens": ("/v1/completions", {**GOOD, "max_tokens": -1}, {}, 400),
    "zero max_tokens": ("/v1/chat/completions", {**CHAT_GOOD, "max_tokens": 0}, {}, 400),
    "too large max_tokens": ("/v1/completions", {**GOOD, "max_tokens": 10 ** 6}, {}, 400),
    "negative temperature": ("/v1/completions", {**GOOD, "temperature": -0.5}, {}, 400),
    "temperature above 2": ("/v1/chat/completions", {**CHAT_GOOD, "temperature": 2.5}, {}, 400),
    "top_p of 0": ("/v1/completions", {**GOOD, "top_p": 0}, {}, 400),
    "top_p above 1": ("/v1/completions", {**GOOD, "top_p": 1.5}, {}, 400),
    "unknown model": ("/v1/completions", {**GOOD, "model": "gpt-5"}, {}, 404),
    "prompt longer than the context": ("/v1/completions", {**GOOD, "prompt": "word " * 400}, {}, 400),
    "token ids outside the vocabulary": ("/v1/completions", {**GOOD, "prompt": [1, 10 ** 9]}, {}, 400),
    "n = 0": ("/v1/completions", {**GOOD, "n": 0}, {}, 400),
    "n over 128": ("/v1/chat/completions", {**CHAT_GOOD, "n": 129}, {}, 400),
    "no messages": ("/v1/chat/completions", {**CHAT_GOOD, "messages": []}, {}, 400),
    "unknown role": ("/v1/chat/completions", {**CHAT_GOOD, "messages": [{"role": "robot", "content": "x"}]}, {}, 400),
    "unknown field": ("/v1/completions", {**GOOD, "temprature": 0.5}, {}, 400),
    "body over the limit": ("/v1/completions", {**GOOD, "prompt": "x" * (100 << 10)}, {}, 413),
    "no API key": ("/v1/completions", GOOD, {"Authorization": ""}, 401),
    "wrong API key": ("/v1/chat/completions", CHAT_GOOD, {"Authorization": "Bearer nope"}, 401),
    "unknown path": ("/v1/engines", GOOD, {}, 404),
}


def test_null_parameters_take_their_defaults(http):
    r = http.post("/v1/completions", json={**GOOD, "temperature": None, "top_p": None, "stop": None, "seed": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_gets_a_json_error_and_the_server_keeps_serving(http, name):
    path, body, headers, status = BAD[name]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    good = http.post("/v1/completions", json=GOOD)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=10 ** 6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=CHAT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="nope", max_retries=0).models.list()


# --- clients that go away ----------------------------------------------------------------------------

def test_disconnect_mid_stream_frees_the_slot(ar_server, http):
    cancelled = metric(ar_server.url, 'requests_total{reason="cancelled"}')
    body = {**GOOD, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # decoding has started
        wait_until(lambda: metric(ar_server.url, "requests_running") == 1)
    wait_until(lambda: metric(ar_server.url, "requests_running") == 0)
    assert metric(ar_server.url, 'requests_total{reason="cancelled"}') == cancelled + 1
    assert ar_server.llm.decoder.verifier.rows.of == {}  # its KV cache row is free
    assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_disconnect_while_waiting_for_a_whole_completion_frees_the_slot(ar_server):
    cancelled = metric(ar_server.url, 'requests_total{reason="cancelled"}')
    body = {**GOOD, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(ar_server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(30, read=1.0))
    wait_until(lambda: metric(ar_server.url, 'requests_total{reason="cancelled"}') == cancelled + 1)
    wait_until(lambda: metric(ar_server.url, "requests_running") == 0)
    assert ar_server.llm.decoder.verifier.rows.of == {}


# --- SSD: continuous batching with a draft worker, a full queue, losing the worker ------------------

@pytest.fixture(scope="module")
def draft_path(llm, tmp_path_factory):
    """The draft shipped for the default model, else the target's first two layers under its
    own final norm and head (a legal draft; its acceptance does not matter here)."""
    shipped = hub.default_draft(MODEL)
    if shipped is not None:
        return shipped
    target = llm.target
    draft = LlamaModel(dataclasses.replace(target.config, num_layers=2))
    state = {k: v for k, v in target.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < 2}
    draft.load_state_dict(state)
    folder = tmp_path_factory.mktemp("truncated-draft")
    save_checkpoint(draft, folder, dtype=torch.float32)
    return folder


@pytest.fixture(scope="module")
def ssd_server(offline, draft_path):
    """Two requests run, one more may wait."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()  # an SSD LLM pins this thread
    llm = LLM(MODEL, draft=str(draft_path), method="ssd", dtype="float32", num_speculative_tokens=3, max_num_seqs=2)
    server = LiveServer(llm, ServerConfig(MODEL), max_waiting=1)
    os.sched_setaffinity(0, affinity)  # the server's threads keep the pinning; what starts later does not
    yield server
    server.stop()
    torch.set_num_threads(threads)


async def stream_text(c: httpx.AsyncClient, prompt: str, max_tokens: int, delay: float = 0.0) -> str:
    await asyncio.sleep(delay)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = ""
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event
                text += event["choices"][0]["text"]
    return text


def test_ssd_requests_joining_a_running_batch_match_offline_generation(ssd_server, offline):
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=ssd_server.url, timeout=TIMEOUT_S) as c:
            return await asyncio.gather(*(stream_text(c, p, 24, delay=0.3 * i) for i, p in enumerate(PROMPTS[:3])))

    assert asyncio.run(run()) == offline["long"]
    assert metric(ssd_server.url, "speculation_cache_lookups_total") > 0


@pytest.fixture(scope="module")
def sd_server(offline, draft_path):
    server = LiveServer(LLM(MODEL, draft=str(draft_path), method="sd", dtype="float32", num_speculative_tokens=5,
                            max_num_seqs=32), ServerConfig(MODEL))
    yield server
    server.stop()


def ask(client: openai.OpenAI, prompt: str | list[dict], stream: bool, **params) -> tuple[str, str, int]:
    """Text, finish reason and completion tokens of a greedy completion (a chat completion for a
    list of messages), whole or streamed."""
    chat = isinstance(prompt, list)
    create = client.chat.completions.create if chat else client.completions.create
    request = dict(model=MODEL, temperature=0, **params, **({"messages": prompt} if chat else {"prompt": prompt}))
    if not stream:
        out = create(**request)
        choice = out.choices[0]
        return choice.message.content if chat else choice.text, choice.finish_reason, out.usage.completion_tokens
    chunks = list(create(**request, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    text = "".join((c.delta.content or "") if chat else c.text for c in choices)
    return text, choices[-1].finish_reason, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("server", ["ar_server", "sd_server", "ssd_server"])
def test_stop_strings_give_every_method_offline_ar_text_and_usage(server, offline, request):
    """A stop string ends SD and SSD at the token where it completes, as AR: the tokens after it
    in the same round are not counted."""
    live = request.getfixturevalue(server)
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    assert sum(reason == "stop" for *_, reason, _ in offline["stopped"]) >= 3  # the stop strings are met
    for prompt, max_tokens, stop, text, reason, num_tokens in offline["stopped"]:
        for stream in (False, True):
            assert ask(client, prompt, stream, max_tokens=max_tokens, stop=stop) == (text, reason, num_tokens), \
                f"{prompt!r}, stop {stop!r}, {'streamed' if stream else 'whole'}"


def test_full_queue_answers_429_with_retry_after(ssd_server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=ssd_server.url, timeout=TIMEOUT_S) as c:
        with c.stream("POST", "/v1/completions", json=body) as a, c.stream("POST", "/v1/completions", json=body) as b:
            lines = [r.iter_lines() for r in (a, b)]  # kept: dropping one would close its stream
            assert all(next(line).startswith("data: ") for line in lines)
            with c.stream("POST", "/v1/completions", json=body) as waiting:  # the one place in the queue
                assert waiting.status_code == 200
                wait_until(lambda: metric(ssd_server.url, "requests_waiting") == 1)
                refused = c.post("/v1/completions", json=body)
                assert refused.status_code == 429
                assert refused.headers["Retry-After"] and refused.json()["error"]["type"] == "rate_limit_error"
        wait_until(lambda: metric(ssd_server.url, "requests_running") == 0)
        assert metric(ssd_server.url, "requests_rejected_total") >= 1
        assert c.post("/v1/completions", json={**body, "max_tokens": 2, "stream": False}).status_code == 200


def test_samples_that_do_not_all_fit_are_refused_together(ssd_server):
    """n = 4 where 3 places are free (2 running, 1 waiting): a 429, and the 3 samples already
    queued are cancelled rather than decoded for nobody."""
    cancelled = metric(ssd_server.url, 'requests_total{reason="cancelled"}')
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "n": 4}
    with httpx.Client(base_url=ssd_server.url, timeout=TIMEOUT_S) as c:
        refused = c.post("/v1/completions", json=body)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        wait_until(lambda: metric(ssd_server.url, 'requests_total{reason="cancelled"}') == cancelled + 3)
        wait_until(lambda: metric(ssd_server.url, "requests_running") == 0)
        assert metric(ssd_server.url, "requests_waiting") == 0
        assert c.post("/v1/completions", json={**body, "n": 3, "max_tokens": 2}).status_code == 200


def test_killing_the_draft_worker_mid_stream_loses_nothing_and_a_new_one_takes_over(ssd_server, offline):
    pool = ssd_of(ssd_server.llm.decoder).pool
    process = pool.lanes[0].client.process
    tokens = metric(ssd_server.url, "generation_tokens_total")

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=ssd_server.url, timeout=TIMEOUT_S) as c:
            streams = [asyncio.ensure_future(stream_text(c, p, 24)) for p in PROMPTS[:2]]
            await asyncio.to_thread(wait_until, lambda: metric(ssd_server.url, "generation_tokens_total") > tokens + 4)
            os.kill(process.pid, signal.SIGKILL)
            return await asyncio.gather(*streams)

    with pytest.warns(RuntimeWarning, match="draft worker lost"):
        texts = asyncio.run(run())
    assert process.wait(timeout=30) is not None
    assert texts == offline["long"][:2]
    assert metric(ssd_server.url, "draft_worker_losses_total") == 1
    if pool.lanes[0].restart is not None:
        pool.lanes[0].restart.result(timeout=TIMEOUT_S)  # the new worker is ready: the next round takes it

    async def again() -> str:
        async with httpx.AsyncClient(base_url=ssd_server.url, timeout=TIMEOUT_S) as c:
            return await stream_text(c, PROMPTS[2], 24)

    hits = metric(ssd_server.url, "speculation_cache_hits_total")
    assert asyncio.run(again()) == offline["long"][2]
    assert metric(ssd_server.url, "draft_worker_restarts_total") == 1 and pool.lanes[0].live
    assert pool.lanes[0].client.process.pid != process.pid
    assert metric(ssd_server.url, "speculation_cache_hits_total") > hits  # SSD again


# --- the command: graceful shutdown -----------------------------------------------------------------

def test_serve_command_shuts_down_gracefully(offline, draft_path, tmp_path):
    """SIGTERM: a request that fits the grace period finishes, one that does not gets an error
    event; the server and its draft worker exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "saguaro.server", "--method", "ssd", "--draft", str(draft_path),
               "--dtype", "float32", "--max-model-len", "4096", "--max-batch-size", "2", "--port", str(port),
               "--shutdown-grace", "10", "--log-level", "warning", "-k", "3"]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: server.poll() is None and _healthy(url), timeout_s=TIMEOUT_S)
        worker = int(open(f"/proc/{server.pid}/task/{server.pid}/children").read().split()[0])

        async def run() -> tuple[str, list[dict]]:
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as c:
                short = asyncio.ensure_future(stream_text(c, PROMPTS[0], 12))
                endless = asyncio.ensure_future(_events(c, {"model": MODEL, "prompt": "Hello", "max_tokens": 4000,
                                                            "ignore_eos": True, "stream": True}))
                await asyncio.to_thread(wait_until, lambda: _running(url) == 2)
                server.send_signal(signal.SIGTERM)
                return await short, await endless

        short, endless = asyncio.run(run())
        assert short == offline["completion"][0]
        assert endless[-1] == "[DONE]" and "shutting down" in endless[-2]["error"]["message"]
        assert server.wait(timeout=60) == -signal.SIGTERM  # uvicorn re-raises the signal once shut down
        assert "Traceback" not in (tmp_path / "server.log").read_text()
        wait_until(lambda: not os.path.exists(f"/proc/{worker}") or _zombie(worker))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _running(url: str) -> float:
    return metric(url, "requests_running")


def _zombie(pid: int) -> bool:
    return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"


async def _events(c: httpx.AsyncClient, body: dict) -> list:
    events = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return events


def test_serve_builds_the_model_and_server_on_a_thread_that_ends(monkeypatch):
    """Every thread that runs an OpenMP region keeps a pool of workers; the main thread's beside
    the scheduler's made libgomp stop spinning, and each decode step waited for its workers
    (13 ms against 3.4). So `saguaro serve` loads the model and zeroes its KV cache elsewhere."""
    from saguaro.server import serve

    setup_threads = []

    class Built:
        def run(self, sockets):
            assert setup_threads and all(not t.is_alive() for t in setup_threads)

        def close(self):
            pass

    def record(result):
        def call(*args):
            setup_threads.append(threading.current_thread())
            return result
        return call

    monkeypatch.setattr(serve, "llm_from_args", record(Built()))
    monkeypatch.setattr(serve, "build_server", record(Built()))
    assert serve.main(["--method", "ar", "--port", "0"]) == 0
    assert len(setup_threads) == 2 and threading.main_thread() not in setup_threads


def test_serve_finds_its_port_in_use_before_loading_the_model(monkeypatch, capsys):
    from saguaro.server import serve

    def load(args):
        raise AssertionError("the model was loaded before the port was bound")

    monkeypatch.setattr(serve, "llm_from_args", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve.main(["--method", "ar", "--port", str(port)]) == 1
    assert f"port {port} on 127.0.0.1 is in use" in capsys.readouterr().err
