"""How many blocks each KV cache group gets: from the tokens asked for, or from the device
memory left after the weights, a workspace and the per-slot state (the builder's
`--kv-pool-tokens 0`). Pure arithmetic over the device's allocator statistics."""

from __future__ import annotations

import dataclasses
import logging

from .config import EngineConfig
from .step_format import GroupShape

log = logging.getLogger(__name__)

# Device memory kept free for compile workspace and step activations when sizing the pool.
WORKSPACE_FRACTION = 0.08
# What the pool sizing counts as in use besides the weights (small arrays, the allocator's
# own). The pool is sized from these fixed figures, not from the allocator's bytes_in_use,
# which moved by tens of MB between two starts on the H200 (41530 and 41515 blocks): a pool
# of another shape is another program, so every step missed the compile cache on restart.
ALLOCATOR_SLACK = 2**30


def kv_spaces(
    c: EngineConfig, groups, device, reserved: int = 0, weights: int = 0
) -> list[GroupShape]:
    """Each cache group's block space (the sink block included): room for kv_pool_tokens tokens,
    or for what device memory holds after the workspace, `reserved` bytes (per-slot state
    allocated later) and what is in use. A sliding-window group needs no more than a window's
    blocks per slot (GroupShape.cap), whatever the others hold.

    In use is `weights` + ALLOCATOR_SLACK, the same on every start, so a restart builds the
    same programs and hits the compile cache; only where the allocator holds more than that
    does its bytes_in_use count, rounded up to a GiB (and a warning says so).

    Args: groups: the family's models.family.CacheGroup list (build.cache_groups).
    """
    shapes = []
    for g in groups:
        P = g.block_size or c.kv_block_size
        s = GroupShape(0, P, 0, g.tokens_per_entry, g.window)
        shapes.append(dataclasses.replace(s, max_blocks=s.blocks_for(c.max_ctx)))
    windowed = [s.window > 0 for s in shapes]
    # what one block of each group costs, and the fixed cost of the windowed groups
    block_bytes = [s.block_size * s.tokens_per_entry * g.bytes_per_token
                   for g, s in zip(groups, shapes, strict=True)]  # fmt: skip
    fixed = [c.max_concurrency * s.cap(c.max_ctx, c.step_span) if w else 0
             for s, w in zip(shapes, windowed, strict=True)]  # fmt: skip
    per_token = sum(g.bytes_per_token for g, w in zip(groups, windowed, strict=True) if not w)
    if c.kv_pool_tokens:
        tokens, whole = c.kv_pool_tokens, False
    else:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "bytes_limit" in stats:
            in_use = weights + ALLOCATOR_SLACK
            if stats["bytes_in_use"] > in_use:
                in_use = -(-stats["bytes_in_use"] // 2**30) * 2**30
                log.warning("%.1f GiB in use besides the weights: the KV pool's size may differ "
                            "between starts", (in_use - weights) / 2**30)  # fmt: skip
            free = stats["bytes_limit"] * (1 - WORKSPACE_FRACTION) - in_use - reserved
            free -= sum(f * b for f, b in zip(fixed, block_bytes, strict=True))
            tokens, whole = (int(free // per_token) if per_token else c.max_ctx), True
        else:  # no allocator statistics (CPU): room for every slot at full context
            tokens, whole = c.max_concurrency * c.max_ctx, False
    if tokens < c.max_ctx:
        raise ValueError(
            f"kv_pool_tokens: the KV pool holds {max(tokens, 0)} tokens, less than one "
            f"max_ctx={c.max_ctx} sequence; lower max_ctx or free device memory"
        )
    out = []
    for s, f in zip(shapes, fixed, strict=True):
        # from memory: whole blocks that fit; asked for: blocks that hold them all, however
        # max_concurrency sequences of at most max_ctx split them (each sequence's partial
        # last block counts: n sequences of t tokens in all need at most blocks_for(t) + n - 1
        # blocks, and a compressed block spans P * m tokens, 2048 for m = 128)
        n = c.max_concurrency
        asked = min(s.blocks_for(tokens) + n - 1, n * s.max_blocks)
        blocks = f or (tokens // (s.block_size * s.tokens_per_entry) if whole else asked)
        out.append(dataclasses.replace(s, num_blocks=blocks + 1))
    return out
