"""`saguaro serve` (also `python -m saguaro.server`): loads a model and serves it over HTTP."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import functools
import ipaddress
import json
import os
import resource
import socket
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from saguaro.llm import add_llm_arguments, llm_from_args
from saguaro.server.app import Inflight, ServerConfig, create_app, head_too_large
from saguaro.server.scheduler import Scheduler

T = TypeVar("T")
END_CHECK_S = 0.5  # how often shutdown looks for requests that cannot finish in its grace period
FORCED_QUIT_DRAIN_S = 2.0  # a forced quit waits this long at most for the error events to go out
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "::1"]
FD_RESERVE = 256  # file descriptors kept from connections (see default_max_connections)
MAX_FDS = 1 << 16  # the soft limit raise_fd_limit asks for at most


class Server(uvicorn.Server):
    """Starts the scheduler's grace period as soon as shutdown begins: requests in flight may
    finish within it; those whose pace shows they cannot end at once, and those still running
    at its end get the same clean error (an SSE error event and [DONE], or a JSON 503) before
    uvicorn closes their connections. A forced quit (a second SIGINT) ends them all so, and
    gives the error events a moment to go out: uvicorn would cut the streams and answer a
    plain-text 500."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, inflight: Inflight, grace_s: float):
        super().__init__(config)
        self.scheduler, self.inflight, self.grace_s = scheduler, inflight, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.scheduler.shutdown(self.grace_s, wait=False)
        ending = asyncio.ensure_future(self.end_what_cannot_finish(asyncio.get_running_loop().time() + self.grace_s))
        try:
            await super().shutdown(sockets)
        finally:
            ending.cancel()
        if self.force_exit:
            self.scheduler.shutdown(0.0, wait=False)
            await self.connections_closed(FORCED_QUIT_DRAIN_S)

    async def end_what_cannot_finish(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.inflight.end_unfinishable(deadline - loop.time())
            await asyncio.sleep(END_CHECK_S)

    async def connections_closed(self, timeout_s: float) -> None:
        """Waits until the connections close (each once its response is out), or timeout_s."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.server_state.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)


class IdleConnections:
    """The connections awaiting a request's head (none sent yet, or part of one), the one
    waiting longest first: the ones to close when the connections reach their cap."""

    def __init__(self):
        self.waiting: dict[GuardedH11, None] = {}  # in the order they began to wait

    def add(self, connection: GuardedH11) -> None:
        self.waiting.pop(connection, None)
        self.waiting[connection] = None

    def discard(self, connection: GuardedH11) -> None:
        self.waiting.pop(connection, None)

    def longest(self) -> GuardedH11 | None:
        return next(iter(self.waiting), None)


@dataclasses.dataclass
class ConnectionLimits:
    header_timeout_s: float  # a request's head must arrive within this of its first byte
    max_header_bytes: int  # a longer head gets 431
    max_connections: int  # beyond it, the connection idle longest is closed


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with three guards on what comes before a request's head is whole,
    which no middleware sees. The head must all arrive within header_timeout_s of its first
    byte (of the connection's opening, for its first request): uvicorn itself waits for ever.
    Beyond max_connections, a new connection closes the one that has waited longest for a head
    (idle between requests or never sending one), or itself if none waits: a client that
    sends its request at once is never the one closed, however many idle ones there are. A
    head that passes max_header_bytes while it arrives gets 431, as one that arrived whole
    does (app.Gate); uvicorn answers it 400. The body has the app's own timeout (BodyTimeout)."""

    def __init__(self, *args, limits: ConnectionLimits, idle: IdleConnections, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits, self.idle = limits, idle
        self.header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle.add(self)
        self.watch_headers()
        if len(self.connections) > self.limits.max_connections:
            self.close(self.idle.longest() or self)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.watch_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.awaiting_headers() and not self.transport.is_closing():
            self.idle.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.idle.discard(self)
        self.stop_header_timer()
        super().connection_lost(exc)

    def awaiting_headers(self) -> bool:
        """No request is being answered, so what arrives (or is yet to) is the next one's head."""
        return self.cycle is None or self.cycle.response_complete

    def watch_headers(self) -> None:
        if not self.awaiting_headers():
            self.idle.discard(self)
            self.stop_header_timer()
        elif self.header_timer is None:
            self.header_timer = self.loop.call_later(self.limits.header_timeout_s, self.headers_too_slow)

    def stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def headers_too_slow(self) -> None:
        self.header_timer = None
        if self.awaiting_headers():
            self.close(self)

    def close(self, connection: GuardedH11) -> None:
        self.idle.discard(connection)
        if not connection.transport.is_closing():
            connection.transport.close()

    def send_400_response(self, msg: str) -> None:
        """h11 refused what arrived: a head grown past max_header_bytes gets 431, anything else 400."""
        if len(self.conn.trailing_data[0]) <= self.limits.max_header_bytes:
            return super().send_400_response(msg)
        body = json.dumps(head_too_large(self.limits.max_header_bytes)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=431, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def fd_limit() -> int:
    """The soft file-descriptor limit (MAX_FDS where there is none)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return MAX_FDS if soft == resource.RLIM_INFINITY else soft


def default_max_connections() -> int:
    """The file-descriptor limit less a reserve for the model's files, the draft worker's
    sockets and the like: at the limit, accepting fails and even a keyed client waits."""
    return max(fd_limit() - FD_RESERVE, 1)


def raise_fd_limit() -> None:
    """Lifts the soft file-descriptor limit towards the hard one (to MAX_FDS at most), as
    servers do: a soft limit of 1024, a common default, would cap the connections below a thousand."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    wanted = MAX_FDS if hard == resource.RLIM_INFINITY else min(hard, MAX_FDS)
    if fd_limit() < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def default_allowed_hosts(bind: str, api_key: str | None) -> list[str]:
    """Loopback names only for a server bound to loopback without a key: any web page the user
    opens could otherwise reach it through DNS rebinding. A key protects a server on its own, and
    one bound elsewhere without a key is exposed on purpose."""
    return list(LOOPBACK_HOSTS) if api_key is None and is_loopback(bind) else ["*"]


def build_server(llm, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, max_waiting: int = 128,
                 max_model_len: int | None = None, log_level: str = "warning") -> Server:
    """The server's batch is the LLM's: its max_num_seqs and kv_cache_mb. config.allowed_hosts
    None: default_allowed_hosts for the bind."""
    if config.allowed_hosts is None:
        config = dataclasses.replace(config, allowed_hosts=default_allowed_hosts(host, config.api_key))
    scheduler = Scheduler(llm, max_waiting, max_model_len)
    app = create_app(llm, scheduler, config)
    limits = ConnectionLimits(config.header_timeout_s, config.max_header_bytes,
                              config.max_connections or default_max_connections())
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                               timeout_graceful_shutdown=config.shutdown_grace_s + 5,
                               http=functools.partial(GuardedH11, limits=limits, idle=IdleConnections()),
                               timeout_keep_alive=config.keep_alive_s,
                               h11_max_incomplete_event_size=config.max_header_bytes)
    return Server(uv_config, scheduler, app.state.inflight, config.shutdown_grace_s)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saguaro serve", description="Serve a model over an OpenAI-compatible "
                                     "HTTP API with continuous batching.")
    add_llm_arguments(parser, defaults={"max_num_seqs": (32, "%(default)s")})
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    server.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    server.add_argument("--api-key", default=os.environ.get("SAGUARO_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $SAGUARO_API_KEY, else none)")
    server.add_argument("--allowed-hosts", type=lambda v: [h.strip() for h in v.split(",") if h.strip()],
                        help="comma-separated Host header names answered, * for any (default: localhost, "
                             "127.0.0.1 and ::1 when bound to loopback without --api-key, else any)")
    server.add_argument("--served-model-name", help="the model's name in the API (default: --model)")
    server.add_argument("--max-batch-size", dest="max_num_seqs", type=int, default=argparse.SUPPRESS,
                        help="the same as --max-num-seqs")
    server.add_argument("--max-waiting", type=int, default=128,
                        help="requests queued beyond the batch before answering 429 (default: %(default)s)")
    server.add_argument("--max-model-len", type=int, default=2048,
                        help="prompt + output tokens per request; the KV cache is reserved at start for "
                             "--max-num-seqs of them, or as many as --kv-cache-mb holds (default: %(default)s)")
    server.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit (default: %(default)s)")
    server.add_argument("--max-header-bytes", type=int, default=16 << 10,
                        help="request headers limit (default: %(default)s)")
    server.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a request's headers may take to arrive (default: %(default)s)")
    server.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request's body may take to arrive after its headers (default: %(default)s)")
    server.add_argument("--timeout-keep-alive", type=float, default=5.0,
                        help="seconds an idle connection is kept open between requests (default: %(default)s)")
    server.add_argument("--limit-concurrency", type=int, default=512,
                        help="requests being answered beyond which new ones get 503; idle connections do not "
                             "count (default: %(default)s)")
    server.add_argument("--max-connections", type=int,
                        help="open connections beyond which the one idle longest is closed (default: the "
                             "file-descriptor limit, raised to its hard limit, less %d)" % FD_RESERVE)
    server.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="seconds in-flight requests may run on after SIGINT/SIGTERM (default: %(default)s)")
    server.add_argument("--log-level", default="info", help="uvicorn's log level (default: %(default)s)")
    return parser


def off_the_main_thread(setup: Callable[..., T], *args) -> T:
    """setup(*args), run on a thread that ends once it returns. OpenMP keeps a pool of worker
    threads for every thread that has run a parallel region (loading a model, zeroing its KV
    cache); with such a pool alive beside the scheduler thread's, libgomp counts more threads
    than cores and stops spinning between regions, so each of a decode step's ~150 regions (a
    few per layer) waits for its workers to wake: a step on the scheduler thread took 13 ms
    against 3.4 ms on the loading thread. A pool ends with its thread, which leaves the
    scheduler's the only one."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="saguaro-setup") as thread:
        return thread.submit(setup, *args).result()


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads so that a port in use is said at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "is in use (choose another with --port)" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e}"
        raise ValueError(f"port {port} on {host} {reason}") from e
    return sock


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    raise_fd_limit()
    try:
        sock = listening_socket(args.host, args.port)
    except ValueError as e:
        print(f"saguaro serve: error: {e}", file=sys.stderr)
        return 1
    try:
        llm = off_the_main_thread(llm_from_args, args)
    except (FileNotFoundError, ValueError) as e:
        sock.close()
        print(f"saguaro serve: error: {e}", file=sys.stderr)
        return 1
    config = ServerConfig(args.served_model_name or str(args.model), args.api_key, args.max_body_bytes,
                          args.shutdown_grace, args.allowed_hosts, args.header_timeout, args.body_timeout,
                          args.timeout_keep_alive, args.limit_concurrency, args.max_header_bytes, args.max_connections)
    try:
        server = off_the_main_thread(build_server, llm, config, args.host, args.port, args.max_waiting,
                                     args.max_model_len, args.log_level)
    except ValueError as e:
        llm.close()
        sock.close()
        print(f"saguaro serve: error: {e}", file=sys.stderr)
        return 1
    try:
        server.run(sockets=[sock])  # returns after a graceful shutdown; uvicorn then re-raises the signal that asked for it
    except KeyboardInterrupt:
        return 130
    return 0
