"""What crosses between proposing and verifying: a round's proposal and each sequence's outcome.
Plain data, shared by the engine and the draft worker's process."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Outcome(NamedTuple):
    """What a verification commits to one sequence: accepted_len drafts, then bonus_token."""
    accepted_len: int
    bonus_token: int


@dataclass
class Proposal:
    """The K tokens per sequence that a round verifies, or a tree of tokens per sequence."""
    tokens: torch.Tensor  # [B, K] vocabulary ids; a tree's [B, N] (a row's first len(parents[i]))
    probs: torch.Tensor | None  # [B, K, V]: the distributions really sampled from; None: point masses
    # sequences a draft model drafted one step at a time, with no more than the last round's
    # tokens to catch up on: the rounds whose time says what a draft step costs (method="auto")
    steady_rows: int = 0
    looked_up: list[int] = field(default_factory=list)  # sequences whose tokens prompt lookup proposed
    hits: list[bool | None] | None = None  # SSD: whether each speculation was cached (None: a first round)
    start_s: float = 0.0  # time the proposer spent first on sequences it had not seen (their prompts)
    parents: list[list[int]] | None = None  # token trees (saguaro.engine.tree): each node's parent; None: chains
    # each sequence's draft positions (a chain's) whose token the grammar forced, proposed
    # without a draft step (jump-forward); None: none
    forced: list[list[int]] | None = None

    def rows(self) -> list[list[int]]:
        """Each sequence's proposed tokens: its chain, or its tree's nodes in order."""
        tokens = self.tokens.tolist()
        return tokens if self.parents is None else [row[:len(p)] for row, p in zip(tokens, self.parents)]
