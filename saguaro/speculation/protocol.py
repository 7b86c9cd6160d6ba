"""The wire between the target (rank 0) and the draft worker (rank 1).

Messages are small dataclasses, pickled and sent point-to-point: over a TCP connection of their
own when the worker's messages go through the host (a round trip of about 25 us on loopback,
where a gloo pair took 300), or through an NCCL pair between two GPUs; a TCPStore is the
rendezvous. Two engines can share a host and the worker can live on another one. Only token
ids, outcome keys and, at temperature > 0, the proposal distributions verification needs (as
their proposal_top (token, probability) pairs), and for an EAGLE draft the target's hidden
states of the committed tokens cross the wire.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import pickle
import secrets
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from saguaro.config import Backup, SpeculativeConfig
from saguaro.engine.proposal import Outcome
from saguaro.engine.sampler import SamplingParams
from saguaro.engine.structured import GrammarTokenizer


class DraftUnavailable(RuntimeError):
    """The draft worker died, hung past the timeout or broke the protocol."""


class DraftRefused(DraftUnavailable):
    """The peer did not prove it knows the shared secret (see `Channel.authenticate`)."""


SECRET_ENV = "SAGUARO_DRAFT_SECRET"  # the secret engine and worker share (a local worker's: a fresh one)


# --- messages --------------------------------------------------------------------------------

@dataclass
class DraftSpec:
    """What a worker loads and how it speculates."""
    speculative: SpeculativeConfig  # draft: the checkpoint's path on the worker's host; fan_out: K+1 counts
    dtype: str
    prefix_cache_mb: float = 0.0  # the draft's prefix cache (0: none)
    quantization: str | None = None  # the target's mode, which a float draft follows (pairing.load_draft)
    # (the target's vocabulary rows, the tokens of the tokenizer the pair shares): a draft padded
    # otherwise is fitted to the target's rows (pairing.fit_vocabulary); None: no tokenizer was compared
    vocabulary: tuple[int, int] | None = None
    cuda_graphs: str = "auto"  # the target's setting (saguaro.models.graphs)


@dataclass
class Hello:
    """Target -> worker, once."""
    draft: DraftSpec
    embeddings: torch.Tensor | None  # the target's table, for drafts that borrow it
    incarnation: int = 0  # workers started before this one for the same engine (restarts)


@dataclass
class DraftProcessing:
    """What the worker needs besides a request's SamplingParams to process its drafts' logits as
    the target does (saguaro.engine.processing): the tokens min_tokens holds back, and the
    tokenizer its grammar is compiled for, by key; its text goes with the first request of a
    connection that needs it (`unsent_tokenizers`), and the worker keeps it."""
    prompt_len: int  # the rest of the request's tokens are output, which penalties and the grammar read
    stop_ids: list[int]
    grammar_key: str | None = None  # GrammarTokenizer.key; None: no grammar
    grammar_tokenizer: GrammarTokenizer | None = None  # the tokenizer itself, where the worker lacks it


def unsent_tokenizers(processing: list[DraftProcessing | None] | None,
                      sent: set[str]) -> list[DraftProcessing | None] | None:
    """The processing as one connection sends it: each grammar tokenizer (megabytes of text)
    only the first time; sent (the keys sent so far) is updated."""
    if processing is None:
        return None
    kept = []
    for entry in processing:
        if entry is not None and entry.grammar_tokenizer is not None:
            if entry.grammar_key in sent:
                entry = replace(entry, grammar_tokenizer=None)
            sent.add(entry.grammar_key)
        kept.append(entry)
    return kept


@dataclass
class Prefill:
    """Target -> worker: new requests, with the first token the target sampled."""
    seq_ids: list[int]
    token_ids: list[list[int]]
    params: list[SamplingParams]
    max_len: int  # longest a sequence may grow, for the draft's KV cache
    num_rows: int  # requests the target may hold at once
    features: list[torch.Tensor] | None = None  # EAGLE drafts: the target's hidden states, [prompt, hidden]
    processing: list[DraftProcessing | None] | None = None  # None: no request processes its logits


@dataclass
class SpecRequest:
    """Target -> worker: each request's outcome of the last verification (None on its first
    round) and the speculations wanted next, with the backup for a miss (neural or fast)."""
    seq_ids: list[int]
    outcomes: list[Outcome | None]
    backup: Backup
    fan_out: list[int] | None = None  # a new fan-out, when the engine re-plans it
    # EAGLE drafts: the target's hidden states at the tokens it ran and committed last round,
    # [accepted_len + 1, hidden] per request (None on its first round).
    features: list[torch.Tensor | None] | None = None


@dataclass
class SparseProbs:
    """Distributions with at most `top` nonzero entries per row, as those entries: what a
    proposal drafted from its top tokens (speculator.keep_top) costs on the wire."""
    indices: torch.Tensor  # [K, top] int32
    values: torch.Tensor  # [K, top]
    width: int  # the dense rows' length

    @classmethod
    def of(cls, dense: torch.Tensor, top: int) -> SparseProbs:
        values, indices = dense.topk(min(top, dense.shape[-1]), dim=-1)  # every nonzero entry
        return cls(indices.to(torch.int32), values, dense.shape[-1])

    def dense(self) -> torch.Tensor:
        rows = torch.zeros(*self.indices.shape[:-1], self.width, dtype=self.values.dtype)
        return rows.scatter_(-1, self.indices.long(), self.values)


def dense_probs(probs: torch.Tensor | SparseProbs | None) -> torch.Tensor | None:
    return probs.dense() if isinstance(probs, SparseProbs) else probs


@dataclass
class RequestSpeculation:
    """One request's next K tokens, and the distributions they were drawn from over the draft's
    head rows ([K, head rows], sparse when the worker drafts from its top tokens; None at
    temperature 0 or for copied tokens: point masses)."""
    tokens: list[int]
    probs: torch.Tensor | SparseProbs | None = None
    hit: bool | None = None  # whether the worker had it cached; None: its first round (nothing to hit)
    lookup: bool = False  # copied from the text (prompt lookup)
    shared: bool = False  # a hit on another request's branch (worker/cache.py)
    miss: str | None = None  # why its own branches missed: "bonus", "length", "unfilled" (SpeculationCache.miss_cause),
    # or "lost": no worker answered for it (the pool's n-gram guess stood in)


@dataclass
class Speculation:
    """Worker -> target: the requests' speculations, in the order asked."""
    requests: list[RequestSpeculation]
    fill_time_s: float = 0.0  # time the worker spent filling the cache in the previous round
    backup_time_s: float = 0.0  # the worker's time from the outcomes to this reply (lookups, backups on misses)
    drafted_tokens: int = 0  # draft tokens the worker decoded since its last reply (tree and backup)


@dataclass
class Release:
    seq_ids: list[int]


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    """Worker -> target after Hello: the draft loaded."""
    vocab_size: int
    num_layers: int
    pid: int
    head_token_ids: list[int] | None = None  # a reduced head's token ids: what its rows stand for
    reads_features: bool = False  # an EAGLE draft: send the target's hidden states


# --- channel ---------------------------------------------------------------------------------

def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on exactly host:port (port 0: a free one), for the rendezvous store:
    torch's own listens on every interface, IPv4 and IPv6."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(128)
    return sock


def _proof(secret: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), role + nonce, hashlib.sha256).digest()


PROOF_BYTES = 32
FRAME_BYTES = 2048  # a message's first transfer: its length and as much of it as fits (a greedy round's whole)
JOINED = "saguaro/joined"  # the store key a worker sets once connected (or about to build its NCCL pair)
DATA_PORT = "saguaro/data_port"  # the store key under which the engine gives its connection's port


class Channel:
    """Sends and receives pickled messages between rank 0 and rank 1: over a TCP connection
    (device "cpu"), or an NCCL pair (a CUDA device)."""

    def __init__(self, host: str, port: int, rank: int, device: str = "cpu", timeout_s: float = 60.0):
        """Rank 0 serves the rendezvous store (port 0 picks a free one: see `port`) and, for
        the TCP connection, listens on host alone for it; `connect` then blocks until the peer
        has joined."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host = host
        if rank == 0:
            # The store (which has no authentication) listens on host alone: a socket bound here
            # is handed over, which torch's own backend honours (its libuv one binds anew).
            listener = listening_socket(host, port)
            port = listener.getsockname()[1]
            self.store = dist.TCPStore(host, port, 2, True, timeout=self.timeout, wait_for_workers=False,
                                       master_listen_fd=listener.detach(), use_libuv=False)
        else:
            self.store = dist.TCPStore(host, port, 2, False, timeout=self.timeout)
        self.rank, self.peer = rank, 1 - rank
        self.device = torch.device(device)
        self.group = self.sock = self.listener = None
        if rank == 0 and self.device.type != "cuda":
            self.listener = listening_socket(host, 0)
            self.store.set(DATA_PORT, str(self.listener.getsockname()[1]))
        self.bytes_sent = self.bytes_received = 0  # what crosses the wire: messages with their lengths (or frames)

    @property
    def port(self) -> int:
        return self.store.port

    def connect(self, alive: Callable[[], bool] | None = None) -> "Channel":
        """alive (rank 0): whether the peer is still there to join, asked while it is awaited,
        so that a local worker that dies before it joins is noticed at once, not at the timeout
        (rank 0 waits for the key the peer sets once connected, or just before it builds its
        side of an NCCL pair, which cannot be interrupted)."""
        timeout_s = self.timeout.total_seconds()
        if self.rank == 1:
            if self.device.type != "cuda":
                port = int(self.store.get(DATA_PORT))
                try:
                    self.sock = socket.create_connection((self.host, port), timeout=timeout_s)
                except OSError as e:
                    raise DraftUnavailable(f"could not reach the engine at {self.host}:{port}: {e}") from e
            self.store.set(JOINED, "1")
        else:
            self._await_peer(alive)
            if self.device.type != "cuda":
                self.listener.settimeout(timeout_s)
                try:
                    self.sock, _ = self.listener.accept()
                except OSError as e:
                    raise DraftUnavailable(f"the draft worker joined but did not connect: {e}") from e
                finally:
                    self.listener.close()
                    self.listener = None
        if self.sock is not None:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a message goes at once
        else:
            self.group = dist.ProcessGroupNCCL(self.store, self.rank, 2)
        return self

    def _await_peer(self, alive: Callable[[], bool] | None) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not self.store.check([JOINED]):
            if alive is not None and not alive():
                raise DraftUnavailable("the draft worker exited before it joined")
            if time.monotonic() > deadline:
                raise DraftUnavailable(f"no draft worker joined within {self.timeout.total_seconds():.0f} s")
            time.sleep(0.02)

    def authenticate(self, secret: str) -> None:
        """Both ends prove they know the shared secret, before either unpickles anything from the
        other (a pickle can run code): each sends a random nonce and answers the other's with
        an HMAC of it, so the secret itself never crosses the wire. The engine (rank 0) refuses
        a worker with a wrong or missing secret; the worker refuses an engine that does not
        answer its nonce (it may have been refused). Raises DraftRefused."""
        timeout_s = self.timeout.total_seconds()
        if self.rank == 0:
            nonce = secrets.token_bytes(PROOF_BYTES)
            self._send_raw(nonce, timeout_s)
            reply = self._recv_raw(2 * PROOF_BYTES, timeout_s)
            peer_nonce, proof = reply[:PROOF_BYTES], reply[PROOF_BYTES:]
            if not hmac.compare_digest(proof, _proof(secret, b"worker", nonce)):
                self._send_raw(bytes(PROOF_BYTES), timeout_s)
                raise DraftRefused(f"a draft worker with a wrong or missing secret was refused (the worker must "
                                   f"have the engine's: {SECRET_ENV} or --draft-secret)")
            self._send_raw(_proof(secret, b"engine", peer_nonce), timeout_s)
        else:
            peer_nonce = self._recv_raw(PROOF_BYTES, timeout_s)
            nonce = os.urandom(PROOF_BYTES)
            self._send_raw(nonce + _proof(secret, b"worker", peer_nonce), timeout_s)
            if not hmac.compare_digest(self._recv_raw(PROOF_BYTES, timeout_s), _proof(secret, b"engine", nonce)):
                raise DraftRefused(f"the engine refused this worker, or does not know its secret: give both the "
                                   f"same secret ({SECRET_ENV} or --draft-secret)")

    def _send_raw(self, data: bytes, timeout_s: float | None) -> None:
        if self.sock is not None:
            self._sock_send(data, timeout_s)
            return
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        try:
            self._wait(self.group.send([payload.to(self.device)], self.peer, 2), datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise DraftUnavailable(str(e)) from e

    def _recv_raw(self, size: int, timeout_s: float | None) -> bytes:
        if self.sock is not None:
            return self._sock_recv(size, None if timeout_s is None else time.monotonic() + timeout_s)
        payload = torch.zeros(size, dtype=torch.uint8, device=self.device)
        try:
            self._wait(self.group.recv([payload], self.peer, 2), datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise DraftUnavailable(str(e)) from e
        return payload.cpu().numpy().tobytes()

    def send(self, message, timeout_s: float | None = None) -> None:
        """Over TCP a message goes as its length and its bytes, and a send returns once the
        system has them (timeout_s bounds a peer that stopped reading a long one). Over NCCL a
        send completes once the peer receives it, hence timeout_s too; a message goes as a frame
        of FRAME_BYTES (its length, then as much of it as fits) and, if longer, its rest: one
        transfer for most of a round's messages, where each transfer costs a round trip."""
        data = pickle.dumps(message, protocol=5)
        if self.sock is not None:
            self._sock_send(len(data).to_bytes(8, "little") + data, timeout_s)
            self.bytes_sent += 8 + len(data)
            return
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        frame = bytearray(FRAME_BYTES)
        frame[:8] = len(data).to_bytes(8, "little")
        frame[8:8 + min(len(data), FRAME_BYTES - 8)] = data[:FRAME_BYTES - 8]
        transfers = [frame] + ([bytearray(data[FRAME_BYTES - 8:])] if len(data) > FRAME_BYTES - 8 else [])
        try:
            for tag, chunk in enumerate(transfers):
                payload = torch.frombuffer(chunk, dtype=torch.uint8)
                self._wait(self.group.send([payload.to(self.device)], self.peer, tag), timeout)
        except RuntimeError as e:
            raise DraftUnavailable(str(e)) from e
        self.bytes_sent += sum(len(chunk) for chunk in transfers)

    def recv(self, timeout_s: float | None = None):
        if self.sock is not None:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            size = int.from_bytes(self._sock_recv(8, deadline), "little")
            data = self._sock_recv(size, deadline)
            self.bytes_received += 8 + size
            return pickle.loads(data)
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8, device=self.device)
        try:
            self._wait(self.group.recv([frame], self.peer, 0), timeout)
            head = frame.cpu().numpy().tobytes()
            size = int.from_bytes(head[:8], "little")
            data, received = head[8:8 + min(size, FRAME_BYTES - 8)], FRAME_BYTES
            if size > FRAME_BYTES - 8:
                rest = torch.empty(size - (FRAME_BYTES - 8), dtype=torch.uint8, device=self.device)
                self._wait(self.group.recv([rest], self.peer, 1), timeout)
                data, received = data + rest.cpu().numpy().tobytes(), received + rest.numel()
        except RuntimeError as e:
            raise DraftUnavailable(str(e)) from e
        self.bytes_received += received
        return pickle.loads(data)

    def readable(self, timeout_s: float) -> bool:
        """Whether a message starts arriving (or the connection ends) within timeout_s. Over
        NCCL, which cannot be polled: True at once, and recv's own timeout bounds the wait."""
        if self.sock is None:
            return True
        ready, _, _ = select.select([self.sock], [], [], max(timeout_s, 0.0))
        return bool(ready)

    def _sock_send(self, data: bytes, timeout_s: float | None) -> None:
        try:
            self.sock.settimeout(timeout_s)
            self.sock.sendall(data)
        except TimeoutError as e:
            raise DraftUnavailable(f"the peer took nothing within {timeout_s:.0f} s") from e
        except OSError as e:
            raise DraftUnavailable(f"the connection to the peer broke: {e}") from e

    def _sock_recv(self, size: int, deadline: float | None) -> bytes:
        """size bytes, by the deadline (None: however long it takes)."""
        data, got = bytearray(size), 0
        view = memoryview(data)
        try:
            while got < size:
                self.sock.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
                n = self.sock.recv_into(view[got:])
                if n == 0:
                    raise DraftUnavailable("the peer closed the connection")
                got += n
        except TimeoutError as e:
            raise DraftUnavailable("no answer within the timeout") from e
        except OSError as e:
            raise DraftUnavailable(f"the connection to the peer broke: {e}") from e
        return bytes(data)

    def close(self) -> None:
        """Drops the connection (or the group) and the store, which frees the port for a new
        rendezvous. After a timeout or a lost peer the channel cannot be used again."""
        for sock in (self.sock, self.listener):
            if sock is not None:
                sock.close()
        self.group = self.store = self.sock = self.listener = None

    @staticmethod
    def _wait(work, timeout) -> None:
        if timeout is None:
            work.wait()
        elif not work.wait(timeout):
            raise DraftUnavailable(f"no answer within {timeout.total_seconds():.0f} s")
