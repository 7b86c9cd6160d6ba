"""Prompt lookup: speculations copied from the text so far instead of drafted by a model.

Code and chat answers repeat their prompts and themselves (names, signatures, lines), so the
tokens that followed an earlier occurrence of the last few tokens are often what comes next.
Proposed as point masses (a deterministic function of the committed text), they keep
verification exact at any temperature, and they cost no draft pass.
"""
from __future__ import annotations


def lookup(tokens: list[int], k: int, min_match: int) -> list[int] | None:
    """The K tokens after the latest earlier occurrence of the last `min_match` tokens (the
    last one repeated if fewer follow), or None when they never occurred before."""
    if min_match < 1 or len(tokens) <= min_match:
        return None
    tail = tokens[-min_match:]
    for i in range(len(tokens) - min_match - 1, -1, -1):
        if tokens[i:i + min_match] == tail:
            guess = tokens[i + min_match:i + min_match + k]
            return guess + [guess[-1]] * (k - len(guess))
    return None


def ngram_guess(tokens: list[int], k: int) -> list[int]:
    """SSD's fast backup: lookup on the last token alone, or the last token repeated."""
    return lookup(tokens, k, 1) or [tokens[-1]] * k
