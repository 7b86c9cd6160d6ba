"""Log-probabilities in OpenAI's shapes: chat's `content` list of {token, logprob, bytes,
top_logprobs}, and completions' parallel lists (tokens, token_logprobs, top_logprobs,
text_offset). The engine gives token ids; their text is the tokenizer's, decoded here."""
from __future__ import annotations

from functools import lru_cache

from saguaro.engine.logprobs import TokenLogprobs

LOWEST_LOGPROB = -9999.0  # JSON has no -inf: a token the constraints rule out is reported as this, as vLLM does


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes (GPT-2's): printable Latin-1 bytes stand for
    themselves, the others for the characters from U+0100 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            spelled[chr(256 + extra)] = b
            extra += 1
    return spelled


class TokenText:
    """Each token's text (what the tokenizer decodes it to alone; part of a character decodes
    to U+FFFD) and its bytes (exact for a byte-level vocabulary, whose pieces spell bytes)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.alphabet = byte_level_alphabet() if any(piece.startswith("Ġ") for piece in vocab) else None
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens([token_id])[0]
        if self.alphabet is not None and piece is not None and all(c in self.alphabet for c in piece):
            return [self.alphabet[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))

    def chat_entry(self, entry: TokenLogprobs) -> dict:
        top = [{"token": self.text(t), "logprob": reported(lp), "bytes": self.bytes(t)}
               for t, lp in zip(entry.top_ids, entry.top_logprobs)]
        return {"token": self.text(entry.token_id), "logprob": reported(entry.logprob),
                "bytes": self.bytes(entry.token_id), "top_logprobs": top}

    def chat(self, entries: list[TokenLogprobs]) -> dict:
        return {"content": [self.chat_entry(e) for e in entries], "refusal": None}

    def completion(self, entries: list[TokenLogprobs | tuple[int, None]], offset: int = 0) -> dict:
        """entries: a position's logprobs, or (token id, None) for a position without them (the
        prompt's first token); offset: where the first token's text starts in the choice's text."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for entry in entries:
            token_id = entry[0] if isinstance(entry, tuple) else entry.token_id
            text = self.text(token_id)
            tokens.append(text)
            text_offset.append(offset)
            offset += len(text)
            if isinstance(entry, tuple):
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(reported(entry.logprob))
            top = {self.text(t): reported(lp) for t, lp in zip(entry.top_ids, entry.top_logprobs)}
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


def reported(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)
