"""Structured outputs: what a request's output must match, compiled by llguidance into a matcher
that gives each position's mask of legal tokens (docs/DESIGN.md, section 2.8).

The matcher follows a sequence's committed tokens; verification moves it along the drafted
tokens and back (`GrammarMatcher.masks`), so it always ends where the committed text is.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field

import llguidance
import numpy
import torch

# JSON as most models write it (json.dumps' separators), so that their likely tokens stay legal;
# no free whitespace between items, which would let a model pad without end
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class StructuredOutputs:
    """Exactly one constraint: a JSON schema (a dict or its text), any JSON object, a regex, one
    of a list of strings, or a grammar in llguidance's Lark dialect (which can embed a JSON
    schema with `%json { ... }`). strict=False lets a schema use keywords llguidance does not
    enforce (they are ignored); strict=True refuses such a schema."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    strict: bool = True

    def __post_init__(self):
        given = [name for name in ("json", "json_object", "regex", "choice", "grammar") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                             f"must be set, got {given or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list)
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a list of non-empty strings")
        error = llguidance.LLMatcher.validate_grammar(self.llguidance_grammar())
        if error:
            raise ValueError(f"structured_outputs.{given[0]}: {error}")

    def llguidance_grammar(self) -> str:
        """The constraint as llguidance's grammar text."""
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            options = dict(JSON_OPTIONS, lenient=not self.strict)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


@dataclass
class GrammarTokenizer:
    """A tokenizer as llguidance reads it: its tokenizer.json text and the EOS tokens a grammar
    may end with. Crosses to the SSD worker as the text; llguidance's tokenizer is built where
    it is first used (0.24 s for 49k tokens, 3.5 s for 262k) and never pickled."""
    text: str
    eos_token_ids: list[int]
    built: llguidance.LLTokenizer | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def key(self) -> str:
        """What names it to an SSD worker that was sent it once (its text is megabytes)."""
        return hashlib.sha256(json.dumps(self.eos_token_ids).encode() + self.text.encode()).hexdigest()

    def llguidance(self) -> llguidance.LLTokenizer:
        if self.built is None:
            self.built = llguidance.LLTokenizer(self.text, eos_token=list(self.eos_token_ids))
        return self.built

    def __getstate__(self) -> dict:
        return {"text": self.text, "eos_token_ids": self.eos_token_ids, "built": None}


_grammar_tokenizers: dict[int, tuple[object, GrammarTokenizer]] = {}


def grammar_tokenizer(tokenizer, eos_token_ids: list[int]) -> GrammarTokenizer:
    """The GrammarTokenizer of saguaro's FolderTokenizer or a transformers fast tokenizer, one
    per tokenizer object (the object is kept, so its id stays its own)."""
    key = id(tokenizer)
    if key not in _grammar_tokenizers:
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "backend", None)
        if backend is None:
            raise ValueError("structured_outputs need a tokenizer backed by the `tokenizers` library")
        _grammar_tokenizers[key] = (tokenizer, GrammarTokenizer(backend.to_str(), list(eos_token_ids)))
    return _grammar_tokenizers[key][1]


class GrammarMatcher:
    """One sequence's matcher: it has consumed exactly the sequence's committed output."""

    def __init__(self, spec: StructuredOutputs, tokenizer: GrammarTokenizer):
        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(tokenizer.llguidance(), spec.llguidance_grammar(), log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"structured_outputs: {self.matcher.get_error()}")
        self.vocab_size = tokenizer.llguidance().vocab_size

    def commit(self, token: int) -> bool:
        """Advances over a committed token; False when the grammar did not allow it."""
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (but EOS)."""
        return self.matcher.is_stopped()

    def mask_into(self, row: numpy.ndarray) -> None:
        """Writes the legal tokens as bools into row (tokens past llguidance's vocabulary: illegal)."""
        # one byte per token, 0 where it is illegal, read as bools in place: numpy, because a
        # torch comparison over the vocabulary costs more than llguidance's whole mask
        allowed = numpy.frombuffer(self.matcher.compute_logit_bias(), dtype=numpy.bool_)
        n = min(len(allowed), len(row))
        row[:n] = allowed[:n]

    def masks(self, contexts: list[list[int]], width: int) -> torch.Tensor:
        """[T, width] bool: the legal tokens after the committed text and contexts[j] (drafted
        tokens). A context holding a token the grammar forbids cannot be reached (verification
        rejects that token first): its row allows everything. The matcher ends where it began."""
        rows = numpy.zeros((len(contexts), width), dtype=numpy.bool_)
        consumed: list[int] = []
        for j, context in enumerate(contexts):
            shared = 0
            while shared < min(len(consumed), len(context)) and consumed[shared] == context[shared]:
                shared += 1
            if len(consumed) > shared:
                self.matcher.rollback(len(consumed) - shared)
                del consumed[shared:]
            rest = context[shared:]
            if rest and self.matcher.validate_tokens(rest) < len(rest):
                rows[j] = True
                continue
            if rest:
                self.matcher.consume_tokens(rest)
                consumed += rest
            self.mask_into(rows[j])
        if consumed:
            self.matcher.rollback(len(consumed))
        return torch.from_numpy(rows)

    def forced(self, limit: int, stop_ids: set[int], context: list[int] = ()) -> list[int]:
        """The tokens the grammar forces next after the committed text and context (drafted
        tokens), each the only legal token where it stands, so of probability 1 under the
        constrained target; up to limit and short of a stop token. Nothing after a context the
        grammar forbids (verification rejects it first). The matcher ends where it began."""
        context = list(context)
        if context and self.matcher.validate_tokens(context) < len(context):
            return []
        if context:
            self.matcher.consume_tokens(context)
        run: list[int] = []
        while len(run) < limit and not self.matcher.is_stopped():
            row = numpy.zeros(self.vocab_size, dtype=numpy.bool_)
            self.mask_into(row)
            allowed = row.nonzero()[0]
            if len(allowed) != 1 or int(allowed[0]) in stop_ids:
                break
            token = int(allowed[0])
            self.matcher.consume_token(token)
            run.append(token)
        if run or context:
            self.matcher.rollback(len(context) + len(run))
        return run
