"""Prompt lookup: speculations copied from the text so far instead of drafted by a model.

Code and chat answers repeat their prompts and themselves (names, signatures, lines), so the
tokens that followed an earlier occurrence of the last few tokens are often what comes next.
Proposed as point masses (a deterministic function of the committed text), they keep
verification exact at any temperature, and they cost no draft pass.
"""
from __future__ import annotations

MAX_MATCH = 4  # longer matches predict better (measured: 3% fewer SD rounds on HumanEval than 2)


def lookup(tokens: list[int], k: int, min_match: int, max_match: int = MAX_MATCH) -> list[int] | None:
    """The K tokens after the earlier occurrence of the text's longest suffix (of min_match to
    max_match tokens; the latest among equals), the last one repeated if fewer follow; None
    when not even the last min_match tokens occurred before."""
    if min_match < 1 or len(tokens) <= min_match:
        return None
    n, last = len(tokens), tokens[-1]
    best, best_len = None, 0
    for i in range(n - 2, -1, -1):  # i: where an earlier occurrence of the suffix ends
        if tokens[i] != last:
            continue
        m = 1
        while m < max_match and i - m >= 0 and tokens[i - m] == tokens[n - 1 - m]:
            m += 1
        if m >= min_match and m > best_len:
            best, best_len = i, m
            if m >= max_match:
                break
    if best is None:
        return None
    guess = tokens[best + 1:best + 1 + k]
    return guess + [guess[-1]] * (k - len(guess))


def lookups(texts: list[list[int]], k: int, min_match: int | None) -> dict[int, list[int]]:
    """Index -> speculation, for the texts that offer a match (none when min_match is off)."""
    if not min_match:
        return {}
    found = {i: lookup(tokens, k, min_match) for i, tokens in enumerate(texts)}
    return {i: guess for i, guess in found.items() if guess is not None}


def ngram_guess(tokens: list[int], k: int) -> list[int]:
    """SSD's fast backup: lookup on the last token alone, or the last token repeated."""
    return lookup(tokens, k, 1, max_match=1) or [tokens[-1]] * k
