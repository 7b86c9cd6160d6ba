"""The processed logits a position samples from: a request's logit bias, penalties, min_tokens
and grammar applied to a model's raw logits, given the tokens before that position.

Inside a speculation round the tokens before position j are the committed ones and the drafted
tokens before j (a chain's first j drafts, a tree node's ancestors). Verification (target) and
drafting (draft model, SSD worker) both call `LogitsProcessor.process`, so the target's
distribution that verification compares against and the draft's proposal are processed alike.
`warp` then applies temperature, top-k, top-p and min-p. Order, as vLLM's: logit bias, then
the repetition penalty (HF: a seen token's positive logit divided by it, a negative one
multiplied), then frequency and presence penalties (OpenAI: minus frequency times the token's
count in the output, minus presence if it occurs at all), min_tokens (stop tokens masked),
the grammar's mask.
"""
from __future__ import annotations

import torch

from saguaro.engine.sampler import SamplingParams
from saguaro.engine.structured import GrammarMatcher


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
        the output). Returns new fp32 logits [T, V]."""
        p = self.params
        T, V = logits.shape
        device = logits.device
        out = logits.float()  # every step below makes a new tensor: the caller's stays as it was
        if self._bias is not None:
            ids, values = self._bias
            keep = ids < V
            bias = torch.zeros(V).index_put_((ids[keep],), values[keep])
            out = out + bias.to(device)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
            counts = torch.zeros(T, V)
            if output_ids:
                counts += torch.bincount(torch.tensor(output_ids), minlength=V)[:V].float()
            drafted = [(j, t) for j, context in enumerate(contexts) for t in context]
            if drafted:
                rows, tokens = torch.tensor(drafted).T
                counts.index_put_((rows, tokens), torch.ones(len(drafted)), accumulate=True)
            counts = counts.to(device)
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                seen[:, torch.tensor(prompt_ids, device=device)] = True
                r = p.repetition_penalty
                out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
            out = out - (p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float())
        short = [j for j, context in enumerate(contexts) if len(output_ids) + len(context) < p.min_tokens]
        if short and self.stop_ids:
            stop = torch.tensor([t for t in self.stop_ids if t < V], device=device)
            out = out.index_put((torch.tensor(short, device=device)[:, None], stop[None]), torch.tensor(float("-inf")))
        if self.grammar is not None:
            allowed = self.grammar.masks(contexts, V).to(device)
            masked = out.masked_fill(~allowed, float("-inf"))
            if short:  # min_tokens against a grammar that allows only a stop token: the grammar wins
                dead = ~torch.isfinite(masked).any(-1, keepdim=True)
                masked = torch.where(dead, logits.float().masked_fill(~allowed, float("-inf")), masked)
            out = masked
        return out

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
                 outputs: list[list[int]], contexts: list[list[list[int]]]) -> torch.Tensor:
    """Each row's processing over a batch: logits [B, T, V] (row i's first len(contexts[i])
    positions are its own); rows without a processor are left as they are (no copy when none has one)."""
    if all(p is None for p in processors):
        return logits
    rows = []
    for i, processor in enumerate(processors):
        n = len(contexts[i])
        own = processor.process(logits[i, :n], prompts[i], outputs[i], contexts[i]) if processor is not None else None
        rows.append(logits[i].float() if own is None else torch.cat((own, logits[i, n:].float())))
    return torch.stack(rows)
