"""Several draft workers for one target (draft data parallelism).

Each request is drafted by one worker, the one with the fewest requests when it arrives; a
round asks every worker before it waits for any, so they draft at once, and the target still
verifies all requests in one pass. A worker that dies or stops answering takes only its own
requests off SSD: until a new worker, started in the background, has taken them over from
their committed tokens, they are speculated by the n-gram guess (point masses: exact, no
model), and the other workers go on as before. The pool speaks DraftClient's interface, so
SSDDecoder drives one or several workers alike.
"""
from __future__ import annotations

import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from saguaro.engine.sampler import SamplingParams
from saguaro.speculation.remote.client import DraftClient, replace_worker
from saguaro.speculation.local.lookup import ngram_guess
from saguaro.speculation.protocol import DraftUnavailable, Speculation, SpecRequest


@dataclass
class Lane:
    """One worker and the requests it drafts for."""
    client: DraftClient
    seq_ids: set[int] = field(default_factory=set)
    restart: Future[DraftClient] | None = None  # its replacement, starting after a loss
    handed_over: set[int] = field(default_factory=set)  # requests a new worker got from their committed tokens

    @property
    def live(self) -> bool:
        return self.restart is None and self.client.alive


class DraftPool:
    """DraftClient's interface over several workers (see the module docstring)."""

    def __init__(self, clients: list[DraftClient]):
        self.lanes = [Lane(client) for client in clients]
        self.config, self.ready = clients[0].config, clients[0].ready
        self.k = self.config.speculative.num_speculative_tokens
        self.fan_out = list(self.config.speculative.fan_out)
        self.lane_of: dict[int, Lane] = {}
        # what the workers know of each request: its committed tokens, params and pending speculation
        self.token_ids: dict[int, list[int]] = {}
        self.params: dict[int, SamplingParams] = {}
        self.spec: dict[int, list[int]] = {}
        self.shape = (0, 0)  # the last Prefill's max_len and num_rows, for a new worker
        self.losses = self.restarts = 0
        self.alive = True  # the pool answers even with every worker lost (n-gram guesses)

    def prefill(self, seq_ids: list[int], token_ids: list[list[int]], params: list[SamplingParams],
                max_len: int, num_rows: int, features: list[torch.Tensor] | None = None) -> None:
        self.shape = (max_len, num_rows)
        for i, sid in enumerate(seq_ids):
            lane = min(self.lanes, key=lambda lane: (not lane.live, len(lane.seq_ids)))
            lane.seq_ids.add(sid)
            self.lane_of[sid] = lane
            self.token_ids[sid], self.params[sid] = list(token_ids[i]), params[i]
        for lane in self.lanes:
            mine = [i for i, sid in enumerate(seq_ids) if self.lane_of[sid] is lane]
            if mine and lane.live:
                self._call(lane, lane.client.prefill, [seq_ids[i] for i in mine], [token_ids[i] for i in mine],
                           [params[i] for i in mine], max_len, num_rows,
                           None if features is None else [features[i] for i in mine])

    def speculate(self, request: SpecRequest) -> Speculation:
        for sid, outcome in zip(request.seq_ids, request.outcomes):
            if outcome is not None:
                accepted_len, bonus = outcome
                self.token_ids[sid] += self.spec[sid][:accepted_len] + [bonus]
        if request.fan_out is not None:
            self.fan_out = list(request.fan_out)
        for lane in self.lanes:
            self._resume(lane)
        index = {sid: i for i, sid in enumerate(request.seq_ids)}
        asked = []
        for lane in self.lanes:
            mine = [sid for sid in request.seq_ids if self.lane_of[sid] is lane]
            if mine and lane.live:
                part = SpecRequest(mine, [None if sid in lane.handed_over else request.outcomes[index[sid]]
                                          for sid in mine], request.backup, request.fan_out,
                                   None if request.features is None else [request.features[index[sid]] for sid in mine])
                sent = self._call(lane, lane.client.ask, part)
                if lane.live:
                    asked.append((lane, mine, sent))
                    lane.handed_over.difference_update(mine)
        n = len(request.seq_ids)
        tokens, hits, probs, lookups, shared = [None] * n, [False] * n, [None] * n, [False] * n, [False] * n
        fill_s = backup_s = 0.0
        drafted = 0
        for lane, mine, sent in asked:
            reply = self._call(lane, lane.client.answer, sent)
            if not lane.live:
                continue
            for j, sid in enumerate(mine):
                i = index[sid]
                tokens[i], hits[i], probs[i] = reply.tokens[j], reply.hits[j], reply.probs[j]
                lookups[i] = bool(reply.lookups and reply.lookups[j])
                shared[i] = bool(reply.shared and reply.shared[j])
            fill_s, backup_s = max(fill_s, reply.fill_time_s), max(backup_s, reply.backup_time_s)
            drafted += reply.drafted_tokens
        for i, sid in enumerate(request.seq_ids):
            if tokens[i] is None:  # its worker is lost: the n-gram guess, a point mass
                tokens[i] = ngram_guess(self.token_ids[sid], self.k)
            self.spec[sid] = tokens[i]
        return Speculation(tokens, hits, probs, fill_s, backup_s, lookups, shared, drafted)

    def release(self, seq_ids: list[int]) -> None:
        for lane in self.lanes:
            mine = [sid for sid in seq_ids if self.lane_of.get(sid) is lane]
            lane.seq_ids.difference_update(mine)
            lane.handed_over.difference_update(mine)
            if mine and lane.live:
                self._call(lane, lane.client.release, mine)
        for sid in seq_ids:
            for table in (self.lane_of, self.token_ids, self.params, self.spec):
                table.pop(sid, None)

    def _call(self, lane: Lane, method, *args):
        """method(*args) on a lane's worker; if the worker is gone, the lane is lost (not live)."""
        try:
            return method(*args)
        except DraftUnavailable as e:
            self._lose(lane, e)
            return None

    def _lose(self, lane: Lane, error: Exception) -> None:
        warnings.warn(f"draft worker {self.lanes.index(lane)} lost ({error}); its {len(lane.seq_ids)} requests "
                      f"continue with n-gram speculation until a new worker takes them over", RuntimeWarning)
        self.losses += 1
        lane.client.abandon()
        if not self.ready.reads_features:  # an EAGLE draft would need every request's hidden states again
            lane.restart = replace_worker(lane.client, self.fan_out)

    def _resume(self, lane: Lane) -> None:
        """A lane whose new worker is up gets its requests from their committed tokens."""
        if lane.restart is None or not lane.restart.done():
            return
        lane.client, lane.restart = lane.restart.result(), None
        self.restarts += 1
        mine = sorted(lane.seq_ids)
        if mine:
            self._call(lane, lane.client.prefill, mine, [self.token_ids[sid] for sid in mine],
                       [self.params[sid] for sid in mine], *self.shape)
        if lane.live:
            lane.handed_over.update(mine)

    def abandon(self) -> None:
        for lane in self.lanes:
            lane.client.abandon()

    def close(self) -> None:
        for lane in self.lanes:
            if lane.restart is not None and not lane.restart.cancel():
                lane.restart.result().close()
            lane.client.close()

    def metrics(self) -> dict:
        return {"draft_workers": len(self.lanes), "draft_worker_losses": self.losses,
                "draft_worker_restarts": self.restarts, "requests_per_draft_worker": [len(lane.seq_ids) for lane in self.lanes]}
