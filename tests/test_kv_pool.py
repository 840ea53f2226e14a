"""The KV pool over several cache groups (host/kv_pool.py): block spaces of different block
sizes and kinds, reserved all or nothing, a sliding window's blocks released behind it and
reused, compressed entries, prefix sharing in whole blocks of every group, and the sizing of
each group's space (kv_sizing.kv_spaces)."""

import random

import numpy as np
import pytest

from luce_jax.config import EngineConfig
from luce_jax.host.kv_pool import KVPool
from luce_jax.kv_sizing import kv_spaces
from luce_jax.models.family import CacheGroup
from luce_jax.step_format import SINK_BLOCK, GroupShape, Row, lower

FULL = GroupShape(num_blocks=13, block_size=4, max_blocks=16)  # 12 usable blocks of 4 tokens
WINDOW = GroupShape(num_blocks=9, block_size=2, max_blocks=32, window=4)  # 8 blocks of 2


def test_a_request_is_reserved_in_every_group_or_in_none():
    """The window's group caps a slot at a window plus a step of blocks: with span 4, (4 + 4) / 2
    + 1 = 5 blocks, however long the sequence. A second slot of 12 tokens fits the full group
    (3 of its 7 free blocks) but not the window's (5 of 3), so it holds nothing anywhere."""
    pool = KVPool([FULL, WINDOW], max_slots=3, span=4)
    assert pool.groups[1].cap(40) == 5 and pool.groups[0].cap(40) == 10
    assert pool.fits_ever(48) and not pool.fits_ever(49)  # 13 blocks > 12
    assert pool.reserve(0, 20)  # full: 5 blocks, window: 5
    before = [g.available for g in pool.groups]
    assert before == [7, 3]
    assert not pool.reserve(1, 12)  # full: 3 fit; window: min(6, 5) = 5 > 3
    assert [g.available for g in pool.groups] == before and 1 not in pool.groups[0].tables
    pool.check()
    assert pool.reserve(1, 4)  # window: 2 blocks
    pool.check()
    pool.release(0)
    pool.release(1)
    pool.check()
    assert pool.available == pool.capacity


def test_the_window_releases_its_blocks_behind_and_they_are_reused():
    """A slot advanced step by step through 40 tokens never holds more than its cap in the
    window group; every block that ends before its step's first visible position is the sink
    in its table (and in the mirror the step reads), and those blocks serve the next slot."""
    pool = KVPool([FULL, WINDOW], max_slots=2, span=4)
    win = pool.groups[1]
    assert pool.reserve(0, 40)
    start = 0
    while start < 40:
        end = min(start + 3, 40)
        pool.ensure(0, end, start)
        pool.check()
        table = win.tables[0]
        first_seen = start - WINDOW.window + 1
        for i, b in enumerate(table):
            behind = (i + 1) * WINDOW.block_size <= first_seen
            assert (b == SINK_BLOCK) == behind, (start, i, table)
        assert sum(b != SINK_BLOCK for b in table) <= win.cap(40)
        assert win.block_array[0, : len(table)].tolist() == table
        start = end
    assert len(win.tables[0]) == 20 and win.used <= 5  # 20 blocks' worth of tokens
    assert pool.reserve(1, 4)
    pool.ensure(1, 4)
    freed = set(win.tables[1])
    assert freed.isdisjoint(b for b in win.tables[0] if b != SINK_BLOCK)
    assert freed & set(range(1, 9))  # drawn from the blocks the window gave back
    pool.release(0)
    pool.release(1)
    pool.check()
    assert pool.available == pool.capacity


def test_random_operations_keep_every_group_consistent():
    """Reserve, grow (with the window moving), release and re-admit at random, with the pool's
    invariants checked after every operation; the blocks a slot holds always cover what its
    next step reads and writes."""
    rng = random.Random(0)
    span = 5
    pool = KVPool([FULL, WINDOW, GroupShape(7, 2, 16, tokens_per_entry=3)], 4, span)
    pos = {}
    for _ in range(600):
        slot = rng.randrange(4)
        if slot not in pos:
            want = rng.randint(1, 40)
            if pool.reserve(slot, want):
                pos[slot] = [0, want]
        elif rng.random() < 0.1 or pos[slot][0] >= pos[slot][1]:
            pool.release(slot)
            del pos[slot]
        else:
            start, want = pos[slot]
            end = min(start + rng.randint(1, span), want)
            pool.ensure(slot, end, start)
            win = pool.groups[1]
            for p in range(max(start - WINDOW.window + 1, 0), end):
                assert win.tables[slot][p // WINDOW.block_size] != SINK_BLOCK
            pos[slot][0] = end
        pool.check()


def test_a_compressed_group_counts_entries():
    """An entry stands for 3 tokens: 9 tokens are 3 entries, 2 blocks of 2; the step's write
    index of each token is its entry's slot, shared by the 3 tokens of one entry."""
    comp = GroupShape(num_blocks=5, block_size=2, max_blocks=8, tokens_per_entry=3)
    pool = KVPool([FULL, comp], max_slots=1, span=16)
    assert comp.blocks_for(9) == 2 and comp.blocks_for(10) == 2 and comp.blocks_for(13) == 3
    assert pool.reserve(0, 10)
    pool.ensure(0, 10)
    pool.check()
    full_tab, comp_tab = pool.block_arrays()
    b = lower([Row(0, tuple(range(10)), 0, True)], full_tab, 4, 16, 1, 1, ((comp_tab, comp),))
    entries = np.arange(10) // 3
    want = comp_tab[0, entries // 2] * 2 + entries % 2
    assert b["write_idx_1"][:10].tolist() == want.tolist()
    assert (b["write_idx_1"][10:] == SINK_BLOCK * 2).all()
    assert b["block_tables_1"][0].tolist() == comp_tab[0].tolist()


def test_prefix_sharing_covers_whole_blocks_of_every_group():
    """Two full groups of 4- and 6-token blocks share a prefix in multiples of 12 tokens; a
    window group cannot share at all."""
    a, b = GroupShape(20, 4, 16), GroupShape(20, 6, 16)
    pool = KVPool([a, b], max_slots=2, prefix_cache=True)
    prompt = list(range(30))
    assert pool.reserve(0, 30)
    pool.ensure(0, 30)
    pool.cache_blocks(0, prompt, 30)
    tokens, shared = pool.match(prompt + [99])
    assert tokens == 24 and [len(s) for s in shared] == [6, 4]
    assert shared[0] == pool.groups[0].tables[0][:6] and shared[1] == pool.groups[1].tables[0][:4]
    assert pool.reserve(1, 40, shared)
    pool.check()
    assert pool.groups[1].tables[1] == shared[1]
    pool.release(0)
    pool.release(1)
    pool.check()
    with pytest.raises(ValueError, match="shareable"):
        KVPool([a, WINDOW], prefix_cache=True)


def test_groups_are_sized_from_the_token_budget_and_device_memory():
    """kv_pool_tokens sizes every full or compressed group for that many tokens, however the
    slots split them (each slot's sequence rounds up to a block); a window's
    group gets its cap per slot; with kv_pool_tokens 0, the window's fixed bytes come off the
    memory first and the rest is tokens over the other groups' bytes per token."""
    c = EngineConfig(max_ctx=1024, kv_block_size=16, kv_pool_tokens=2048, max_concurrency=4,
                     prefill_chunk=64)  # fmt: skip
    groups = [
        CacheGroup("full", 2, 1000.0),
        CacheGroup("sliding", 4, 2000.0, window=128),
        CacheGroup("compressed", 2, 250.0, tokens_per_entry=4, block_size=32),
    ]
    full, window, comp = kv_spaces(c, groups, None)
    # 4 sequences of 2048 tokens in all each round up to whole blocks: 3 blocks more
    assert (full.num_blocks, full.max_blocks) == (2048 // 16 + 3 + 1, 1024 // 16)
    cap = -(-(128 + c.step_span) // 16) + 1
    assert window.num_blocks == 4 * cap + 1 and window.window == 128
    assert (comp.num_blocks, comp.max_blocks) == (2048 // 128 + 3 + 1, 1024 // 128)
    spaces = dict(zip(("full", "window", "comp"), (full, window, comp), strict=True))
    for n in (2, 3, 4):  # any n sequences (of at most max_ctx) of 2048 tokens in all fit
        pool = KVPool([full, window, comp], max_slots=4, span=c.step_span)
        lengths = [2048 // n + (i < 2048 % n) for i in range(n)]
        assert all(pool.reserve(i, t) for i, t in enumerate(lengths)), (n, lengths, spaces)

    class Dev:
        def memory_stats(self):
            return {"bytes_limit": 2**30, "bytes_in_use": 0}

    auto = c.replace(kv_pool_tokens=0)
    with pytest.raises(ValueError, match="max_ctx=1024"):
        kv_spaces(auto, groups, Dev(), weights=2**24)

    class Big:
        def memory_stats(self):
            return {"bytes_limit": 4 * 2**30, "bytes_in_use": 0}

    full, window, comp = kv_spaces(auto, groups, Big())
    free = 4 * 2**30 * 0.92 - 2**30 - (window.num_blocks - 1) * 16 * 2000.0
    tokens = int(free // 1250.0)
    assert full.num_blocks - 1 == tokens // 16 and comp.num_blocks - 1 == tokens // 128
