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

from saguaro.models.native import bindings as native

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


def set_bits(words: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """(rows, bit numbers) of the set bits of words [n, W] (int32, bit b of word w is bit 32w + b)."""
    nonzero = numpy.flatnonzero(words)
    rows, columns = numpy.divmod(nonzero, words.shape[1])
    # bools, not uint8: numpy finds nonzero bools several times faster
    bits = numpy.unpackbits(words.reshape(-1)[nonzero].view(numpy.uint8), bitorder="little").view(numpy.bool_)
    which = numpy.flatnonzero(bits)
    word = which >> 5
    return rows[word], columns[word] * 32 + (which & 31)


@dataclass
class TokenMasks:
    """The legal tokens at T positions, as llguidance writes them: bit t of row j set where
    token t is legal at position j (tokens past the tokenizer's vocabulary: illegal). A view of
    the matcher's buffer, valid until its next call."""
    bits: numpy.ndarray  # [T, words] int32
    unreachable: list[int]  # positions after a token the grammar forbids: nothing masked there

    def apply_(self, logits: torch.Tensor) -> None:
        """-inf at each position's illegal tokens, in place (logits [T, width]): by saguaro's
        kernel (token_mask.c: about 10 us a position over 49k tokens, 7-18x the indexing below)
        on contiguous fp32 CPU logits where it runs, else by indexing."""
        if native.available() and logits.device.type == "cpu" and logits.dtype == torch.float32 \
                and logits.is_contiguous():
            skip = numpy.zeros(len(logits), dtype=numpy.bool_)
            skip[self.unreachable] = True
            native.mask_logits(logits, self.bits, skip)
        else:
            self.index_(logits)

    def index_(self, logits: torch.Tensor) -> None:
        """apply_ by torch's indexing, the minority only: where few tokens are legal (keys,
        punctuation, enums) the row is filled with -inf and its legal logits put back; where most
        are (inside a string) the illegal ones are set. Either way no [T, width] mask is built:
        a masked fill over the vocabulary costs several times a fill."""
        T, width = logits.shape
        flat = logits.view(-1)  # the positions' logits are contiguous: one flat index each
        words = self.bits.shape[1]
        reachable = numpy.ones(T, dtype=numpy.bool_)
        reachable[self.unreachable] = False
        few = reachable & (numpy.count_nonzero(self.bits, axis=-1) * 2 <= words)
        many = numpy.flatnonzero(reachable & ~few)
        few = numpy.flatnonzero(few)
        device = logits.device
        if len(few):
            rows, ids = set_bits(self.bits[few])
            keep = ids < width
            at = torch.from_numpy(few[rows[keep]] * width + ids[keep]).to(device)
            legal = flat.index_select(0, at)
            logits.index_fill_(0, torch.from_numpy(few).to(device), float("-inf"))
            flat.index_copy_(0, at, legal)
        if len(many):
            rows, ids = set_bits(~self.bits[many])
            keep = ids < width
            flat.index_fill_(0, torch.from_numpy(many[rows[keep]] * width + ids[keep]).to(device), float("-inf"))
            if width > 32 * words:
                logits[torch.from_numpy(many).to(device), 32 * words:] = float("-inf")

    def illegal(self, width: int) -> torch.Tensor:
        """[T, width] bool, True at the illegal tokens (none at an unreachable position)."""
        illegal = torch.zeros(len(self.bits), width)
        self.apply_(illegal)
        return illegal.isinf()


class GrammarMatcher:
    """One sequence's matcher: it has consumed exactly the sequence's committed output.

    llguidance writes each mask as a bitmask (a bit a token, 32 to an int32 word) into a buffer
    the matcher keeps and reuses: no per-token Python, nothing vocabulary-wide allocated."""

    def __init__(self, spec: StructuredOutputs, tokenizer: GrammarTokenizer):
        self.tokenizer = tokenizer
        self.matcher = llguidance.LLMatcher(tokenizer.llguidance(), spec.llguidance_grammar(), log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"structured_outputs: {self.matcher.get_error()}")
        self.vocab_size = tokenizer.llguidance().vocab_size
        self.words = (self.vocab_size + 31) // 32  # llguidance wants a buffer of exactly this many
        self._bitmask = numpy.zeros((1, self.words), dtype=numpy.int32)
        # the masks computed since the last commit, by the drafted tokens they follow (None: that
        # context is illegal): a round asks for the same ones several times (the forced-token
        # search, the local draft, verification), and a commit of a drafted token keeps the
        # masks after it
        self._known: dict[tuple[int, ...], numpy.ndarray | None] = {}

    def commit(self, token: int) -> bool:
        """Advances over a committed token; False when the grammar did not allow it."""
        self._known = {key[1:]: row for key, row in self._known.items() if key and key[0] == token}
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (but EOS)."""
        return self.matcher.is_stopped()

    def _fill(self, row: numpy.ndarray) -> None:
        """The legal tokens where the matcher stands, as bits, into row (contiguous int32 words)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, self.words * 4)

    def masks(self, contexts: list[list[int]]) -> TokenMasks:
        """The legal tokens after the committed text and contexts[j] (drafted tokens). A context
        holding a token the grammar forbids cannot be reached (verification rejects that token
        first): nothing is masked there. The matcher ends where it began."""
        if len(self._bitmask) < len(contexts):
            self._bitmask = numpy.zeros((len(contexts), self.words), dtype=numpy.int32)
        bitmask = self._bitmask[:len(contexts)]
        unreachable: list[int] = []
        consumed: list[int] = []
        for j, context in enumerate(contexts):
            key = tuple(context)
            if key not in self._known:
                self._known[key] = self._mask_after(consumed, context, bitmask[j])
            elif self._known[key] is not None:
                bitmask[j] = self._known[key]
            if self._known[key] is None:
                unreachable.append(j)
        if consumed:
            self.matcher.rollback(len(consumed))
        for key, row in self._known.items():  # rows of the buffer are overwritten by the next call
            if row is not None and row.base is self._bitmask:
                self._known[key] = row.copy()
        return TokenMasks(bitmask, unreachable)

    def _mask_after(self, consumed: list[int], context: list[int], row: numpy.ndarray) -> numpy.ndarray | None:
        """Fills row with the mask after context, moving the matcher there from where consumed
        (the tokens it has consumed past the committed text, updated) left it; row, or None
        where the grammar forbids a token of context."""
        shared = 0
        while shared < min(len(consumed), len(context)) and consumed[shared] == context[shared]:
            shared += 1
        if len(consumed) > shared:
            self.matcher.rollback(len(consumed) - shared)
            del consumed[shared:]
        rest = list(context[shared:])
        if rest and self.matcher.validate_tokens(rest) < len(rest):
            return None
        if rest:
            self.matcher.consume_tokens(rest)
            consumed += rest
        self._fill(row)
        return row

    def _mask_here(self, key: tuple[int, ...]) -> numpy.ndarray:
        """The mask where the matcher stands, after the committed text and key (drafted tokens)."""
        if self._known.get(key) is None:
            row = numpy.empty(self.words, dtype=numpy.int32)
            self._fill(row)
            self._known[key] = row
        return self._known[key]

    def only_legal_token(self) -> int | None:
        """The token legal after the committed text when it is the only one, else None."""
        return single_token(self._mask_here(()))

    def forced(self, limit: int, stop_ids: set[int], context: list[int] = ()) -> list[int]:
        """The tokens the grammar forces next after the committed text and context (drafted
        tokens), each the only legal token where it stands, so of probability 1 under the
        constrained target; up to limit and short of a stop token. Nothing after a context the
        grammar forbids (verification rejects it first). The matcher ends where it began."""
        context = list(context)
        if limit <= 0:
            return []
        if context and self.matcher.validate_tokens(context) < len(context):
            return []
        if context:
            self.matcher.consume_tokens(context)
        run: list[int] = []
        while len(run) < limit and not self.matcher.is_stopped():
            token = single_token(self._mask_here(tuple(context + run)))
            if token is None or token in stop_ids:
                break
            self.matcher.consume_token(token)
            run.append(token)
        if run or context:
            self.matcher.rollback(len(context) + len(run))
        return run


def single_token(mask: numpy.ndarray) -> int | None:
    """The one legal token of a mask (int32 words) where only one is, else None."""
    if numpy.count_nonzero(mask) != 1:  # a tenth of flatnonzero's time, and most masks allow many
        return None
    words = numpy.flatnonzero(mask)
    word = int(mask[words[0]]) & 0xFFFFFFFF
    return None if word & (word - 1) else int(words[0]) * 32 + word.bit_length() - 1
