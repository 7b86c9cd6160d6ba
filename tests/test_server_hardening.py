"""The server against hostile or unlucky clients (issue 34): inputs that must get a 4xx rather than
a 5xx; oversized prompts that must neither be tokenized nor stall other streams; the API key
checked before anything else; connections that never finish sending; shutdown that ends every
stream with an error event; Host headers that are not loopback names.

Each test builds its own server on the session's fp32 model (a few hundred milliseconds), so
that its limits can be set small; `saguaro serve` runs in a subprocess where signals matter."""
from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from saguaro import LLM
from saguaro.server import serve
from saguaro.server.app import ServerConfig
from test_server import KEY, MODEL, TIMEOUT_S, LiveServer, _events, _healthy, _running, wait_until

AUTH = {"Authorization": f"Bearer {KEY}"}
IDLE = 1000  # idle connections a keyed client must get past


@pytest.fixture(scope="module")
def llm():
    """The default target as the session's, with a batch of 8: a server reserves its KV cache
    for its whole batch when it starts."""
    with LLM(MODEL, method="ar", dtype="float32", max_num_seqs=8) as small:
        yield small


@pytest.fixture
def keyed(llm):
    """A server that requires the API key."""
    server = LiveServer(llm, ServerConfig(MODEL, api_key=KEY), max_waiting=8)
    yield server
    server.stop()


def post_raw(url: str, path: str, raw: str, headers: dict | None = None) -> httpx.Response:
    """Posts raw JSON text (escapes such as \\ud800 reach the server as written)."""
    return httpx.post(url + path, content=raw.encode(), timeout=60,
                      headers={"Content-Type": "application/json", **AUTH, **(headers or {})})


# --- 3: no input gets a 5xx --------------------------------------------------------------------

COMPLETION = '{"model": "smollm2", "max_tokens": 4, '
CHAT = '{"model": "smollm2", "max_tokens": 4, "messages": '
HOSTILE = {  # name: (path, raw JSON)
    "surrogate in the prompt": ("/v1/completions", COMPLETION + '"prompt": "\\ud800abc"}'),
    "surrogate in a prompt list": ("/v1/completions", COMPLETION + '"prompt": ["\\udfffabc"]}'),
    "surrogate in a stop string": ("/v1/completions", COMPLETION + '"prompt": "Hi", "stop": "\\ud800"}'),
    "surrogate in a stop list": ("/v1/completions", COMPLETION + '"prompt": "Hi", "stop": ["a", "b\\udc00"]}'),
    "surrogate in a chat message": ("/v1/chat/completions", CHAT + '[{"role": "user", "content": "\\ud800"}]}'),
    "surrogate in a content part": ("/v1/chat/completions",
                                    CHAT + '[{"role": "user", "content": [{"type": "text", "text": "a\\ud800"}]}]}'),
    "surrogate in a message name": ("/v1/chat/completions",
                                    CHAT + '[{"role": "user", "content": "Hi", "name": "\\ud800"}]}'),
    "surrogate in user": ("/v1/completions", COMPLETION + '"prompt": "Hi", "user": "\\ud800"}'),
    "surrogate in an unknown field's name": ("/v1/completions", COMPLETION + '"prompt": "Hi", "\\ud800": 1}'),
    "surrogate in a logit_bias key": ("/v1/completions", COMPLETION + '"prompt": "Hi", "logit_bias": {"\\ud800": 1}}'),
    "half a surrogate pair after a whole one": ("/v1/completions", COMPLETION + '"prompt": "\\ud83d\\ude00 \\ud83d"}'),
    "top_k beyond int64": ("/v1/completions", COMPLETION + '"prompt": "Hi", "temperature": 1, '
                                                           '"top_k": 100000000000000000000}'),
    "token id beyond int64": ("/v1/completions", COMPLETION + '"prompt": [1, 100000000000000000000000]}'),
    "negative token id": ("/v1/completions", COMPLETION + '"prompt": [[-1]]}'),
    "a deeply nested unknown field": ("/v1/completions", COMPLETION + '"prompt": "Hi", "x": ' + "[" * 900 + "]" * 900
                                      + "}"),
}
ODD_BUT_VALID = {
    "a whole surrogate pair": COMPLETION + '"prompt": "\\ud83d\\ude00 Hello", "stop": "\\ud83d\\ude00"}',
    "a denormal temperature": COMPLETION + '"prompt": "Hi", "temperature": 5e-324}',
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_gets_a_400_and_the_server_keeps_serving(keyed, name):
    path, raw = HOSTILE[name]
    r = post_raw(keyed.url, path, raw)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    good = post_raw(keyed.url, "/v1/completions", COMPLETION + '"prompt": "Hello"}')
    assert good.status_code == 200


@pytest.mark.parametrize("name", list(ODD_BUT_VALID))
def test_odd_but_valid_input_is_served(keyed, name):
    r = post_raw(keyed.url, "/v1/completions", ODD_BUT_VALID[name])
    assert r.status_code == 200, r.text


# --- 5: the API key before anything else -----------------------------------------------------------

def test_metrics_need_the_key_and_health_tells_only_that_it_is_up(keyed):
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    assert httpx.get(keyed.url + "/metrics", headers=AUTH).status_code == 200
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}
    assert set(httpx.get(keyed.url + "/health", headers=AUTH).json()) == {"status", "running", "waiting"}


UNAUTHENTICATED = {  # name: (method, path, body)
    "garbage": ("POST", "/v1/completions", b'{"garbage": 1}'),
    "malformed JSON": ("POST", "/v1/chat/completions", b'{"model": '),
    "a lone surrogate": ("POST", "/v1/completions", b'{"prompt": "\\ud800"}'),
    "an unknown path": ("GET", "/v1/engines", b""),
}


@pytest.mark.parametrize("name", list(UNAUTHENTICATED))
def test_requests_without_the_key_get_401_whatever_their_body(keyed, name):
    method, path, body = UNAUTHENTICATED[name]
    r = httpx.request(method, keyed.url + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("length", [1000, 2 << 20], ids=["a short body", "a body over the limit"])
def test_the_key_is_checked_before_the_body_is_read(keyed, length):
    """Headers that announce a body which never comes (within the limit or over it: the 401
    comes before the 413): the 401 needs none of it. On a socket, since a client still sending
    a large body may see the connection reset instead of the early answer."""
    with socket.create_connection(("127.0.0.1", int(keyed.url.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(length).encode() + b"\r\n\r\n{")
        assert s.recv(4096).startswith(b"HTTP/1.1 401 ")


# --- 8: Host names (DNS rebinding) ----------------------------------------------------------------

def test_loopback_without_a_key_answers_only_loopback_host_names():
    assert serve.default_allowed_hosts("127.0.0.1", None) == ["localhost", "127.0.0.1", "::1"]
    assert serve.default_allowed_hosts("localhost", None) == ["localhost", "127.0.0.1", "::1"]
    assert serve.default_allowed_hosts("::1", None) == ["localhost", "127.0.0.1", "::1"]
    assert serve.default_allowed_hosts("127.0.0.1", KEY) == ["*"]  # the key protects it
    assert serve.default_allowed_hosts("0.0.0.0", None) == ["*"]  # exposed on purpose


def status_for_host(url: str, host: str) -> int:
    return httpx.get(url + "/v1/models", headers={"Host": host, **AUTH}).status_code


@pytest.mark.parametrize("allowed, refused, admitted", [
    (None, ["evil.example", "evil.example:80", "127.0.0.1.evil.example", "localhost.evil.example"],
     ["localhost", "LOCALHOST:8000", "127.0.0.1:1", "[::1]:8000", "localhost."]),
    (["api.example"], ["localhost", "evil.example"], ["api.example", "API.example:443"]),
    (["*"], [], ["evil.example", "localhost"]),
])
def test_host_header_is_checked_on_loopback_without_a_key(llm, allowed, refused, admitted):
    server = LiveServer(llm, ServerConfig(MODEL, allowed_hosts=allowed), max_waiting=2)
    try:
        for host in refused:
            r = httpx.get(server.url + "/health", headers={"Host": host})
            assert r.status_code == 400 and "Host" in r.json()["error"]["message"], host
        assert all(status_for_host(server.url, host) == 200 for host in admitted)
    finally:
        server.stop()


def test_host_header_is_not_checked_with_a_key(keyed):
    assert status_for_host(keyed.url, "evil.example") == 200


# --- 4: oversized prompts are refused untokenized; tokenizing stalls no stream ---------------------

def counting_encode(monkeypatch, llm, delay_s: float = 0.0) -> list:
    """Replaces llm.encode with one that records each call (and may sleep first, as a long
    prompt's tokenizing would take)."""
    calls, encode = [], llm.encode

    def encode_and_count(prompt, *args, **kwargs):
        calls.append(prompt)
        time.sleep(delay_s)
        return encode(prompt, *args, **kwargs)

    monkeypatch.setattr(llm, "encode", encode_and_count)
    return calls


@pytest.mark.parametrize("body", [
    {"model": MODEL, "prompt": "word " * 20_000},
    {"model": MODEL, "messages": [{"role": "user", "content": "word " * 10_000}] * 2},
])
def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(keyed, monkeypatch, body):
    calls = counting_encode(monkeypatch, keyed.llm)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(keyed.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert calls == []
    within = {"prompt": "word " * 300} if "prompt" in body else {"messages": [{"role": "user", "content": "word " * 300}]}
    r = httpx.post(keyed.url + path, json={**body, **within}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"] and len(calls) == 1  # within the bound


def test_tokenizing_does_not_stall_streams(keyed, monkeypatch):
    """Three prompts that each take 3 s to tokenize arrive while a stream runs: no gap between
    its chunks comes near 3 s (tokenizing on the event loop stalled it for all 9), though a
    loaded machine may take most of a second per token."""
    counting_encode(monkeypatch, keyed.llm, delay_s=3.0)

    async def run() -> float:
        async with httpx.AsyncClient(base_url=keyed.url, headers=AUTH, timeout=TIMEOUT_S) as c:
            gaps, last = [], None
            body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 120, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=body) as r:
                slow = None
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    if last is None:  # decoding has started: the slow prompts arrive
                        slow = asyncio.gather(*(c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                                                "max_tokens": 2}) for _ in range(3)))
                    else:
                        gaps.append(now - last)
                    last = now
                assert all(r.status_code == 200 for r in await slow)
            return max(gaps)

    assert asyncio.run(run()) < 2.5


# --- 6: connections that never finish sending ----------------------------------------------------

def slow_server(llm, **limits) -> LiveServer:
    return LiveServer(llm, ServerConfig(MODEL, api_key=KEY, header_timeout_s=1.0, body_timeout_s=1.0, **limits),
                      max_waiting=2)


def port(server: LiveServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


STALLED = {  # what a connection sends, then nothing more
    "nothing": b"",
    "part of the headers": b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty",
    "headers and part of the body": (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                                     + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 1000\r\n\r\n{\"model\": "),
}


def closed_within(sockets: list[socket.socket], seconds: float) -> int:
    """How many of the sockets the server closed within the time (what it sent before is read)."""
    deadline, closed = time.monotonic() + seconds, 0
    for s in sockets:
        try:
            while (left := deadline - time.monotonic()) > 0:
                s.settimeout(left)
                if not s.recv(4096):
                    closed += 1
                    break
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed += 1
    return closed


def test_connections_that_stall_are_closed_within_the_timeouts(llm):
    server = slow_server(llm)
    sockets = []
    try:
        for sent in STALLED.values():
            for _ in range(20):
                sockets.append(socket.create_connection(("127.0.0.1", port(server))))
                sockets[-1].sendall(sent)
        assert closed_within(sockets, 3.0) == len(sockets)
        trickle = socket.create_connection(("127.0.0.1", port(server)))  # one header byte every 0.2 s
        sockets.append(trickle)
        request, start = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100, time.monotonic()
        for byte in request:
            trickle.sendall(bytes([byte]))
            if closed_within([trickle], 0.2):
                break
        assert time.monotonic() - start < 2.5  # the headers' time runs from their first byte
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        for s in sockets:
            s.close()
        server.stop()


def test_the_body_timeout_answers_408(llm):
    server = slow_server(llm)
    try:
        with socket.create_connection(("127.0.0.1", port(server)), timeout=5) as s:
            s.sendall(STALLED["headers and part of the body"])
            assert s.recv(4096).startswith(b"HTTP/1.1 408 ")
    finally:
        server.stop()


def open_idle(server: LiveServer, count: int) -> list[socket.socket]:
    """count connections that send nothing, once the server has taken them all."""
    sockets = [socket.create_connection(("127.0.0.1", port(server))) for _ in range(count)]
    wait_until(lambda: len(server.server.server_state.connections) >= count, timeout_s=30)
    return sockets


def still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        s.setblocking(True)


def test_a_keyed_client_is_served_while_1000_idle_connections_are_open(llm):
    """Connections that send nothing (and need no key) cost a socket each, not a place among the
    requests: uvicorn's limit_concurrency counted them, and 512 such locked everyone out."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * IDLE + 512  # both ends of each connection are in this process
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    server = LiveServer(llm, ServerConfig(MODEL, api_key=KEY, header_timeout_s=60.0), max_waiting=8)
    sockets = []
    try:
        sockets = open_idle(server, IDLE)
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
            assert c.get("/v1/models").status_code == 200
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert all(still_open(s) for s in sockets)
    finally:
        for s in sockets:
            s.close()
        server.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_serve_raises_a_low_file_descriptor_limit_towards_the_hard_one():
    """A soft limit of 1024 (a common default) would leave a thousand idle connections no room."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = serve.MAX_FDS if hard == resource.RLIM_INFINITY else min(hard, serve.MAX_FDS)
    if wanted <= 1024:
        pytest.skip(f"the hard limit is {hard}")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        serve.raise_fd_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == wanted
        assert serve.default_max_connections() == wanted - serve.FD_RESERVE
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_at_the_connection_cap_the_connection_idle_longest_is_closed(llm):
    server = LiveServer(llm, ServerConfig(MODEL, api_key=KEY, max_connections=8), max_waiting=8)
    sockets = []
    try:
        sockets = open_idle(server, 8)
        assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
        assert closed_within(sockets[:1], 5.0) == 1
        assert all(still_open(s) for s in sockets[1:])
    finally:
        for s in sockets:
            s.close()
        server.stop()


def test_requests_beyond_the_limit_get_503_and_idle_connections_do_not_count(llm):
    """With a limit of one request, four idle connections leave room for it; one whose body is
    still arriving is a request being answered, and fills it."""
    server = LiveServer(llm, ServerConfig(MODEL, api_key=KEY, limit_concurrency=1), max_waiting=8)
    sockets = []
    try:
        sockets = open_idle(server, 4)
        assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
        sockets.append(socket.create_connection(("127.0.0.1", port(server)), timeout=5))
        sockets[-1].sendall(STALLED["headers and part of the body"])
        wait_until(lambda: httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 503, timeout_s=5)
        refused = httpx.get(server.url + "/v1/models", headers=AUTH)
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        sockets[-1].close()
        wait_until(lambda: httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200, timeout_s=5)
    finally:
        for s in sockets:
            s.close()
        server.stop()


# --- oversized heads and declared bodies get their 4xx at once ------------------------------------

def head(target: bytes = b"/v1/models", extra: bytes = b"") -> bytes:
    return b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n" + \
        extra + b"\r\n"


BIG_HEADER = b"X-Big: " + b"a" * 20_000 + b"\r\n"
HEADS = {  # name: (the head, the pieces it is sent in a moment apart, its status under a 16 KB limit)
    "a 100 KB URL in one piece": (head(b"/v1/models?q=" + b"a" * 100_000), 1, 431),
    "a 20 KB header in one piece": (head(extra=BIG_HEADER), 1, 431),
    "a 20 KB header in two pieces": (head(extra=BIG_HEADER), 2, 431),
    "a 15 KB header in two pieces": (head(extra=BIG_HEADER[:15_000] + b"\r\n"), 2, 200),
}


def status_of(sock: socket.socket) -> int:
    reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 "), reply
    return int(reply.split()[1])


@pytest.mark.parametrize("name", list(HEADS))
def test_an_oversized_head_gets_431_at_once(keyed, name):
    sent, pieces, status = HEADS[name]
    with socket.create_connection(("127.0.0.1", port(keyed)), timeout=5) as s:
        for i in range(pieces):
            s.sendall(sent[i * len(sent) // pieces:(i + 1) * len(sent) // pieces])
            time.sleep(0.1)
        assert status_of(s) == status


def test_a_declared_oversized_body_gets_413_at_once(keyed):
    """The body never comes: the 413 must not wait for it (the body timeout's 408 came after 30 s)."""
    with socket.create_connection(("127.0.0.1", port(keyed)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: " + str(10 ** 12).encode() + b"\r\n\r\n")
        assert status_of(s) == 413


def test_a_trailing_slash_is_the_same_route(keyed):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=keyed.url, headers=AUTH, timeout=60) as c:
        plain, slashed = c.post("/v1/completions", json=body), c.post("/v1/completions/", json=body)
        assert slashed.status_code == 200, slashed.text
        assert slashed.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert c.get("/v1/models/").status_code == 200
    assert httpx.get(keyed.url + "/health/").json() == {"status": "ok"}  # public, as /health is


# --- 7: shutdown ends every stream with an error event ------------------------------------------

@contextlib.contextmanager
def serve_process(tmp_path, *args: str):
    """`saguaro serve --method ar` on a free loopback port, in a subprocess: (process, url)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    command = [sys.executable, "-m", "saguaro.server", "--method", "ar", "--dtype", "float32", "--max-model-len",
               "4096", "--max-batch-size", "4", "--port", str(free), "--log-level", "warning", *args]
    with open(tmp_path / "server.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{free}"
            wait_until(lambda: process.poll() is None and _healthy(url), timeout_s=TIMEOUT_S)
            yield process, url
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


LONG = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}


async def whole(c: httpx.AsyncClient, body: dict) -> tuple[int, dict]:
    r = await c.post("/v1/completions", json=body)
    return r.status_code, r.json()  # a plain-text answer fails here


def ended_by_shutdown(events: list) -> bool:
    return events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]


def test_sigterm_ends_at_once_what_cannot_finish_in_the_grace_period(tmp_path):
    """A request that fits the grace period finishes; those that cannot (4000 tokens in 30 s)
    end at once with an error event or a 503, and the server exits without waiting out the grace."""
    with serve_process(tmp_path, "--shutdown-grace", "30") as (server, url):
        async def run() -> tuple:
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as c:
                short = asyncio.ensure_future(_events(c, {**LONG, "max_tokens": 6, "stream": True}))
                endless = asyncio.ensure_future(_events(c, {**LONG, "stream": True}))
                waiting = asyncio.ensure_future(whole(c, LONG))
                await asyncio.to_thread(wait_until, lambda: _running(url) == 3)
                await asyncio.sleep(1.0)  # the server has seen them decode
                server.send_signal(signal.SIGTERM)
                return time.monotonic(), await short, await endless, await waiting

        signalled, short, endless, (status, answer) = asyncio.run(run())
        assert short[-1] == "[DONE]" and short[-2]["choices"][0]["finish_reason"] == "length"
        assert ended_by_shutdown(endless)
        assert status == 503 and "shutting down" in answer["error"]["message"]
        assert server.wait(timeout=60) == -signal.SIGTERM
        assert time.monotonic() - signalled < 20  # not the 30 s of grace
    assert "Traceback" not in (tmp_path / "server.log").read_text()


def test_a_forced_quit_ends_every_stream_with_an_error_event(tmp_path):
    """A second SIGINT: the streams get an error event and [DONE], a whole completion a JSON 503.
    The grace period (an hour) is long enough for them all: the first SIGINT ends none."""
    fitting = {**LONG, "max_tokens": 1000}
    with serve_process(tmp_path, "--shutdown-grace", "3600") as (server, url):
        async def run() -> tuple:
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as c:
                streams = [asyncio.ensure_future(_events(c, {**fitting, "stream": True})) for _ in range(2)]
                waiting = asyncio.ensure_future(whole(c, fitting))
                await asyncio.to_thread(wait_until, lambda: _running(url) == 3)
                server.send_signal(signal.SIGINT)
                await asyncio.sleep(1.0)
                server.send_signal(signal.SIGINT)
                return await asyncio.gather(*streams), await waiting

        streams, (status, answer) = asyncio.run(run())
        assert all(ended_by_shutdown(events) for events in streams)
        assert status == 503 and "shutting down" in answer["error"]["message"]
        server.wait(timeout=30)
