"""Ragged paged attention: prompt chunks and decode rows of a packed step in one Pallas call.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

Work split. The packed query axis is cut into query blocks of BQ rows of one sequence
(`query_blocks`). Program (i, k, s) takes query block i, kv head k and kv split s: it gathers the G
query heads of kv head k for those rows from q [T, H, D] into one [BQ*G, D] operand, and walks the
sequence's keys in logical order over split s (TPS tiles of BK tokens, never past the keys the block
needs) with an online softmax, causal per query position. A tile gathers its BK tokens through the
block table, so BK is independent of the block size P: one iteration moves enough bytes to keep the
memory system busy even for a single decode row. A long context is spread over several programs;
each stores its (max, sum, accumulator) partials at its own rows and heads, and split_combine.py
combines them (XLA's reduction, or from 32 splits on a kernel that reads the real rows' partials
only). Gathering q and storing partials by row took a call in the bench's loop of layers from 11
kernels to 6 (no transpose of q, no scatter of the output): one decode row at 4096 keys 26 -> 17 us,
8 rows 56 -> 46, 64 rows 296 -> 278 (bench/results/attention_partials_by_row_h200.md).
Tokens past a sequence's kv length are masked loads, never read.

KV types: plain float caches, and q8_0 / q4_0 (kv_cache.py beside this file). A quantized tile is
one contiguous load of each token's code words and one of its scales, made f16 in registers by
inline PTX and contracted in TILE_PIECES dots (kv_tiles.tile_pieces: runs of code planes, q read and
the output stored in their column order); its loads are issued a tile ahead. Per scale group dots
(an earlier form) had left q4_0 2.4-2.9x slower than a tile (8 rows x 4096 178 -> 75 us, 64 rows
1209 -> 422: bench/results/attention_tile_dequant_h200.md). With the PTX and the tile in
value order, 64 rows x 4096: q8_0 304 us, q4_0 289, bf16 269 (bench/results/
history/2026-12-04_attention_kernel_planes_h200.md); in pieces q8_0 280 and q4_0 247.

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
from jax.experimental.pallas import triton as plgpu

from . import kv_cache, kv_tiles
from .call_options import call_options, uses_ptx, whole
from .kv_cache import GROUP, VALUES_PER_WORD
from .query_blocks import query_blocks
from .split_combine import MASK_VALUE, PALLAS_FROM_SPLITS, split_combine, split_combine_reference


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


# Dots a quantized tile is contracted in (kv_tiles.tile_pieces), from a sweep on the H200
# (bench/results/attention_tile_pieces_h200.md): against one dot, q8_0's 4 planes as 4
# dots are 7-10% faster, q4_0's 8 as 2 dots 12-17% (128 registers, not 157); 8 dots spilled.
TILE_PIECES = {"q8_0": 4, "q4_0": 2}


def _dot(a, b, contract_b: int):
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32
    )


def _kernel(
    meta_ref, bt_ref, kvlen_ref, q_ref, pos_ref, *refs, scale, BQG, G, BK, TPS, NS, kinds,
    split_masks, ptx, pieces,
):  # fmt: skip
    k_kind, v_kind = kinds
    refs = list(refs)
    k_data = refs.pop(0)
    k_scale = refs.pop(0) if k_kind != "plain" else None
    v_data = refs.pop(0)
    v_scale = refs.pop(0) if v_kind != "plain" else None
    acc_ref, m_ref, l_ref = refs
    P, MB = k_data.shape[1], bt_ref.shape[1]
    T, H, D = q_ref.shape
    cdt = q_ref.dtype

    i, kh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seg, start, n = meta_ref[i, 0], meta_ref[i, 1], meta_ref[i, 2]
    # Operand row j is query row start + j // G, head kh * G' + j % G (G' the real group, G a
    # power of two); rows past the block and padded heads are masked.
    j = jnp.arange(BQG)
    Gr = H // k_data.shape[2]
    row_ok = (j // G < n) & (j % G < Gr)
    # Partials have BQ spare rows and G heads a kv head, so no two operand rows of a block share
    # a partial (interpret mode's masked stores write back what they read).
    t = jnp.minimum(start + j // G, acc_ref.shape[1] - 1)
    tq, hq = jnp.minimum(t, T - 1), jnp.minimum(kh * Gr + j % G, H - 1)  # in bounds for loads
    # Each cache's tile is contracted in pieces[c] dots (kv_tiles.tile_pieces), so q is read and
    # the output stored in the pieces' column orders: K's pieces over D, V's into the output.
    k_cols, v_cols = (
        kv_tiles.piece_values(kind, D, n) if kind != "plain" else [jnp.arange(D)]
        for kind, n in zip(kinds, pieces, strict=True)
    )
    qs = [
        plgpu.load(q_ref.at[tq[:, None], hq[:, None], c[None, :]], mask=row_ok[:, None], other=0)
        for c in k_cols
    ]
    qpos = plgpu.load(pos_ref.at[tq])  # [BQG]
    # Keys this block needs: causal up to its last row's position, within the kv length.
    last = pos_ref[jnp.minimum(jnp.maximum(start + n - 1, 0), T - 1)]
    need = jnp.where(n > 0, jnp.minimum(kvlen_ref[seg], last + 1), 0)
    tiles = (need + BK - 1) // BK
    if TPS:  # fixed splits: TPS tiles each, over the longest context the table holds
        lo = sp * TPS
    else:  # NS equal runs of the tiles this block needs, however long its context
        TPS = (tiles + NS - 1) // NS
        lo = jnp.minimum(sp * TPS, tiles)
    hi = jnp.minimum(lo + TPS, tiles)

    caches = ((k_data, k_scale, k_kind), (v_data, v_scale, v_kind))

    def tile_at(j):
        kpos = j * BK + jnp.arange(BK)
        return kpos, bt_ref[seg, jnp.minimum(kpos // P, MB - 1)], kpos % P  # phys block, offset

    def loads(j):
        """Tile j's raw loads of the quantized caches (none past the split's last tile)."""
        kpos, phys, off = tile_at(j)
        ok = (kpos < need) & (j < hi)
        return tuple(
            kv_tiles.quantized_loads(data, sc, kind, phys, off, kh, ok, D)
            for data, sc, kind in caches if kind != "plain"
        )  # fmt: skip

    def body(j, carry, masked=True):
        m, den, acc, raw = carry
        kpos, phys, off = tile_at(j)
        ok = kpos < need if masked else None
        # A quantized tile is dequantized in registers, which keeps Triton from pipelining its
        # loads as it does a plain tile's; they are issued a tile ahead here instead (64 rows x
        # 4096 of q8_0 367 -> 313 us on the H200; q4_0, bound by its unpacking, 389 -> 379:
        # bench/results/attention_kernel_kvtypes_h200.md).
        nxt, raw = loads(j + 1) if raw else (), list(raw)

        def tile(c) -> list:
            """Cache c's tile as its pieces [BK, D / pieces[c]] (k_cols / v_cols)."""
            data, _, kind = caches[c]
            if kind == "plain":
                return [kv_tiles.load_tile(data, phys, off, kh, ok, cdt, D)]
            return kv_tiles.tile_pieces(raw.pop(0), kind, cdt, ptx, pieces[c])

        dots = [_dot(qc, kc, 1) for qc, kc in zip(qs, tile(0), strict=True)]
        s = functools.reduce(jnp.add, dots) * scale  # [BQG, BK]
        if masked:
            mask = (kpos[None, :] <= qpos[:, None]) & ok[None, :] & row_ok[:, None]
            s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        p = jnp.where(mask, p, 0.0) if masked else p
        alpha = jnp.exp(m - m_new)
        den = den * alpha + jnp.sum(p, axis=1)
        pv = [_dot(p.astype(cdt), vc, 0) for vc in tile(1)]
        acc = tuple(a * alpha[:, None] + x for a, x in zip(acc, pv, strict=True))
        return m_new, den, acc, nxt

    init = (
        jnp.full((BQG,), MASK_VALUE, jnp.float32),
        jnp.zeros((BQG,), jnp.float32),
        tuple(jnp.zeros((BQG, c.shape[0]), jnp.float32) for c in v_cols),
        loads(lo),
    )
    if split_masks:
        # Tiles whose every key all rows see (before the block's first position, within the
        # keys it needs) run without the mask; only the rest, the diagonal and the tail, mask.
        # A row outside the block (row_ok False) then computes values nobody reads.
        first = pos_ref[jnp.minimum(start, T - 1)]
        whole = jnp.clip(jnp.minimum(first + 1, need) // BK, lo, hi)
        init = jax.lax.fori_loop(lo, whole, functools.partial(body, masked=False), init)
        lo = whole
    m, den, acc, _ = jax.lax.fori_loop(lo, hi, body, init)
    # Partials land at their query rows and heads: the combine needs no transpose or scatter.
    g = j % G
    for a, c in zip(acc, v_cols, strict=True):
        at = (sp, t[:, None], kh, g[:, None], c[None, :])
        plgpu.store(acc_ref.at[at], a, mask=row_ok[:, None])
    plgpu.store(m_ref.at[sp, t, kh, g], m, mask=row_ok)
    plgpu.store(l_ref.at[sp, t, kh, g], den, mask=row_ok)


def _quantized_compute_dtype(dtype):
    """What a step's attention over two quantized caches computes in: f16 for 16-bit queries
    (quantized tiles come out of kv_tiles' PTX as f16, and f16 keeps 3 more bits of q and p
    than bf16), else q's float32. f16 holds K/V values up to 65504 in magnitude, as llama.cpp's
    default f16 cache does."""
    return jnp.float16 if jnp.dtype(dtype).itemsize == 2 else dtype


def plan_tiles(
    T: int,
    G: int,
    MB: int,
    P: int,
    K: int,
    D: int,
    split_tokens: int = 256,
    block_k: int = 64,
    partial_budget: int = 16 << 20,
    block_qg: int = 64,
):
    """(BQ, TPS, NS): rows per query block, kv tiles of block_k tokens per split, splits.

    Small steps (decode rows) get 16-row operands, larger ones `block_qg` (a prompt chunk reuses
    each KV tile across more queries). Splits of `split_tokens` spread long contexts over
    programs while the f32 partials stay under `partial_budget` bytes: the combine reads them
    all in every layer, and MB is the longest context the engine serves (--max-ctx), not the
    step's.
    """
    bqg = max(16 if T <= 64 else block_qg, G)
    bq = bqg // G
    tiles = -(-MB * P // block_k)
    tps = max(1, split_tokens // block_k)
    while True:
        ns = -(-tiles // tps)
        if ns == 1 or ns * (T + bq) * K * G * (D + 2) * 4 <= partial_budget:
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
    pieces: int | None = None,
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
        bench/results/attention_split_masks_h200.md.
      splits: a fixed number of kv splits per query block and kv head, each walking an equal
        share of the keys that block needs (computed in the kernel from its kv length), in
        place of split_tokens' splits over the longest context the block table holds: with few
        rows, a short context still spreads over `splits` programs, and a long one writes no
        more partials than a short one (flash-decoding with the split count fixed per bucket).
      pieces: dots a quantized tile is contracted in, a power of two up to its planes (q8_0 4,
        q4_0 8); None: TILE_PIECES per type.
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
    for c, kind in zip((k_cache, v_cache), kinds, strict=True):
        lead, width = kv_cache.leading_shape(c), kv_cache.head_dim(c)
        if lead != (NB, P, K) or width != D or (kind != "plain" and D % GROUP):
            raise ValueError(
                f"{kind} cache of {lead} x {width} values does not fit q {q.shape} and blocks "
                f"{(NB, P, K)}"
            )
    if H % K:
        raise ValueError(f"{H} query heads are not a multiple of {K} kv heads")
    planes = [VALUES_PER_WORD[k] for k in kinds if k != "plain"]
    if pieces is not None and any(pieces < 1 or n % pieces for n in planes):
        raise ValueError(f"pieces {pieces} does not divide the caches' code planes {planes}")
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
    bq, tps, ns = plan_tiles(T, Gp, MB, P, K, D, split_tokens, block_k, block_qg=block_qg)
    if splits is not None:
        if splits < 1:
            raise ValueError(f"splits {splits} must be at least 1")
        tps, ns = 0, splits  # TPS 0: the kernel sizes each split from the block's keys
    bqg = bq * Gp
    meta = query_blocks(cu_q_lens, T, bq)
    nblk = meta.shape[0]
    cdt = kv_cache.compute_dtype(k_cache, q.dtype)
    if "plain" not in kinds:
        cdt = _quantized_compute_dtype(cdt)
    inputs = (meta, block_tables, kv_lens, q.astype(cdt), positions, *k_in, *v_in)
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
        ptx=uses_ptx(interpret),
        pieces=tuple(1 if kind == "plain" else pieces or TILE_PIECES[kind] for kind in kinds),
    )
    options = call_options(interpret, num_warps, num_stages, name="paged_attention")
    # Partials [NS, T + BQ, K, G, (D)] at the rows and heads they belong to; rows outside every
    # segment and padded heads are never written (undefined until the combine drops them).
    lead = (ns, T + bq, K, Gp)
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((*lead, D), lead, lead)]
    acc, m, den = pl.pallas_call(
        kernel,
        grid=(nblk, K, ns),
        in_specs=[whole(x) for x in inputs],
        out_specs=[whole(s) for s in shapes],
        out_shape=shapes,
        **options,
    )(*inputs)
    # Combine the splits (split_combine.py): with many, a kernel that reads real rows only.
    if ns >= PALLAS_FROM_SPLITS:
        return split_combine(acc, m, den, cu_q_lens, T, H, q.dtype, interpret=interpret)
    return split_combine_reference(acc, m, den, cu_q_lens, T, H, q.dtype)
