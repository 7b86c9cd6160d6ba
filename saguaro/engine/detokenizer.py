"""A request's output text, decoded as its tokens are committed, cut at its first stop string.

One token may carry part of a UTF-8 character (byte-level BPE splits emoji and accented
letters), so decoding the tokens so far can end in "\ufffd" that a later token turns into a
real character. The text therefore only grows by whole characters, and what is streamed also
holds back any end of the text that may turn out to begin a stop string: streamed text is
never taken back.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def stop_prefix_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of text that is the beginning (not all) of a stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class Detokenizer:
    """Incremental text of one token stream.

    New tokens are decoded after a few already read, not alone: a tokenizer may render a token
    differently at the start of a text (SentencePiece drops the leading space), and the window
    makes the new text what decoding everything would have added."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.text = ""  # complete characters so far, cut before the first stop string
        self.stopped = False  # a stop string completed: no more text
        self.finished = False  # no more tokens
        self._ids: list[int] = []
        self._prefix = 0  # the decoding window starts here; its tokens before _read are only context
        self._read = 0  # tokens whose text is in self.text
        self._streamed = 0  # characters of self.text handed out by take_stream

    def add(self, token: int) -> bool:
        """Appends a token; returns whether a stop string completed in it."""
        if self.finished:
            raise RuntimeError("the stream has finished")
        self._ids.append(token)
        prefix_text, window_text = self._window_texts()
        if len(window_text) > len(prefix_text) and not window_text.endswith(REPLACEMENT_CHAR):
            self._append(window_text[len(prefix_text):])
            self._prefix, self._read = self._read, len(self._ids)
        if self.stopped:
            self.finished = True
        return self.stopped

    def finish(self) -> None:
        """No more tokens: a trailing partial character becomes final, as "\ufffd", just as
        decoding all tokens at once shows it."""
        if self.finished:
            return
        prefix_text, window_text = self._window_texts()
        if len(window_text) > len(prefix_text):
            self._append(window_text[len(prefix_text):])
        self._read = len(self._ids)
        self.finished = True

    def take_stream(self) -> str:
        """The text not handed out yet that can no longer change (all of it once finished)."""
        end = len(self.text) if self.finished else len(self.text) - stop_prefix_length(self.text, self.stop)
        new = self.text[self._streamed:end]
        self._streamed = max(self._streamed, end)
        return new

    def _window_texts(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        return (decode(self._ids[self._prefix:self._read], skip_special_tokens=True),
                decode(self._ids[self._prefix:], skip_special_tokens=True))

    def _append(self, new: str) -> None:
        """Adds text; cuts it before the first stop string, which can only end in `new`
        (an earlier one would have stopped the stream)."""
        before = len(self.text)
        self.text += new
        found = [at for s in self.stop if (at := self.text.find(s, max(before - len(s) + 1, 0))) >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True
