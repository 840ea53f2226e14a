"""The KV pool: one block space per cache group of the model (models/family.py's
CacheGroup), reserved for a slot all at once and released together.

Pure Python. A family with one full-attention group (dense, hybrid) has one space; a family
with sliding-window or compressed layers has one per group, each with its own block size,
tables and free list (host/block_space.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..step_format import GroupShape
from .block_space import BlockSpace


class KVPool:
    """Block spaces reserved together: a request is admitted only if every group has room for
    it (all or nothing, so admission stays FIFO without partial holds), and grows, shares and
    goes back in every group at once.

    Args:
      shapes: one step_format.GroupShape per cache group, in the family's order.
      max_slots: rows of each space's block_array (step_format.lower reads them).
      span: the most positions one step claims past the first it queries (a window's cap).
      prefix_cache: share leading blocks by content in every group; each must be shareable.
    """

    def __init__(
        self,
        shapes: Sequence[GroupShape],
        max_slots: int = 0,
        span: int = 0,
        prefix_cache: bool = False,
    ):
        if not shapes:
            raise ValueError("shapes=[]: a pool needs at least one cache group")
        self.groups = [BlockSpace(s, max_slots, span, prefix_cache) for s in shapes]
        # whole tokens one shared block stands for in every group: a prefix is shared up to a
        # multiple of all of them
        self._share_unit = math.lcm(*(s.block_size * s.tokens_per_entry for s in shapes))

    @property
    def first(self) -> BlockSpace:
        """Group 0: its tables are the step's block_tables (step_format.lower)."""
        return self.groups[0]

    @property
    def block_array(self):
        return self.first.block_array

    @property
    def tables(self) -> dict[int, list[int]]:
        """Group 0's block table of each slot."""
        return self.first.tables

    @property
    def cache(self):
        return self.first.cache

    def _total(self, name: str) -> int:
        return sum(getattr(g, name) for g in self.groups)

    capacity = property(lambda self: self._total("capacity"))
    available = property(lambda self: self._total("available"))
    used = property(lambda self: self._total("used"))
    cached = property(lambda self: self._total("cached"))

    def fits_ever(self, tokens: int) -> bool:
        """Whether a request of `tokens` tokens fits in an empty pool."""
        return all(g.cap(tokens) <= g.capacity for g in self.groups)

    def match(self, prompt: Sequence[int]) -> tuple[int, list[list[int]]]:
        """(tokens, blocks per group) of the prompt's longest leading run that every group
        has cached: whole blocks of every group."""
        if self.cache is None:
            return 0, [[] for _ in self.groups]
        found = [g.match(prompt) for g in self.groups]
        tokens = min(len(b) * g.block_size for g, b in zip(self.groups, found, strict=True))
        tokens -= tokens % self._share_unit
        return tokens, [
            b[: tokens // g.block_size] for g, b in zip(self.groups, found, strict=True)
        ]

    def reserve(
        self, slot: int, tokens: int, shared: Sequence[Sequence[int]] | None = None
    ) -> bool:
        """Promise `slot` room for `tokens` tokens in every group, or in none; False if some
        group has no room. shared: match's blocks per group."""
        shared = shared or [()] * len(self.groups)
        pairs = list(zip(self.groups, shared, strict=True))
        if not all(g.fits(tokens, s) for g, s in pairs):
            return False
        for g, s in pairs:
            assert g.reserve(slot, tokens, s)
        return True

    def ensure(self, slot: int, tokens: int, start: int = 0) -> None:
        """Claim blocks so `slot` holds `tokens` tokens in every group (BlockSpace.ensure)."""
        for g in self.groups:
            g.ensure(slot, tokens, start)

    def cache_blocks(self, slot: int, tokens: Sequence[int], written: int) -> None:
        for g in self.groups:
            g.cache_blocks(slot, tokens, written)

    def release(self, slot: int) -> None:
        """Return `slot`'s blocks in every group. Safe to call twice."""
        for g in self.groups:
            g.release(slot)

    def clear_cache(self) -> None:
        for g in self.groups:
            g.clear_cache()

    def block_arrays(self) -> list:
        """Each group's block_array, in order (step_format.lower's tables and groups)."""
        return [g.block_array for g in self.groups]

    def check(self) -> None:
        """Assert every group's invariants, and that they hold the same slots."""
        for g in self.groups:
            g.check()
        assert all(g.tables.keys() == self.first.tables.keys() for g in self.groups)
