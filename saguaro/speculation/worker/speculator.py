"""The draft side of SSD: answers speculation requests and fills the speculation cache.

After it sends a speculation d_1..d_K for a request, the speculator predicts the outcomes of
its verification: for every accepted length k it takes the F_k most likely bonus tokens of
its own distribution at position k+1 (the token it proposed there can never be the bonus),
and drafts K tokens after each predicted outcome. All branches of all requests are decoded
together as a tree, one forward per depth. When the real outcome arrives, a hit is answered
at once; a miss gets a backup speculation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from saguaro.config import Backup, checked_fan_out
from saguaro.engine.processing import LogitsProcessor, chain_contexts
from saguaro.engine.proposal import Outcome
from saguaro.engine.runner import forward_chunks, last_hidden, run_pass
from saguaro.engine.sampler import SamplingParams, WarpParams, sample, uniforms, warp
from saguaro.models.llama import LlamaModel
from saguaro.models.prefix_cache import PrefixCache
from saguaro.engine.structured import GrammarMatcher, GrammarTokenizer
from saguaro.speculation.protocol import DraftProcessing, RequestSpeculation
from saguaro.speculation.worker.cache import SpeculationCache
from saguaro.speculation.local.drafters import (NGramDrafter, PromptLookupDrafter, constrained_head_logits, constraint,
                                                model_drafter)


@dataclass
class DraftSequence:
    """What the worker knows of one request."""
    seq_id: int
    token_ids: list[int]  # committed tokens
    params: SamplingParams
    generator: torch.Generator
    prompt_len: int = 0
    processor: LogitsProcessor | None = None  # its penalties, bias, grammar, as the target applies them
    spec: list[int] = field(default_factory=list)  # the speculation being verified
    # EAGLE drafts: the draft's own feature each token of the speculation was drawn from
    # ([K, hidden]; None after the fast backup or a lookup).
    spec_features: torch.Tensor | None = None

    def commit(self, accepted_len: int, bonus: int) -> None:
        """The target's outcome: the first accepted_len tokens of its speculation and the bonus
        are committed (its grammar advanced over them)."""
        tokens = self.spec[:accepted_len] + [bonus]
        self.token_ids += tokens
        if self.processor is not None:
            for token in tokens:
                self.processor.commit(token)

    def speculate(self, tokens: list[int], features: torch.Tensor | None = None) -> None:
        """Its next speculation, and for an EAGLE draft the features its tokens were drawn from."""
        self.spec, self.spec_features = tokens, features


def saguaro_sigma(probs: torch.Tensor, logits: torch.Tensor, top: int, c: float) -> torch.Tensor:
    """Saguaro sampling (Definition 14): the mass of the `top` most likely tokens is scaled by
    c and the rest renormalized, which pushes the residual of a rejection onto the tokens the
    cache holds. Exact, because verification uses this distribution as the proposal."""
    if c >= 1 or top <= 0:
        return probs
    top = min(top, logits.shape[-1])
    favoured = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, logits.topk(top, dim=-1).indices, True)
    scaled = torch.where(favoured, probs * c, probs)
    total = scaled.sum(-1, keepdim=True)
    return torch.where(total > 0, scaled / total.clamp_min(1e-30), probs)


def keep_top(probs: torch.Tensor, top: int) -> torch.Tensor:
    """probs with each row's `top` most likely tokens kept and renormalized, the rest zero (0:
    all kept). Drafting from this and reporting it keeps verification exact, and a proposal
    then crosses the wire as `top` pairs per position (protocol.SparseProbs)."""
    if top <= 0 or top >= probs.shape[-1]:
        return probs
    values, indices = probs.topk(top, dim=-1)
    kept = torch.zeros_like(probs).scatter_(-1, indices, values)
    return kept / kept.sum(-1, keepdim=True)


class Speculator:
    """The draft model (through its drafter), the speculation cache and each request's pending
    speculation."""

    def __init__(self, draft: LlamaModel, k: int, fan_out: list[int], saguaro_c: float = 1.0,
                 prompt_lookup: int | None = None, incarnation: int = 0, prefix_cache: PrefixCache | None = None,
                 proposal_top: int = 0, share_window: int = 0):
        self.k, self.saguaro_c, self.proposal_top = k, saguaro_c, proposal_top
        self.drafter = model_drafter(draft, k, reshape=self._sigma, prefix_cache=prefix_cache)
        # Branches serve other requests after the same last share_window tokens (cache.py); not
        # for an EAGLE draft, whose branches carry features of their own request's context.
        self.share_window = 0 if self.drafter.reads_target_features else share_window
        self.drafted_tokens = 0  # draft tokens decoded (tree and neural backup), for the target's metrics
        self.lookup = PromptLookupDrafter(k, prompt_lookup, self.drafter) if prompt_lookup else None
        self.fast_backup = NGramDrafter(k)
        self.cache = SpeculationCache()
        # A restarted worker draws from new random streams: the uniforms of the one before
        # already shaped the committed text, so reusing them would bias its proposals.
        self.incarnation = incarnation
        self.seqs: dict[int, DraftSequence] = {}
        # by key (sent once per connection): llguidance's tokenizer is built once
        self.grammar_tokenizers: dict[str, GrammarTokenizer] = {}
        self.max_len = 0
        self.set_fan_out(fan_out)

    @property
    def draft(self) -> LlamaModel:
        return self.drafter.model

    def set_fan_out(self, fan_out: list[int]) -> None:
        self.fan_out = checked_fan_out(fan_out, self.k)
        if self.drafter.kv_cache is not None:
            self.reserve(self.drafter.kv_cache.num_rows, self.max_len)

    @property
    def num_branches(self) -> int:
        return sum(self.fan_out)

    def reserve(self, num_rows: int, num_slots: int) -> None:
        """Rows for num_rows requests; slots for num_slots tokens, the glue and the tree."""
        tree = self.k * self.num_branches
        self.max_len = max(self.max_len, num_slots)
        self.drafter.reserve(num_rows, num_slots + self.k + 1 + tree)

    def add(self, seq_ids: list[int], token_ids: list[list[int]], params: list[SamplingParams],
            max_len: int, num_rows: int, features: list[torch.Tensor] | None = None,
            processing: list[DraftProcessing | None] | None = None) -> None:
        """Registers requests (prompt + first token) and runs their prompts through the draft.
        An EAGLE draft needs `features`: the target's hidden states over each prompt.
        processing: what each request's drafts need to be processed as the target's are."""
        self.reserve(max(num_rows, len(self.seqs) + len(seq_ids)), max_len)
        new = []
        for i, (sid, ids, p) in enumerate(zip(seq_ids, token_ids, params)):
            # independent of the target's stream, and of earlier incarnations' streams
            seed = (p.seed if p.seed is not None else sid) * 2654435761 + 1 + self.incarnation * 0x9E3779B97F4A7C15
            gen = torch.Generator().manual_seed(seed % (2 ** 63))
            wanted = processing[i] if processing is not None else None
            prompt_len = len(ids) - 1 if wanted is None else wanted.prompt_len
            processor = None if wanted is None else self._processor(p, wanted, ids[prompt_len:])
            seq = self.seqs[sid] = DraftSequence(sid, list(ids), p, gen, prompt_len, processor)
            new.append(seq)
        self._keep_features(seq_ids, features)
        self.drafter.prefill(new)

    def take_drafted_tokens(self) -> int:
        """The draft tokens decoded since the last call (the target's metrics count them)."""
        drafted, self.drafted_tokens = self.drafted_tokens, 0
        return drafted

    def _processor(self, params: SamplingParams, processing: DraftProcessing, output: list[int]) -> LogitsProcessor:
        """The request's processing, its grammar past the output the target committed."""
        grammar = None
        if processing.grammar_tokenizer is not None:
            self.grammar_tokenizers.setdefault(processing.grammar_key, processing.grammar_tokenizer)
        if params.structured_outputs is not None and processing.grammar_key is not None:
            grammar = GrammarMatcher(params.structured_outputs, self.grammar_tokenizers[processing.grammar_key])
            for token in output:
                grammar.commit(token)
        return LogitsProcessor(params, set(processing.stop_ids), grammar)

    def release(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.seqs.pop(sid, None)
            self.cache.drop(sid)
        self.drafter.release(seq_ids)

    def _keep_features(self, seq_ids: list[int], features: list[torch.Tensor | None] | None) -> None:
        if not self.drafter.reads_target_features:
            return
        if features is None:
            raise ValueError("an EAGLE draft needs the target's hidden states with every request")
        for sid, f in zip(seq_ids, features):
            if f is not None:
                self.drafter.keep_target_hidden(sid, f)

    # --- answering ------------------------------------------------------------------------

    def speculate(self, seq_ids: list[int], outcomes: list[Outcome | None], backup: Backup,
                  features: list[torch.Tensor | None] | None = None) -> list[RequestSpeculation]:
        """Applies each request's last outcome and returns its next speculation: from the cache
        on a hit (its own branch, else one another request drafted after the same last
        share_window tokens and did not use), else from the backup (neural: the draft just in
        time; fast: n-gram); with prompt_lookup, from the text itself wherever its last
        prompt_lookup tokens occurred before (a hit is still reported as one)."""
        seqs = [self.seqs[sid] for sid in seq_ids]
        self._keep_features(seq_ids, features)
        hits, probs = [], [None] * len(seqs)
        causes = [None if o is None else self.cache.miss_cause(s.seq_id, o) for s, o in zip(seqs, outcomes)]
        for i, (seq, outcome) in enumerate(zip(seqs, outcomes)):
            branch = self.cache.take(seq.seq_id, outcome)
            if outcome is not None:
                accepted_len, bonus = outcome
                committed = len(seq.token_ids)
                seq.commit(accepted_len, bonus)
                self.drafter.rollback([seq.seq_id], [committed + accepted_len])
            if branch is not None:
                probs[i] = branch.probs
                seq.speculate(branch.tokens, seq.spec_features if branch.features is None else branch.features)
            hits.append(branch is not None)
        shared = [False] * len(seqs)
        for i, (seq, outcome) in enumerate(zip(seqs, outcomes)):
            if self.share_window and not hits[i] and outcome is not None:
                branch = self.cache.take_shared(tuple(seq.token_ids[-self.share_window:]))
                if branch is not None:
                    probs[i] = branch.probs
                    seq.speculate(branch.tokens, seq.spec_features)
                    hits[i] = shared[i] = True
        self.cache.end_round()
        looked = self.lookup.find(seqs) if self.lookup is not None else {}
        for i, guess in looked.items():
            seqs[i].speculate(guess)
            probs[i] = None
        missed = [i for i, hit in enumerate(hits) if not hit and i not in looked]
        if missed and backup == Backup.NEURAL:
            drafts = self.drafter.draft([seqs[i] for i in missed])
            self.drafted_tokens += drafts.tokens.numel()
            for j, i in enumerate(missed):
                seqs[i].speculate(drafts.tokens[j].tolist(), None if drafts.hidden is None else drafts.hidden[j])
                probs[i] = None if drafts.probs is None or seqs[i].params.greedy else drafts.probs[j].clone()
        elif missed:
            guesses = self.fast_backup.propose([seqs[i] for i in missed]).tokens.tolist()
            for i, guess in zip(missed, guesses):
                seqs[i].speculate(guess)
                probs[i] = None
        return [RequestSpeculation(seq.spec, probs[i], None if outcome is None else hits[i], i in looked, shared[i],
                                   causes[i]) for i, (seq, outcome) in enumerate(zip(seqs, outcomes))]

    def _sigma(self, position: int, probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Saguaro sampling for draft position `position` (0-based): a rejection there is the
        outcome accepted_len = position, whose bonus candidates are the top fan_out[position];
        then only the proposal_top most likely tokens are kept."""
        return keep_top(saguaro_sigma(probs, logits, self.fan_out[position], self.saguaro_c), self.proposal_top)

    def _warp_params(self, seqs: list[DraftSequence], repeat: int = 1) -> WarpParams:
        params = WarpParams.of([s.params for s in seqs], self.draft.device)
        return params.repeat(repeat) if repeat > 1 else params

    def _uniforms(self, seqs: list[DraftSequence], n: int) -> torch.Tensor:
        return uniforms([s.generator for s in seqs], n).to(self.draft.device, non_blocking=True)

    # --- filling the cache ----------------------------------------------------------------

    @torch.inference_mode()
    def fill(self, seq_ids: list[int]) -> float:
        """Pre-drafts a speculation for every predicted outcome of each request's pending
        verification. Returns the time it took."""
        start = time.perf_counter()
        seqs = [self.seqs[sid] for sid in seq_ids if sid in self.seqs]
        if not seqs or self.num_branches == 0:
            return time.perf_counter() - start
        position_hidden = self._glue(seqs)
        logits = self.draft.logits(position_hidden)
        if (constrain := constraint(seqs)) is not None:  # bonus candidates the target may commit
            logits = constrain(logits, [chain_contexts(s.spec) for s in seqs])
        branch_len, branch_token = self._candidates(seqs, logits)
        self._decode_tree(seqs, branch_len, branch_token, position_hidden)
        return time.perf_counter() - start

    def _glue(self, seqs: list[DraftSequence]) -> torch.Tensor:
        """One pass over [last committed, d_1..d_K] (plus anything not yet cached): KV entries
        for the shared prefix, and the draft's hidden states at those K+1 positions [B, K+1,
        hidden]. An EAGLE draft reads the target's features up to the last committed token and,
        with d_1..d_K, the features they were drafted from; after the fast backup there are
        none, and it goes over the speculation one token at a time, reading its own outputs."""
        k, drafter, cache = self.k, self.drafter, self.drafter.kv_cache
        starts = [min(drafter.cached_len[s.seq_id], len(s.token_ids) - 1) for s in seqs]
        ends = [len(s.token_ids) for s in seqs]
        rows = drafter.rows[[s.seq_id for s in seqs]]
        features = drafter.features_for(seqs, starts, ends)
        if features is not None and any(s.spec_features is None for s in seqs):
            chunks = [s.token_ids[st:] for s, st in zip(seqs, starts)]
            hidden = [last_hidden(forward_chunks(self.draft, cache, rows, chunks, starts, features), chunks)]
            for i in range(k):
                step = [[s.spec[i]] for s in seqs]
                hidden.append(forward_chunks(self.draft, cache, rows, step, [e + i for e in ends],
                                             list(hidden[-1][:, None]))[:, 0])
            hidden = torch.stack(hidden, 1)
        else:
            chunks = [s.token_ids[st:] + s.spec for s, st in zip(seqs, starts)]
            if features is not None:
                features = [torch.cat((f, s.spec_features)) for f, s in zip(features, seqs)]
            hidden = forward_chunks(self.draft, cache, rows, chunks, starts, features)
            last = torch.tensor([len(c) - k - 1 for c in chunks])[:, None] + torch.arange(k + 1)
            hidden = hidden[torch.arange(len(seqs))[:, None], last.to(hidden.device)]
        for seq in seqs:
            # An EAGLE draft's entries for d_1..d_K came from its own features: not kept.
            drafter.cached_len[seq.seq_id] = len(seq.token_ids) + (0 if drafter.reads_target_features else k)
        return hidden

    def _candidates(self, seqs: list[DraftSequence], logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Branches: accepted length j repeated fan_out[j] times, and for each request the top
        fan_out[j] tokens at position j+1, its own proposal there excluded. [B, branches]."""
        logits = logits.clone()
        spec = torch.tensor([s.spec for s in seqs]).to(logits.device, non_blocking=True)
        logits[:, : self.k].scatter_(-1, spec[..., None], float("-inf"))
        branch_len, tokens = [], []
        for j, f in enumerate(self.fan_out):
            if f > 0:
                branch_len += [j] * f
                tokens.append(logits[:, j].topk(f, dim=-1).indices)
        return branch_len, torch.cat(tokens, dim=1)

    def _decode_tree(self, seqs: list[DraftSequence], branch_len: list[int], first: torch.Tensor,
                     position_hidden: torch.Tensor) -> None:
        """Drafts K tokens after every branch's bonus candidate, one forward per depth over all
        branches. Branch slots follow each row's glue entries, depth-major. An EAGLE draft reads
        with each bonus candidate the glue's output before it, then its own outputs."""
        B, NB = first.shape
        k, device = self.k, self.draft.device
        committed = torch.tensor([len(s.token_ids) for s in seqs]).to(device, non_blocking=True)  # n
        accepted = torch.tensor(branch_len).to(device, non_blocking=True)  # [NB]
        base = committed + k  # first tree slot of each row
        prefix_end = committed[:, None] - 1 + accepted[None]  # last linear slot each branch sees
        params = self._warp_params(seqs, NB)
        u = self._uniforms(seqs, NB * k).view(B, NB, k)
        rows = self.drafter.rows[[s.seq_id for s in seqs]]
        base_max = max(len(s.token_ids) for s in seqs) + k  # int(base.max()), without waiting for the device
        branch = torch.arange(NB, device=device)
        tokens, drafted, probs = first, [], []
        extra = {"features": position_hidden[:, branch_len]} if self.drafter.reads_target_features else {}
        branch_features = []
        constrain = constraint(seqs)
        if constrain is not None:  # each branch's text after the committed one: accepted drafts, its bonus, its drafts
            firsts = first.tolist()
            contexts = [[s.spec[:j] + [t] for j, t in zip(branch_len, row)] for s, row in zip(seqs, firsts)]
        for depth in range(k):
            span = base_max + (depth + 1) * NB
            slot_ids = torch.arange(span, device=device)
            rel = slot_ids[None, None] - base[:, None, None]  # [B, 1, span]
            in_branch = (rel >= 0) & (rel % NB == branch[None, :, None]) & (rel // NB <= depth)
            mask = (slot_ids[None, None] <= prefix_end[..., None]) | in_branch
            positions = committed[:, None] + accepted[None] + depth
            slots = (base[:, None] + depth * NB + branch[None]).expand(B, NB)
            hidden = run_pass(self.draft, self.drafter.kv_cache, rows, tokens, positions, slots, mask,
                              extra.get("features"))
            if extra:
                extra["features"] = hidden
                branch_features.append(hidden)
            if constrain is None:
                logits = self.draft.head_logits(hidden).flatten(0, 1)
            else:
                logits = constrained_head_logits(self.draft, hidden, constrain, contexts).flatten(0, 1)
            if params.all_greedy:
                tokens = self.draft.head_token(logits.argmax(-1)).view(B, NB)
            else:
                q = self._sigma(depth, warp(logits, params), logits)
                tokens = self.draft.head_token(sample(q, u[:, :, depth].flatten())).view(B, NB)
                probs.append(q.view(B, NB, -1))
            drafted.append(tokens)
            if constrain is not None:
                contexts = [[c + [t] for c, t in zip(row, new)] for row, new in zip(contexts, tokens.tolist())]
        drafted_t = torch.stack(drafted, -1).tolist()  # [B, NB, K]
        self.drafted_tokens += B * NB * k
        probs_t = torch.stack(probs, 2) if probs else None  # [B, NB, K, head rows]
        features_t = torch.stack(branch_features, 2) if branch_features else None  # [B, NB, K, hidden]
        for b, (seq, bonus) in enumerate(zip(seqs, first.tolist())):
            keys = None
            if self.share_window:  # the text each branch follows: committed, the accepted drafts, the bonus
                text = seq.token_ids + seq.spec
                keys = [tuple((text[:len(seq.token_ids) + j] + [t])[-self.share_window:])
                        for j, t in zip(branch_len, bonus)]
            self.cache.store(seq.seq_id, list(zip(branch_len, bonus)), drafted_t[b],
                             None if probs_t is None or seq.params.greedy else probs_t[b],
                             None if features_t is None else features_t[b], keys)
