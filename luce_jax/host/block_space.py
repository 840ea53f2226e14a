"""One cache group's physical KV blocks: free list, per-slot block tables, reservation and
release, blocks released behind a sliding window, and blocks shared between slots through the
prefix cache.

Pure Python: the space only decides which block holds which entries; the runner owns the
arrays. Block 0 is the sink that padding rows write to and is never handed out.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence

import numpy as np

from ..step_format import SINK_BLOCK, GroupShape
from .prefix_cache import ROOT, PrefixCache


class BlockSpace:
    """Blocks of `block_size` entries; a slot reserves the most it will ever hold at once.

    Every block is in exactly one state: free, held by one or more slots (its reference count is
    the number of block tables it appears in), or parked (cached contents, held by no slot,
    evicted least recently used when a block is needed). A slot's reservation (blocks it may
    still claim) is counted against free and parked blocks, so growth can never fail. A slot
    writes only blocks it claimed itself, never shared ones: sharing covers whole blocks of its
    prompt before the position its prefill starts at.

    A sliding-window space (shape.window > 0) holds a slot's blocks from the one its step's
    first query still sees to the one its last write lands in: a block wholly behind the
    window goes back (its table entry becomes the sink) before new ones are claimed, so a
    slot never holds more than `cap` blocks, however long its sequence.

    Args:
      shape: the group's blocks (step_format.GroupShape); its max_blocks and `max_slots` give
        `block_array`, the numpy mirror of the tables that step_format.lower reads (no
        mirror when max_slots is 0).
      span: the most positions one step claims past the first it queries (a window's cap).
      prefix_cache: keep full blocks findable by content after their slot lets them go.
    """

    def __init__(
        self,
        shape: GroupShape,
        max_slots: int = 0,
        span: int = 0,
        prefix_cache: bool = False,
    ):
        num_blocks, block_size, max_blocks = shape.num_blocks, shape.block_size, shape.max_blocks
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}: need the sink block plus at least one")
        if prefix_cache and (shape.window or shape.tokens_per_entry > 1):
            raise ValueError(f"{shape}: only a group of full, per-token entries is shareable")
        self.shape, self.span = shape, span
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = [b for b in range(num_blocks) if b != SINK_BLOCK]  # min-heap: lowest first
        heapq.heapify(self._free)
        self.tables: dict[int, list[int]] = {}
        self._reserved: dict[int, int] = {}  # slot -> blocks promised but not yet claimed
        self._cap: dict[int, int] = {}  # slot -> blocks it holds plus those promised
        self._refs: dict[int, int] = {}  # held block -> tables holding it
        self.cache = PrefixCache(block_size) if prefix_cache else None
        # slot -> cache entry id of each of its leading full blocks entered so far; None once
        # the cache was cleared under it (its blocks are no longer trusted).
        self._chain: dict[int, list[int] | None] = {}
        self.block_array = np.full((max_slots, max_blocks), SINK_BLOCK, np.int32)

    @property
    def capacity(self) -> int:
        """Blocks that can ever be handed out (all but the sink)."""
        return self.num_blocks - 1

    @property
    def available(self) -> int:
        """Blocks neither held nor promised (parked cached blocks count: they are evictable)."""
        return len(self._free) + self.parked - sum(self._reserved.values())

    @property
    def used(self) -> int:
        """Blocks held by slots."""
        return len(self._refs)

    @property
    def parked(self) -> int:
        return self.cache.parked if self.cache is not None else 0

    @property
    def cached(self) -> int:
        """Blocks whose contents the prefix cache can hand to a new request."""
        return len(self.cache) if self.cache is not None else 0

    def blocks_for(self, tokens: int) -> int:
        return self.shape.blocks_for(tokens)

    def cap(self, tokens: int) -> int:
        """The most blocks a slot of `tokens` tokens holds at once (GroupShape.cap)."""
        return self.shape.cap(tokens, self.span)

    def fits(self, tokens: int, shared: Sequence[int] = ()) -> bool:
        """Whether `reserve` would succeed."""
        parked = sum(1 for b in shared if not self._refs.get(b))
        return self.cap(tokens) - len(shared) + parked <= self.available

    def match(self, prompt: Sequence[int]) -> list[int]:
        """Cached blocks holding `prompt`'s leading full blocks (PrefixCache.match)."""
        return self.cache.match(prompt) if self.cache is not None else []

    def reserve(self, slot: int, tokens: int, shared: Sequence[int] = ()) -> bool:
        """Promise `slot` room for `tokens` tokens, all or nothing; False if it won't fit.

        Args:
          shared: blocks from `match` that start its table; only the rest are promised, and a
            parked one among them stops counting as free.
        """
        assert slot not in self.tables, f"slot {slot} already holds a reservation"
        need = self.cap(tokens) - len(shared)
        assert need >= 0, (tokens, len(shared))
        if not self.fits(tokens, shared):
            return False
        for b in shared:
            if self.cache.unpark(b):
                assert b not in self._refs
            self._refs[b] = self._refs.get(b, 0) + 1
        self.tables[slot] = list(shared)
        if self.block_array.size:
            self.block_array[slot, : len(shared)] = shared
        self._reserved[slot] = need
        self._cap[slot] = need + len(shared)
        if self.cache is not None:
            self._chain[slot] = [self.cache.entry_id(b) for b in shared]
        return True

    def ensure(self, slot: int, tokens: int, start: int = 0) -> list[int]:
        """Claim blocks so `slot` can hold `tokens` tokens; returns its block table.

        start: the first position the slot's next step queries (never less than an earlier
        call's): in a window, blocks wholly behind what it sees go back first."""
        table = self.tables[slot]
        if self.shape.window:
            assert tokens - start <= self.span, (tokens, start, self.span)
            self._release_behind(slot, start - self.shape.window + 1)
        need = self.blocks_for(tokens) - len(table)
        if need > self._reserved[slot]:
            raise RuntimeError(
                f"slot {slot} needs {need} more blocks but reserved {self._reserved[slot]}"
            )
        for _ in range(max(need, 0)):
            # A free block first; evict a cached one only when none is left.
            b = heapq.heappop(self._free) if self._free else self.cache.evict()
            if self.block_array.size:
                self.block_array[slot, len(table)] = b
            table.append(b)
            self._refs[b] = 1
            self._reserved[slot] -= 1
        return table

    def _release_behind(self, slot: int, first: int) -> None:
        """Return `slot`'s blocks that end before position `first`."""
        table = self.tables[slot]
        per_block = self.block_size * self.shape.tokens_per_entry
        for i in range(min(max(first, 0) // per_block, len(table))):
            b = table[i]
            if b == SINK_BLOCK:
                continue
            table[i] = SINK_BLOCK
            if self.block_array.size:
                self.block_array[slot, i] = SINK_BLOCK
            self._reserved[slot] += 1
            self._drop(b)

    def _drop(self, b: int) -> None:
        """One table less holds block b: back to the free list when none does (parked, if
        cached)."""
        self._refs[b] -= 1
        if self._refs[b]:
            return
        del self._refs[b]
        if self.cache is not None and self.cache.cached(b):
            self.cache.park(b)
        else:
            heapq.heappush(self._free, b)

    def cache_blocks(self, slot: int, tokens: Sequence[int], written: int) -> None:
        """Enter `slot`'s full blocks among its first `written` positions in the prefix cache.

        Args:
          tokens: the slot's sequence (prompt, then output) from position 0, at least `written`
            long; `written`: positions whose KV is written by steps already launched (a step
            launched later reads them after they are written: the device runs steps in order).
        """
        chain = self._chain.get(slot) if self.cache is not None else None
        if chain is None:
            return
        P, table = self.block_size, self.tables[slot]
        for i in range(len(chain), min(written // P, len(table))):
            parent = chain[-1] if chain else ROOT
            chain.append(self.cache.add(parent, tokens[i * P : (i + 1) * P], table[i]))

    def release(self, slot: int) -> None:
        """Return `slot`'s blocks and its unclaimed reservation. Safe to call twice.

        A block no other slot holds goes back to the free list, or is parked if it is cached;
        the table's last blocks are parked first, so they are evicted before its first ones
        (which other prompts are likelier to share)."""
        for b in reversed(self.tables.pop(slot, [])):
            if b != SINK_BLOCK:
                self._drop(b)
        if self.block_array.size:
            self.block_array[slot] = SINK_BLOCK
        self._reserved.pop(slot, None)
        self._cap.pop(slot, None)
        self._chain.pop(slot, None)

    def clear_cache(self) -> None:
        """Forget every cached block (after a failed step: its KV writes may not have happened);
        slots keep the blocks they hold, and enter no more."""
        if self.cache is None:
            return
        for b in self.cache.clear():
            heapq.heappush(self._free, b)
        self._chain = dict.fromkeys(self._chain)

    def check(self) -> None:
        """Assert the pool's invariants (tests call this after every operation)."""
        live = {s: [b for b in t if b != SINK_BLOCK] for s, t in self.tables.items()}
        held = Counter(b for t in live.values() for b in t)
        assert all(len(set(t)) == len(t) for t in live.values()), "a table repeats a block"
        assert all(len(t) + self._reserved[s] == self._cap[s] for s, t in live.items()), (
            "a slot holds or may claim other than its reservation's blocks"
        )
        assert all(SINK_BLOCK not in t for t in live.values())
        assert held == Counter(self._refs), "reference counts differ from the tables"
        assert SINK_BLOCK not in self._free
        assert set(held).isdisjoint(self._free), "a held block is on the free list"
        if self.cache is not None:
            self.cache.check(set(held))
            assert set(self._free).isdisjoint(self.cache._lru), "a parked block is free"
        assert len(held) + len(self._free) + self.parked == self.capacity, "a block leaked"
        assert self.available >= 0
        for s, t in self.tables.items():
            if self.block_array.size:
                assert self.block_array[s, : len(t)].tolist() == t
