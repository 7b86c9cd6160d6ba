"""The speculation cache: for each request, the speculations pre-drafted for the predicted
outcomes of its pending verification.

An outcome is (accepted_len, bonus_token). While the target verifies a speculation, the draft
worker drafts one branch (K tokens) after each outcome it predicts; when the real outcome
arrives, a branch for it is the next speculation at once (a hit). A request's branches serve
one round: whatever the outcome, they are dropped when it is looked up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

Outcome = tuple[int, int]  # (accepted_len, bonus_token)


@dataclass
class Branch:
    tokens: list[int]  # K draft tokens
    probs: torch.Tensor | None  # [K, head rows]: the distributions they were sampled from; None: point masses
    features: torch.Tensor | None  # [K, hidden]: an EAGLE draft's own feature at each token


@dataclass
class _Branches:
    index: dict[Outcome, int]  # outcome -> branch
    tokens: list[list[int]]  # [branches][K]
    probs: torch.Tensor | None  # [branches, K, head rows]
    features: torch.Tensor | None  # [branches, K, hidden]


class SpeculationCache:
    def __init__(self):
        self._requests: dict[int, _Branches] = {}

    def store(self, seq_id: int, outcomes: list[Outcome], tokens: list[list[int]],
              probs: torch.Tensor | None, features: torch.Tensor | None) -> None:
        """One request's branches: branch i follows outcomes[i]; probs and features may be
        views of a batch's tensors (take copies what it hands out)."""
        self._requests[seq_id] = _Branches(dict(zip(outcomes, range(len(outcomes)))), tokens, probs, features)

    def take(self, seq_id: int, outcome: Outcome | None) -> Branch | None:
        """The branch drafted for this outcome (None: a miss), and forgets the request's others.
        Its distributions are copied out of the batch's tensor: a pickled view would carry the
        whole storage (all branches of all requests) over the wire."""
        branches = self._requests.pop(seq_id, None)
        i = None if branches is None or outcome is None else branches.index.get(outcome)
        if i is None:
            return None
        return Branch(branches.tokens[i], None if branches.probs is None else branches.probs[i].clone(),
                      None if branches.features is None else branches.features[i])

    def drop(self, seq_id: int) -> None:
        self._requests.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._requests)
