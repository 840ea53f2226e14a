"""Physical KV blocks: free list, per-slot block tables, atomic reservation and release.

Pure Python: the pool only decides which block holds which tokens; the runner owns the arrays.
Block 0 is the sink that padding rows write to and is never handed out.
"""

from __future__ import annotations

import heapq

import numpy as np

from .batch import SINK_BLOCK


class KVPool:
    """Blocks of `block_size` tokens; a slot reserves its worst case up front.

    Invariants: every block is either free or owned by exactly one slot; a slot's reservation
    (blocks it may still claim) is counted against the free list, so growth can never fail.
    """

    def __init__(self, num_blocks: int, block_size: int, max_slots: int = 0, max_blocks: int = 0):
        """Args: max_slots, max_blocks: shape of `block_array`, the numpy mirror of the
        tables that batch.lower reads (no mirror when 0)."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the sink block plus at least one")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = [b for b in range(num_blocks) if b != SINK_BLOCK]  # min-heap: lowest first
        heapq.heapify(self._free)
        self.tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}  # slot -> blocks promised but not yet claimed
        self.block_array = np.full((max_slots, max_blocks), SINK_BLOCK, np.int32)

    @property
    def capacity(self) -> int:
        """Blocks that can ever be handed out (all but the sink)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks neither owned nor promised."""
        return len(self._free) - sum(self._reserved.values())

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def reserve(self, slot: int, tokens: int) -> bool:
        """Promise `slot` room for `tokens` tokens, all or nothing; False if it won't fit."""
        assert slot not in self.tables, f"slot {slot} already holds a reservation"
        need = self.blocks_for(tokens)
        if need > self.available:
            return False
        self.tables[slot] = []
        self._reserved[slot] = need
        return True

    def ensure(self, slot: int, tokens: int) -> list[int]:
        """Claim blocks so `slot` can hold `tokens` tokens; returns its block table."""
        table = self.tables[slot]
        need = self.blocks_for(tokens) - len(table)
        if need > self._reserved[slot]:
            raise RuntimeError(
                f"slot {slot} needs {need} more blocks but reserved {self._reserved[slot]}"
            )
        for _ in range(max(need, 0)):
            b = heapq.heappop(self._free)
            if self.block_array.size:
                self.block_array[slot, len(table)] = b
            table.append(b)
            self._reserved[slot] -= 1
        return table

    def release(self, slot: int) -> None:
        """Return all of `slot`'s blocks and its unclaimed reservation. Safe to call twice."""
        for b in self.tables.pop(slot, []):
            heapq.heappush(self._free, b)
        if self.block_array.size:
            self.block_array[slot] = SINK_BLOCK
        self._reserved.pop(slot, None)

    def check(self) -> None:
        """Assert the pool's invariants (tests call this after every operation)."""
        owned = [b for t in self.tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert SINK_BLOCK not in owned and SINK_BLOCK not in self._free
        assert set(owned).isdisjoint(self._free), "an owned block is on the free list"
        assert len(owned) + len(self._free) == self.capacity, "a block leaked"
        assert self.available >= 0
