"""The speculation cache: for each request, the speculations pre-drafted for the predicted
outcomes of its pending verification.

An outcome is (accepted_len, bonus_token). While the target verifies a speculation, the draft
worker drafts one branch (K tokens) after each outcome it predicts; when the real outcome
arrives, a branch for it is the next speculation at once (a hit). A request's branches serve
one round: whatever the outcome, they are dropped when it is looked up.

Branches are also shared across requests: within a round, a branch its own request did not
take may serve another request that missed, if that request's text ends with the same last
tokens the branch was drafted after (its `key`). Exactness needs nothing more, since any
proposal is verified against the distribution it was drawn from. Independence of requests
(n samples of one prompt) needs each branch to serve one request at most: a branch two
requests verified would tie their outputs together through its one draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.engine.proposal import Outcome


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
    keys: list[tuple[int, ...]] | None  # the last tokens each branch was drafted after (None: not shared)

    def branch(self, i: int) -> Branch:
        """Branch i, its distributions copied out of the batch's tensor: a pickled view would
        carry the whole storage (all branches of all requests) over the wire."""
        return Branch(self.tokens[i], None if self.probs is None else self.probs[i].clone(),
                      None if self.features is None else self.features[i])


class SpeculationCache:
    def __init__(self):
        self._requests: dict[int, _Branches] = {}
        self._unused: dict[tuple[int, ...], list[tuple[_Branches, int]]] = {}  # this round's, left by their own

    def store(self, seq_id: int, outcomes: list[Outcome], tokens: list[list[int]],
              probs: torch.Tensor | None, features: torch.Tensor | None,
              keys: list[tuple[int, ...]] | None = None) -> None:
        """One request's branches: branch i follows outcomes[i] (and the text ending in
        keys[i]); probs and features may be views of a batch's tensors."""
        self._requests[seq_id] = _Branches(dict(zip(outcomes, range(len(outcomes)))), tokens, probs, features, keys)

    def miss_cause(self, seq_id: int, outcome: Outcome) -> str | None:
        """Why this outcome would miss: "bonus" (branches after its accepted length, none for its
        bonus token), "length" (no branch after its accepted length) or "unfilled" (no branches
        for the request: its fill had not run); None: it would hit."""
        branches = self._requests.get(seq_id)
        if branches is None:
            return "unfilled"
        if outcome in branches.index:
            return None
        return "bonus" if any(o[0] == outcome[0] for o in branches.index) else "length"

    def take(self, seq_id: int, outcome: Outcome | None) -> Branch | None:
        """The branch drafted for this outcome (None: a miss). The request's other branches are
        left to `take_shared` until `end_round`."""
        branches = self._requests.pop(seq_id, None)
        if branches is None:
            return None
        i = None if outcome is None else branches.index.get(outcome)
        for j, key in enumerate(branches.keys or []):
            if j != i:
                self._unused.setdefault(key, []).append((branches, j))
        return None if i is None else branches.branch(i)

    def take_shared(self, key: tuple[int, ...]) -> Branch | None:
        """A branch another request left this round, drafted after text ending in `key`; it
        serves no one else."""
        left = self._unused.get(key)
        if not left:
            return None
        branches, i = left.pop()
        return branches.branch(i)

    def end_round(self) -> None:
        self._unused.clear()

    def drop(self, seq_id: int) -> None:
        self._requests.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._requests)
