"""The target's side of a round: its passes over the sequences' KV cache rows, and the commit
of what they decide (one token in an AR round; accepted drafts and a bonus after a proposal)."""
from __future__ import annotations

import torch

from saguaro.engine.logprobs import token_logprobs
from saguaro.engine.processing import chain_contexts, head_masks, process_rows, tree_contexts
from saguaro.engine.proposal import Outcome, Proposal
from saguaro.engine.runner import forward_chunks, last_hidden, prefill_chunks
from saguaro.engine.sampler import WarpParams, sample, uniforms, warp
from saguaro.engine.sequence import Sequence
from saguaro.engine.tree import walk, walk_greedy
from saguaro.engine.rejection import point_masses, verify, verify_argmax, verify_greedy
from saguaro.models.kv_cache import CacheRows, KVCache, ensure_cache
from saguaro.models.llama import LlamaModel
from saguaro.models.prefix_cache import PrefixCache


def wants_raw_logprobs(seqs: list[Sequence]) -> bool:
    """Whether a sequence with processing wants the log-probabilities of its raw logits."""
    return any(s.processor is not None and s.params.logprobs is not None and s.params.logprobs_mode == "raw"
               for s in seqs)


def processed(logits: torch.Tensor, seqs: list[Sequence], contexts: list[list[list[int]]],
              masked: bool = False) -> torch.Tensor:
    """The sequences' processed logits (saguaro.engine.processing) at positions after their
    committed text and contexts[i][j]: logits [B, T, V], processed in place unless a sequence
    with processing wants its raw log-probabilities (then a copy is); the same tensor when
    none processes. masked: the grammars' masks are in the logits already."""
    if wants_raw_logprobs(seqs):
        logits = logits.clone()
    return process_rows(logits, [s.processor for s in seqs], [s.prompt_ids for s in seqs],
                        [s.output_ids for s in seqs], contexts, masked)


def scored(target: LlamaModel, hidden: torch.Tensor, seqs: list[Sequence],
           contexts: list[list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits at hidden [B, T, hidden] and them processed after the contexts
    (`processed`): (raw, final). Where the head takes masks (LlamaModel.masks_in_head) and no
    request wants its raw log-probabilities, the grammars' masks go into the head's product,
    which writes -inf at the illegal tokens while the logits are in the cache, and skips tokens
    no row may take; the processing then leaves the grammar out, and raw holds the masks too."""
    legal = None
    if target.masks_in_head and not wants_raw_logprobs(seqs):
        legal = head_masks([s.processor for s in seqs], contexts, hidden.shape[1], target.config.vocab_size,
                           target.head_ids)
    raw = target.logits(hidden, legal)
    return raw, processed(raw, seqs, contexts, masked=legal is not None)


def commit_with_logprobs(seq: Sequence, tokens: list[int], raw: torch.Tensor, final: torch.Tensor) -> None:
    """Commits tokens, chosen at the positions whose logits are raw / final [len(tokens), V]
    (before / after processing), with their log-probabilities where the request asks for them."""
    params = seq.params
    entries = None
    if params.logprobs is not None:
        logits = raw if params.logprobs_mode == "raw" else final
        temperature = params.temperature if params.logprobs_mode == "processed" and not params.greedy else 1.0
        entries = token_logprobs(logits, tokens, params.logprobs, temperature)
    seq.commit(tokens, entries)


def sample_next(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Each sequence's next token from its (processed) logits [B, V], with its own parameters and stream."""
    if all(s.params.greedy for s in seqs):  # the argmax the one-hot distribution would sample, without building it
        return logits.argmax(-1).tolist()
    params = WarpParams.of([s.params for s in seqs], logits.device)
    probs = warp(logits, params)
    u = uniforms([s.generator for s in seqs], 1)[:, 0].to(logits.device, non_blocking=True)
    return sample(probs, u).tolist()


class Verifier:
    """The target, its KV cache (one row per running sequence) and the prefix cache: runs the
    target's passes and commits what they decide. Each call also returns the target's final
    hidden states at the tokens it ran, what a draft that reads them (EAGLE) is given: per
    sequence after a prefill, as one [B, T, hidden] tensor after a round (a sequence's first
    accepted_len + 1 rows are its own)."""

    def __init__(self, target: LlamaModel, prefix_cache: PrefixCache | None = None):
        self.target = target
        self.prefix_cache = prefix_cache
        self.cache: KVCache | None = None
        self.rows = CacheRows()

    def reserve(self, num_rows: int, num_slots: int) -> None:
        self.cache = ensure_cache(self.cache, self.target, num_rows, num_slots)

    def release(self, seqs: list[Sequence]) -> None:
        """Frees the sequences' rows; the prefix cache first keeps their text's blocks (its KV
        entries are all there but the last token's), which the next turn of a chat starts with."""
        if self.prefix_cache is not None:
            for seq in seqs:
                if seq.seq_id in self.rows.of:
                    self.prefix_cache.store(self.cache, self.rows.of[seq.seq_id], seq.token_ids[:-1])
        self.rows.free([s.seq_id for s in seqs])

    def metrics(self) -> dict:
        return self.prefix_cache.summary() if self.prefix_cache is not None else {}

    def prefill(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """Runs the prompts (what the prefix cache lacks of them) and commits each first token.
        Prompts whose log-probabilities are wanted run whole (their cached KV entries come
        without the logits)."""
        self.rows.assign([s.seq_id for s in seqs], self.cache.num_rows)
        rows = self._rows(seqs)
        whole = [i for i, s in enumerate(seqs) if s.params.prompt_logprobs is not None]
        hidden: list[torch.Tensor | None] = [None] * len(seqs)
        starts = [0] * len(seqs)
        for group, prefix_cache in (([i for i in range(len(seqs)) if i not in whole], self.prefix_cache),
                                    (whole, None)):
            if not group:
                continue
            chunks = [seqs[i].prompt_ids for i in group]
            ran, group_starts = prefill_chunks(self.target, self.cache, [rows[i] for i in group], chunks, prefix_cache)
            for j, i in enumerate(group):
                starts[i] = group_starts[j]
                hidden[i] = ran[j, :len(chunks[j]) - group_starts[j]]
        prompt_logprobs = {i: [None] + token_logprobs(self.target.logits(hidden[i][:-1]), seqs[i].prompt_ids[1:],
                                                      seqs[i].params.prompt_logprobs) for i in whole}
        raw, final = scored(self.target, torch.stack([h[-1] for h in hidden])[:, None], seqs, [[[]] for _ in seqs])
        first = sample_next(final[:, 0], seqs)
        for i, (seq, token, start) in enumerate(zip(seqs, first, starts)):
            seq.prefilled(start, prompt_logprobs.get(i))
            commit_with_logprobs(seq, [token], raw[i], final[i])
        return hidden

    def decode(self, seqs: list[Sequence], runs: list[list[int]] | None = None
               ) -> tuple[list[Outcome], torch.Tensor]:
        """An AR round: one target pass over each sequence's last token, one token committed.
        runs (jump-forward): row i also runs the tokens its grammar forces next, which commit
        before the sampled token. Each is its position's only legal token, probability 1 under
        the constrained target, so only the position after the run needs logits: a forced
        token costs the model's layers, not the vocabulary projection (a fifth of the 135M
        model's work) and its processing. A request that wants log-probabilities has no run."""
        runs = runs or [[] for _ in seqs]
        chunks = [[s.token_ids[-1]] + run for s, run in zip(seqs, runs)]
        hidden = forward_chunks(self.target, self.cache, self._rows(seqs), chunks, [len(s) - 1 for s in seqs])
        raw, final = scored(self.target, last_hidden(hidden, chunks)[:, None], seqs, [[run] for run in runs])
        tokens = sample_next(final[:, 0], seqs)
        for i, (seq, run, token) in enumerate(zip(seqs, runs, tokens)):
            commit_with_logprobs(seq, run + [token], raw[i], final[i])
        return [Outcome(len(run), token) for run, token in zip(runs, tokens)], hidden

    @property
    def device_side(self) -> bool:
        """Whether a round stays on the target's device until its one transfer to the host (the
        drafts, accepted lengths and bonus tokens together): where its passes are captured
        (saguaro.models.graphs). On the CPU the greedy comparison runs on lists instead, where
        each small torch operation after a pass would run cold."""
        return self.target.step_graphs is not None

    def verify(self, seqs: list[Sequence], proposal: Proposal) -> tuple[list[Outcome], torch.Tensor]:
        """One target pass over [last token, drafts]; commits accepted drafts + bonus. Draft
        distributions None mean the drafts are point masses (greedy drafts, cheap backup tokens)."""
        if proposal.parents is not None:
            return self.verify_tree(seqs, proposal.tokens, proposal.parents)
        draft_tokens, draft_probs = proposal.tokens, proposal.probs
        B, K = draft_tokens.shape
        device = self.target.device
        draft_tokens = draft_tokens.to(device, non_blocking=True)
        starts = [len(s) - 1 for s in seqs]
        if self.device_side:
            last = torch.tensor([s.token_ids[-1] for s in seqs]).to(device, non_blocking=True)
            hidden = forward_chunks(self.target, self.cache, self._rows(seqs),
                                    torch.cat((last[:, None], draft_tokens), 1), starts)
        else:
            drafts = draft_tokens.tolist()
            hidden = forward_chunks(self.target, self.cache, self._rows(seqs),
                                    [[s.token_ids[-1]] + d for s, d in zip(seqs, drafts)], starts)
        if any(s.processor is not None for s in seqs):
            if self.device_side:
                drafts = draft_tokens.tolist()
            raw, logits = scored(self.target, hidden, seqs, [chain_contexts(d) for d in drafts])
        else:
            raw = logits = self.target.logits(hidden)
        if all(s.params.greedy for s in seqs) and not self.device_side:
            outcomes = verify_greedy(drafts, logits.argmax(-1).tolist())
        else:
            if all(s.params.greedy for s in seqs):
                accepted_len, bonus = verify_argmax(draft_tokens, logits.argmax(-1))
            else:
                params = WarpParams.of([s.params for s in seqs], device).repeat(K + 1)
                if draft_probs is None:
                    draft_probs = point_masses(draft_tokens, self.target.config.vocab_size)
                target_probs = warp(logits.flatten(0, 1), params).view(B, K + 1, -1)
                u = uniforms([s.generator for s in seqs], K + 1).to(device, non_blocking=True)
                accepted_len, bonus = verify(draft_tokens, draft_probs.to(device, non_blocking=True), target_probs,
                                             u[:, :K], u[:, K])
            # the round's one wait for the device: everything the host needs, in one transfer
            host = torch.cat((draft_tokens, accepted_len[:, None], bonus[:, None]), 1).tolist()
            drafts = [row[:K] for row in host]
            outcomes = [Outcome(row[K], row[K + 1]) for row in host]
        for i, (seq, drafted, outcome) in enumerate(zip(seqs, drafts, outcomes)):
            n = outcome.accepted_len + 1
            commit_with_logprobs(seq, drafted[:outcome.accepted_len] + [outcome.bonus_token], raw[i, :n], logits[i, :n])
        return outcomes, hidden

    def verify_tree(self, seqs: list[Sequence], draft_tokens: torch.Tensor,
                    parents: list[list[int]]) -> tuple[list[Outcome], torch.Tensor]:
        """One target pass over [last token, tree nodes] (saguaro.engine.tree); commits the
        accepted path and the bonus. The path's KV entries are moved to the slots after the
        committed text; the other nodes' entries are left to be overwritten. The returned hidden
        states hold each row's root and path first, as a chain's would."""
        device = self.target.device
        nodes = [row[:len(p)] for row, p in zip(draft_tokens.tolist(), parents)]
        chunks = [[s.token_ids[-1]] + n for s, n in zip(seqs, nodes)]
        starts = [len(s) - 1 for s in seqs]
        rows = self._rows(seqs)
        hidden = forward_chunks(self.target, self.cache, rows, chunks, starts,
                                parents=[[-1] + [p + 1 for p in row] for row in parents])
        raw, logits = scored(self.target, hidden, seqs, [tree_contexts(n, p) for n, p in zip(nodes, parents)])
        if all(s.params.greedy for s in seqs):
            argmax = logits.argmax(-1).tolist()
            walks = [walk_greedy(n, p, a) for n, p, a in zip(nodes, parents, argmax)]
        else:
            B, T = hidden.shape[:2]
            params = WarpParams.of([s.params for s in seqs], device).repeat(T)
            target_probs = warp(logits.flatten(0, 1), params).view(B, T, -1)
            # each row draws for its own nodes, not the batch's widest tree: what a seeded request
            # consumes must not depend on the others (a lookup's chain of K beside trees of 2K)
            walks = [walk(n, p, target_probs[i, :len(n) + 1], uniforms([s.generator], len(n) + 1)[0])
                     for i, (s, n, p) in enumerate(zip(seqs, nodes, parents))]
        outcomes = []
        for i, (seq, (path, bonus)) in enumerate(zip(seqs, walks)):
            start = starts[i]
            self.cache.move(rows[i], [start + 1 + j for j in path], list(range(start + 1, start + 1 + len(path))))
            ran = [0] + [1 + j for j in path]
            commit_with_logprobs(seq, [nodes[i][j] for j in path] + [bonus], raw[i, ran], logits[i, ran])
            outcomes.append(Outcome(len(path), bonus))
            hidden[i, :len(ran)] = hidden[i, ran]
        return outcomes, hidden

    def _rows(self, seqs: list[Sequence]) -> list[int]:
        return self.rows[[s.seq_id for s in seqs]]
