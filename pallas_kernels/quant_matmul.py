"""Matmuls with quantized weights dequantized in registers: x[M, K] @ W[K, N], W packed.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

Weight layout (Q8_0, ggml's block of 32 int8 values with one f16 scale): `Q8_0(qs, d)` with
qs int8 [K, N] and d float16 [K/32, N], the 32-value groups running along the contraction K
as in the GGUF file (a file row is one output column here). It holds 1.0625 bytes per weight,
as the file does; `q8_0_from_blocks` reorders a file tensor's blocks once at load.

Work split. Program (i, j, s) takes row tile i (BM rows), column tile j (BN columns) and
contraction split s. It walks its split in chunks of BK = 32 * G values. With `per_group` (the
default) it loads, per 32-value group, the int8 tile [32, BN], converts it to the activations'
dtype, takes one dot with the rows' [BM, 32] slice and scales that partial product by the
group's scale row [1, BN] before adding it to the float32 accumulator: the scale is applied
once per group and column, not per weight, and no tile needs a reshape. Otherwise it loads the
whole chunk [BK, BN] with a scale per value (gathered: the 32 values of a group share an
address), dequantizes it to the activations' dtype and takes one dot of depth BK, which uses the
matrix units better for many rows. First H200 timings of the per-group form:
bench/results/2026-11-30_quant_matmul_h200.md (41% of the copy bandwidth at decode; the
per-tile form has not been timed). Decode-sized calls (few rows) have few column tiles for a
narrow N, so the contraction is split until there are about `min_programs` programs to fill
the GPU; the splits' float32 partials are summed afterwards.

Triton backend: all indices are arrays and loads are masked, so K, N and M need not be tile
multiples (K must be a multiple of 32, as every GGUF Q8_0 tensor's is). On CPU the kernel runs
in interpret mode.

Shapes: M rows, K contraction, N output columns, G groups per chunk.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import kv_cache
from .call_options import call_options, whole

GROUP = 32  # values per scale in a Q8_0 block
Q8_0_BLOCK_BYTES = 2 + GROUP  # f16 scale, then 32 int8 values


class Q8_0(NamedTuple):
    """A Q8_0 weight W [K, N]: qs int8 [K, N], d float16 [K/32, N]."""

    qs: jax.Array
    d: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.d.nbytes


def quantize_q8_0(w) -> Q8_0:
    """ggml's Q8_0 quantization of w [K, N] over groups of 32 along K (bit-exact)."""
    q = kv_cache.quantize(jnp.asarray(w).T, "q8_0")  # groups along the last axis: [N, K]
    return Q8_0(q.data.T, q.scale.T)


def q8_0_from_blocks(blocks, K: int, N: int) -> Q8_0:
    """A GGUF Q8_0 tensor of ggml shape (K, N) (N rows of K values) as Q8_0.

    Args:
      blocks: uint8 [N * K / 32, 34], the file's blocks in order.
    """
    b = jnp.asarray(blocks).reshape(N, K // GROUP, Q8_0_BLOCK_BYTES)
    d = jax.lax.bitcast_convert_type(b[..., :2], jnp.float16)  # [N, K/32]
    qs = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).reshape(N, K)
    return Q8_0(qs.T, d.T)


def dequantize_q8_0(w: Q8_0, dtype=jnp.float32):
    """W [K, N] in dtype."""
    K, N = w.qs.shape
    vals = w.qs.astype(jnp.float32).reshape(K // GROUP, GROUP, N)
    return (vals * w.d.astype(jnp.float32)[:, None, :]).reshape(K, N).astype(dtype)


def quant_matmul_reference(x, w: Q8_0):
    """x [M, K] @ W in float32, W dequantized first."""
    return jnp.dot(x.astype(jnp.float32), dequantize_q8_0(w), precision="highest")


def _kernel(x_ref, q_ref, d_ref, o_ref, *, BM, BN, G, chunks, Ks, per_group):
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    M, K = x_ref.shape
    N = q_ref.shape[1]
    rows = i * BM + jnp.arange(BM)
    row_ok = rows < M
    rows = jnp.minimum(rows, M - 1)
    cols = j * BN + jnp.arange(BN)
    col_ok = cols < N

    def load(k0, width: int, scale_per_value: bool):
        """x [BM, width] and int8 values [width, BN] from contraction index k0, with their
        scales: [width, BN] (one per value) or [1, BN] (the group's row, width 32)."""
        ks = k0 + jnp.arange(width)
        k_ok = ks < K
        xb = plgpu.load(
            x_ref.at[rows[:, None], ks[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0
        )
        qb = plgpu.load(
            q_ref.at[ks[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0
        )
        grp = ks // GROUP if scale_per_value else jnp.full((1,), k0 // GROUP)
        db = plgpu.load(
            d_ref.at[grp[:, None], cols[None, :]],
            mask=(grp < K // GROUP)[:, None] & col_ok[None, :],
            other=0,
        )
        return xb, qb, db

    def dot(a, b):
        return jax.lax.dot_general(
            a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    def body_per_group(c, acc):
        for g in range(G):  # one dot per 32-value group, scaled by its row of scales
            xb, qb, db = load(s * Ks + (c * G + g) * GROUP, GROUP, False)
            acc = acc + dot(xb, qb.astype(xb.dtype)) * db.astype(jnp.float32)
        return acc

    def body_per_tile(c, acc):
        # The chunk's values times their scales, gathered per value (repeated addresses: L1),
        # rounded to x's dtype, then one dot over the whole chunk.
        xb, qb, db = load(s * Ks + c * G * GROUP, G * GROUP, True)
        w = (qb.astype(jnp.float32) * db.astype(jnp.float32)).astype(xb.dtype)
        return acc + dot(xb, w)

    body = body_per_group if per_group else body_per_tile
    o_ref[...] = jax.lax.fori_loop(0, chunks, body, jnp.zeros((BM, BN), jnp.float32))


def _pow2(n: int, lo: int, hi: int) -> int:
    """The power of two nearest above n, within [lo, hi]."""
    return max(lo, min(hi, 1 << max(n - 1, 0).bit_length()))


def tiling(M: int, K: int, N: int, block_m=64, block_n=128, groups=4, min_programs=264):
    """(BM, BN, S, chunks): tile sizes, contraction splits and BK-chunks per split.

    Splits only where row and column tiles alone give fewer than `min_programs` programs, and
    never more than one per chunk.
    """
    BM, BN = _pow2(M, 16, block_m), _pow2(N, 16, block_n)
    tiles = -(-M // BM) * -(-N // BN)
    n_chunks = -(-K // (GROUP * groups))
    S = max(1, min(n_chunks, min_programs // tiles))
    chunks = -(-n_chunks // S)  # per split; the last split's tail is masked
    return BM, BN, -(-n_chunks // chunks), chunks


def quant_matmul(
    x,
    w: Q8_0,
    *,
    out_dtype=jnp.float32,
    block_m: int = 64,
    block_n: int = 128,
    groups: int = 4,
    per_group: bool = True,
    min_programs: int = 264,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """Pallas x @ W with W quantized (quant_matmul_reference's signature).

    Args:
      x: [M, K] activations (bfloat16 on GPU; the dots run in x's dtype).
      w: Q8_0 weight [K, N].
      out_dtype: result dtype (accumulation is float32).
      block_m, block_n: caps on BM (rows, at least 16) and BN (columns).
      groups: G, 32-value groups per loop iteration (BK = 32 G).
      per_group: one dot per group, scaled after it (exact int8 values in the dot); else the
        chunk dequantized to x's dtype first (scales gathered per value) and one dot of depth BK.
      min_programs: split the contraction until the grid has about this many programs (two
        per SM of an H200), never below one chunk per split.
      interpret: run in interpret mode (default: when the backend is the CPU).
    Returns:
      [M, N] in out_dtype.
    """
    M, K = x.shape
    Kw, N = w.qs.shape
    if Kw != K or K % GROUP or w.d.shape != (K // GROUP, N):
        raise ValueError(f"x {x.shape} and Q8_0 weight {w.qs.shape} / {w.d.shape} do not fit")
    BM, BN, S, chunks = tiling(M, K, N, block_m, block_n, groups, min_programs)
    NI, NJ = -(-M // BM), -(-N // BN)
    options = call_options(interpret, num_warps, num_stages)

    parts = pl.pallas_call(
        functools.partial(
            _kernel,
            BM=BM,
            BN=BN,
            G=groups,
            chunks=chunks,
            Ks=chunks * GROUP * groups,
            per_group=per_group,
        ),  # fmt: skip
        grid=(NI, NJ, S),
        in_specs=[whole(x), whole(w.qs), whole(w.d)],
        out_specs=pl.BlockSpec((None, BM, BN), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((S, NI * BM, NJ * BN), jnp.float32),
        **options,
    )(x, w.qs, w.d)
    return parts.sum(0)[:M, :N].astype(out_dtype)
