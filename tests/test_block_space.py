"""One cache group's block space: sink block, lowest-first reuse, atomic reservation, growth,
release, the prefix cache."""

import numpy as np
import pytest

from luce_jax.host.block_space import BlockSpace
from luce_jax.step_format import GroupShape


def KVPool(num_blocks, block_size, prefix_cache=False):  # noqa: N802  (one group's pool)
    return BlockSpace(GroupShape(num_blocks, block_size, 64), prefix_cache=prefix_cache)


def test_sink_is_never_handed_out_and_lowest_blocks_come_first():
    pool = KVPool(8, 4)
    assert pool.capacity == 7
    assert pool.reserve(0, 12)
    assert pool.ensure(0, 12) == [1, 2, 3]
    pool.check()


def test_reservation_is_all_or_nothing_and_counts_against_others():
    pool = KVPool(5, 4)  # 4 usable blocks
    assert pool.reserve(0, 10)  # 3 blocks promised, none claimed yet
    assert pool.available == 1 and pool.used == 0
    assert not pool.reserve(1, 5)  # needs 2
    assert 1 not in pool.tables
    assert pool.reserve(1, 4)
    assert pool.available == 0
    pool.check()


def test_growth_one_block_at_a_time_within_the_reservation():
    pool = KVPool(10, 4)
    pool.reserve(0, 9)
    assert len(pool.ensure(0, 1)) == 1
    assert len(pool.ensure(0, 4)) == 1
    assert len(pool.ensure(0, 5)) == 2
    assert len(pool.ensure(0, 9)) == 3
    with pytest.raises(RuntimeError, match="reserved"):
        pool.ensure(0, 13)


def test_release_returns_blocks_and_reservation_and_is_idempotent():
    pool = KVPool(10, 4)
    pool.reserve(0, 20)
    pool.ensure(0, 8)
    pool.reserve(1, 4)
    pool.ensure(1, 4)
    pool.release(0)
    pool.release(0)
    assert pool.available == pool.capacity - 1
    pool.reserve(2, 4)
    assert pool.ensure(2, 1) == [1]  # freed low block reused first
    pool.check()


def test_too_small_pool_is_an_error():
    with pytest.raises(ValueError, match="num_blocks"):
        KVPool(1, 16)


# -- prefix cache ---------------------------------------------------------------------------


def share(pool, slot, prompt, tokens=None):
    """Admit `prompt` as the engine does: match, reserve, then claim and cache what the
    prefill writes. Returns the number of shared blocks (None: it did not fit)."""
    shared = pool.match(prompt)
    if not pool.reserve(slot, tokens or len(prompt) + 4, shared):
        return None
    pool.ensure(slot, len(prompt))
    pool.cache_blocks(slot, prompt, len(prompt))
    return len(shared)


def test_a_prompt_shares_the_full_blocks_an_earlier_one_wrote_and_never_its_last_token():
    pool = KVPool(32, 4, prefix_cache=True)
    a = list(range(10))  # blocks [0-3] [4-7], and 2 tokens of a third
    assert share(pool, 0, a) == 0
    assert share(pool, 1, a + [99]) == 2  # both full blocks, then its own
    assert pool.tables[1][:2] == pool.tables[0][:2] and pool.tables[1][2] != pool.tables[0][2]
    assert share(pool, 2, a[:8]) == 1  # all 8 tokens cached, but token 8's logits are needed
    assert share(pool, 3, [0, 1, 2, 3, 4, 5, 7, 6, 1]) == 1  # diverging mid-block: own block
    assert share(pool, 4, [1] + a) == 0  # the same tokens at other positions share nothing
    assert share(pool, 5, a[4:8] + a[4:8] + [1]) == 0  # a block is keyed by all before it
    pool.check()


def test_shared_blocks_are_counted_once_and_parked_when_their_last_holder_leaves():
    pool = KVPool(9, 4, prefix_cache=True)  # 8 usable blocks
    prompt = list(range(12))
    share(pool, 0, prompt, tokens=16)  # 4 blocks: 3 written and cached, 1 promised
    assert pool.used == 3 and pool.available == 4 and pool.cached == 3
    assert share(pool, 1, prompt, tokens=16) == 2  # needs 2 blocks of its own, not 4
    assert pool.used == 4 and pool.available == 2
    pool.release(0)
    assert pool.used == 3  # the shared two stay held by slot 1
    pool.release(1)
    assert pool.used == 0 and pool.cached == 3 and pool.parked == 3
    assert pool.available == pool.capacity  # parked blocks count as free
    assert share(pool, 2, prompt, tokens=16) == 2  # and can still be shared
    pool.check()


def test_admission_counts_a_parked_match_as_taken_and_stays_all_or_nothing():
    pool = KVPool(5, 4, prefix_cache=True)  # 4 usable blocks
    share(pool, 0, list(range(9)), tokens=9)  # 3 blocks, 2 cacheable
    pool.release(0)
    assert pool.parked == 2 and pool.available == 4
    # 16 tokens: 4 blocks, 2 of them matched and parked; all 4 are gone from `available`
    assert share(pool, 1, list(range(9)), tokens=16) == 2 and pool.available == 0
    assert not pool.reserve(2, 1)
    pool.check()


def test_eviction_takes_free_blocks_first_then_the_least_recently_parked():
    pool = KVPool(7, 4, prefix_cache=True)  # 6 usable blocks
    old, new = list(range(100, 109)), list(range(200, 209))
    share(pool, 0, old, tokens=9)
    pool.release(0)
    share(pool, 1, new, tokens=9)
    pool.release(1)
    assert pool.parked == 4 and len(pool._free) == 2
    pool.reserve(2, 12)
    pool.ensure(2, 12)  # 3 blocks: the 2 free ones, then the oldest parked (old's 2nd block)
    assert pool.parked == 3
    assert len(pool.match(old + [0])) == 1 and len(pool.match(new + [0])) == 2
    pool.check()


def test_clearing_the_cache_keeps_held_blocks_and_frees_the_parked_ones():
    pool = KVPool(16, 4, prefix_cache=True)
    share(pool, 0, list(range(9)))
    share(pool, 1, list(range(50, 59)))
    pool.release(1)
    pool.clear_cache()
    assert pool.cached == 0 and pool.parked == 0 and pool.used == 3
    assert pool.match(list(range(9))) == []
    pool.ensure(0, 13)
    pool.cache_blocks(0, list(range(13)), 13)  # a slot whose blocks were dropped adds none
    assert pool.cached == 0
    pool.release(0)
    assert pool.available == pool.capacity
    pool.check()


def test_without_the_cache_nothing_is_matched_or_kept():
    pool = KVPool(16, 4)
    share(pool, 0, list(range(9)))
    assert pool.match(list(range(9))) == [] and pool.cached == 0
    pool.release(0)
    assert pool.available == pool.capacity
    pool.check()


def test_random_arrivals_cancellations_and_evictions_keep_the_pool_consistent():
    """A property test: prompts drawn from a few shared stems, admitted, prefilled in chunks,
    decoded, cancelled and released at random in a pool small enough to evict. After every
    operation the invariants hold (reference counts equal table occurrences, no held block is
    evictable, nothing leaks), and every position a slot holds has exactly its own contents:
    a write records the whole sequence up to its position (what a KV entry depends on), so a
    block handed out while still cached, or shared under another prefix, shows up."""
    rng = np.random.default_rng(0)
    P = 4
    pool = KVPool(24, P, prefix_cache=True)
    stems = [rng.integers(0, 2, 12).tolist() for _ in range(3)]  # few values: blocks recur
    contents = {}  # block -> {position in block: token} as last written
    live = {}  # slot -> (sequence tokens, prefilled)
    shares = 0
    for _ in range(1500):
        op = rng.random()
        free_slots = [s for s in range(6) if s not in live]
        if op < 0.3 and free_slots:
            stem = stems[rng.integers(len(stems))]
            seq = stem[: rng.integers(0, 13)] + rng.integers(0, 2, rng.integers(1, 8)).tolist()
            total = len(seq) + int(rng.integers(0, 6))
            shared = pool.match(seq)
            if pool.reserve(free_slots[0], total, shared):
                live[free_slots[0]] = (seq, len(shared) * P, total)
                shares += bool(shared)
        elif op < 0.8 and live:  # a step: prefill a chunk, or decode a token
            s = list(live)[rng.integers(len(live))]
            seq, done, total = live[s]
            n = min(int(rng.integers(1, 6)), total - done)
            if n <= 0:
                continue
            if done >= len(seq):  # decoding appends tokens
                seq = seq + rng.integers(0, 2, n).tolist()
            n = min(n, len(seq) - done)
            table = pool.ensure(s, done + n)
            for p in range(done, done + n):
                contents.setdefault(table[p // P], {})[p % P] = tuple(seq[: p + 1])
            live[s] = (seq, done + n, total)
            pool.cache_blocks(s, seq, done + n)
        elif live:  # finish or cancel
            s = list(live)[rng.integers(len(live))]
            pool.release(s)
            del live[s]
        pool.check()
        for s, (seq, done, _) in live.items():
            for p in range(done):
                assert contents[pool.tables[s][p // P]].get(p % P) == tuple(seq[: p + 1])
    assert shares > 50  # the schedule did exercise sharing
    for s in list(live):
        pool.release(s)
    pool.check()
    assert pool.used == 0 and pool.available == pool.capacity
