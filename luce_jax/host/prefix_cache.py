"""Prefix cache: full KV blocks found by their content, and an LRU of the ones no slot holds.

Pure Python (NumPy arrays of ids accepted). A cached block is keyed by (the entry id of the
block before it, its P token ids), so a key names the whole prefix up to and including the
block: a chained key, resolved by dict equality rather than by a hash alone, so two different
prefixes never share an entry. Entry ids are never reused; an entry whose parent was evicted
can no longer be reached from the root and ages out of the LRU. The root (id 0) stands for the
pool's model, cache types and block size, which one pool never changes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

ROOT = 0  # entry id "before" a sequence's first block

Key = tuple[int, tuple[int, ...]]


def _ints(tokens: Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints, converted once: a per-id int() made matching an
    8k-token prompt 1.2 ms of the engine thread."""
    return tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)


class PrefixCache:
    """Block ids by content, for a KVPool (which owns the blocks and their reference counts).

    Invariants: `_index` and `_entry` describe the same set of blocks; every parked block is
    cached (it sits in the LRU, oldest first, until it is shared again or evicted).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._index: dict[Key, int] = {}  # key -> block
        self._entry: dict[int, tuple[Key, int]] = {}  # block -> (key, entry id)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks no slot holds
        self._ids = itertools.count(ROOT + 1)

    def __len__(self) -> int:
        """Blocks with cached contents (held by slots or parked)."""
        return len(self._entry)

    @property
    def parked(self) -> int:
        """Cached blocks no slot holds: evictable, so they count as free."""
        return len(self._lru)

    def key(self, parent: int, tokens: Sequence[int]) -> Key:
        return parent, tuple(_ints(tokens))

    def match(self, prompt: Sequence[int]) -> list[int]:
        """Blocks holding the longest run of `prompt`'s leading full blocks, never its last
        token: that token's logits start generation, so it is always computed."""
        P, parent, out, ids = self.block_size, ROOT, [], _ints(prompt)
        for i in range((len(ids) - 1) // P):
            b = self._index.get((parent, tuple(ids[i * P : (i + 1) * P])))
            if b is None:
                break
            out.append(b)
            parent = self._entry[b][1]
        return out

    def entry_id(self, block: int) -> int:
        return self._entry[block][1]

    def add(self, parent: int, tokens: Sequence[int], block: int) -> int:
        """Cache `block` as holding `tokens` after entry `parent`; returns the entry id. If that
        content is cached already (in another block), `block` stays uncached and the existing
        entry's id is returned, so the sequence's next blocks chain through it."""
        k = self.key(parent, tokens)
        hit = self._index.get(k)
        if hit is not None:
            return self._entry[hit][1]
        assert block not in self._entry, f"block {block} is cached twice"
        eid = next(self._ids)
        self._index[k], self._entry[block] = block, (k, eid)
        return eid

    def cached(self, block: int) -> bool:
        return block in self._entry

    def park(self, block: int) -> None:
        """The last slot holding cached `block` let it go: most recently used from now."""
        assert block in self._entry and block not in self._lru
        self._lru[block] = None

    def unpark(self, block: int) -> bool:
        """A slot takes `block` (a match): it is no longer evictable. True if it was parked."""
        if block not in self._lru:
            return False
        del self._lru[block]
        return True

    def evict(self) -> int:
        """Forget the least recently used parked block and return it (its contents are lost)."""
        block, _ = self._lru.popitem(last=False)
        self._forget(block)
        return block

    def clear(self) -> list[int]:
        """Forget every entry (after a failed step, whose writes cannot be trusted); returns
        the blocks that were parked, which are now plain free blocks."""
        parked = list(self._lru)
        self._index.clear()
        self._entry.clear()
        self._lru.clear()
        return parked

    def _forget(self, block: int) -> None:
        k, _ = self._entry.pop(block)
        del self._index[k]

    def check(self, held: set[int]) -> None:
        """Assert the invariants, given the blocks slots hold (KVPool.check calls this)."""
        assert len(self._index) == len(self._entry)
        assert all(self._index[k] == b for b, (k, _) in self._entry.items())
        assert set(self._lru) <= set(self._entry), "a parked block is not cached"
        assert held.isdisjoint(self._lru), "a block a slot holds is evictable"
