"""Prompt-lookup proposals against a brute-force search, and the proposer's slot bookkeeping."""

import random

import pytest

from luce_jax.speculation.ngram import NgramProposer
from luce_jax.step_format import GroupShape


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


def continuation_start(tokens, n_min, n_max, with_n=False):
    """Where brute_force's continuation starts (None: no earlier occurrence), and with_n the
    suffix length that matched (0: none)."""
    end = len(tokens)
    for n in range(min(n_max, end), n_min - 1, -1):
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n : e] == tokens[end - n :]:
                return (e, n) if with_n else e
    return (None, 0) if with_n else None


@pytest.mark.parametrize("seed", range(4))
def test_device_lookup_reads_paged_sequences_as_the_host_proposer_does(seed):
    """device/ngram_lookup.py over sequences scattered in shuffled blocks, each row's new token
    still outside the cache, rejected proposals left past it, and rows that kept proposals
    (its last logits row further on): the host proposer's tokens, then the continuation
    repeating itself where the host's runs out (the last token where it has none)."""
    import jax.numpy as jnp
    import numpy as np

    from luce_jax.device.ngram_lookup import NgramLookup

    r = random.Random(seed)
    K, P, MB, S = 4, 4, 6, 5
    n_min, n_max = r.choice([(1, 3), (2, 3), (1, 1)])
    look = NgramLookup(k=K, block_size=P, n_min=n_min, n_max=n_max)
    ids = list(range(1, S * MB + 1))  # block 0 is the sink
    r.shuffle(ids)
    tables = np.array(ids, np.int32).reshape(S, MB)
    cache = np.asarray(look.init_kv(GroupShape(S * MB + 1, P, MB))).copy()
    seqs = [[r.randrange(4) for _ in range(r.randint(1, MB * P - K))] for _ in range(S)]
    cache[:] = [r.randrange(4) for _ in cache]  # stale tokens everywhere
    R = S * (K + 1)
    lpos, tok = np.zeros(R, np.int32), np.zeros(R, np.int32)
    acc, start = np.zeros(S, np.int32), np.arange(S, dtype=np.int32) * (K + 1)
    for s, x in enumerate(seqs):
        for p, t in enumerate(x[:-1]):  # the new token x[-1] is not in the cache yet
            cache[tables[s, p // P] * P + p % P] = t
        acc[s] = r.randint(0, min(K, len(x) - 1))
        for j in range(K + 1):  # the verify row: its last token, then the proposals
            lpos[start[s] + j] = len(x) - 2 - acc[s] + j
        tok[start[s] + acc[s]] = x[-1]
    packed = jnp.asarray(np.concatenate([tok, np.zeros(R, np.int32), acc]))
    batch = {"slots": jnp.arange(S), "logit_start": jnp.asarray(start)}
    reads = (jnp.asarray(lpos), jnp.asarray(tables))
    props, _ = look.propose(None, jnp.asarray(cache), reads, packed, batch, None, False)
    matched = look.lookup(jnp.asarray(cache), reads, packed, batch)[1].tolist()
    for s, x in enumerate(seqs):
        assert matched[s] == continuation_start(x, n_min, n_max, with_n=True)[1], x
        host = NgramProposer(n_min, n_max)
        host.start(0, x)
        at = continuation_start(x, n_min, n_max)
        at = len(x) - 1 if at is None else at
        want = [x[at + j % (len(x) - at)] for j in range(K)]
        assert props[s].tolist() == want, (x, acc[s])
        expected = host.propose({0: K})[0]
        assert props[s].tolist()[: len(expected)] == expected


def test_device_lookup_feed_writes_each_fed_token_where_its_kv_goes():
    import jax.numpy as jnp

    from luce_jax.device.ngram_lookup import NgramLookup

    look = NgramLookup(k=2, block_size=4)
    batch = {
        "tokens": jnp.array([7, 8, 9, 0]),
        "write_idx": jnp.array([13, 14, 5, 0]),  # padding writes the sink (0)
        "positions": jnp.array([1, 2, 5, 0]),
        "logit_rows": jnp.array([1, 2]),
        "block_tables": jnp.zeros((2, 3), jnp.int32),
    }
    cache, (lpos, _) = look.feed(None, look.init_kv(GroupShape(4, 4, 1)), batch)
    assert cache[jnp.array([13, 14, 5])].tolist() == [7, 8, 9] and lpos.tolist() == [2, 5]
