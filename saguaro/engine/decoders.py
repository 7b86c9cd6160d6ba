"""Autoregressive (AR) and synchronous speculative (SD) decoders.

Invariant shared by every decoder: a sequence's target KV cache row holds all its tokens but
the last one, which is the input of its next target pass. A decoder works on whichever
sequences it is handed, so a scheduler may add and drop requests between rounds.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from saguaro.engine.kv_cache import KVCache
from saguaro.engine.lookup import lookups
from saguaro.engine.runner import forward_chunks, last_hidden
from saguaro.engine.sampler import WarpParams, sample, uniforms, warp
from saguaro.engine.sequence import Sequence
from saguaro.engine.verify import verify, verify_greedy
from saguaro.models.llama import LlamaModel


def new_cache(model: LlamaModel, num_rows: int, num_slots: int) -> KVCache:
    """A cache with one extra slot per row: the scratch slot that padding writes to."""
    return KVCache(model.config, num_rows, num_slots + 1, model.dtype, model.device)


def ensure_cache(cache: KVCache | None, model: LlamaModel, num_rows: int, num_slots: int) -> KVCache:
    """A cache with at least num_rows rows of num_slots usable slots. Growing keeps what the
    old cache held, so sequences in flight survive a larger batch joining them."""
    if cache is not None and cache.num_rows >= num_rows and cache.num_slots > num_slots:
        return cache
    grown = new_cache(model, max(num_rows, cache.num_rows if cache else 0),
                      max(num_slots, cache.num_slots - 1 if cache else 0))
    if cache is not None:
        rows, slots = cache.num_rows, cache.num_slots
        grown.keys[:, :rows, :, :slots] = cache.keys
        grown.values[:, :rows, :, :slots] = cache.values
    return grown


def point_masses(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, K] tokens -> [B, K, V] distributions with all mass on each token."""
    return torch.zeros(*tokens.shape, vocab_size, device=tokens.device).scatter_(-1, tokens[..., None], 1.0)


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
                         starts: list[int], params: WarpParams, u: torch.Tensor,
                         reshape: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                         features: list[torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Feeds each row's pending chunk, then drafts u.shape[1] tokens one at a time. An EAGLE
    draft reads `features` with the chunks, then its own output at each drafted token.

    Sampling happens over the model's head rows (`head_logits`): a reduced head holds all the
    mass at a fraction of the vocabulary's width. reshape(i, probs, logits) may change the
    distribution draft token i is sampled from (Saguaro sampling); the returned distributions
    are the ones really sampled from.
    Returns tokens [B, K] (vocabulary ids) and distributions over the head rows [B, K, H]
    (`model.to_vocab` widens them), or None when every row is greedy (the drafts are then
    argmaxes: point masses, which verification rebuilds from the tokens); and the hidden
    states each token was drawn from [B, K, hidden] (an EAGLE draft's own features)."""
    k = u.shape[1]
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
            hidden = forward_chunks(model, cache, rows, step, [e + i for e in ends], list(hidden[:, None]))[:, 0]
    return torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, torch.stack(hiddens, 1)


def sample_next(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    params = WarpParams.of([s.params for s in seqs], logits.device)
    if params.all_greedy:  # the argmax the one-hot distribution would sample, without building it
        return logits.argmax(-1).tolist()
    probs = warp(logits, params)
    u = uniforms([s.generator for s in seqs], 1)[:, 0].to(logits.device)
    return sample(probs, u).tolist()


class ARDecoder:
    """One target pass per token."""

    def __init__(self, target: LlamaModel):
        self.target = target
        self.cache: KVCache | None = None
        self.rows: dict[int, int] = {}  # seq_id -> cache row
        self.features: FeatureLog | None = None  # kept when an EAGLE draft reads them

    @property
    def lookahead(self) -> int:
        """Slots a round may write past a sequence's committed length."""
        return 1

    def reserve(self, num_rows: int, num_slots: int) -> None:
        """Makes room for num_rows sequences of up to num_slots tokens each."""
        self.cache = ensure_cache(self.cache, self.target, num_rows, num_slots)

    def assign_rows(self, seqs: list[Sequence]) -> None:
        free = sorted(set(range(self.cache.num_rows)) - set(self.rows.values()))
        for seq in seqs:
            if not free:
                raise RuntimeError("no free KV cache row")
            self.rows[seq.seq_id] = free.pop(0)

    def release(self, seqs: list[Sequence]) -> None:
        """Frees the cache rows of finished (or cancelled) sequences."""
        for seq in seqs:
            self.rows.pop(seq.seq_id, None)
            if self.features is not None:
                self.features.drop(seq.seq_id)

    def prefill(self, seqs: list[Sequence]) -> None:
        """Runs the prompts and commits each sequence's first token."""
        self.assign_rows(seqs)
        chunks = [s.prompt_ids for s in seqs]
        hidden = forward_chunks(self.target, self.cache, self._rows(seqs), chunks, [0] * len(seqs))
        first = sample_next(self.target.logits(last_hidden(hidden, chunks)), seqs)
        for i, (seq, token) in enumerate(zip(seqs, first)):
            seq.commit([token])
            self._log_features(seq, hidden[i, :len(chunks[i])])

    def step(self, seqs: list[Sequence]) -> None:
        chunks = [[s.token_ids[-1]] for s in seqs]
        hidden = forward_chunks(self.target, self.cache, self._rows(seqs), chunks, [len(s) - 1 for s in seqs])
        for i, (seq, token) in enumerate(zip(seqs, sample_next(self.target.logits(hidden[:, 0]), seqs))):
            seq.commit([token])
            self._log_features(seq, hidden[i, :1])

    def verify_and_commit(self, seqs: list[Sequence], draft_tokens: torch.Tensor,
                          draft_probs: torch.Tensor | None) -> list[tuple[int, int]]:
        """One target pass over [last token, drafts]; commits accepted drafts + bonus and
        returns each sequence's outcome (accepted_len, bonus_token). draft_probs None means
        the drafts are point masses (greedy drafts, cheap backup tokens)."""
        B, K = draft_tokens.shape
        device = self.target.device
        draft_tokens = draft_tokens.to(device)
        chunks = [[s.token_ids[-1]] + d for s, d in zip(seqs, draft_tokens.tolist())]
        hidden = forward_chunks(self.target, self.cache, self._rows(seqs), chunks, [len(s) - 1 for s in seqs])
        params = WarpParams.of([s.params for s in seqs], device).repeat(K + 1)
        logits = self.target.logits(hidden)
        if params.all_greedy:
            accepted_len, bonus = verify_greedy(draft_tokens, logits.argmax(-1))
        else:
            if draft_probs is None:
                draft_probs = point_masses(draft_tokens, self.target.config.vocab_size)
            target_probs = warp(logits.flatten(0, 1), params).view(B, K + 1, -1)
            u = uniforms([s.generator for s in seqs], K + 1).to(device)
            accepted_len, bonus = verify(draft_tokens, draft_probs.to(device), target_probs, u[:, :K], u[:, K])
        outcomes = list(zip(accepted_len.tolist(), bonus.tolist()))
        for i, (seq, drafts, (k, bonus_token)) in enumerate(zip(seqs, draft_tokens.tolist(), outcomes)):
            seq.commit(drafts[:k] + [bonus_token])
            seq.stats.acceptance_lengths.append(k + 1)
            self._log_features(seq, hidden[i, :k + 1])
        return outcomes

    def _log_features(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """Keeps the target's hidden states of the tokens it just ran, when a draft reads them
        (also for a sequence that just finished: SSD still registers it with the worker)."""
        if self.features is not None:
            self.features.add(seq.seq_id, hidden)

    def _rows(self, seqs: list[Sequence]) -> list[int]:
        return [self.rows[s.seq_id] for s in seqs]


class SDDecoder(ARDecoder):
    """Synchronous speculative decoding: the draft proposes K tokens, the target verifies them
    in one pass, exact rejection sampling commits accepted + 1 tokens."""

    def __init__(self, target: LlamaModel, draft: LlamaModel, num_speculative_tokens: int,
                 prompt_lookup: int | None = None):
        super().__init__(target)
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.draft = draft
        self.k = num_speculative_tokens
        self.prompt_lookup = prompt_lookup  # n-gram length whose earlier match replaces the draft
        self.draft_cache: KVCache | None = None
        self.draft_len: dict[int, int] = {}  # seq_id -> tokens whose KV the draft cache holds
        if draft.reads_features:
            self.features = FeatureLog()

    @property
    def lookahead(self) -> int:
        return self.k + 1

    def reserve(self, num_rows: int, num_slots: int) -> None:
        super().reserve(num_rows, num_slots)
        self.draft_cache = ensure_cache(self.draft_cache, self.draft, num_rows, num_slots)

    def release(self, seqs: list[Sequence]) -> None:
        super().release(seqs)
        for seq in seqs:
            self.draft_len.pop(seq.seq_id, None)

    def prefill(self, seqs: list[Sequence]) -> None:
        super().prefill(seqs)
        chunks = [s.prompt_ids for s in seqs]
        forward_chunks(self.draft, self.draft_cache, self._rows(seqs), chunks, [0] * len(seqs),
                       self._draft_features(seqs, [0] * len(seqs), [len(c) for c in chunks]))
        for seq in seqs:
            self.draft_len[seq.seq_id] = len(seq.prompt_ids)

    def propose(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K draft tokens per sequence [B, K] and the distributions they came from [B, K, V]
        (None: point masses). With prompt_lookup, sequences whose text offers a match take it
        (point masses) and skip the draft, whose cache catches up on their next drafted round."""
        looked = lookups([s.token_ids for s in seqs], self.k, self.prompt_lookup)
        if not looked:
            return self._draft(seqs)
        tokens = torch.tensor([looked.get(i, [0] * self.k) for i in range(len(seqs))], device=self.draft.device)
        drafted = [i for i in range(len(seqs)) if i not in looked]
        probs = None
        if drafted:
            draft_tokens, draft_probs = self._draft([seqs[i] for i in drafted])
            tokens[drafted] = draft_tokens
            if draft_probs is not None:
                probs = point_masses(tokens, self.target.config.vocab_size).to(draft_probs.device)
                probs[drafted] = draft_probs
        return tokens, probs

    def _draft(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        chunks = [s.token_ids[self.draft_len[s.seq_id]:] for s in seqs]
        starts = [self.draft_len[s.seq_id] for s in seqs]
        params = WarpParams.of([s.params for s in seqs], self.draft.device)
        u = uniforms([s.generator for s in seqs], self.k).to(self.draft.device)
        tokens, probs, _ = autoregressive_draft(self.draft, self.draft_cache, self._rows(seqs), chunks, starts,
                                                params, u, features=self._draft_features(seqs, starts, [len(s) for s in seqs]))
        for seq in seqs:
            # An EAGLE draft ran the drafted tokens on its own guessed features: redone with
            # the target's once they are verified.
            self.draft_len[seq.seq_id] = len(seq) + (0 if self.draft.reads_features else self.k - 1)
        return tokens, None if probs is None else self.draft.to_vocab(probs)

    def _draft_features(self, seqs: list[Sequence], starts: list[int], ends: list[int]) -> list[torch.Tensor] | None:
        if self.features is None:
            return None
        return [self.features.inputs(s.seq_id, a, b) for s, a, b in zip(seqs, starts, ends)]

    def step(self, seqs: list[Sequence]) -> None:
        draft_tokens, draft_probs = self.propose(seqs)
        self.verify_and_commit(seqs, draft_tokens, draft_probs)

    def verify_and_commit(self, seqs: list[Sequence], draft_tokens: torch.Tensor,
                          draft_probs: torch.Tensor | None) -> list[tuple[int, int]]:
        committed_before = [len(s) for s in seqs]
        outcomes = super().verify_and_commit(seqs, draft_tokens, draft_probs)
        for seq, n, (k, _) in zip(seqs, committed_before, outcomes):
            self.draft_len[seq.seq_id] = min(self.draft_len[seq.seq_id], n + k)
        return outcomes
