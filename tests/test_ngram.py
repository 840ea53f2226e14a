"""Prompt-lookup proposals against a brute-force search, and the proposer's slot bookkeeping."""

import random

import pytest

from luce_jax.speculation.ngram import NgramProposer


def brute_force(tokens, k, n_min, n_max):
    """Longest suffix (n_max..n_min) with an earlier occurrence; the k tokens after the latest."""
    end = len(tokens)
    for n in range(min(n_max, end), n_min - 1, -1):
        suffix = tokens[end - n :]
        for e in range(end - 1, n - 1, -1):  # earlier end positions, latest first
            if tokens[e - n : e] == suffix:
                return tokens[e : e + k]
    return []


def proposal(tokens, k=3, n_min=1, n_max=3):
    p = NgramProposer(n_min, n_max)
    p.start(0, tokens)
    return p.propose({0: k})[0]


def test_continues_the_previous_occurrence_of_the_suffix():
    assert proposal([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]


def test_prefers_the_longest_matching_suffix():
    # The 3-gram (1, 2, 3) was followed by 10; the latest 1-gram (3) by 11.
    assert proposal([1, 2, 3, 10, 9, 3, 11, 1, 2, 3], k=1) == [10]
    assert proposal([1, 2, 3, 10, 9, 3, 11, 1, 2, 3], k=1, n_max=1) == [11]


def test_falls_back_to_shorter_suffixes_and_to_nothing():
    assert proposal([4, 5, 6, 7, 5], k=2) == [6, 7]
    assert proposal([1, 2, 3, 4]) == []
    assert proposal([1, 2, 1, 2], k=0) == []


@pytest.mark.parametrize("seed", range(20))
def test_equals_brute_force_search_while_the_sequence_grows(seed):
    r = random.Random(seed)
    n_min, n_max, k = r.choice([(1, 3), (2, 4), (1, 1)]) + (r.randint(1, 6),)
    tokens = [r.randrange(5) for _ in range(r.randint(1, 20))]
    p = NgramProposer(n_min, n_max)
    p.start(7, tokens)
    for _ in range(30):
        assert p.propose({7: k})[7] == brute_force(tokens, k, n_min, n_max), tokens
        more = [r.randrange(5) for _ in range(r.randint(1, 3))]
        p.extend(7, more)
        tokens = tokens + more


def test_slots_are_independent_and_start_replaces_a_reused_slot():
    p = NgramProposer()
    p.start(0, [1, 2, 1])
    p.start(1, [5, 6, 5])
    assert p.propose({0: 2, 1: 2}) == {0: [2, 1], 1: [6, 5]}
    p.drop(0)
    p.start(0, [8, 8])  # a new request in the reused slot sees none of the old one's tokens
    assert p.propose({0: 1}) == {0: [8]}
    with pytest.raises(KeyError):
        p.propose({3: 1})


def test_bad_ngram_lengths_are_named():
    with pytest.raises(ValueError, match="n_min <= n_max"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="n_min"):
        NgramProposer(0, 2)
