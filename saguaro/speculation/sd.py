"""Synchronous speculative decoding (SD): a drafter proposes K tokens, the target verifies them
in one pass, exact rejection sampling commits the accepted ones and a bonus token."""
from __future__ import annotations

import torch

from saguaro.engine.decoders import ARDecoder
from saguaro.engine.sequence import Sequence
from saguaro.models.llama import LlamaModel
from saguaro.models.prefix_cache import PrefixCache
from saguaro.speculation.local.drafters import Drafter, Proposal


class SDDecoder(ARDecoder):
    def __init__(self, target: LlamaModel, drafter: Drafter, prefix_cache: PrefixCache | None = None):
        super().__init__(target, prefix_cache)
        self.drafter = drafter
        self.num_speculative_tokens = drafter.k

    @property
    def lookahead(self) -> int:
        return self.num_speculative_tokens + 1

    def reserve(self, num_rows: int, num_slots: int) -> None:
        super().reserve(num_rows, num_slots)
        self.drafter.reserve(num_rows, num_slots)

    def release(self, seqs: list[Sequence]) -> None:
        super().release(seqs)
        self.drafter.release([s.seq_id for s in seqs])

    def keep_hidden(self, seq: Sequence, hidden: torch.Tensor) -> None:
        self.drafter.keep_target_hidden(seq.seq_id, hidden)

    def prefill(self, seqs: list[Sequence]) -> None:
        super().prefill(seqs)
        self.drafter.prefill(seqs)

    def step(self, seqs: list[Sequence]) -> None:
        self.verify_proposal(seqs, self.drafter.propose(seqs))

    def verify_proposal(self, seqs: list[Sequence], proposal: Proposal) -> list[tuple[int, int]]:
        """Verifies and commits the drafter's proposal; the drafter forgets the rejected tokens.
        Returns each sequence's (accepted_len, bonus_token)."""
        committed_before = [len(s) for s in seqs]
        outcomes = self.verify_and_commit(seqs, proposal.tokens, proposal.probs)
        self.drafter.rollback([s.seq_id for s in seqs],
                              [n + accepted_len for n, (accepted_len, _) in zip(committed_before, outcomes)])
        return outcomes
