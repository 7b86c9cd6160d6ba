"""Drafters: what proposes the K tokens a target pass verifies.

A standalone draft model, an EAGLE-style draft that reads the target's hidden states, prompt
lookup (earlier text) and the n-gram guess share one interface, so SD (`sd.py`) and the SSD
worker (`speculator.py`) work with any of them. A drafter sees sequences through `Drafted`:
engine Sequences on the target side, the worker's own records in SSD.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch

from saguaro.engine.proposal import Proposal
from saguaro.engine.runner import forward_chunks, last_hidden, prefill_chunks
from saguaro.engine.sampler import SamplingParams, WarpParams, sample, uniforms, warp
from saguaro.engine.verify import point_masses
from saguaro.models.kv_cache import CacheRows, KVCache, ensure_cache
from saguaro.models.llama import LlamaModel
from saguaro.models.prefix_cache import PrefixCache
from saguaro.speculation.local.lookup import lookups, ngram_guess

# reshape(i, probs, logits) -> the distribution draft token i is really sampled from
Reshape = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class Drafted(Protocol):
    """What a drafter reads of a sequence."""
    seq_id: int
    token_ids: list[int]  # committed tokens, prompt included
    params: SamplingParams
    generator: torch.Generator  # the sequence's own random stream


class Drafter(ABC):
    reads_target_features = False  # wants the target's hidden states (keep_target_hidden)

    def __init__(self, k: int):
        self.k = k

    def set_num_tokens(self, k: int) -> None:
        """Proposes k tokens from the next round on (method="auto" changes it between rounds)."""
        self.k = k

    def reserve(self, num_rows: int, num_slots: int) -> None:
        """Makes room for num_rows sequences of up to num_slots tokens each."""

    def prefill(self, seqs: list[Drafted]) -> None:
        """Registers new sequences (prompt + first token)."""

    @abstractmethod
    def propose(self, seqs: list[Drafted]) -> Proposal:
        """The next K tokens of each sequence."""

    def rollback(self, seq_ids: list[int], lengths: list[int]) -> None:
        """Only the first lengths[i] tokens of sequence i are committed (the rest were rejected)."""

    def keep_target_hidden(self, seq_id: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states at the next positions of a sequence."""

    def release(self, seq_ids: list[int]) -> None:
        """Forgets finished sequences."""


class FeatureLog:
    """The target's final hidden state at every position of each sequence, for an EAGLE draft,
    which reads h_{t-1} together with token t (saguaro.models.eagle)."""

    def __init__(self):
        self.known: dict[int, list[torch.Tensor]] = {}  # seq_id -> chunks of h_0, h_1, ...

    def add(self, seq_id: int, hidden: torch.Tensor) -> None:
        self.known.setdefault(seq_id, []).append(hidden)

    def drop(self, seq_id: int) -> None:
        self.known.pop(seq_id, None)

    def take(self, seq_id: int) -> torch.Tensor | None:
        """Everything added since the last take (what SSD sends the worker), forgotten here."""
        chunks = self.known.pop(seq_id, None)
        return torch.cat(chunks) if chunks else None

    def inputs(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """The features read with tokens start..end-1: h_{start-1}..h_{end-2}, zeros for h_{-1}."""
        chunks = self.known[seq_id]
        if len(chunks) > 1:
            chunks[:] = [torch.cat(chunks)]
        rows = chunks[0][max(start - 1, 0):end - 1]
        if start == 0:
            rows = torch.cat((rows.new_zeros(1, rows.shape[-1]), rows))
        return rows


def autoregressive_draft(model: LlamaModel, cache: KVCache, rows: list[int], chunks: list[list[int]],
                         starts: list[int], params: WarpParams, k: int, u: torch.Tensor | None,
                         reshape: Reshape | None = None,
                         features: list[torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Feeds each row's pending chunk, then drafts k tokens one at a time, sampling with the
    uniforms u [B, k] (None where every row is greedy). An EAGLE draft reads `features` with
    the chunks, then its own output at each drafted token.

    Sampling happens over the model's head rows (`head_logits`): a reduced head holds all the
    mass at a fraction of the vocabulary's width. reshape may change the distribution a draft
    token is sampled from (Saguaro sampling); the returned distributions are the ones really
    sampled from.
    Returns tokens [B, K] (vocabulary ids) and distributions over the head rows [B, K, H]
    (`model.to_vocab` widens them), or None when every row is greedy (the drafts are then
    argmaxes: point masses, which verification rebuilds from the tokens); and the hidden
    states each token was drawn from [B, K, hidden] (an EAGLE draft's own features)."""
    hidden = last_hidden(forward_chunks(model, cache, rows, chunks, starts, features), chunks)
    ends = [s + len(c) for s, c in zip(starts, chunks)]
    tokens, probs, hiddens = [], [], []
    for i in range(k):
        hiddens.append(hidden)
        logits = model.head_logits(hidden)
        if params.all_greedy:
            token = model.head_token(logits.argmax(-1))
        else:
            q = warp(logits, params)
            if reshape is not None:
                q = reshape(i, q, logits)
            token = model.head_token(sample(q, u[:, i]))
            probs.append(q)
        tokens.append(token)
        if i < k - 1:
            step = [[t] for t in token.tolist()]
            own = list(hidden[:, None]) if model.reads_features else None
            hidden = forward_chunks(model, cache, rows, step, [e + i for e in ends], own)[:, 0]
    return torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, torch.stack(hiddens, 1)


class DraftModelDrafter(Drafter):
    """A small language model drafting K tokens autoregressively, with a KV cache of its own.

    The cache holds the KV entries of a sequence's first `cached_len` committed tokens; a
    draft round first runs what it has not seen (the last committed tokens), then K tokens.
    reshape: see autoregressive_draft (the SSD worker's Saguaro sampling). prefix_cache: the
    draft's own, for prompts that start like earlier ones."""

    def __init__(self, model: LlamaModel, k: int, reshape: Reshape | None = None,
                 prefix_cache: PrefixCache | None = None):
        super().__init__(k)
        self.model = model
        self.reshape = reshape
        self.prefix_cache = prefix_cache
        self.kv_cache: KVCache | None = None
        self.rows = CacheRows()
        self.cached_len: dict[int, int] = {}  # seq_id -> committed tokens whose KV entries are cached
        self.caught_up_late = False  # the last draft first ran more tokens than a round commits

    @property
    def kept_after_draft(self) -> int:
        """Drafted tokens whose KV entries stay valid once they are accepted."""
        return self.k - 1

    def reserve(self, num_rows: int, num_slots: int) -> None:
        self.kv_cache = ensure_cache(self.kv_cache, self.model, num_rows, num_slots)

    def prefill(self, seqs: list[Drafted]) -> None:
        """Runs each prompt (all committed tokens but the last, the next round's input)."""
        rows = self.rows.assign([s.seq_id for s in seqs], self.kv_cache.num_rows)
        chunks = [s.token_ids[:-1] for s in seqs]
        prefill_chunks(self.model, self.kv_cache, rows, chunks, self.prefix_cache,
                       self.features_for(seqs, [0] * len(seqs), [len(c) for c in chunks]))
        for seq, chunk in zip(seqs, chunks):
            self.cached_len[seq.seq_id] = len(chunk)

    def draft(self, seqs: list[Drafted]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """autoregressive_draft over each sequence's uncached tokens, with its own uniforms."""
        starts = [self.cached_len[s.seq_id] for s in seqs]
        self.caught_up_late = max(len(s.token_ids) - start for s, start in zip(seqs, starts)) > self.k + 1
        chunks = [s.token_ids[start:] for s, start in zip(seqs, starts)]
        device = self.model.device
        params = WarpParams.of([s.params for s in seqs], device)
        # greedy drafts draw nothing (a greedy sequence never samples from its stream)
        u = None if params.all_greedy else uniforms([s.generator for s in seqs], self.k).to(device)
        result = autoregressive_draft(self.model, self.kv_cache, self.rows[[s.seq_id for s in seqs]], chunks,
                                      starts, params, self.k, u, self.reshape,
                                      self.features_for(seqs, starts, [len(s.token_ids) for s in seqs]))
        for seq in seqs:
            self.cached_len[seq.seq_id] = len(seq.token_ids) + self.kept_after_draft
        return result

    def propose(self, seqs: list[Drafted]) -> Proposal:
        tokens, probs, _ = self.draft(seqs)
        return Proposal(tokens, None if probs is None else self.model.to_vocab(probs),
                        0 if self.caught_up_late else len(seqs))

    def rollback(self, seq_ids: list[int], lengths: list[int]) -> None:
        for seq_id, length in zip(seq_ids, lengths):
            self.cached_len[seq_id] = min(self.cached_len[seq_id], length)

    def release(self, seq_ids: list[int]) -> None:
        self.rows.free(seq_ids)
        for seq_id in seq_ids:
            self.cached_len.pop(seq_id, None)

    def features_for(self, seqs: list[Drafted], starts: list[int], ends: list[int]) -> list[torch.Tensor] | None:
        """What the model reads with tokens start..end-1 of each sequence besides the tokens."""
        return None


class EagleDrafter(DraftModelDrafter):
    """An EAGLE-style draft (saguaro.models.eagle): reads the target's hidden state before each
    token. Its drafted tokens' KV entries came from its own guessed features, so they are run
    again with the target's once verified. Its prompts run whole (no prefix cache): their KV
    entries come with the target's hidden states."""
    reads_target_features = True

    def __init__(self, model: LlamaModel, k: int, reshape: Reshape | None = None):
        super().__init__(model, k, reshape)
        self.features = FeatureLog()

    @property
    def kept_after_draft(self) -> int:
        return 0

    def keep_target_hidden(self, seq_id: int, hidden: torch.Tensor) -> None:
        self.features.add(seq_id, hidden.to(self.model.device))

    def release(self, seq_ids: list[int]) -> None:
        super().release(seq_ids)
        for seq_id in seq_ids:
            self.features.drop(seq_id)

    def features_for(self, seqs: list[Drafted], starts: list[int], ends: list[int]) -> list[torch.Tensor]:
        return [self.features.inputs(s.seq_id, a, b) for s, a, b in zip(seqs, starts, ends)]


def model_drafter(model: LlamaModel, k: int, reshape: Reshape | None = None,
                  prefix_cache: PrefixCache | None = None) -> DraftModelDrafter:
    """The drafter for a loaded draft model (an EAGLE draft's without the prefix cache)."""
    if model.reads_features:
        return EagleDrafter(model, k, reshape)
    return DraftModelDrafter(model, k, reshape, prefix_cache)


class NGramDrafter(Drafter):
    """SSD's fast backup: what followed the last token's previous occurrence, else that token
    repeated; point masses, at no model cost."""

    def propose(self, seqs: list[Drafted]) -> Proposal:
        return Proposal(torch.tensor([ngram_guess(s.token_ids, self.k) for s in seqs]), None)


class PromptLookupDrafter(Drafter):
    """Prompt lookup: where a sequence's last `min_match` tokens occurred earlier in its text,
    the tokens that followed them, as point masses (exact at any temperature, no model pass).
    The other sequences go to `fallback`."""

    def __init__(self, k: int, min_match: int, fallback: Drafter):
        super().__init__(k)
        self.min_match, self.fallback = min_match, fallback
        self.reads_target_features = fallback.reads_target_features

    def find(self, seqs: list[Drafted]) -> dict[int, list[int]]:
        """Index -> speculation, for the sequences whose text offers a match."""
        return lookups([s.token_ids for s in seqs], self.k, self.min_match)

    def propose(self, seqs: list[Drafted]) -> Proposal:
        looked = self.find(seqs)
        if not looked:
            return self.fallback.propose(seqs)
        drafted = [i for i in range(len(seqs)) if i not in looked]
        tokens = torch.tensor([looked.get(i, [0] * self.k) for i in range(len(seqs))])
        if not drafted:
            return Proposal(tokens, None, looked_up=sorted(looked))  # no model ran
        proposal = self.fallback.propose([seqs[i] for i in drafted])
        tokens = tokens.to(proposal.tokens.device)
        tokens[drafted] = proposal.tokens
        probs = None
        if proposal.probs is not None:
            probs = point_masses(tokens, proposal.probs.shape[-1]).to(proposal.probs.device)
            probs[drafted] = proposal.probs
        return Proposal(tokens, probs, proposal.steady_rows, sorted(looked))

    def set_num_tokens(self, k: int) -> None:
        self.k = k
        self.fallback.set_num_tokens(k)

    def reserve(self, num_rows: int, num_slots: int) -> None:
        self.fallback.reserve(num_rows, num_slots)

    def prefill(self, seqs: list[Drafted]) -> None:
        self.fallback.prefill(seqs)

    def rollback(self, seq_ids: list[int], lengths: list[int]) -> None:
        self.fallback.rollback(seq_ids, lengths)

    def keep_target_hidden(self, seq_id: int, hidden: torch.Tensor) -> None:
        self.fallback.keep_target_hidden(seq_id, hidden)

    def release(self, seq_ids: list[int]) -> None:
        self.fallback.release(seq_ids)
