"""Drafters: what proposes the K tokens a target pass verifies.

A standalone draft model, an EAGLE-style draft that reads the target's hidden states, prompt
lookup (earlier text) and the n-gram guess share one interface, so SD (`sd.py`) and the SSD
worker (`speculator.py`) work with any of them. A drafter sees sequences through `Drafted`:
engine Sequences on the target side, the worker's own records in SSD.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from saguaro.config import SpeculativeConfig, TreeShape
from saguaro.engine.processing import LogitsProcessor, head_masks, process_rows
from saguaro.engine.proposal import Proposal
from saguaro.engine.runner import forward_chunks, last_hidden, prefill_chunks
from saguaro.engine.sampler import MIN_TEMPERATURE, SamplingParams, WarpParams, sample, uniforms, warp
from saguaro.engine.rejection import point_masses
from saguaro.models.kv_cache import CacheRows, KVCache, ensure_cache
from saguaro.models.llama import LlamaModel
from saguaro.models.prefix_cache import PrefixCache, new_prefix_cache
from saguaro.speculation.local.lookup import lookups, ngram_guess

# reshape(i, probs, logits) -> the distribution draft token i is really sampled from
Reshape = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Constraint:
    """The sequences' processing as drafts apply it: called on logits [B, T, vocabulary] and
    contexts [B][T], the rows' processed logits after each row's committed text and its
    drafted tokens contexts[b][t] (saguaro.engine.processing)."""
    processors: list[LogitsProcessor | None]
    prompts: list[list[int]]
    outputs: list[list[int]]

    def __call__(self, logits: torch.Tensor, contexts: list[list[list[int]]]) -> torch.Tensor:
        return process_rows(logits, self.processors, self.prompts, self.outputs, contexts)

    @property
    def only_grammars(self) -> bool:
        """Whether all of it is grammars' masks, which a head can take (constrained_head_logits)."""
        return all(p is None or p.only_grammar for p in self.processors)


class Drafted(Protocol):
    """What a drafter reads of a sequence."""
    seq_id: int
    token_ids: list[int]  # committed tokens, prompt included
    params: SamplingParams
    generator: torch.Generator  # the sequence's own random stream
    processor: LogitsProcessor | None  # its penalties, bias, grammar (None: none)
    prompt_len: int


def constraint(seqs: list[Drafted]) -> Constraint | None:
    """The sequences' processing as drafts apply it, so they draft what the target may accept
    (under a grammar, an unconstrained draft's tokens would mostly be rejected); None when no
    sequence processes its logits."""
    if all(s.processor is None for s in seqs):
        return None
    return Constraint([s.processor for s in seqs], [s.token_ids[:s.prompt_len] for s in seqs],
                      [s.token_ids[s.prompt_len:] for s in seqs])


def constrained_head_logits(model: LlamaModel, hidden: torch.Tensor, constrain: Constraint | None,
                            contexts: list[list[list[int]]]) -> torch.Tensor:
    """The draft's logits over its head rows [B, T, head rows] for hidden [B, T, hidden], processed
    where constrain is given: over the vocabulary, then read back at the head's rows; or, where
    it is grammars alone and the head takes masks (LlamaModel.masks_in_head), by the head's
    product over its own rows (-inf at the illegal tokens, their columns skipped), the same
    logits without a pass over the vocabulary."""
    if constrain is None:
        return model.head_logits(hidden)
    if constrain.only_grammars and model.masks_in_head:
        return model.head_logits(hidden, head_masks(constrain.processors, contexts, hidden.shape[1],
                                                    model.config.vocab_size, model.head_ids))
    logits = constrain(model.logits(hidden), contexts)
    return logits if model.config.head_vocab_size is None else logits[..., model.head_token_ids]


class Drafter(ABC):
    reads_target_features = False  # wants the target's hidden states (keep_target_hidden)

    def __init__(self, k: int, tree: TreeShape | None = None):
        self.k = k
        self.tree = tree  # grow token trees of this shape (depth k) instead of chains

    def set_num_tokens(self, k: int, tree: TreeShape | None = None) -> None:
        """Proposes k tokens, or trees of depth k, from the next round on (method="auto"
        changes them between rounds)."""
        if tree is not None and self.reads_target_features:
            raise ValueError("an EAGLE-style draft drafts chains (token trees need a standalone draft model)")
        self.k, self.tree = k, tree

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
                         features: list[torch.Tensor] | None = None, constrain: Constraint | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Feeds each row's pending chunk, then drafts k tokens one at a time, sampling with the
    uniforms u [B, k] (None where every row is greedy). An EAGLE draft reads `features` with
    the chunks, then its own output at each drafted token.

    Sampling happens over the model's head rows (`head_logits`): a reduced head holds all the
    mass at a fraction of the vocabulary's width. reshape may change the distribution a draft
    token is sampled from (Saguaro sampling); the returned distributions are the ones really
    sampled from. constrain: the rows' processing (penalties, grammar) along the drafted tokens.
    Returns tokens [B, K] (vocabulary ids) and distributions over the head rows [B, K, H]
    (`model.to_vocab` widens them), or None when every row is greedy (the drafts are then
    argmaxes: point masses, which verification rebuilds from the tokens); and the hidden
    states each token was drawn from [B, K, hidden] (an EAGLE draft's own features)."""
    hidden = last_hidden(forward_chunks(model, cache, rows, chunks, starts, features), chunks)
    ends = [s + len(c) for s, c in zip(starts, chunks)]
    tokens, probs, hiddens = [], [], []
    drafted: list[list[int]] = [[] for _ in chunks]
    for i in range(k):
        hiddens.append(hidden)
        logits = constrained_head_logits(model, hidden[:, None], constrain, [[d] for d in drafted])[:, 0]
        if params.all_greedy:
            token = model.head_token(logits.argmax(-1))
        else:
            q = warp(logits, params)
            if reshape is not None:
                q = reshape(i, q, logits)
            token = model.head_token(sample(q, u[:, i]))
            probs.append(q)
        tokens.append(token)
        if constrain is not None:
            drafted = [d + [t] for d, t in zip(drafted, token.tolist())]
        if i < k - 1:
            own = list(hidden[:, None]) if model.reads_features else None
            hidden = forward_chunks(model, cache, rows, token[:, None], [e + i for e in ends], own)[:, 0]
    return torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, torch.stack(hiddens, 1)


@dataclass
class Drafts:
    """What a drafter's K tokens per sequence came with."""
    tokens: torch.Tensor  # [B, K] vocabulary ids
    probs: torch.Tensor | None  # [B, K, head rows]: the distributions really sampled from; None: all greedy
    hidden: torch.Tensor | None  # [B, K, hidden]: what each token was drawn from (an EAGLE draft's own features)
    forced: list[list[int]] | None = None  # each row's positions whose token the grammar forced (no draft step)
    written: list[int] | None = None  # each row's slots with KV entries; None: its text and its first K - 1 drafts


def jump_forward_draft(model: LlamaModel, cache: KVCache, rows: list[int], chunks: list[list[int]],
                       starts: list[int], seqs: list[Drafted], k: int, u: torch.Tensor | None,
                       reshape: Reshape | None = None) -> Drafts:
    """autoregressive_draft under the sequences' grammars, with jump-forward: where a grammar
    forces the next token (the only legal one: probability 1 under the processed draft and
    target alike), it is drafted without a step of its own and fed to the draft with the next
    sampled token, in that step's pass. A row whose K tokens are all forced runs no pass (its
    text waits for the next round's). Rows move at their own pace: a pass runs the rows still
    short of K, each over its pending tokens. Not for a draft that reads features (EAGLE)."""
    B = len(chunks)
    pending = [list(c) for c in chunks]  # tokens not yet run, from slot written[b]
    written = list(starts)
    drafted: list[list[int]] = [[] for _ in range(B)]
    forced: list[list[int]] = [[] for _ in range(B)]
    sampled: list[dict[int, torch.Tensor]] = [{} for _ in range(B)]  # position -> distribution

    def force(b: int) -> None:
        processor = seqs[b].processor
        run = [] if processor is None else processor.forced(k - len(drafted[b]), drafted[b])
        forced[b] += range(len(drafted[b]), len(drafted[b]) + len(run))
        drafted[b] += run
        pending[b] += run

    for b in range(B):
        force(b)
    while live := [b for b in range(B) if len(drafted[b]) < k]:
        chunk = [pending[b] for b in live]
        hidden = last_hidden(forward_chunks(model, cache, [rows[b] for b in live], chunk,
                                            [written[b] for b in live]), chunk)
        for b in live:
            written[b] += len(pending[b])
        group = [seqs[b] for b in live]
        logits = constrained_head_logits(model, hidden[:, None], constraint(group),
                                         [[drafted[b]] for b in live])[:, 0]
        params = WarpParams.of([s.params for s in group], model.device)
        if params.all_greedy:
            tokens = model.head_token(logits.argmax(-1)).tolist()
        else:
            q = warp(logits, params)
            positions = [len(drafted[b]) for b in live]
            if reshape is not None:  # Saguaro sampling is per draft position
                for position in set(positions):
                    at = torch.tensor([j for j, p in enumerate(positions) if p == position])
                    q[at] = reshape(position, q[at], logits[at])
            row_u = torch.stack([u[b, p] for b, p in zip(live, positions)])
            tokens = model.head_token(sample(q, row_u)).tolist()
            for j, (b, position) in enumerate(zip(live, positions)):
                sampled[b][position] = q[j]
        for b, token in zip(live, tokens):
            drafted[b].append(token)
            pending[b] = [token]
            force(b)
    probs = None
    if any(sampled):  # a forced (or greedy) token's distribution is a point mass on it
        width = next(q.shape[-1] for row in sampled for q in row.values())
        head_ids = model.head_token(torch.arange(width, device=model.device))
        probs = torch.stack([torch.stack([row[j] if j in row else (head_ids == drafted[b][j]).float()
                                          for j in range(k)]) for b, row in enumerate(sampled)])
    return Drafts(torch.tensor(drafted), probs, None, forced, written)


def grow_tree(model: LlamaModel, cache: KVCache, rows: list[int], chunks: list[list[int]], starts: list[int],
              temperatures: list[float], shape: TreeShape, constrain: Constraint | None = None
              ) -> tuple[list[list[int]], list[list[int]]]:
    """Feeds each row's pending chunk, then grows a token tree below its last token, as EAGLE-2
    does: a node's score is the draft's log-probability of its path from the root; at each
    depth the draft runs the `topk` best-scored nodes of the last depth (one pass, each node
    seeing the text and its ancestors) and scores their `topk` most likely children; the
    `num_nodes` best of all are kept. A child scores no more than its parent, so a kept node's
    parent is kept. Probabilities are the draft's at each row's temperature (1 when greedy).
    No random draw is made: the tree is a function of the text (saguaro.engine.tree).
    constrain: the rows' processing, applied at each node after its path (under a grammar, a
    node's illegal children score -inf and are never kept, so the tree spends its nodes on
    what the target may accept; where the grammar forces a token, a node has that one child).
    Returns each row's tokens (vocabulary ids) and parents, parents first."""
    device = model.device
    B, k = len(chunks), shape.topk
    hidden = last_hidden(forward_chunks(model, cache, rows, chunks, starts), chunks)[:, None]
    inverse_t = torch.tensor([1 / t if t >= MIN_TEMPERATURE else 1.0 for t in temperatures]).to(device, non_blocking=True)
    inverse_t = inverse_t[:, None, None]
    ends = [s + len(c) for s, c in zip(starts, chunks)]  # the first slot after each row's text
    rows_t = None if rows == list(range(B)) else torch.tensor(rows).to(device, non_blocking=True)
    tokens, parents, scores = [], [], []  # per depth: [B, nodes of that depth]
    frontier = torch.full((B, 1), -1, device=device)  # the nodes run last (pool indices; -1: the root)
    frontier_scores = torch.zeros(B, 1, device=device)
    lines = [{-1: []} for _ in range(B)]  # pool index -> slots of its ancestors and itself
    paths = [{-1: []} for _ in range(B)]  # pool index -> the tokens of its ancestors and itself
    contexts = [[[]] for _ in range(B)]  # the frontier's paths
    pooled = 0
    for depth in range(shape.depth):
        log_probs = torch.log_softmax(constrained_head_logits(model, hidden, constrain, contexts) * inverse_t, -1)
        best, head_rows = log_probs.topk(k, -1)  # [B, F, k]
        scored = (frontier_scores[..., None] + best).flatten(1)
        tokens.append(model.head_token(head_rows).flatten(1))
        parents.append(frontier[..., None].expand(-1, -1, k).flatten(1))
        scores.append(scored)
        if depth == shape.depth - 1:
            break
        frontier_scores, chosen = scored.topk(k, -1)
        frontier = pooled + chosen
        pooled += scored.shape[1]
        # run the chosen nodes: slots after the text, `k` per depth; positions by depth
        all_parents = torch.cat(parents, 1)
        slots = [[ends[i] + depth * k + j for j in range(k)] for i in range(B)]
        span = max(ends) + (depth + 1) * k
        mask = torch.arange(span)[None, None] < torch.tensor(ends)[:, None, None]
        mask = mask.expand(B, k, span).clone()
        seen = []  # (row, node, slot) for each earlier node slot a node sees, its own included
        node_tokens = torch.cat(tokens, 1).gather(1, frontier)
        for i, (row, row_parents) in enumerate(zip(frontier.tolist(), all_parents.tolist())):
            for j, node in enumerate(row):
                lines[i][node] = lines[i][row_parents[node]] + [slots[i][j]]
                seen += [(i, j, slot) for slot in lines[i][node]]
        mask[tuple(torch.tensor(seen).T)] = True
        if constrain is not None:
            for i, (row, row_parents, row_tokens) in enumerate(zip(frontier.tolist(), all_parents.tolist(),
                                                                   node_tokens.tolist())):
                for node, token in zip(row, row_tokens):
                    paths[i][node] = paths[i][row_parents[node]] + [token]
                contexts[i] = [paths[i][node] for node in row]
        positions = torch.tensor([[e + depth] * k for e in ends]).to(device, non_blocking=True)
        hidden = model(node_tokens, positions, cache, rows=rows_t,
                       slots=torch.tensor(slots).to(device, non_blocking=True),
                       mask=mask.to(device, non_blocking=True))
    return pick_nodes(torch.cat(tokens, 1).tolist(), torch.cat(parents, 1).tolist(),
                      torch.cat(scores, 1).tolist(), shape.num_nodes)


def pick_nodes(tokens: list[list[int]], parents: list[list[int]], scores: list[list[float]],
               num_nodes: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's num_nodes best-scored nodes whose parent is kept, in their first order, parents
    renumbered; never a node of score -inf (a token its processing forbids)."""
    kept_tokens, kept_parents = [], []
    for row_tokens, row_parents, row_scores in zip(tokens, parents, scores):
        kept: dict[int, int] = {-1: -1}  # pool index -> index in the tree
        for node in sorted(range(len(row_tokens)), key=lambda j: (-row_scores[j], j)):
            if row_scores[node] == float("-inf"):
                break
            if row_parents[node] in kept:
                kept[node] = 0
                if len(kept) > num_nodes:
                    break
        order = sorted(n for n in kept if n >= 0)
        kept.update((node, j) for j, node in enumerate(order))
        kept_tokens.append([row_tokens[n] for n in order])
        kept_parents.append([kept[row_parents[n]] for n in order])
    return kept_tokens, kept_parents


class DraftModelDrafter(Drafter):
    """A small language model drafting K tokens autoregressively, with a KV cache of its own.

    The cache holds the KV entries of a sequence's first `cached_len` committed tokens; a
    draft round first runs what it has not seen (the last committed tokens), then K tokens.
    reshape: see autoregressive_draft (the SSD worker's Saguaro sampling). prefix_cache: the
    draft's own, for prompts that start like earlier ones."""

    def __init__(self, model: LlamaModel, k: int, reshape: Reshape | None = None,
                 prefix_cache: PrefixCache | None = None, tree: TreeShape | None = None):
        super().__init__(k, tree)
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

    def draft(self, seqs: list[Drafted]) -> Drafts:
        """autoregressive_draft over each sequence's uncached tokens, with its own uniforms;
        jump_forward_draft where a sequence has a grammar (and the draft reads no features)."""
        starts = [self.cached_len[s.seq_id] for s in seqs]
        self.caught_up_late = max(len(s.token_ids) - start for s, start in zip(seqs, starts)) > self.k + 1
        chunks = [s.token_ids[start:] for s, start in zip(seqs, starts)]
        device = self.model.device
        rows = self.rows[[s.seq_id for s in seqs]]
        params = WarpParams.of([s.params for s in seqs], device)
        # greedy drafts draw nothing (a greedy sequence never samples from its stream)
        u = None if params.all_greedy else uniforms([s.generator for s in seqs], self.k).to(device, non_blocking=True)
        if not self.model.reads_features and any(s.processor is not None and s.processor.grammar is not None
                                                 for s in seqs):
            drafts = jump_forward_draft(self.model, self.kv_cache, rows, chunks, starts, seqs, self.k, u, self.reshape)
        else:
            drafts = Drafts(*autoregressive_draft(self.model, self.kv_cache, rows, chunks, starts, params, self.k, u,
                                                  self.reshape,
                                                  self.features_for(seqs, starts, [len(s.token_ids) for s in seqs]),
                                                  constraint(seqs)))
        for i, seq in enumerate(seqs):
            kept = len(seq.token_ids) + self.kept_after_draft
            self.cached_len[seq.seq_id] = kept if drafts.written is None else min(kept, drafts.written[i])
        return drafts

    def propose(self, seqs: list[Drafted]) -> Proposal:
        if self.tree is not None:
            return self.propose_tree(seqs)
        drafts = self.draft(seqs)
        # a round that jumped forward ran fewer draft steps than it proposed: its time is no step's
        steady = not self.caught_up_late and not any(drafts.forced or ())
        return Proposal(drafts.tokens, None if drafts.probs is None else self.model.to_vocab(drafts.probs),
                        len(seqs) if steady else 0, forced=drafts.forced)

    def propose_tree(self, seqs: list[Drafted]) -> Proposal:
        """A token tree per sequence; the draft keeps the KV entries of the committed text only
        (its nodes' entries lie where the next round's text will go)."""
        starts = [self.cached_len[s.seq_id] for s in seqs]
        self.caught_up_late = max(len(s.token_ids) - start for s, start in zip(seqs, starts)) > self.k + 1
        nodes, parents = grow_tree(self.model, self.kv_cache, self.rows[[s.seq_id for s in seqs]],
                                   [s.token_ids[start:] for s, start in zip(seqs, starts)], starts,
                                   [s.params.temperature for s in seqs], self.tree, constraint(seqs))
        for seq in seqs:
            self.cached_len[seq.seq_id] = len(seq.token_ids)
        width = max(len(n) for n in nodes)
        return Proposal(torch.tensor([n + [0] * (width - len(n)) for n in nodes]), None,
                        0 if self.caught_up_late else len(seqs), parents=parents)

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
                  prefix_cache: PrefixCache | None = None, tree: TreeShape | None = None) -> DraftModelDrafter:
    """The drafter for a loaded draft model (an EAGLE draft's without the prefix cache)."""
    if model.reads_features:
        drafter = EagleDrafter(model, k, reshape)
        drafter.set_num_tokens(k, tree)  # refuses a tree
        return drafter
    return DraftModelDrafter(model, k, reshape, prefix_cache, tree)


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
        super().__init__(k, fallback.tree)
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
        if proposal.parents is not None:
            return self.beside_trees(looked, drafted, proposal)
        tokens = tokens.to(proposal.tokens.device)
        tokens[drafted] = proposal.tokens
        probs = None
        if proposal.probs is not None:
            probs = point_masses(tokens, proposal.probs.shape[-1]).to(proposal.probs.device)
            probs[drafted] = proposal.probs
        forced = None
        if proposal.forced is not None:
            forced = [[] for _ in seqs]
            for i, positions in zip(drafted, proposal.forced):
                forced[i] = positions
        return Proposal(tokens, probs, proposal.steady_rows, sorted(looked), forced=forced)

    def beside_trees(self, looked: dict[int, list[int]], drafted: list[int], trees: Proposal) -> Proposal:
        """The looked-up speculations as chains (trees of one branch) beside the drafted trees."""
        parents = {i: list(range(-1, self.k - 1)) for i in looked}
        parents.update(zip(drafted, trees.parents))
        drawn = dict(zip(drafted, trees.tokens.tolist()))
        rows = [looked[i] if i in looked else drawn[i][:len(parents[i])] for i in range(len(parents))]
        width = max(len(r) for r in rows)
        return Proposal(torch.tensor([r + [0] * (width - len(r)) for r in rows]), None, trees.steady_rows,
                        sorted(looked), parents=[parents[i] for i in range(len(parents))])

    def set_num_tokens(self, k: int, tree: TreeShape | None = None) -> None:
        self.k, self.tree = k, tree
        self.fallback.set_num_tokens(k, tree)

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


def sd_drafter(draft: LlamaModel, spec: SpeculativeConfig, prefix_cache_mb: float = 0.0) -> Drafter:
    """The drafter SD runs in this process for `spec`: the draft model's, behind prompt lookup
    when it is on."""
    drafter = model_drafter(draft, spec.num_speculative_tokens, prefix_cache=new_prefix_cache(prefix_cache_mb),
                            tree=spec.tree)
    return PromptLookupDrafter(drafter.k, spec.prompt_lookup, drafter) if spec.prompt_lookup else drafter
