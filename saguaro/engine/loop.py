"""The decoding loop that `LLM.generate` and the server's scheduler both drive.

Sequences added to the engine wait, in arrival order, until the admission limits let them run:
at most max_num_seqs at once, whose KV cache rows fit the KV budget. Each step admits what fits
(their prefill commits a first token), runs one decoder round over every running sequence,
hands out the text that became final and releases the finished, whose places the next waiting
sequences take. A sequence's tokens depend only on its own prompt, parameters and random
stream, never on which others share its steps or when it was admitted.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from saguaro.engine.decoder import Decoder
from saguaro.engine.sequence import Sequence


@dataclass(frozen=True)
class AdmissionLimits:
    """max_num_seqs: sequences running at once. kv_cache_tokens: KV cache slots their rows may
    take together (None: no limit). The decoder's cache has one row per running sequence, each
    as long as the longest sequence needs, so the budget bounds rows times that length."""
    max_num_seqs: int = 256
    kv_cache_tokens: int | None = None

    @classmethod
    def of_budget(cls, max_num_seqs: int, kv_cache_mb: float, kv_bytes_per_token: int) -> AdmissionLimits:
        """Limits whose KV budget is kv_cache_mb MiB of tokens of kv_bytes_per_token each."""
        return cls(max_num_seqs, int(kv_cache_mb * 2**20) // kv_bytes_per_token)

    def rows(self, row_len: int) -> int:
        """How many sequences may run at once in rows of row_len slots (0: not even one)."""
        fit = self.max_num_seqs if self.kv_cache_tokens is None else self.kv_cache_tokens // row_len
        return min(self.max_num_seqs, fit)


@dataclass
class SequenceUpdate:
    """A sequence that took part in a step, and its text that became final in it."""
    seq: Sequence
    new_text: str


@dataclass
class StepResult:
    updates: list[SequenceUpdate]  # every sequence that was admitted or decoded
    decoded: int  # sequences in the decoding round (0 when there was none)


class Engine:
    def __init__(self, decoder: Decoder, limits: AdmissionLimits = AdmissionLimits()):
        self.decoder = decoder
        self.limits = limits
        self.waiting: deque[Sequence] = deque()  # in arrival order
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, in admission order
        self.num_rows = 0  # what this engine has reserved of the decoder's cache
        self.row_len = 0

    def slots(self, seq: Sequence) -> int:
        """The KV cache slots a sequence may need: its prompt, every token it may generate and
        what a round writes past them."""
        return len(seq.prompt_ids) + seq.params.max_tokens + self.decoder.lookahead

    def add(self, seqs: list[Sequence]) -> None:
        """Queues sequences behind those already waiting. Raises ValueError, adding none, when
        one could never be admitted: its row alone would exceed the KV budget."""
        for seq in seqs:
            if self.limits.rows(self.slots(seq)) < 1:
                raise ValueError(f"{len(seq.prompt_ids)} prompt tokens + max_tokens {seq.params.max_tokens} need "
                                 f"{self.slots(seq)} KV cache slots, more than the KV cache budget of "
                                 f"{self.limits.kv_cache_tokens} tokens (kv_cache_mb)")
        self.waiting.extend(seqs)

    def reserve(self, row_len: int) -> int:
        """Reserves the decoder's cache up front for as many sequences of up to row_len slots as
        the limits allow (a server's whole batch); returns how many."""
        rows = self.limits.rows(row_len)
        if rows < 1:
            raise ValueError(f"a sequence of {row_len} tokens does not fit the KV cache budget of "
                             f"{self.limits.kv_cache_tokens} tokens (kv_cache_mb)")
        self._reserve(rows, row_len)
        return rows

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> StepResult:
        """Prefills the waiting sequences that fit, then runs one round for all running ones."""
        took_part: dict[int, Sequence] = {}
        admitted = self._admit()
        if admitted:
            self.running.update((s.seq_id, s) for s in admitted)
            took_part.update((s.seq_id, s) for s in admitted)
            self.decoder.prefill(admitted)
            self._release_finished(admitted)
        active = list(self.running.values())
        if active:
            took_part.update((s.seq_id, s) for s in active)
            self.decoder.step(active)
            self._release_finished(active)
        updates = [SequenceUpdate(s, s.detokenizer.take_stream() if s.detokenizer is not None else "")
                   for s in took_part.values()]
        return StepResult(updates, len(active))

    def abort(self, seqs: list[Sequence]) -> None:
        """Drops sequences (cancelled, or failed with their round) and frees what they held."""
        ids = {s.seq_id for s in seqs}
        self.waiting = deque(s for s in self.waiting if s.seq_id not in ids)
        admitted = [self.running.pop(seq_id) for seq_id in ids if seq_id in self.running]
        if admitted:
            self.decoder.release(admitted)

    def _admit(self) -> list[Sequence]:
        """Takes the first waiting sequences that fit beside the running ones. Rows are as long
        as the longest waiting sequence needs, so that they are reserved once for all of them
        rather than regrown as longer ones come in."""
        if not self.waiting:
            return []
        row_len = max(self.row_len, max(map(self.slots, self.waiting)))
        free = self.limits.rows(row_len) - len(self.running)
        admitted = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        if admitted:
            self._reserve(len(self.running) + len(admitted), row_len)
        return admitted

    def _reserve(self, num_rows: int, row_len: int) -> None:
        """Grows the decoder's cache to num_rows rows of row_len slots where it is smaller (it
        never shrinks: rows reserved for shorter sequences stay when longer ones come)."""
        if num_rows > self.num_rows or row_len > self.row_len:
            self.num_rows, self.row_len = max(num_rows, self.num_rows), max(row_len, self.row_len)
            self.decoder.reserve(self.num_rows, self.row_len)

    def _release_finished(self, seqs: list[Sequence]) -> None:
        finished = [s for s in seqs if s.finished]
        for seq in finished:
            del self.running[seq.seq_id]
        if finished:
            self.decoder.release(finished)
