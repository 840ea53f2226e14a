"""Paged attention over the packed token axis: the pure-XLA reference backend.

A Pallas kernel (pallas_kernels/paged_attention.py) replaces this on GPU; both take the same
arguments, so the model calls whichever `attention_fn` it is given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_cache

# Query rows gathered per pass: bounds the [tile, L, K, D] KV gather of long prefills.
QUERY_TILE = 32
# Finite, so padding rows with nothing to attend to stay finite and never write NaN into the
# sink block (a NaN there times a zero weight would poison real rows that gather it).
MASK_VALUE = -1e30


def paged_attention_xla(
    q, k_cache, v_cache, seg_ids, positions, block_tables, kv_lens, *, scale, cu_q_lens=None
):
    """Causal attention of packed query rows against their sequences' paged KV.

    Each query row attends to KV positions 0..positions[t] of its segment, read through the
    segment's block table; positions past it (stale data of earlier tenants) are masked.

    Args:
      q: [T, H, D] queries.
      k_cache, v_cache: [NB, P, K, D] KV blocks (already holding this step's K/V), or
        kv_cache.Quantized caches, dequantized here to q's dtype.
      seg_ids: [T] int32 segment (row of block_tables) of each query row.
      positions: [T] int32 absolute position of each query row.
      block_tables: [S, MB] int32 physical block of each logical block.
      kv_lens: [S] int32 KV length of each segment after this step (positions < kv_lens).
      cu_q_lens: unused here (the Pallas kernel finds its query blocks from it).
    Returns:
      [T, H, D] attention output in q's dtype.
    """
    del cu_q_lens
    T, H, D = q.shape
    _, P, K = kv_cache.leading_shape(k_cache)
    cdt = kv_cache.compute_dtype(k_cache, q.dtype)
    MB = block_tables.shape[1]
    L = MB * P
    G = H // K
    tile = min(T, QUERY_TILE)
    pad = -T % tile

    def one(qt, st, pt):
        n = qt.shape[0]
        blocks = block_tables[st]  # [n, MB]
        k = kv_cache.values(kv_cache.gather(k_cache, blocks), cdt).reshape(n, L, K, D)
        v = kv_cache.values(kv_cache.gather(v_cache, blocks), cdt).reshape(n, L, K, D)
        qg = qt.reshape(n, K, G, D).astype(k.dtype)
        s = jnp.einsum("tkgd,tlkd->tkgl", qg, k, preferred_element_type=jnp.float32) * scale
        limit = jnp.minimum(pt, kv_lens[st] - 1)
        mask = jnp.arange(L)[None, :] <= limit[:, None]  # [n, L]
        s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("tkgl,tlkd->tkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o.reshape(n, H, D).astype(q.dtype)

    if pad == 0 and tile == T:
        return one(q, seg_ids, positions)
    qp = jnp.pad(q, ((0, pad), (0, 0), (0, 0)))
    sp = jnp.pad(seg_ids, (0, pad))
    pp = jnp.pad(positions, (0, pad))
    n = (T + pad) // tile
    out = jax.lax.map(
        lambda a: one(*a),
        (qp.reshape(n, tile, H, D), sp.reshape(n, tile), pp.reshape(n, tile)),
    )
    return out.reshape(-1, H, D)[:T]
