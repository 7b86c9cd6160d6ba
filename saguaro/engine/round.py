"""What a decoding round is: a policy chooses how to speculate, a proposer proposes, the
verifier runs the target's pass and commits, and the proposer observes the outcome. Here are
the parts' protocols, the choice, the round's one record and the counters read from it, and
the proposal a grammar forces without a draft (jump-forward); `Decoder` (decoder.py) runs the
rounds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from saguaro.config import TreeShape
from saguaro.engine.proposal import Outcome, Proposal
from saguaro.engine.sequence import Sequence


class Proposer(Protocol):
    """Proposes the tokens a round verifies: a draft model, prompt lookup, the SSD worker(s)."""
    reads_target_features: bool  # wants the target's hidden states of every committed token

    def reserve(self, num_rows: int, num_slots: int) -> None:
        """Makes room for num_rows sequences of up to num_slots tokens each."""

    def propose(self, seqs: list[Sequence], k: int, tree: TreeShape | None = None) -> Proposal | None:
        """k tokens for each sequence, or a token tree of depth k and this shape (a sequence it
        has not seen is taken up first); None when it cannot propose this round (its worker is
        lost): the round then runs without."""

    def observe(self, record: RoundRecord) -> None:
        """The outcome of the round that verified its proposal."""

    def keep_hidden(self, seqs: list[Sequence], hidden: list[torch.Tensor]) -> None:
        """The target's hidden states at the tokens it just ran for each sequence (feature readers)."""

    def pause(self) -> None:
        """Rounds go to another proposer from now on (what it knows may go stale meanwhile)."""

    def release(self, seq_ids: list[int]) -> None:
        """Forgets finished sequences."""

    def metrics(self) -> dict:
        """Figures of its own (SSD: cache hit rate, worker losses, ...)."""

    def close(self) -> None:
        """Stops what it started (a draft worker)."""


@dataclass(frozen=True)
class Choice:
    """How one round speculates: k tokens from `proposer`; no proposer: a plain AR round."""
    proposer: Proposer | None = None
    k: int = 0
    name: str = "ar"  # what metrics call it: "ar", "sd", "ssd"
    tree: TreeShape | None = None  # the token trees the proposer grows (depth k)

    @property
    def span(self) -> int:
        """The most draft tokens a round may propose: K, or a tree's KV slots past the text."""
        return self.tree.span if self.tree is not None else self.k


AR = Choice()
JUMP_FORWARD = 16  # the most grammar-forced tokens a round commits without a draft (forced_proposal)
JUMP_YIELD = 0.9  # the least share of a batched jump-forward pass's positions that commit (jump_width)
WAITED = 1.25  # a round whose thread ran for less than 1 / WAITED of it waited (RoundRecord.waited)


@dataclass(frozen=True)
class RowRecord:
    """What a round did for one of its sequences."""
    accepted_len: int  # draft tokens the target accepted (0 in an AR round)
    committed: int  # tokens committed: the accepted ones and the target's, fewer where the sequence ended
    hit: bool | None = None  # SSD: whether the worker had the speculation cached (None: not SSD, or nothing to hit)
    looked_up: bool = False  # prompt lookup proposed the tokens, not the draft model


@dataclass
class RoundRecord:
    """What one round did and how long each part took, made once by `Decoder.step`: the engine's
    counters, each request's figures, the proposers' and the policy's measurements all read it."""
    choice: Choice
    seqs: list[Sequence]
    lengths_before: list[int]  # committed tokens of each sequence before the round
    proposal: Proposal | None  # None: no speculation (an AR round)
    outcomes: list[Outcome]
    propose_s: float  # the proposer's time, the sequences it took up first not counted (proposal.start_s)
    verify_s: float  # the target's pass and the commit
    # The engine's thread ran for less than 1 / WAITED of the round on a CPU target: it waited for
    # the interpreter (a server's HTTP thread held it: passes then took 12 ms where they run in 3)
    # or for a core, so the round's times say what it cost then, not what its passes cost.
    waited: bool = False
    rows: list[RowRecord] = field(init=False)  # per sequence, in the order of seqs

    def __post_init__(self):
        hits = (self.proposal.hits if self.proposal is not None else None) or [None] * len(self.seqs)
        looked_up = set(self.proposal.looked_up) if self.proposal is not None else set()
        self.rows = [RowRecord(outcome.accepted_len, len(seq) - before, hit, i in looked_up)
                     for i, (seq, before, outcome, hit) in enumerate(zip(self.seqs, self.lengths_before,
                                                                          self.outcomes, hits))]

    @property
    def committed(self) -> int:
        return sum(row.committed for row in self.rows)


@dataclass
class CacheHits:
    """SSD's cache hits, counted here alone: the server's /metrics, SSD's summary, its backup
    choice and auto's rate of SSD all read one of these (the SSD proposer's). A sequence round
    counts once the worker knows the sequence (its first round has nothing to hit)."""
    rounds: int = 0  # sequence rounds that could hit
    hits: int = 0
    tokens: list[int] = field(default_factory=lambda: [0, 0])  # tokens they committed after a hit, after a miss
    lookup_rounds: int = 0  # ... of them, rounds a prompt lookup's tokens were sent instead of the cache's
    lookup_hits: int = 0

    def add(self, row: RowRecord) -> None:
        self.rounds += 1
        self.hits += row.hit
        self.tokens[not row.hit] += row.committed
        self.lookup_rounds += row.looked_up
        self.lookup_hits += row.looked_up and row.hit

    @property
    def rate(self) -> float | None:
        return self.hits / self.rounds if self.rounds else None

    @property
    def drafted(self) -> tuple[int, int]:
        """Hits and misses of the rounds whose tokens the worker drafted (lookups left out)."""
        hits = self.hits - self.lookup_hits
        return hits, self.rounds - self.lookup_rounds - hits

    def tokens_after(self, hit: bool) -> float | None:
        """The tokens a round committed on average after a hit (a miss); None before one."""
        rounds = self.hits if hit else self.rounds - self.hits
        return self.tokens[not hit] / rounds if rounds else None

    def summary(self) -> dict:
        return {"spec_decode_num_cache_lookups": self.rounds, "spec_decode_num_cache_hits": self.hits}


@dataclass
class SpecDecodeCounters:
    """The engine's speculation counters since it started, named as vLLM names them (SSD's
    cache hits are the SSD proposer's: CacheHits); each round's record also goes to its
    requests' own figures (SequenceStats)."""
    num_rounds: int = 0  # decoding rounds (prefills not counted)
    num_drafts: int = 0  # sequence rounds that verified a proposal
    num_draft_tokens: int = 0  # tokens proposed (a tree's: its nodes, all scored by the target)
    num_accepted_tokens: int = 0  # proposed tokens the target accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # ... at draft position (tree depth) 1, 2, ...
    num_forced_tokens: int = 0  # accepted tokens the grammar forced, proposed without a draft step (jump-forward)

    def observe(self, record: RoundRecord) -> None:
        """Counts a round, and adds it to each of its requests' own figures."""
        self.num_rounds += 1
        proposal = record.proposal
        if proposal is None:
            return
        k = proposal.tokens.shape[1]  # a tree's nodes verified, its accepted lengths its depths
        if len(self.num_accepted_tokens_per_pos) < k:
            self.num_accepted_tokens_per_pos += [0] * (k - len(self.num_accepted_tokens_per_pos))
        for seq, row in zip(record.seqs, record.rows):
            seq.stats.add(row)
            for position in range(row.accepted_len):
                self.num_accepted_tokens_per_pos[position] += 1
        self.num_drafts += len(record.seqs)
        self.num_draft_tokens += (k * len(record.seqs) if proposal.parents is None
                                  else sum(len(p) for p in proposal.parents))
        self.num_accepted_tokens += sum(row.accepted_len for row in record.rows)
        for positions, row in zip(proposal.forced or (), record.rows):  # a chain's, or a tree's one branch
            self.num_forced_tokens += sum(p < row.accepted_len for p in positions)

    def summary(self) -> dict:
        return {"spec_decode_num_rounds": self.num_rounds, "spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "spec_decode_num_forced_tokens": self.num_forced_tokens}


class Policy(Protocol):
    """Chooses each round's speculation among its proposers."""
    max_k: int  # the most tokens a round may propose

    def proposers(self) -> list[Proposer]:
        """Every proposer it may choose (auto: SSD's once its worker is up)."""

    def choose(self, seqs: list[Sequence]) -> Choice:
        """The next round's choice for these sequences."""

    def observe(self, record: RoundRecord) -> None:
        """The round that ran on its choice."""

    def metrics(self) -> dict:
        """Figures of its own (auto: rounds by choice, switches, ...)."""

    def wait_for_ssd(self, start: bool = False) -> None:
        """Blocks until an SSD worker it starts in the background is up (auto); start: starts
        it now rather than when it would first pay."""

    def close(self) -> None:
        """Stops what it started, its proposers included."""


@dataclass
class FixedPolicy:
    """The same choice every round: AR, or SD / SSD with their K."""
    choice: Choice = AR

    @property
    def max_k(self) -> int:
        return self.choice.span

    def proposers(self) -> list[Proposer]:
        return [] if self.choice.proposer is None else [self.choice.proposer]

    def choose(self, seqs: list[Sequence]) -> Choice:
        return self.choice

    def observe(self, record: RoundRecord) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def wait_for_ssd(self, start: bool = False) -> None:
        pass  # its proposers are up once built

    def close(self) -> None:
        for proposer in self.proposers():
            proposer.close()


def forced_proposal(seqs: list[Sequence], padded: bool = True) -> Proposal | None:
    """Jump-forward in a round without a draft: the tokens each sequence's grammar forces next
    (each the only legal token where it stands: probability 1 under the constrained target),
    committed with the target's token after them in one pass (Verifier.decode). None when no
    grammar forces anything. A run stops at max_tokens, so it stays within the KV slots reserved
    for the sequence; a request that wants log-probabilities has none (they need the logits at
    each position). padded: the pass computes every row to the widest run (jump_width)."""
    runs = [s.processor.forced(min(JUMP_FORWARD, s.params.max_tokens - len(s.output_ids)))
            if s.processor is not None and s.params.logprobs is None else [] for s in seqs]
    width = jump_width([len(r) for r in runs]) if padded else max(len(r) for r in runs)
    if width == 0:
        return None
    runs = [r[:width] for r in runs]
    return Proposal(torch.tensor([r + [0] * (width - len(r)) for r in runs]), None,
                    parents=[list(range(-1, len(r) - 1)) for r in runs], forced=[list(range(len(r))) for r in runs])


def jump_width(run_lengths: list[int]) -> int:
    """How many forced tokens a batch's jump-forward pass takes: the pass computes every row to
    the widest run, so rows with shorter runs compute padding. The widest width whose pass commits
    at least JUMP_YIELD of the positions it computes (a batch of one always jumps its whole run);
    0: no jump this round."""
    for width in range(max(run_lengths, default=0), 0, -1):
        committed = sum(min(n, width) + 1 for n in run_lengths)
        if committed >= JUMP_YIELD * len(run_lengths) * (width + 1):
            return width
    return 0
