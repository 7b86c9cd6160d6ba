"""Prompt lookup finds the latest earlier occurrence of the text's last n tokens."""
from saguaro.engine.lookup import lookup, ngram_guess


def test_lookup_copies_what_followed_the_latest_match():
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 5, 8, 1, 2]
    assert lookup(tokens, 3, 2) == [4, 5, 8]  # the later of the two [1, 2] wins
    assert lookup(tokens, 3, 3) is None  # [8, 1, 2] never occurred before


def test_lookup_repeats_the_last_token_when_the_match_is_near_the_end():
    assert lookup([4, 6, 4, 6], 3, 1) == [4, 6, 6]
    assert lookup([5, 5], 2, 1) == [5, 5]


def test_lookup_needs_a_match_longer_than_nothing():
    assert lookup([1, 2, 3], 2, 0) is None
    assert lookup([1], 2, 1) is None


def test_fast_backup_falls_back_to_repeating_the_last_token():
    assert ngram_guess([1, 2, 3], 2) == [3, 3]
    assert ngram_guess([3, 1, 2, 3], 2) == [1, 2]
