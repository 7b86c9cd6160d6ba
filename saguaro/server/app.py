"""The HTTP side of `saguaro serve`: an OpenAI-compatible FastAPI app in front of a Scheduler.

The scheduler thread owns the model; each HTTP request submits one engine request per sample
(n of them, which share the prompt's prefill through the prefix cache) and reads their updates
from an asyncio queue that the scheduler fills through call_soon_threadsafe. A request whose
client goes away is cancelled, which frees its places in the batch and its cache.

With an API key, every path but /health needs it, and it is checked from the headers before
anything reads the body: without it, any request gets 401 and learns nothing of what the server
would accept. /health answers {"status": "ok"} to anyone, so that a liveness probe needs no
secret; the load (requests running and waiting) is only for holders of the key, as is /metrics.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from saguaro.engine.sampler import SamplingParams
from saguaro.engine.structured import grammar_tokenizer
from saguaro.llm import LLM
from saguaro.server import scheduler as sched
from saguaro.server import metrics
from saguaro.server.logprobs import TokenText
from saguaro.server.protocol import (MAX_CHOICES, APIError, ChatCompletionRequest, CompletionRequest,
                                     SamplingRequest, chat_choice, chat_delta, completion_choice, envelope,
                                     error_body, new_id, usage)
from saguaro.server.tools import ChatTemplateTools, ToolCallStream, ToolReading, new_call_id

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5
PACE_MARGIN = 2.0  # see Inflight


@dataclass
class ServerConfig:
    model_name: str  # what /v1/models lists and requests must name
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on every path but /health when set
    max_body_bytes: int = 1 << 20
    shutdown_grace_s: float = 30.0  # in-flight requests may finish within this on shutdown
    # Host header names answered ("*": any); None: any here, and build_server's default for its bind
    allowed_hosts: list[str] | None = None
    header_timeout_s: float = 10.0  # a request's headers must arrive within this of their first byte
    body_timeout_s: float = 30.0  # and its body within this of its headers
    keep_alive_s: float = 5.0  # an idle connection between requests is closed after this
    limit_concurrency: int | None = 512  # requests being answered beyond which a new one gets 503
    max_header_bytes: int = 16 << 10  # a request's head (request line and headers) beyond it gets 431
    # open connections beyond which the one idle longest is closed; None: from the file-descriptor limit
    max_connections: int | None = None


class EngineStream:
    """The updates of one HTTP request's engine requests (one per sample), carried from the
    scheduler thread to the event loop as (sample index, update)."""

    def __init__(self, scheduler: sched.Scheduler, prompts: list[list[int]], params: SamplingParams,
                 inflight: Inflight, constraint_param: str | None = None):
        """constraint_param: the request field that set params.structured_outputs, which a 400
        for a grammar the engine cannot compile names."""
        self.scheduler, self.inflight = scheduler, inflight
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, sched.Update]] = asyncio.Queue()
        self.request_ids: list[int] = []
        self.running: set[int] = set()  # samples not ended
        self.max_tokens = params.max_tokens
        self.generated: dict[int, int] = {}  # output tokens by sample
        self.since: tuple[float, int] | None = None  # (time, tokens generated) at the first update
        try:
            for prompt_ids in prompts:  # choice index: prompt * n + sample, as OpenAI orders them
                for sample in params.samples():
                    index = len(self.request_ids)
                    self.request_ids.append(scheduler.submit(sched.Request(prompt_ids, sample, self._putter(index))))
                    self.running.add(index)
        except (sched.QueueFull, sched.ShuttingDown, ValueError) as e:
            self.close()  # all samples or none
            if isinstance(e, sched.QueueFull):
                raise APIError(429, f"the server is busy ({e}); retry later", "rate_limit_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from e
            if isinstance(e, sched.ShuttingDown):
                raise APIError(503, str(e), "server_error") from e
            raise APIError(400, str(e), param=constraint_param if "structured_outputs" in str(e) else
                           "max_tokens") from e
        inflight.streams.add(self)

    @property
    def done(self) -> bool:
        return not self.running

    def _putter(self, index: int):
        def put(update: sched.Update) -> None:  # on the scheduler thread
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, update))
        return put

    async def next(self) -> tuple[int, sched.Update]:
        index, update = await self.queue.get()
        if update.done:
            self.running.discard(index)
        if update.error is None:
            self.generated[index] = update.num_output_tokens
            self.since = self.since or (self.loop.time(), sum(self.generated.values()))
        return index, update

    def seconds_to_finish(self) -> float | None:
        """How long, at the rate its samples have decoded since their first update, until the
        furthest behind reaches max_tokens (an end of text may come sooner); None before any
        decoding could be timed."""
        if self.since is None or not self.running:
            return None
        elapsed, decoded = self.loop.time() - self.since[0], sum(self.generated.values()) - self.since[1]
        if elapsed <= 0 or decoded <= 0:
            return None
        left = max(self.max_tokens - self.generated.get(index, 0) for index in self.running)
        return left / (decoded / elapsed / len(self.request_ids))

    def end(self, error: str) -> None:
        """Ends the request early with an error update, as the scheduler ends one; close()
        then cancels its samples."""
        if self.running:
            self.queue.put_nowait((min(self.running), sched.Update("", 0, 0, error=error)))

    def close(self) -> None:
        """Cancels the samples that have not ended."""
        for index in sorted(self.running):
            self.scheduler.cancel(self.request_ids[index])
        self.running.clear()
        self.inflight.streams.discard(self)


class Inflight:
    """The requests being answered, so that shutdown can end at once those that cannot finish
    within its grace period, rather than run them until it is over for nothing. A request is
    ended only if even at PACE_MARGIN times its pace so far it could not finish: the pace of a
    fresh process's first rounds, or of a loaded machine's, varies severalfold, and one ended
    wrongly is lost while one kept wrongly only waits for the grace period's end."""

    def __init__(self):
        self.streams: set[EngineStream] = set()

    def end_unfinishable(self, seconds_left: float) -> None:
        for stream in list(self.streams):
            needed = stream.seconds_to_finish()
            if needed is not None and needed > PACE_MARGIN * seconds_left:
                self.streams.discard(stream)
                stream.end(f"the server is shutting down: this request would need {needed:.0f} s more, "
                           f"beyond the {max(seconds_left, 0):.0f} s left of its grace period")


PUBLIC_PATHS = frozenset({"/health"})  # answered without the API key (with less in it)


def key_given(headers: list[tuple[bytes, bytes]], api_key: str | None) -> bool:
    """Whether the request carries "Authorization: Bearer KEY" (always true without a key)."""
    if api_key is None:
        return True
    given = dict(headers).get(b"authorization", b"")
    return hmac.compare_digest(given, f"Bearer {api_key}".encode())


def host_name(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The Host header's name, lowercase, without its port or a final dot; None without one."""
    host = dict(headers).get(b"host")
    if host is None:
        return None
    name = host.decode("latin-1").strip().lower()
    name = name[1:name.index("]")] if name.startswith("[") and "]" in name else name.rsplit(":", 1)[0]
    return name.rstrip(".")


def head_bytes(scope) -> int:
    """The size of a request's head as it came: its request line and header lines."""
    line = len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"]) + len(" ? HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + len(": \r\n") for name, value in scope["headers"]) + len("\r\n")


def head_too_large(max_bytes: int) -> dict:
    return error_body(f"the request's head (its request line and headers) exceeds {max_bytes} bytes "
                      f"(saguaro serve --max-header-bytes)", code="request_header_fields_too_large")


async def refuse(status: int, body: dict, errors: Counter[int], scope, receive, send,
                 headers: dict | None = None) -> None:
    """Answers at once, counted in errors; the body is left unread, so the connection closes
    rather than wait for it."""
    errors[status] += 1
    await JSONResponse(body, status_code=status, headers={"Connection": "close", **(headers or {})})(
        scope, receive, send)


class Gate:
    """ASGI middleware that judges a request by its head alone, before anything reads, limits
    or validates its body: first its size (uvicorn's parser limits only a head that arrives in
    several reads), then the Host header, which a DNS-rebinding page cannot choose (its
    requests name the attacker's domain, though they reach a loopback address), then the API key
    (every path but /health needs it), so that an unauthenticated client learns nothing about
    what the server would accept. A request without a Host header (no browser sends one) passes.
    A path's trailing slash is dropped: /v1/completions/ is /v1/completions, not a redirect."""

    def __init__(self, app, api_key: str | None, allowed_hosts: list[str] | None, max_header_bytes: int,
                 errors: Counter[int]):
        self.app, self.api_key, self.max_header_bytes, self.errors = app, api_key, max_header_bytes, errors
        self.allowed_hosts = None if allowed_hosts is None or "*" in allowed_hosts else \
            {h.lower().rstrip(".") for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if head_bytes(scope) > self.max_header_bytes:
            return await refuse(431, head_too_large(self.max_header_bytes), self.errors, scope, receive, send)
        scope["path"] = scope["path"].rstrip("/") or "/"
        host = host_name(scope["headers"])
        if self.allowed_hosts is not None and host is not None and host not in self.allowed_hosts:
            return await refuse(400, error_body(f"the Host header {host!r} is not one this server answers to "
                                                f"(saguaro serve --allowed-hosts)", code="host_not_allowed"),
                                self.errors, scope, receive, send)
        if scope["path"] not in PUBLIC_PATHS and not key_given(scope["headers"], self.api_key):
            return await refuse(401, error_body("a valid API key is required (Authorization: Bearer KEY)",
                                                code="invalid_api_key"), self.errors, scope, receive, send)
        await self.app(scope, receive, send)


class RequestLimit:
    """ASGI middleware: while max_requests requests are being answered, a new one gets 503 at
    once. It counts requests, not connections (uvicorn's limit_concurrency counts both): a
    connection that sends nothing, or not yet a whole head, costs a socket but no work, and
    counting those let anyone without the key lock keyed clients out (serve.py caps them)."""

    def __init__(self, app, max_requests: int | None, errors: Counter[int]):
        self.app, self.max_requests, self.errors = app, max_requests, errors
        self.answering = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.max_requests is None:
            return await self.app(scope, receive, send)
        if self.answering >= self.max_requests:
            return await refuse(503, error_body(f"the server is answering {self.answering} requests, its limit "
                                                f"(saguaro serve --limit-concurrency); retry later", "server_error"),
                                self.errors, scope, receive, send, headers={"Retry-After": str(RETRY_AFTER_S)})
        self.answering += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.answering -= 1


class BodyLimit:
    """ASGI middleware: a request body over max_bytes is refused with 413, at once if its
    Content-Length says so, else when a read passes the limit. A declared body up to
    DRAINED x max_bytes is read and dropped first: a server that closes with a request's bytes
    unread resets the connection, and the client sees that instead of the 413."""

    DRAINED = 4

    def __init__(self, app, max_bytes: int, errors: Counter[int]):
        self.app, self.max_bytes, self.errors = app, max_bytes, errors

    def too_large(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes (saguaro serve --max-body-bytes)"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_bytes:
            if int(declared) <= self.DRAINED * self.max_bytes:  # within the body timeout (BodyTimeout)
                while (await receive()).get("more_body", False):
                    pass
            return await refuse(413, error_body(self.too_large()), self.errors, scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self.too_large())
            return message

        await self.app(scope, limited_receive, send)


class BodyTimeout:
    """ASGI middleware: a request body that has not all arrived within timeout_s of the app's
    first read is answered 408 and its connection closed; uvicorn would wait for ever. Reads
    after the body (a streaming response listening for the client going away) are not timed."""

    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline: float | None = None
        body_done = False

        async def timed_receive():
            nonlocal deadline, body_done
            if body_done:
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                    headers={"Connection": "close"}) from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


def create_app(llm: LLM, scheduler: sched.Scheduler, config: ServerConfig) -> FastAPI:
    """The app starts the scheduler thread; on shutdown it stops it (requests still running
    get an error) and closes the LLM, which stops an SSD draft worker. app.state.inflight holds
    the requests being answered."""
    errors: Counter[int] = Counter()  # refused requests by status, for /metrics
    inflight = Inflight()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.shutdown, 0.0)
            llm.close()

    app = FastAPI(title="saguaro", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.inflight = inflight
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, errors=errors)
    app.add_middleware(BodyTimeout, timeout_s=config.body_timeout_s)
    app.add_middleware(RequestLimit, max_requests=config.limit_concurrency, errors=errors)
    # the last added runs first: the gate before anything reads the body
    app.add_middleware(Gate, api_key=config.api_key, allowed_hosts=config.allowed_hosts,
                       max_header_bytes=config.max_header_bytes, errors=errors)

    def error_response(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
        errors[status] += 1
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.body(), e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = e.errors()
        if any(p["type"] == "json_invalid" for p in problems):
            return error_response(400, error_body("the request body is not valid JSON"))
        first = problems[0] if problems else {"loc": (), "msg": "invalid request", "type": ""}
        param = ".".join(str(part) for part in first["loc"][1:]) or None
        if first["type"] == "extra_forbidden":  # OpenAI's words for an argument it does not know
            return error_response(400, error_body(f"Unrecognized request argument supplied: {param}", param=param))
        message = "; ".join(f"{'.'.join(str(x) for x in p['loc'][1:]) or 'body'}: {p['msg']}" for p in problems[:3])
        return error_response(400, error_body(message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(e.status_code, error_body(str(e.detail), kind), getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return error_response(500, error_body(f"internal error: {e!r}", "server_error"))

    def check_model(body: SamplingRequest) -> None:
        if body.model != config.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{config.model_name!r}", param="model", code="model_not_found")

    @app.get("/health")
    async def health(request: Request) -> dict:
        """Liveness for anyone; the load only for holders of the key."""
        if not key_given(request.scope["headers"], config.api_key):
            return {"status": "ok"}
        s = scheduler.stats()
        return {"status": "ok", "running": s.running, "waiting": s.waiting}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = metrics.render(scheduler.stats(), dict(errors), scheduler.max_batch_size, scheduler.max_waiting,
                              llm.metrics())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "saguaro", "max_model_len": scheduler.max_model_len}]}

    max_prompt_chars = scheduler.max_model_len * longest_token(llm.tokenizer)
    vocab_size = llm.target.config.vocab_size
    token_text = TokenText(llm.tokenizer)
    template_tools = ChatTemplateTools.of(chat_template(llm.tokenizer))

    def check_prompt_chars(chars: int, param: str) -> None:
        """Refuses, untokenized, a prompt with more characters than the context's tokens could
        hold were each the vocabulary's longest: such a prompt cannot fit, and tokenizing a
        megabyte only to say so took about a second."""
        if chars > max_prompt_chars:
            raise APIError(400, f"the prompt has {chars} characters; it cannot fit the context of "
                                f"{scheduler.max_model_len} tokens, which hold at most {max_prompt_chars}",
                           param=param)

    def check_token_ids(ids, param: str) -> None:
        if not all(0 <= int(t) < vocab_size for t in ids):
            raise APIError(400, f"token ids must be in [0, {vocab_size})", param=param)

    def check_request(body: SamplingRequest) -> None:
        body.check_supported()
        check_model(body)
        check_token_ids(body.logit_bias or (), "logit_bias")
        check_token_ids(body.stop_token_ids or (), "stop_token_ids")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body)
        prompts = body.prompts()
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n = {body.n} exceed the {MAX_CHOICES} choices a request "
                                f"may have", param="prompt")
        check_prompt_chars(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        prompt_ids = []
        for prompt in prompts:
            if isinstance(prompt, str):
                prompt_ids.append(await asyncio.to_thread(llm.encode, prompt))  # the streams go on meanwhile
            else:
                check_token_ids(prompt, "prompt")
                prompt_ids.append(prompt)
        echo = [p if isinstance(p, str) else llm.tokenizer.decode(p) for p in prompts] if body.echo else None
        shape = ReplyShape(chat=False, prompt_ids=prompt_ids, samples_per_prompt=body.n,
                           logprobs=body.logprobs is not None, echo=echo)
        prompt_logprobs = body.logprobs if body.echo else None
        return await respond(request, body, shape, body.max_tokens, body.logprobs, prompt_logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request(body)
        offered = [t.model_dump(exclude_none=True) for t in body.tools] if body.calls_tools else None
        messages = template_tools.messages([m.as_template_input() for m in body.messages], offered)
        check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        try:  # the streams go on meanwhile
            prompt_ids = await asyncio.to_thread(llm.encode, messages, offered if template_tools.takes_tools else None,
                                                 body.chat_template_kwargs)
        except Exception as e:  # the chat template refused the conversation
            raise APIError(400, f"the chat template cannot format these messages: {e}", param="messages") from e
        reading = None
        if body.calls_tools:
            forced = body.tool_choice == "required" or body.named_function is not None
            reading = ToolReading(template_tools.format, forced, body.named_function, body.parallel_tool_calls)
        shape = ReplyShape(chat=True, prompt_ids=[prompt_ids], samples_per_prompt=body.n, logprobs=body.logprobs,
                           tools=reading)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await respond(request, body, shape, body.requested_max_tokens, logprobs, None)

    async def respond(request: Request, body: SamplingRequest, shape: ReplyShape, max_tokens: int | None,
                      logprobs: int | None, prompt_logprobs: int | None):
        longest = max(shape.prompt_ids, key=len)
        room = scheduler.max_new_tokens(len(longest))
        param = "messages" if shape.chat else "prompt"
        if room < 1:
            raise APIError(400, f"the prompt ({len(longest)} tokens) does not fit the context of "
                                f"{scheduler.max_model_len} tokens", param=param)
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens ({max_tokens}) is too large: the prompt has {len(longest)} tokens "
                                f"and the context {scheduler.max_model_len}, which leaves at most {room}",
                           param="max_completion_tokens" if shape.chat and body.max_completion_tokens else "max_tokens")
        constraint = body.output_constraint()
        params = body.sampling_params(max_tokens or room, logprobs, prompt_logprobs, constraint)
        if constraint is not None:  # llguidance's view of the tokenizer, built once (0.2 s for 49k tokens)
            await asyncio.to_thread(lambda: grammar_tokenizer(llm.tokenizer, llm.eos_token_ids).llguidance())
        stream = EngineStream(scheduler, shape.prompt_ids, params, inflight, constraint.param if constraint else None)
        reply = Reply(new_id("chatcmpl" if shape.chat else "cmpl"), config.model_name, shape, token_text)
        if body.stream:
            return StreamingResponse(reply.events(stream, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await reply.whole(stream, request)

    return app


def chat_template(tokenizer) -> str | None:
    """The template the tokenizer renders chats with (of several, the one for tools)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return template.get("tool_use") or template.get("default")
    return template


def longest_token(tokenizer) -> int:
    """The characters of the vocabulary's longest token, as spelled in the vocabulary: at least
    the characters of text it stands for (a byte-level token spells each byte as a character)."""
    return max(map(len, tokenizer.get_vocab()))


@dataclass
class ReplyShape:
    """What a reply holds besides text: choice index = prompt * samples_per_prompt + sample."""
    chat: bool
    prompt_ids: list[list[int]]
    samples_per_prompt: int = 1
    logprobs: bool = False
    echo: list[str] | None = None  # completions: each prompt's text, written before its choices' text
    tools: ToolReading | None = None  # chat: how the reply is read for tool calls

    def prompt_of(self, index: int) -> int:
        return index // self.samples_per_prompt


class ChoiceState:
    """One choice's reply as its updates arrive."""

    def __init__(self, shape: ReplyShape, index: int):
        self.shape, self.index = shape, index
        self.parts: list[str] = []
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None
        self.tool_stream = ToolCallStream(shape.tools) if shape.tools is not None else None
        self.text_offset = 0  # completions, streamed: where the next token's text starts
        self.last: sched.Update | None = None

    def add(self, update: sched.Update) -> None:
        self.parts.append(update.text)
        self.logprobs += update.logprobs
        if update.prompt_logprobs is not None:
            self.prompt_logprobs = update.prompt_logprobs
        self.last = update

    def echoed(self) -> str:
        return self.shape.echo[self.shape.prompt_of(self.index)] if self.shape.echo is not None else ""

    def completion_logprobs(self, token_text: TokenText, new: list, first: bool) -> dict | None:
        """Completions' logprobs of new tokens (with the echoed prompt's before the first)."""
        if not self.shape.logprobs:
            return None
        entries = list(new)
        if first and self.shape.echo is not None:
            prompt = self.shape.prompt_ids[self.shape.prompt_of(self.index)]
            given = self.prompt_logprobs or [None] * len(prompt)
            entries = [e if e is not None else (t, None) for t, e in zip(prompt, given)] + entries
        rendered = token_text.completion(entries, self.text_offset)
        if rendered["text_offset"]:
            self.text_offset = rendered["text_offset"][-1] + len(rendered["tokens"][-1])
        return rendered


class Reply:
    """Renders one request's updates as an OpenAI completion or chat completion."""

    def __init__(self, id: str, model: str, shape: ReplyShape, token_text: TokenText):
        self.id, self.model, self.shape, self.token_text = id, model, shape, token_text
        self.chat = shape.chat
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, object: str, choices: list[dict], usage_: dict | None = None) -> dict:
        return envelope(self.id, object, self.model, choices, usage_, self.created)

    def _usage(self, states: dict[int, ChoiceState]) -> dict:
        """Each prompt counts once (its cached tokens as its first sample found them); the
        completion tokens of every sample add up."""
        firsts = [states[i].last for i in sorted(states) if i % self.shape.samples_per_prompt == 0]
        return usage(sum(u.num_prompt_tokens for u in firsts), sum(s.last.num_output_tokens for s in states.values()),
                     sum(u.num_cached_tokens for u in firsts))

    def _chunk(self, state: ChoiceState, update: sched.Update, first: bool) -> dict | None:
        """The chunk for one update of a choice, or None when it has nothing to say."""
        finish = update.finish_reason
        if not self.chat:
            text = (state.echoed() if first else "") + update.text
            logprobs = state.completion_logprobs(self.token_text, update.logprobs, first)
            if not (text or finish or first or logprobs):
                return None
            return self._envelope(self.chunk_object, [completion_choice(text, finish, state.index, logprobs)])
        stream = state.tool_stream
        text = stream.add(update.text) if stream is not None else update.text
        calls = []
        if update.done and stream is not None:
            rest, calls = stream.finish()
            text += rest
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if calls:
            delta["tool_calls"] = [{"index": i, **call.as_openai(new_call_id())} for i, call in enumerate(calls)]
            finish = "tool_calls" if finish == "stop" else finish
        logprobs = self.token_text.chat(update.logprobs) if self.shape.logprobs and update.logprobs else None
        if not (delta or finish or logprobs):
            return None
        return self._envelope(self.chunk_object, [chat_delta(delta, finish, state.index, logprobs)])

    async def events(self, stream: EngineStream, include_usage: bool) -> AsyncIterator[str]:
        """Server-sent events, each choice's chunks under its index; an engine error ends the
        stream with an error event."""
        try:
            states: dict[int, ChoiceState] = {}
            while not stream.done:
                index, update = await stream.next()
                if update.error is not None:
                    yield sse(error_body(update.error, "server_error"))
                    break
                first = index not in states
                state = states.setdefault(index, ChoiceState(self.shape, index))
                state.add(update)
                if (chunk := self._chunk(state, update, first)) is not None:
                    yield sse(chunk)
            else:
                if include_usage:
                    yield sse(self._envelope(self.chunk_object, [], self._usage(states)))
            yield "data: [DONE]\n\n"
        finally:
            stream.close()

    async def whole(self, stream: EngineStream, request: Request) -> JSONResponse:
        """Waits for every choice's end, watching for the client going away meanwhile."""
        states: dict[int, ChoiceState] = {}
        pending = asyncio.ensure_future(stream.next())
        try:
            while True:
                done = (await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S))[0]
                if await request.is_disconnected():
                    return JSONResponse(error_body("the client disconnected"), status_code=499)
                if not done:
                    continue
                index, update = pending.result()
                if update.error is not None:
                    status = 503 if "shutting down" in update.error else 500
                    return JSONResponse(error_body(update.error, "server_error"), status_code=status)
                states.setdefault(index, ChoiceState(self.shape, index)).add(update)
                if stream.done:
                    break
                pending = asyncio.ensure_future(stream.next())
        finally:
            pending.cancel()
            stream.close()
        choices = [self._choice(states[i]) for i in sorted(states)]
        return JSONResponse(self._envelope(self.object, choices, self._usage(states)))

    def _choice(self, state: ChoiceState) -> dict:
        text, finish = "".join(state.parts), state.last.finish_reason
        if not self.chat:
            logprobs = state.completion_logprobs(self.token_text, state.logprobs, True)
            return completion_choice(state.echoed() + text, finish, state.index, logprobs)
        logprobs = self.token_text.chat(state.logprobs) if self.shape.logprobs else None
        if self.shape.tools is None:
            return chat_choice(text, finish, state.index, logprobs=logprobs)
        content, calls = self.shape.tools.read(text)
        if calls and finish == "stop":
            finish = "tool_calls"
        return chat_choice(content, finish, state.index, [c.as_openai(new_call_id()) for c in calls], logprobs)


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
