"""The draft workers of one target, and the one place where a worker is lost, replaced and
handed its requests.

Each request is drafted by one worker, the one with the fewest requests when it arrives; a
round asks every worker before it waits for any, so they draft at once, and the target still
verifies all requests in one pass. A worker that dies or stops answering takes only its own
requests off SSD: a new worker starts in the background, and once it is up it is handed them
from their committed tokens (the engine's sequences, their one owner on this side). Meanwhile
they are speculated by the n-gram guess (point masses: exact, no model) while other workers
live; with none live, `live` is False and the engine decodes without speculation.
"""
from __future__ import annotations

import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from saguaro.config import Backup
from saguaro.engine.proposal import Outcome
from saguaro.engine.sequence import Sequence
from saguaro.speculation.local.lookup import ngram_guess
from saguaro.speculation.protocol import (DraftProcessing, DraftUnavailable, Ready, RequestSpeculation, Speculation,
                                          SpecRequest)
from saguaro.speculation.remote.client import DraftClient, replace_worker


def draft_processing(seqs: list[Sequence]) -> list[DraftProcessing | None] | None:
    """What the worker needs to process the requests' drafts (None: nothing to process)."""
    if all(s.processor is None for s in seqs):
        return None
    entries = []
    for s in seqs:
        grammar = None if s.processor is None else s.processor.grammar
        entries.append(None if s.processor is None else
                       DraftProcessing(s.prompt_len, sorted(s.stop_ids), grammar and grammar.tokenizer.key,
                                       grammar and grammar.tokenizer))
    return entries


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

    def restarting(self, restart: Future[DraftClient]) -> None:
        """Its worker was lost; `restart` is starting in its place."""
        self.restart = restart

    def take_restarted(self) -> bool:
        """Takes its new worker once that is up; whether it did."""
        if self.restart is None or not self.restart.done():
            return False
        self.client, self.restart = self.restart.result(), None
        return True


class DraftPool:
    """One or several workers behind one interface (see the module docstring)."""

    def __init__(self, clients: list[DraftClient]):
        self.lanes = [Lane(client) for client in clients]
        self.ready: Ready = clients[0].ready
        self.k = clients[0].config.draft.speculative.num_speculative_tokens
        self.fan_out = list(clients[0].config.draft.speculative.fan_out)
        self.lane_of: dict[int, Lane] = {}
        self.seqs: dict[int, Sequence] = {}
        self.shape = (0, 0)  # the longest a sequence may grow and the rows, for a new worker's cache
        self.losses = self.restarts = 0

    @property
    def live(self) -> bool:
        """Whether any worker is up (after taking up replacements that are ready)."""
        for lane in self.lanes:
            self._resume(lane)
        return any(lane.live for lane in self.lanes)

    @property
    def gone(self) -> bool:
        """No worker is up and none is starting: an EAGLE draft's, which is not replaced."""
        return not any(lane.live or lane.restart is not None for lane in self.lanes)

    def reserve(self, max_len: int, num_rows: int) -> None:
        self.shape = (max_len, num_rows)

    def prefill(self, seqs: list[Sequence], features: list[torch.Tensor | None] | None = None) -> None:
        """Gives each new request to the least busy live worker, from its committed tokens."""
        for seq in seqs:
            lane = min(self.lanes, key=lambda lane: (not lane.live, len(lane.seq_ids)))
            lane.seq_ids.add(seq.seq_id)
            self.lane_of[seq.seq_id], self.seqs[seq.seq_id] = lane, seq
        for lane in self.lanes:
            mine = [i for i, seq in enumerate(seqs) if self.lane_of[seq.seq_id] is lane]
            if mine and lane.live:
                self._call(lane, lane.client.prefill, [seqs[i].seq_id for i in mine],
                           [seqs[i].token_ids for i in mine], [seqs[i].params for i in mine], *self.shape,
                           None if features is None else [features[i] for i in mine],
                           draft_processing([seqs[i] for i in mine]))

    def speculate(self, seqs: list[Sequence], outcomes: list[Outcome | None], backup: Backup,
                  fan_out: list[int] | None = None,
                  features: list[torch.Tensor | None] | None = None) -> Speculation:
        """Each request's next speculation, from its worker (all workers asked before any is
        awaited), or the n-gram guess where its worker is lost."""
        if fan_out is not None:
            self.fan_out = list(fan_out)
        index = {seq.seq_id: i for i, seq in enumerate(seqs)}
        asked = []
        for lane in self.lanes:
            mine = [seq.seq_id for seq in seqs if self.lane_of[seq.seq_id] is lane]
            if mine and lane.live:
                part = SpecRequest(mine, [None if sid in lane.handed_over else outcomes[index[sid]] for sid in mine],
                                   backup, fan_out, None if features is None else [features[index[sid]] for sid in mine])
                sent = self._call(lane, lane.client.ask, part)
                if lane.live:
                    asked.append((lane, mine, sent))
                    lane.handed_over.difference_update(mine)
        requests: list[RequestSpeculation | None] = [None] * len(seqs)
        fill_s = backup_s = 0.0
        drafted = 0
        for lane, mine, sent in asked:
            replacing = any(other.restart is not None for other in self.lanes)
            reply = self._call(lane, lane.client.answer, sent, replacing)
            if not lane.live:
                continue
            for sid, request in zip(mine, reply.requests):
                requests[index[sid]] = request
            fill_s, backup_s = max(fill_s, reply.fill_time_s), max(backup_s, reply.backup_time_s)
            drafted += reply.drafted_tokens
        requests = [r if r is not None else
                    RequestSpeculation(ngram_guess(seq.token_ids, self.k), hit=False, miss="lost")
                    for r, seq in zip(requests, seqs)]
        return Speculation(requests, fill_s, backup_s, drafted)

    def release(self, seq_ids: list[int]) -> None:
        for lane in self.lanes:
            mine = [sid for sid in seq_ids if self.lane_of.get(sid) is lane]
            lane.seq_ids.difference_update(mine)
            lane.handed_over.difference_update(mine)
            if mine and lane.live:
                self._call(lane, lane.client.release, mine)
        for sid in seq_ids:
            self.lane_of.pop(sid, None)
            self.seqs.pop(sid, None)

    def _call(self, lane: Lane, method, *args):
        """method(*args) on a lane's worker; if the worker is gone, the lane is lost (not live)."""
        try:
            return method(*args)
        except DraftUnavailable as e:
            self._lose(lane, e)
            return None

    def _lose(self, lane: Lane, error: Exception) -> None:
        """Kills the worker and, unless it reads the target's hidden states (it would need every
        request's again), starts a new one."""
        warnings.warn(f"draft worker lost (worker {self.lanes.index(lane)} of {len(self.lanes)}: {error}); its "
                      f"{len(lane.seq_ids)} requests continue without it until a new worker takes them over",
                      RuntimeWarning)
        self.losses += 1
        lane.client.abandon()
        if not self.ready.reads_features:
            lane.restarting(replace_worker(lane.client, self.fan_out))

    def _resume(self, lane: Lane) -> None:
        """A lane whose new worker is up gets its requests from their committed tokens (their
        next round is a first one: nothing is cached for them)."""
        if not lane.take_restarted():
            return
        self.restarts += 1
        mine = sorted(lane.seq_ids)
        if mine:
            self._call(lane, lane.client.prefill, mine, [self.seqs[sid].token_ids for sid in mine],
                       [self.seqs[sid].params for sid in mine], *self.shape)
        if lane.live:
            lane.handed_over.update(mine)

    def close(self) -> None:
        for lane in self.lanes:
            if lane.restart is not None and not lane.restart.cancel():
                lane.restart.result().close()
            lane.client.close()

    def metrics(self) -> dict:
        return {"draft_workers": len(self.lanes), "draft_losses": self.losses, "draft_restarts": self.restarts,
                "requests_per_draft_worker": [len(lane.seq_ids) for lane in self.lanes]}
