"""SD's proposer: a drafter in the engine's own process (draft model, EAGLE, prompt lookup)."""
from __future__ import annotations

import dataclasses
import time

import torch

from saguaro.config import TreeShape
from saguaro.engine.proposal import Proposal
from saguaro.engine.round import RoundRecord
from saguaro.engine.sequence import Sequence
from saguaro.speculation.local.drafters import Drafter


class DraftProposer:
    """Proposes with a drafter, whose K may change round by round (auto). A sequence is taken
    up (its prompt run through the draft) at its first round here, so requests decoded without
    speculation never pay for it."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.reads_target_features = drafter.reads_target_features
        self.known: set[int] = set()  # sequences whose prompt the drafter has run

    def knows(self, seq: Sequence) -> bool:
        return seq.seq_id in self.known

    def reserve(self, num_rows: int, num_slots: int) -> None:
        self.drafter.reserve(num_rows, num_slots)

    def propose(self, seqs: list[Sequence], k: int, tree: TreeShape | None = None) -> Proposal:
        started = time.perf_counter()
        if new := [s for s in seqs if s.seq_id not in self.known]:
            self.drafter.prefill(new)
            self.known.update(s.seq_id for s in new)
        start_s = time.perf_counter() - started
        if (k, tree) != (self.drafter.k, self.drafter.tree):
            self.drafter.set_num_tokens(k, tree)
        return dataclasses.replace(self.drafter.propose(seqs), start_s=start_s)

    def observe(self, record: RoundRecord) -> None:
        """The drafter forgets what the target rejected."""
        self.drafter.rollback([s.seq_id for s in record.seqs],
                              [n + o.accepted_len for n, o in zip(record.lengths_before, record.outcomes)])

    def keep_hidden(self, seqs: list[Sequence], hidden: list[torch.Tensor]) -> None:
        for seq, h in zip(seqs, hidden):
            self.drafter.keep_target_hidden(seq.seq_id, h)

    def pause(self) -> None:
        """Its cache catches up on the tokens committed meanwhile at its next round."""

    def release(self, seq_ids: list[int]) -> None:
        self.drafter.release(seq_ids)
        self.known.difference_update(seq_ids)

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass
