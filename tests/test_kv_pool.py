"""KV block pool: sink block, lowest-first reuse, atomic reservation, growth, release."""

import pytest

from luce_jax.host.kv_pool import KVPool


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
