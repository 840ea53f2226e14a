"""Ragged paged attention: prompt chunks and decode rows of a packed step in one Pallas call.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

Work split. The packed query axis is cut into query blocks of BQ rows of one sequence
(`query_blocks`). Program (i, k, s) takes query block i, kv head k and kv split s: the G query
heads of kv head k for those rows are packed into one [BQ*G, D] operand, and the program walks
the sequence's keys in logical order over split s (TPS tiles of BK tokens, never past the keys
the block needs) with an online softmax, causal per query position. A tile gathers its BK
tokens through the block table, so BK is independent of the block size P: one iteration moves
enough bytes to keep the memory system busy even for a single decode row. A long context is
spread over several programs; their (max, sum, accumulator) partials are combined in jnp
afterwards. Tokens past a sequence's kv length are masked loads, never read.

KV types: plain float caches, and q8_0 / q4_0 (kv_cache.py beside this file), contracted a
scale group at a time: each group's codes (exact small integers) go straight into a dot, and
its scale multiplies the dot's result (keys) or the probabilities (values), so a quantized
tile moves fewer bytes and does no more work per byte than a plain one (scales multiplied per
value column had taken 64 decode rows at 4096 to 614 / 1921 us with q8_0 / q4_0 against 338
for bf16, bench/results/2026-11-30_attention_kernel_kvtypes_h200.md).

Triton backend (CUDA; ROCm through Triton as well): there is no scalar prefetch, so block
tables, kv lengths and the query-block list are ordinary inputs read inside the kernel, and the
KV caches are whole-array refs indexed by physical block and offset. Tile sizes (BQ*G, BK, D)
are powers of two, as Triton requires; a group of G heads that is not is padded with zero
queries. Not yet run on ROCm (64-lane wavefronts, less shared memory a CU: num_stages may have
to drop to 1). On CPU the kernel runs in interpret mode.

Shapes: T packed query rows, S segments (sequences in the step), H query heads, K kv heads,
G = H / K, D head dim, P block size, NB blocks in the pool, MB blocks per sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import kv_cache, kv_tiles
from .call_options import call_options, whole
from .kv_cache import GROUP

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
    blocks = block_tables[seg_ids]  # [T, MB]
    k = kv_cache.values(kv_cache.gather(k_cache, blocks), jnp.float32)  # [T, MB, P, K, D]
    v = kv_cache.values(kv_cache.gather(v_cache, blocks), jnp.float32)
    _, MB, P, K, _ = k.shape
    L = MB * P
    k, v = k.reshape(T, L, K, D), v.reshape(T, L, K, D)
    qg = q.reshape(T, K, H // K, D).astype(jnp.float32)
    s = jnp.einsum("tkgd,tlkd->tkgl", qg, k) * scale
    limit = jnp.minimum(positions, kv_lens[seg_ids] - 1)
    mask = jnp.arange(L)[None, :] <= limit[:, None]
    s = jnp.where(mask[:, None, None, :], s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("tkgl,tlkd->tkgd", p, v).reshape(T, H, D).astype(q.dtype)


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


def _dot(a, b, contract_b: int):
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32
    )


def _kernel(
    meta_ref, bt_ref, kvlen_ref, q_ref, qpos_ref, *refs, scale, BQG, G, BK, TPS, NS, kinds,
    split_masks,
):  # fmt: skip
    k_kind, v_kind = kinds
    refs = list(refs)
    k_data = refs.pop(0)
    k_scale = refs.pop(0) if k_kind != "plain" else None
    v_data = refs.pop(0)
    v_scale = refs.pop(0) if v_kind != "plain" else None
    acc_ref, m_ref, l_ref = refs
    P, MB, D = k_data.shape[1], bt_ref.shape[1], acc_ref.shape[-1]
    cdt = q_ref.dtype

    i, kh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seg, start, n = meta_ref[i, 0], meta_ref[i, 1], meta_ref[i, 2]
    qpos = qpos_ref[pl.ds(start * G, BQG)]  # [BQG]: BQ rows x G heads
    row_ok = jnp.arange(BQG) < n * G
    # Keys this block needs: causal up to its last row's position, within the kv length.
    last = qpos_ref[jnp.maximum(start + n - 1, 0) * G]
    need = jnp.where(n > 0, jnp.minimum(kvlen_ref[seg], last + 1), 0)
    tiles = (need + BK - 1) // BK
    if TPS:  # fixed splits: TPS tiles each, over the longest context the table holds
        lo = sp * TPS
    else:  # NS equal runs of the tiles this block needs, however long its context
        TPS = (tiles + NS - 1) // NS
        lo = jnp.minimum(sp * TPS, tiles)
    hi = jnp.minimum(lo + TPS, tiles)
    rows = pl.ds(start * G, BQG)
    q = q_ref[kh, rows, :]  # [BQG, D]
    # Quantized values accumulate per piece of a scale group ([BQG, n] each), written side by
    # side at the end; a plain V accumulates [BQG, D] at once.
    v_cols = [(0, D)] if v_kind == "plain" else [
        (g * GROUP + first, n) for g in range(D // GROUP) for first, n in kv_tiles.pieces(v_kind)
    ]  # fmt: skip
    q_parts = {  # q's columns per piece of a quantized K's groups, loaded once
        (g, first): q_ref[kh, rows, pl.ds(g * GROUP + first, n)]
        for g in range(D // GROUP if k_kind != "plain" else 0)
        for first, n in kv_tiles.pieces(k_kind)
    }
    q_sums = {}  # q's sum over each group, for codes stored with an offset (q4_0)
    for g in range(D // GROUP if k_kind == "q4_0" else 0):
        parts = [q_parts[g, first].astype(jnp.float32) for first, _ in kv_tiles.pieces(k_kind)]
        q_sums[g] = sum(jnp.sum(p, axis=1) for p in parts)

    def scores(phys, off, ok):
        """q . k for the tile's BK tokens: [BQG, BK] float32."""
        if k_kind == "plain":
            return _dot(q, kv_tiles.load_tile(k_data, phys, off, kh, ok, cdt, D), 1)
        s = jnp.zeros((BQG, BK), jnp.float32)
        for g in range(D // GROUP):
            sc, pieces, (a, b) = kv_tiles.group_pieces(
                k_data, k_scale, k_kind, phys, off, kh, ok, g, cdt
            )
            part = None
            for first, f in pieces:
                d = _dot(q_parts[g, first], f, 1)
                part = d if part is None else part + d
            if b:  # q . (a f + b) = a (q . f) + b sum(q), a and b folded into the scale
                s = s + part * (a * sc)[None, :] + (b * q_sums[g])[:, None] * sc[None, :]
            else:
                s = s + part * sc[None, :]
        return s

    def values(p, phys, off, ok):
        """p [BQG, BK] times the tile's values, per accumulator piece."""
        if v_kind == "plain":
            return [_dot(p.astype(cdt), kv_tiles.load_tile(v_data, phys, off, kh, ok, cdt, D), 0)]
        out = []
        for g in range(D // GROUP):
            sc, pieces, (a, b) = kv_tiles.group_pieces(
                v_data, v_scale, v_kind, phys, off, kh, ok, g, cdt
            )
            pg = (p * sc[None, :]).astype(cdt)
            if b:  # pg @ (a f + b) = a (pg @ f) + b rowsum(pg)
                pg_sum = b * jnp.sum(pg.astype(jnp.float32), axis=1)[:, None]
                out += [a * _dot(pg, f, 0) + pg_sum for _, f in pieces]
            else:
                out += [_dot(pg, f, 0) for _, f in pieces]
        return out

    def body(j, carry, masked=True):
        m, den, accs = carry
        kpos = j * BK + jnp.arange(BK)
        ok = kpos < need if masked else None
        phys = bt_ref[seg, jnp.minimum(kpos // P, MB - 1)]  # [BK] physical block per token
        off = kpos % P
        s = scores(phys, off, ok) * scale  # [BQG, BK]
        if masked:
            mask = (kpos[None, :] <= qpos[:, None]) & ok[None, :] & row_ok[:, None]
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        p = jnp.where(mask, p, 0.0) if masked else p
        alpha = jnp.exp(m - m_new)
        den = den * alpha + jnp.sum(p, axis=1)
        new = values(p, phys, off, ok)
        accs = tuple(a * alpha[:, None] + n for a, n in zip(accs, new, strict=True))
        return m_new, den, accs

    init = (
        jnp.full((BQG,), MASK_VALUE, jnp.float32),
        jnp.zeros((BQG,), jnp.float32),
        tuple(jnp.zeros((BQG, n), jnp.float32) for _, n in v_cols),
    )
    if split_masks:
        # Tiles whose every key all rows see (before the block's first position, within the
        # keys it needs) run without the mask; only the rest, the diagonal and the tail, mask.
        # A row outside the block (row_ok False) then computes values nobody reads.
        whole = jnp.clip(jnp.minimum(qpos_ref[start * G] + 1, need) // BK, lo, hi)
        init = jax.lax.fori_loop(lo, whole, functools.partial(body, masked=False), init)
        lo = whole
    m, den, accs = jax.lax.fori_loop(lo, hi, body, init)
    for (c0, n), a in zip(v_cols, accs, strict=True):
        acc_ref[:, pl.ds(c0, n)] = a
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
    split_tokens: int = 256,
    block_k: int = 64,
    partial_budget: int = 64 << 20,
    block_qg: int = 64,
):
    """(BQ, TPS, NS): rows per query block, kv tiles of block_k tokens per split, splits.

    Small steps (decode rows) get 16-row operands, larger ones `block_qg` (a prompt chunk reuses
    each KV tile across more queries). Splits of `split_tokens` spread long contexts over
    programs while the f32 partials stay under `partial_budget` bytes.
    """
    bqg = max(16 if T <= 64 else block_qg, G)
    bq = bqg // G
    nblk = -(-T // bq) + S
    tiles = -(-MB * P // block_k)
    tps = max(1, split_tokens // block_k)
    while True:
        ns = -(-tiles // tps)
        if ns == 1 or nblk * K * ns * bqg * (D + 2) * 4 <= partial_budget:
            return bq, tps, ns
        tps *= 2


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
    split_tokens: int = 256,
    block_k: int = 64,
    block_qg: int = 64,
    split_masks: bool | None = None,
    splits: int | None = None,
):
    """Pallas ragged paged attention with paged_attention_reference's signature.

    Args:
      q: [T, H, D]; k_cache, v_cache: [NB, P, K, D] arrays or kv_cache.Quantized (q8_0 / q4_0),
        already holding this step's K/V;
      seg_ids: [T] int32 (unused: rows are found from cu_q_lens); positions: [T] int32;
      block_tables: [S, MB] int32; kv_lens: [S] int32; scale: softmax scale;
      cu_q_lens: [S+1] int32 row offsets of the segments.
      interpret: run the kernel in interpret mode (default: when the backend is the CPU).
      split_tokens, block_k: kv tokens per program and per loop iteration (BK).
      block_qg: query rows x heads a program reads its keys for, in steps over 64 rows.
      split_masks: walk the tiles all of a block's rows see whole in a loop without masks,
        then the rest with them (FlashAttention-2's causal split). None: on, except for bf16
        (plain) caches at T <= 64 (decode-sized steps). On the H200 the split took steps with
        prompt rows 13-27% faster (2048 rows over 6k keys 981 -> 721 us, a 200-row warm prefix
        step over 8.6k 198 -> 156), q8_0 caches 8-13% faster at every shape, and plain decode
        rows 0-3% slower (64 x 32k 1995 -> 2054 us):
        bench/results/2026-12-03_attention_split_masks_h200.md.
      splits: a fixed number of kv splits per query block and kv head, each walking an equal
        share of the keys that block needs (computed in the kernel from its kv length), in
        place of split_tokens' splits over the longest context the block table holds: with few
        rows, a short context still spreads over `splits` programs, and a long one writes no
        more partials than a short one (flash-decoding with the split count fixed per bucket).
    Returns:
      [T, H, D] in q's dtype; rows outside every segment are zero.
    """
    del seg_ids
    T, H, D = q.shape
    kinds = (kv_cache.kind(k_cache), kv_cache.kind(v_cache))
    k_in = tuple(k_cache) if kinds[0] != "plain" else (k_cache,)
    v_in = tuple(v_cache) if kinds[1] != "plain" else (v_cache,)
    NB, P, K = kv_cache.leading_shape(k_cache)
    S, MB = block_tables.shape
    for c, kind in zip((k_in, v_in), kinds, strict=True):
        want = D if kind in ("plain", "q8_0") else D // 8
        if c[0].shape != (NB, P, K, want) or (kind != "plain" and D % GROUP):
            raise ValueError(
                f"{kind} cache shape {c[0].shape} does not fit q {q.shape} and blocks {(NB, P, K)}"
            )
    if H % K:
        raise ValueError(f"{H} query heads are not a multiple of {K} kv heads")
    G = H // K
    if split_masks is None:
        split_masks = kinds != ("plain", "plain") or T > 64
    Gp = 1 << (G - 1).bit_length()  # a group is padded with zero queries to a power of two
    sizes = {"block size": P, "head dim": D, "block_k": block_k, "block_qg": block_qg}
    for name, n in sizes.items():
        if n & (n - 1):
            raise ValueError(f"{name} {n} is not a power of two (Triton tiles)")
    if cu_q_lens.shape != (S + 1,) or kv_lens.shape != (S,) or positions.shape != (T,):
        raise ValueError(
            f"metadata shapes cu_q_lens {cu_q_lens.shape}, kv_lens {kv_lens.shape}, "
            f"positions {positions.shape} do not fit {S} segments and {T} rows"
        )
    bq, tps, ns = plan_tiles(T, S, Gp, MB, P, K, D, split_tokens, block_k, block_qg=block_qg)
    if splits is not None:
        if splits < 1:
            raise ValueError(f"splits {splits} must be at least 1")
        tps, ns = 0, splits  # TPS 0: the kernel sizes each split from the block's keys
    bqg = bq * Gp
    meta = query_blocks(cu_q_lens, T, bq)
    nblk = meta.shape[0]
    cdt = kv_cache.compute_dtype(k_cache, q.dtype)
    # [K, (T + BQ) * Gp, D]: a block's rows x heads are contiguous; padded so the last block's
    # fixed-size load stays in bounds.
    qk = jnp.pad(q.reshape(T, K, G, D), ((0, bq), (0, 0), (0, Gp - G), (0, 0)))
    qk = qk.transpose(1, 0, 2, 3).reshape(K, (T + bq) * Gp, D).astype(cdt)
    qpos = jnp.repeat(jnp.pad(positions, (0, bq)), Gp)

    inputs = (meta, block_tables, kv_lens, qk, qpos, *k_in, *v_in)
    kernel = functools.partial(
        _kernel,
        scale=scale,
        BQG=bqg,
        G=Gp,
        BK=block_k,
        TPS=tps,
        NS=ns,
        kinds=kinds,
        split_masks=split_masks,
    )
    options = call_options(interpret, num_warps, num_stages)
    acc, m, den = pl.pallas_call(
        kernel,
        grid=(nblk, K, ns),
        in_specs=[whole(x) for x in inputs],
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
        **options,
    )(*inputs)
    # Combine the splits: weights exp(m_s - max m) over splits that saw any key.
    mx = jnp.max(m, axis=2, keepdims=True)
    w = jnp.where(den > 0, jnp.exp(m - mx), 0.0)
    denom = jnp.sum(w * den, axis=2)
    o = jnp.sum(w[..., None] * acc, axis=2) / jnp.maximum(denom, 1e-30)[..., None]
    o = o.reshape(nblk, K, bq, Gp, D)[:, :, :, :G]
    o = o.transpose(0, 2, 1, 3, 4).reshape(nblk * bq, H, D)
    r = jnp.arange(bq)
    rows = jnp.where(r[None, :] < meta[:, 2:3], meta[:, 1:2] + r[None, :], T).reshape(-1)
    out = jnp.zeros((T + 1, H, D), q.dtype).at[rows].set(o.astype(q.dtype), mode="drop")
    return out[:T]
