"""Speculation's figures, all derived from one record per round (RoundRecord): each request's
own (SequenceStats: acceptance lengths, SSD cache hits) and the engine's counters, named as
vLLM names its speculative-decoding metrics. The server's /metrics, the SSD and auto views
read the same records."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from saguaro.engine.round import RoundRecord


@dataclass
class SpecDecodeCounters:
    """Engine-wide counters since the engine started."""
    num_rounds: int = 0  # decoding rounds (prefills not counted)
    num_drafts: int = 0  # sequence rounds that verified a proposal
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens the target accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # ... at draft position 1, 2, ...
    num_cache_lookups: int = 0  # SSD sequence rounds whose outcome the worker could have cached
    num_cache_hits: int = 0  # ... and did

    def observe(self, record: RoundRecord) -> None:
        """Counts a round, and adds it to each of its requests' own figures."""
        self.num_rounds += 1
        proposal = record.proposal
        if proposal is None:
            return
        k = proposal.tokens.shape[1]
        if len(self.num_accepted_tokens_per_pos) < k:
            self.num_accepted_tokens_per_pos += [0] * (k - len(self.num_accepted_tokens_per_pos))
        for seq, outcome in zip(record.seqs, record.outcomes):
            seq.stats.acceptance_lengths.append(outcome.accepted_len + 1)
            for position in range(outcome.accepted_len):
                self.num_accepted_tokens_per_pos[position] += 1
        self.num_drafts += len(record.seqs)
        self.num_draft_tokens += k * len(record.seqs)
        self.num_accepted_tokens += sum(o.accepted_len for o in record.outcomes)
        for seq, hit in zip(record.seqs, proposal.hits or ()):
            if hit is not None:  # None: the request's first SSD round, which nothing could hit
                seq.stats.cache_hits.append(hit)
                self.num_cache_lookups += 1
                self.num_cache_hits += hit

    def summary(self) -> dict:
        return {"spec_decode_num_rounds": self.num_rounds, "spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "spec_decode_num_cache_lookups": self.num_cache_lookups,
                "spec_decode_num_cache_hits": self.num_cache_hits}
