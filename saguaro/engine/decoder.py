"""The decoder the engine loop drives, one round per step: the policy chooses, the chosen
proposer proposes, the verifier runs the target's pass and commits, and everyone observes the
round's one record. What varies between AR, SD, SSD and auto is only which policy chooses and
which proposers it chooses among (saguaro.speculation builds them); the target's KV cache has
one owner, the `Verifier`.
"""
from __future__ import annotations

import time

from saguaro.engine.round import (WAITED, CacheHits, FixedPolicy, Policy, Proposer, RoundRecord, SpecDecodeCounters,
                                  forced_proposal)
from saguaro.engine.runner import pads_chunks
from saguaro.engine.sequence import Sequence
from saguaro.engine.verifier import Verifier


class Decoder:
    """What the engine loop drives. Invariant: a sequence's target KV cache row holds all its
    tokens but the last one, which is the input of its next target pass. A decoder works on
    whichever sequences it is handed, so a scheduler may add and drop requests between rounds."""

    def __init__(self, verifier: Verifier, policy: Policy | None = None):
        self.verifier = verifier
        self.policy = policy or FixedPolicy()
        self.shape = (0, 0)  # rows and slots reserved, which a proposer gets when first chosen
        self.reserved: list[Proposer] = []  # proposers that have run rounds, in the order they came
        self.current: Proposer | None = None  # the last round's proposer
        self.counters = SpecDecodeCounters()
        # a GPU pass's thread may sleep on the device, so only a CPU target's rounds are judged waited
        self.on_cpu = verifier.target.device.type == "cpu"
        self.pads = pads_chunks(verifier.target)

    @property
    def num_speculative_tokens(self) -> int | None:
        """Draft tokens per round at most; None without speculation."""
        return self.policy.max_k or None

    @property
    def lookahead(self) -> int:
        """Slots a round may write past a sequence's committed length."""
        return self.policy.max_k + 1

    @property
    def readers(self) -> list[Proposer]:
        return [p for p in self.policy.proposers() if p.reads_target_features]

    def reserve(self, num_rows: int, num_slots: int) -> None:
        self.verifier.reserve(num_rows, num_slots)
        self.shape = (max(self.shape[0], num_rows), max(self.shape[1], num_slots))
        for proposer in self.reserved:
            proposer.reserve(*self.shape)

    def prefill(self, seqs: list[Sequence]) -> None:
        """Runs the prompts and commits each sequence's first token; proposers take a sequence
        up when first asked for it, so one auto never speculates for costs nothing."""
        hidden = self.verifier.prefill(seqs)
        for proposer in self.readers:
            proposer.keep_hidden(seqs, hidden)

    def step(self, seqs: list[Sequence]) -> RoundRecord:
        """One round: commits one or more tokens to each sequence."""
        choice = self.policy.choose(seqs)
        proposer = choice.proposer
        if proposer is not self.current and self.current is not None:
            self.current.pause()
        self.current = proposer
        if proposer is not None and proposer not in self.reserved:
            proposer.reserve(*self.shape)
            self.reserved.append(proposer)
        lengths_before = [len(s) for s in seqs]
        started, started_cpu = time.perf_counter(), time.thread_time()
        proposal = proposer.propose(seqs, choice.k, choice.tree) if proposer is not None else forced_proposal(seqs, self.pads)
        proposed = time.perf_counter()
        if proposer is None or proposal is None:  # AR, over the tokens its grammar forces where it does
            outcomes, hidden = self.verifier.decode(seqs, proposal and proposal.rows())
        else:
            outcomes, hidden = self.verifier.verify(seqs, proposal)
        verified = time.perf_counter()
        waited = self.on_cpu and (time.thread_time() - started_cpu) * WAITED < verified - started
        record = RoundRecord(choice, seqs, lengths_before, proposal, outcomes,
                             proposed - started - (proposal.start_s if proposal else 0.0), verified - proposed, waited)
        if readers := self.readers:
            ran = [hidden[i, :outcome.accepted_len + 1] for i, outcome in enumerate(outcomes)]
            for reader in readers:
                reader.keep_hidden(seqs, ran)
        self.counters.observe(record)
        if proposal is not None and proposer is not None:
            proposer.observe(record)
        self.policy.observe(record)
        return record

    def release(self, seqs: list[Sequence]) -> None:
        """Frees what finished (or cancelled) sequences held."""
        self.verifier.release(seqs)
        seq_ids = [s.seq_id for s in seqs]
        for proposer in self.policy.proposers():
            proposer.release(seq_ids)

    def metrics(self) -> dict:
        """Engine-wide figures: the rounds' counters, the prefix cache's, the proposers' (SSD's
        cache hits: none counted without it) and the policy's."""
        figures = {**self.counters.summary(), **CacheHits().summary()}
        for proposer in self.policy.proposers():
            figures.update(proposer.metrics())
        return {**figures, **self.verifier.metrics(), **self.policy.metrics()}

    def wait_for_ssd(self, start: bool = False) -> None:
        """Blocks until SSD's worker is up where the policy starts it in the background (method
        "auto"), so that timed rounds have SSD among their choices; start: start it now."""
        self.policy.wait_for_ssd(start)

    def close(self) -> None:
        self.policy.close()
