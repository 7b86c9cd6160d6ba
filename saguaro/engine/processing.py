"""The processed logits a position samples from: a request's logit bias, penalties, min_tokens
and grammar applied to a model's raw logits, given the tokens before that position.

Inside a speculation round the tokens before position j are the committed ones and the drafted
tokens before j (a chain's first j drafts, a tree node's ancestors). Verification (target) and
drafting (draft model, SSD worker) both call `process_rows`, so the target's
distribution that verification compares against and the draft's proposal are processed alike.
`warp` then applies temperature, top-k, top-p and min-p. Order, as vLLM's: logit bias, then
the repetition penalty (HF: a seen token's positive logit divided by it, a negative one
multiplied), then frequency and presence penalties (OpenAI: minus frequency times the token's
count in the output, minus presence if it occurs at all), min_tokens (stop tokens masked),
the grammar's mask.
"""
from __future__ import annotations

import numpy
import torch

from saguaro.engine.sampler import SamplingParams
from saguaro.engine.structured import GrammarMatcher
from saguaro.models.native import bindings as native


class LogitsProcessor:
    """One sequence's processing. Holds no copy of the text: the caller passes the prompt and
    output at each call (the engine's Sequence, the worker's DraftSequence)."""

    def __init__(self, params: SamplingParams, stop_ids: set[int], grammar: GrammarMatcher | None = None):
        self.params = params
        self.stop_ids = sorted(stop_ids)
        self.grammar = grammar
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None
        if params.logit_bias:
            ids = list(params.logit_bias)
            self._bias = torch.tensor(ids), torch.tensor([params.logit_bias[i] for i in ids], dtype=torch.float32)

    @classmethod
    def of(cls, params: SamplingParams, stop_ids: set[int], grammar: GrammarMatcher | None = None
           ) -> LogitsProcessor | None:
        """None when the request asks for no processing: its rounds then run as before."""
        if grammar is None and not params.processes_logits:
            return None
        return cls(params, stop_ids, grammar)

    def process(self, logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                contexts: list[list[int]]) -> torch.Tensor:
        """logits [T, V] at T positions; contexts[j]: the drafted tokens before position j (after
        the output). Returns new fp32 logits [T, V]; the caller's stay as they were."""
        out = logits.float().clone()
        self.process_(out, prompt_ids, output_ids, contexts)
        return out

    def process_(self, logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                 contexts: list[list[int]], masked: bool = False) -> None:
        """`process` in place on contiguous fp32 logits [T, V]. Each step indexes only what it
        changes (the biased tokens, the tokens seen, the stop tokens, the grammar's minority of
        legal or illegal tokens): nothing vocabulary-wide is built per call. masked: the
        grammar's masks are in the logits already (`head_masks`); the steps before it keep -inf
        where it is, so applying it first changes nothing."""
        p = self.params
        short = [j for j, context in enumerate(contexts) if len(output_ids) + len(context) < p.min_tokens]
        # min_tokens against a grammar that allows only a stop token: the grammar wins (over the raw logits)
        raw = logits.clone() if short and self.grammar is not None else None
        if self._bias is not None:
            ids, values = self._bias
            keep = ids < logits.shape[1]
            logits[:, ids[keep].to(logits.device)] += values[keep].to(logits.device)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            self._penalize(logits, prompt_ids, output_ids, contexts)
        if short and self.stop_ids:
            stop = torch.tensor([t for t in self.stop_ids if t < logits.shape[1]], device=logits.device)
            logits[torch.tensor(short, device=logits.device)[:, None], stop[None]] = float("-inf")
        if self.grammar is not None:
            masks = None if masked else self.grammar.masks(contexts)
            if masks is not None:
                masks.apply_(logits)
            if raw is not None:
                dead = ~torch.isfinite(logits).any(-1)
                if dead.any():
                    if masks is not None:
                        masks.apply_(raw)
                    logits[dead] = raw[dead]

    def _penalize(self, logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int],
                  contexts: list[list[int]]) -> None:
        """Repetition, frequency and presence penalties at each position, on the columns of the
        tokens seen only (the output's, the drafts', and the prompt's for repetition): a count
        matrix [T, tokens seen] instead of one over the vocabulary."""
        p = self.params
        device = logits.device
        drafted = [t for context in contexts for t in context]
        prompt = prompt_ids if p.repetition_penalty != 1.0 else []
        columns = torch.tensor(output_ids + drafted + prompt, dtype=torch.long).unique()  # sorted
        if not len(columns):
            return
        counts = torch.zeros(len(contexts), len(columns))
        if output_ids:
            output_columns = torch.searchsorted(columns, torch.tensor(output_ids))
            counts += torch.bincount(output_columns, minlength=len(columns)).float()
        if drafted:
            rows = torch.tensor([j for j, context in enumerate(contexts) for _ in context])
            counts.index_put_((rows, torch.searchsorted(columns, torch.tensor(drafted))), torch.ones(len(drafted)),
                              accumulate=True)
        counts, columns = counts.to(device), columns.to(device)
        values = logits[:, columns]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[:, torch.searchsorted(columns, torch.tensor(prompt, dtype=torch.long, device=device))] = True
            r = p.repetition_penalty
            values = torch.where(seen, torch.where(values > 0, values / r, values * r), values)
        logits[:, columns] = values - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float())

    @property
    def only_grammar(self) -> bool:
        """Whether its only processing is a grammar's masks."""
        return self.grammar is not None and not self.params.adjusts_logits

    def commit(self, token: int) -> bool:
        """Advances the grammar over a committed token; False when it was not legal there."""
        return self.grammar is None or self.grammar.commit(token)

    @property
    def grammar_finished(self) -> bool:
        return self.grammar is not None and self.grammar.finished

    def forced(self, limit: int, context: list[int] = ()) -> list[int]:
        """The tokens the grammar forces next after the committed text and context (drafted
        tokens; see GrammarMatcher.forced); none without a grammar."""
        return [] if self.grammar is None else self.grammar.forced(limit, set(self.stop_ids), context)


def chain_contexts(drafts: list[int]) -> list[list[int]]:
    """The drafted tokens before each of a chain's K + 1 positions."""
    return [drafts[:j] for j in range(len(drafts) + 1)]


def tree_contexts(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """The drafted tokens before the root's position and each node's next position: the path
    down to and including that node."""
    paths: list[list[int]] = []
    for j, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [tokens[j]])
    return [[]] + paths


def process_rows(logits: torch.Tensor, processors: list[LogitsProcessor | None], prompts: list[list[int]],
                 outputs: list[list[int]], contexts: list[list[list[int]]], masked: bool = False) -> torch.Tensor:
    """Each row's processing over a batch: logits [B, T, V] (row i's first len(contexts[i])
    positions are its own), processed in place where they are fp32 (a caller that still needs
    the raw logits passes a copy). Rows without a processor are left as they are, and a batch
    without any costs nothing. masked: the grammars' masks are in the logits (`head_masks`)."""
    if all(p is None for p in processors):
        return logits
    out = logits.float()
    for i, processor in enumerate(processors):
        if processor is not None:
            processor.process_(out[i, :len(contexts[i])], prompts[i], outputs[i], contexts[i], masked)
    return out


def head_masks(processors: list[LogitsProcessor | None], contexts: list[list[list[int]]], positions: int,
               vocab_size: int, head_ids: numpy.ndarray | None = None) -> numpy.ndarray | None:
    """The grammars' masks of a batch's positions as a model's head takes them
    (LlamaModel.head_logits, legal): [B * positions, words] int32, row i * positions + j the
    mask after sequence i's text and contexts[i][j], every token legal where a sequence has no
    grammar, at a position no context reaches, or one verification cannot reach (after a
    token the grammar forbids). head_ids: a reduced head's token of each row (bit k of a mask
    is then head row k's). None when no sequence has a grammar."""
    grammars = [p.grammar if p is not None else None for p in processors]
    if all(g is None for g in grammars):
        return None
    rows = vocab_size if head_ids is None else len(head_ids)
    words = (rows + 31) // 32
    # each row written once: a call runs between model passes, when every numpy call costs
    # several times its warm time
    legal = numpy.empty((len(processors), positions, words), dtype=numpy.int32)
    for i, grammar in enumerate(grammars):
        n = 0 if grammar is None else len(contexts[i])
        if n < positions:
            legal[i, n:] = -1
        if grammar is None:
            continue
        masks = grammar.masks(contexts[i])
        if head_ids is not None:  # each head row's bit, from its token's (only saguaro's kernels take masks)
            native.head_bits(masks.bits, head_ids, legal[i, :n])
        elif words <= grammar.words:
            legal[i, :n] = masks.bits[:, :words]
        else:
            legal[i, :n, :grammar.words] = masks.bits
            legal[i, :n, grammar.words:] = 0  # past the grammar's vocabulary: illegal
        if masks.unreachable:
            legal[i, masks.unreachable] = -1
    return legal.reshape(-1, words)
