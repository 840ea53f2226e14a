"""Query blocks of a packed ragged axis: rows cut into blocks of up to BQ rows of one segment,
the work list of the kernels that take a packed step (paged_attention.py's query blocks,
moe_grouping.py's row tiles of one expert). Pure jnp; a kernel reads the list inside.

Shapes: T packed rows, S segments, NBLK blocks.
"""

from __future__ import annotations

import jax.numpy as jnp


def query_blocks(cu_q_lens, T: int, block_q: int, max_blocks: int | None = None):
    """Query blocks of up to block_q rows, each within one segment.

    Args:
      cu_q_lens: [S+1] int32 row offsets of the segments on the packed axis.
      T: packed rows; block_q: BQ.
      max_blocks: a tighter static bound on the blocks with rows, if the caller has one.
    Returns:
      [NBLK, 3] int32 (segment, first row, rows), blocks with rows first, with NBLK =
      ceil(T / BQ) + S (or max_blocks if smaller), a bound on sum(ceil(q_len / BQ)); unused
      entries have 0 rows.
    """
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    nb = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(nb)
    n_blocks = -(-T // block_q) + S
    i = jnp.arange(n_blocks if max_blocks is None else min(n_blocks, max_blocks))
    # compare_all: the default method is a while loop, which on GPU syncs with the host each turn.
    seg = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"), S - 1)
    local = i - (ends[seg] - nb[seg])
    start = cu_q_lens[seg] + local * block_q
    n = jnp.where(i < ends[-1], jnp.clip(q_lens[seg] - local * block_q, 0, block_q), 0)
    return jnp.stack([seg, start, n], axis=1).astype(jnp.int32)
