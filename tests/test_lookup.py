"""Prompt lookup finds the latest earlier occurrence of the text's last n tokens."""
from saguaro.speculation.local.lookup import lookup, ngram_guess


def test_lookup_copies_what_followed_the_latest_match():
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 5, 8, 1, 2]
    assert lookup(tokens, 3, 2) == [4, 5, 8]  # the later of the two [1, 2] wins
    assert lookup(tokens, 3, 3) is None  # [8, 1, 2] never occurred before


def test_lookup_prefers_the_longest_match():
    tokens = [3, 1, 2, 6, 6, 9, 1, 2, 7, 3, 1, 2]
    assert lookup(tokens, 2, 2) == [6, 6]  # [3, 1, 2] matched at the start beats the later [1, 2]
    assert lookup(tokens, 2, 2, max_match=2) == [7, 3]  # capped at 2: the latest [1, 2]


def test_lookup_matches_a_search_from_the_longest_suffix_down():
    import random

    def reference(tokens, k, shortest, longest):
        for n in range(longest, shortest - 1, -1):
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i:i + n] == tokens[-n:]:
                    guess = tokens[i + n:i + n + k]
                    return guess + [guess[-1]] * (k - len(guess))
        return None

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 25))]
        k, shortest = rng.randrange(1, 6), rng.randrange(1, 3)
        longest = shortest + rng.randrange(3)
        assert lookup(tokens, k, shortest, longest) == reference(tokens, k, shortest, longest)


def test_lookup_repeats_the_last_token_when_the_match_is_near_the_end():
    assert lookup([4, 6, 4, 6], 3, 1) == [4, 6, 6]
    assert lookup([5, 5], 2, 1) == [5, 5]


def test_lookup_needs_a_match_longer_than_nothing():
    assert lookup([1, 2, 3], 2, 0) is None
    assert lookup([1], 2, 1) is None


def test_fast_backup_falls_back_to_repeating_the_last_token():
    assert ngram_guess([1, 2, 3], 2) == [3, 3]
    assert ngram_guess([3, 1, 2, 3], 2) == [1, 2]
