"""Grouped expert matmuls for mixture-of-experts layers, over rows sorted by expert.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

Work split. The M rows (token, expert) pairs, already grouped by expert (models/moe.py's stable
sort), are cut into row tiles of BM rows of one expert (`query_blocks.py`, shared with the paged
attention kernel: a tile never straddles two experts). Program (i, j) takes row tile i and
column tile j of BN output columns and runs over the contraction in BK chunks with that
expert's weights. An expert gets ceil(rows / BM) tiles, so nothing is padded to the largest
group, and an expert with no rows gets none; the tile count is bounded by
min(ceil(M / BM) + E, M) (the static grid; tiles past the real ones have 0 rows and exit at
once). The bound M matters at decode: one token's 8 rows over 128 experts made a grid of 129
row tiles, 121 of them empty, and the call took 196 us on the H200; with 8 tiles it took 27 us
(bench/results/history/2026-11-30_moe_kernel_grid_h200.md).

The gate/up projection fuses SwiGLU: with `swiglu`, w holds [gate | up] along its columns and
a program computes both column tiles and writes silu(gate) * up, so the [M, 2F] intermediate is
never stored.

Triton backend: expert ids and row offsets are ordinary inputs read inside the kernel (no scalar
prefetch); rows, contraction and columns are gathered with masks, so widths that are not
multiples of the tiles (or not powers of two, like an expert FFN of 768) need no padding of the
weights. On CPU the kernel runs in interpret mode, and its Triton module is verified by
tests/test_triton_lowering.py; bench/kernels/moe_kernel.py times it against ragged_dot on the GPU.

Shapes: M grouped rows, K contraction width, N output columns, E experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole
from .ggml_blocks import block_loaders, contract_block
from .quant_matmul import dot_nn, dot_nt
from .quant_weight import QuantWeight, dequantize_weight
from .query_blocks import query_blocks
from .swiglu import swiglu as glu


def expert_weights(w, dtype=None):
    """Dense [E, K, N] of w (a QuantWeight [E, N, K] dequantized to dtype, default its own)."""
    if isinstance(w, QuantWeight):
        return jnp.swapaxes(dequantize_weight(w, dtype or w.dtype), -1, -2)
    return w


def grouped_matmul_reference(x, w, sizes, *, swiglu: bool = False, limit: float = 0.0):
    """Row r times the weights of its expert, in float32.

    Args:
      x: [M, K] rows grouped by expert (expert e's rows follow expert e-1's).
      w: [E, K, N] (with swiglu: [E, K, 2N], gate columns then up columns), or a
        QuantWeight [E, N, K] ([E, 2N, K]), dequantized in float32.
      sizes: [E] int32 rows per expert; sum(sizes) <= M, rows past it belong to no expert.
    Returns:
      [M, N] float32; rows past sum(sizes) are zero.
    """
    w = expert_weights(w, jnp.float32)
    M = x.shape[0]
    ends = jnp.cumsum(sizes)
    expert = jnp.searchsorted(ends, jnp.arange(M), side="right", method="compare_all")
    real = jnp.arange(M) < ends[-1]
    wr = w[jnp.minimum(expert, w.shape[0] - 1)].astype(jnp.float32)  # [M, K, N]
    y = jnp.einsum("mk,mkn->mn", x.astype(jnp.float32), wr)
    if swiglu:
        gate, up = jnp.split(y, 2, axis=-1)
        y = glu(gate, up, limit)
    return jnp.where(real[:, None], y, 0.0)


def _kernel(meta_ref, x_ref, *refs, BM, BN, BK, N, swiglu, limit=0.0, fmt=None):
    """One (row tile, column tile) program. With fmt (a ggml_blocks.BlockFormat), the weight
    refs are the experts' QuantWeight head and body ([E, K / B * hs / u, N or 2N] in u-byte
    units, and [E, N or 2N, K / B * bs]) and the contraction walks them a block at a time, as
    quant_matmul's kernel does; else one dense w_ref, BK values at a time."""
    *w_refs, o_ref = refs
    w_ref = w_refs[0]
    i, j = pl.program_id(0), pl.program_id(1)
    e, start, n = meta_ref[i, 0], meta_ref[i, 1], meta_ref[i, 2]
    M, K = x_ref.shape
    rows = jnp.minimum(start + jnp.arange(BM), M - 1)
    row_ok = jnp.arange(BM) < n
    cols = j * BN + jnp.arange(BN)
    col_ok = cols < N
    halves = (cols, cols + N)[: 2 if swiglu else 1]  # gate and up column tiles

    def dense_body(kk, accs):
        ks = kk * BK + jnp.arange(BK)
        k_ok = ks < K
        xb = plgpu.load(
            x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0
        )
        wmask = k_ok[:, None] & col_ok[None, :]
        out = []
        for a, c in zip(accs, halves, strict=True):
            wb = plgpu.load(w_ref.at[e, ks[:, None], c[None, :]], mask=wmask, other=0)
            out.append(a + dot_nn(xb, wb))
        return tuple(out)

    def quant_body(b, accs):
        def load_x(first: int, width: int):
            ks = b * fmt.block + first + jnp.arange(width)
            return plgpu.load(x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None], other=0)

        out = []
        for a, c in zip(accs, halves, strict=True):
            load, load1 = block_loaders(
                fmt,
                lambda r, c_: w_refs[1].at[e, r, c_],
                lambda h, r: w_refs[0].at[e, h, r],
                c,
                col_ok,
                b,
            )
            out.append(contract_block(fmt, load, load1, load_x, a, dot_nt))
        return tuple(out)

    if fmt is None:
        body, steps = dense_body, (K + BK - 1) // BK
    else:
        body, steps = quant_body, K // fmt.block
    zero = jnp.zeros((BM, BN), jnp.float32)
    # A tile with no rows skips the contraction. Bounds are int32 values computed in the kernel:
    # Triton's scf.for needs equal bound types, and jnp.where(n > 0, 1, 0) lowered to i1.
    n_k = (n > 0).astype(n.dtype) * steps
    accs = jax.lax.fori_loop(n * 0, n_k, body, (zero,) * len(halves))
    y = glu(accs[0], accs[1], limit) if swiglu else accs[0]
    o_ref[...] = y.astype(o_ref.dtype)


def _tile(n: int, cap: int) -> int:
    """The power of two nearest above n, at least 16 (Triton's smallest dot), at most cap."""
    return max(16, min(cap, 1 << (n - 1).bit_length()))


def grouped_matmul(
    x,
    w,
    sizes,
    *,
    swiglu: bool = False,
    limit: float = 0.0,
    out_dtype=jnp.float32,
    block_m: int = 16,
    block_n: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """Pallas grouped matmul with grouped_matmul_reference's signature.

    Args:
      x: [M, K] rows grouped by expert; w: [E, K, N] or, with swiglu, [E, K, 2N], or a
        QuantWeight [E, N, K] ([E, 2N, K]) whose blocks are decoded in registers;
      sizes: [E] int32 rows per expert.
      out_dtype: result dtype (accumulation is float32).
      block_m, block_n, block_k: tile caps (BM rows, BN columns, BK contraction); BM is
        the mean rows per expert rounded up to a power of two, at least 16, at most block_m.
        The defaults (16, 128, 128, 4 warps, 3 stages) were the fastest of five tilings on
        the H200 from 8 to 32768 rows (bench/results/moe_kernel_h200.md).
      interpret: run in interpret mode (default: when the backend is the CPU).
    Returns:
      [M, N] in out_dtype; rows past sum(sizes) are zero.
    """
    M, K = x.shape
    quant = isinstance(w, QuantWeight)
    E, Nw, Kw = w.shape if quant else (w.shape[0], w.shape[2], w.shape[1])
    if Kw != K or sizes.shape != (E,):
        raise ValueError(f"x {x.shape}, w {w.shape} and sizes {sizes.shape} do not fit")
    if swiglu and Nw % 2:
        raise ValueError(f"swiglu needs [gate | up] columns; w has {Nw}")
    N = Nw // 2 if swiglu else Nw
    # Row tiles sized to the mean rows per expert: a decode step puts a few rows on each expert,
    # and a 64-row tile would spend its matrix work on masked rows.
    BM, BN, BK = _tile(-(-M // E), block_m), _tile(N, block_n), _tile(K, block_k)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes).astype(jnp.int32)])
    # Every tile with rows holds at least one of the M rows, so at most M tiles have rows.
    meta = query_blocks(cu, M, BM, max_blocks=M)  # [NT, 3] (expert, first row, rows)
    NT, NJ = meta.shape[0], -(-N // BN)
    options = call_options(interpret, num_warps, num_stages, name="grouped_matmul")

    kernel = functools.partial(_kernel, BM=BM, BN=BN, BK=BK, N=N, swiglu=swiglu, limit=limit,
                               fmt=w.format if quant else None)  # fmt: skip
    wdata = (w.head, w.body) if quant else (w,)
    tiles = pl.pallas_call(
        kernel,
        grid=(NT, NJ),
        in_specs=[whole(meta), whole(x), *map(whole, wdata)],
        out_specs=pl.BlockSpec((None, BM, BN), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((NT, BM, NJ * BN), out_dtype),
        **options,
    )(meta, x, *wdata)
    r = jnp.arange(BM)
    rows = jnp.where(r[None, :] < meta[:, 2:3], meta[:, 1:2] + r[None, :], M).reshape(-1)
    # Tile rows past a tile's rows get index M, out of bounds, and are dropped.
    out = jnp.zeros((M, N), out_dtype)
    return out.at[rows].set(tiles.reshape(NT * BM, -1)[:, :N], mode="drop")
