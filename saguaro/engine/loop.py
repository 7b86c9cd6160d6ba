"""The decoding loop that `LLM.generate` and the server's scheduler both drive.

Each step admits the sequences added since the last one (their prefill commits a first token),
runs one decoder round over every running sequence, hands out the text that became final and
releases the finished. A sequence's tokens depend only on its own prompt, parameters and random
stream, never on which others share its steps.
"""
from __future__ import annotations

from dataclasses import dataclass

from saguaro.engine.round import Decoder
from saguaro.engine.sequence import Sequence


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
    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.waiting: list[Sequence] = []
        self.running: dict[int, Sequence] = {}  # seq_id -> sequence, in admission order

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting += seqs

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> StepResult:
        """Prefills what was added, then runs one round for all running sequences."""
        took_part: dict[int, Sequence] = {}
        admitted, self.waiting = self.waiting, []
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
        self.waiting = [s for s in self.waiting if s.seq_id not in ids]
        admitted = [self.running.pop(seq_id) for seq_id in ids if seq_id in self.running]
        if admitted:
            self.decoder.release(admitted)

    def _release_finished(self, seqs: list[Sequence]) -> None:
        finished = [s for s in seqs if s.finished]
        for seq in finished:
            del self.running[seq.seq_id]
        if finished:
            self.decoder.release(finished)
