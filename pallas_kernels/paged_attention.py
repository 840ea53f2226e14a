"""Ragged paged attention: prompt chunks and decode rows of a packed step in one Pallas call.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

Work split. The packed query axis is cut into query blocks of BQ rows of one sequence
(`query_blocks`). Program (i, k, s) takes query block i, kv head k and kv split s: the G query
heads of kv head k for those rows are packed into one [BQ*G, D] operand, and the program walks
the sequence's block table in logical order over split s's blocks (at most BPS of them, never
past the sequence's kv length) with an online softmax, causal per query position. A long
context is thus spread over several programs; their (max, sum, accumulator) partials are
combined in jnp afterwards. Nothing past a sequence's kv length is read.

Triton backend (CUDA; ROCm through Triton as well): there is no scalar prefetch, so block
tables, kv lengths and the query-block list are ordinary inputs read inside the kernel, and the
KV caches are whole-array refs indexed by physical block. Tile sizes (BQ*G, P, D) are powers of
two, as Triton requires. Not yet run on ROCm: there a wavefront is 64 lanes (num_warps=4 is 256
threads) and a CU has less shared memory, so num_stages may have to drop to 1. On CPU the
kernel runs in interpret mode.

Shapes: T packed query rows, S segments (sequences in the step), H query heads, K kv heads,
G = H / K, D head dim, P block size, NB blocks in the pool, MB blocks per sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MASK_VALUE = -1e30  # finite: a fully masked row keeps m finite and contributes nothing


def paged_attention_reference(
    q, k_cache, v_cache, seg_ids, positions, block_tables, kv_lens, *, scale, cu_q_lens=None
):
    """Row-at-a-time jnp reference: gathers each row's whole block table.

    Args:
      q: [T, H, D]; k_cache, v_cache: [NB, P, K, D]; seg_ids, positions: [T] int32;
      block_tables: [S, MB] int32; kv_lens: [S] int32; scale: softmax scale.
      cu_q_lens: unused (the kernel's signature).
    Returns:
      [T, H, D] in q's dtype.
    """
    del cu_q_lens
    T, H, D = q.shape
    _, P, K, _ = k_cache.shape
    L = block_tables.shape[1] * P
    k = k_cache[block_tables[seg_ids]].reshape(T, L, K, D).astype(jnp.float32)
    v = v_cache[block_tables[seg_ids]].reshape(T, L, K, D).astype(jnp.float32)
    qg = q.reshape(T, K, H // K, D).astype(jnp.float32)
    s = jnp.einsum("tkgd,tlkd->tkgl", qg, k) * scale
    limit = jnp.minimum(positions, kv_lens[seg_ids] - 1)
    mask = jnp.arange(L)[None, :] <= limit[:, None]
    s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("tkgl,tlkd->tkgd", p, v).reshape(T, H, D).astype(q.dtype)


def query_blocks(cu_q_lens, T: int, block_q: int):
    """Query blocks of up to block_q rows, each within one segment.

    Args:
      cu_q_lens: [S+1] int32 row offsets of the segments on the packed axis.
      T: packed rows; block_q: BQ.
    Returns:
      [NBLK, 3] int32 (segment, first row, rows) with NBLK = ceil(T / BQ) + S, a bound on
      sum(ceil(q_len / BQ)); unused entries have 0 rows.
    """
    S = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    nb = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(nb)
    i = jnp.arange(-(-T // block_q) + S)
    seg = jnp.minimum(jnp.searchsorted(ends, i, side="right"), S - 1)
    local = i - (ends[seg] - nb[seg])
    start = cu_q_lens[seg] + local * block_q
    n = jnp.where(i < ends[-1], jnp.clip(q_lens[seg] - local * block_q, 0, block_q), 0)
    return jnp.stack([seg, start, n], axis=1).astype(jnp.int32)


def _kernel(
    meta_ref,
    bt_ref,
    kvlen_ref,
    q_ref,
    qpos_ref,
    k_ref,
    v_ref,
    acc_ref,
    m_ref,
    l_ref,
    *,
    scale,
    P,
    BQG,
    G,
    BPS,
):
    i, kh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seg, start, n = meta_ref[i, 0], meta_ref[i, 1], meta_ref[i, 2]
    kv_len = kvlen_ref[seg]
    q = q_ref[kh, pl.ds(start * G, BQG), :]  # [BQG, D]: BQ rows x G heads
    qpos = qpos_ref[pl.ds(start * G, BQG)]  # [BQG]
    row_ok = jnp.arange(BQG) < n * G
    n_blocks = jnp.where(n > 0, (kv_len + P - 1) // P, 0)
    lo = sp * BPS
    hi = jnp.minimum(lo + BPS, n_blocks)

    def body(j, carry):
        m, den, acc = carry
        phys = bt_ref[seg, j]
        kb = k_ref[phys, :, kh, :]  # [P, D]
        vb = v_ref[phys, :, kh, :]
        s = (
            jax.lax.dot_general(q, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            * scale
        )
        kpos = j * P + jnp.arange(P)
        mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < kv_len) & row_ok[:, None]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        den = den * alpha + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(
            p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return m_new, den, acc * alpha[:, None] + pv

    D = acc_ref.shape[-1]
    init = (
        jnp.full((BQG,), MASK_VALUE, jnp.float32),
        jnp.zeros((BQG,), jnp.float32),
        jnp.zeros((BQG, D), jnp.float32),
    )
    m, den, acc = jax.lax.fori_loop(lo, hi, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = den


def plan_tiles(
    T: int,
    S: int,
    G: int,
    MB: int,
    P: int,
    K: int,
    D: int,
    split_tokens: int = 1024,
    partial_budget: int = 64 << 20,
):
    """(BQ, BPS, NS): rows per query block, kv blocks per split, splits.

    Small steps (decode rows) get 16-row operands; larger steps 64, so a prompt chunk reuses
    each KV tile across more queries. Splits of `split_tokens` spread long contexts over
    programs, as long as the f32 partials stay under `partial_budget` bytes.
    """
    bqg = max(16 if T <= 64 else 64, G)
    bq = bqg // G
    nblk = -(-T // bq) + S
    bps = max(1, split_tokens // P)
    while True:
        ns = -(-MB // bps)
        if ns == 1 or nblk * K * ns * bqg * (D + 2) * 4 <= partial_budget:
            return bq, bps, ns
        bps *= 2


def paged_attention(
    q,
    k_cache,
    v_cache,
    seg_ids,
    positions,
    block_tables,
    kv_lens,
    *,
    scale,
    cu_q_lens,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    split_tokens: int = 1024,
):
    """Pallas ragged paged attention with paged_attention_reference's signature.

    Args:
      q: [T, H, D]; k_cache, v_cache: [NB, P, K, D] (already holding this step's K/V);
      seg_ids: [T] int32 (unused: rows are found from cu_q_lens); positions: [T] int32;
      block_tables: [S, MB] int32; kv_lens: [S] int32; scale: softmax scale;
      cu_q_lens: [S+1] int32 row offsets of the segments.
      interpret: run the kernel in interpret mode (default: when the backend is the CPU).
    Returns:
      [T, H, D] in q's dtype; rows outside every segment are zero.
    """
    del seg_ids
    T, H, D = q.shape
    NB, P, K, Dk = k_cache.shape
    S, MB = block_tables.shape
    if Dk != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shapes {k_cache.shape}, {v_cache.shape} do not fit q {q.shape}")
    if H % K:
        raise ValueError(f"{H} query heads are not a multiple of {K} kv heads")
    G = H // K
    for name, n in (("block size", P), ("head dim", D), ("group size", G)):
        if n & (n - 1):
            raise ValueError(f"{name} {n} is not a power of two (Triton tiles)")
    if cu_q_lens.shape != (S + 1,) or kv_lens.shape != (S,) or positions.shape != (T,):
        raise ValueError(
            f"metadata shapes cu_q_lens {cu_q_lens.shape}, kv_lens {kv_lens.shape}, "
            f"positions {positions.shape} do not fit {S} segments and {T} rows"
        )
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    bq, bps, ns = plan_tiles(T, S, G, MB, P, K, D, split_tokens)
    bqg = bq * G
    meta = query_blocks(cu_q_lens, T, bq)
    nblk = meta.shape[0]
    # [K, (T + BQ) * G, D]: a block's rows x heads are contiguous; padded so the last block's
    # fixed-size load stays in bounds.
    qk = jnp.pad(q, ((0, bq), (0, 0), (0, 0))).reshape(T + bq, K, G, D)
    qk = qk.transpose(1, 0, 2, 3).reshape(K, (T + bq) * G, D).astype(k_cache.dtype)
    qpos = jnp.repeat(jnp.pad(positions, (0, bq)), G)

    def full(x):
        return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)

    inputs = (meta, block_tables, kv_lens, qk, qpos, k_cache, v_cache)
    kernel = functools.partial(_kernel, scale=scale, P=P, BQG=bqg, G=G, BPS=bps)
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    acc, m, den = pl.pallas_call(
        kernel,
        grid=(nblk, K, ns),
        in_specs=[full(x) for x in inputs],
        out_specs=[
            pl.BlockSpec((None, None, None, bqg, D), lambda i, k, s: (i, k, s, 0, 0)),
            pl.BlockSpec((None, None, None, bqg), lambda i, k, s: (i, k, s, 0)),
            pl.BlockSpec((None, None, None, bqg), lambda i, k, s: (i, k, s, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((nblk, K, ns, bqg, D), jnp.float32),
            jax.ShapeDtypeStruct((nblk, K, ns, bqg), jnp.float32),
            jax.ShapeDtypeStruct((nblk, K, ns, bqg), jnp.float32),
        ],
        interpret=interpret,
        **params,
    )(*inputs)
    # Combine the splits: weights exp(m_s - max m) over splits that saw any key.
    mx = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(den > 0, jnp.exp(m - mx), 0.0)
    denom = jnp.sum(w * den, axis=2)
    o = jnp.sum(w[..., None] * acc, axis=2) / jnp.maximum(denom, 1e-30)[..., None]
    o = o.reshape(nblk, K, bq, G, D).transpose(0, 2, 1, 3, 4).reshape(nblk * bq, H, D)
    r = jnp.arange(bq)
    rows = jnp.where(r[None, :] < meta[:, 2:3], meta[:, 1:2] + r[None, :], T).reshape(-1)
    out = jnp.zeros((T + 1, H, D), q.dtype).at[rows].set(o.astype(q.dtype), mode="drop")
    return out[:T]
