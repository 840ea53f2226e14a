"""Prefill-sized matmuls with Q8_0, Q4_0, Q4_K and Q6_K weights: each [BN, BK] weight tile is
dequantized in registers and multiplied in one tensor-core dot (tile-dequantize-then-dot).

Kernel, wrapper and pure-jnp reference (quant_matmul.quant_matmul_reference) together, in the
style of JAX's Pallas ops.

quant_matmul.py's kernel contracts a block one 16- or 32-value group at a time, a dot per
group, which suits few rows and measured 6x to 15x the bf16 dot at 512 rows
(bench/results/2026-11-30_quant_matmul_types_h200.md); models/linear.py sends such steps to
XLA's dequantize-then-dot (1.3x to 1.7x). Here program (i, j) takes BM rows of x and BN weight
rows and walks K BK values at a time: every value of the tile is decoded by its own index
arithmetic (its code byte, nibble and block scale gathered per column, as paged_attention's
quantized KV tiles are), so the tile needs no reshape, and one [BM, BK] x [BK, BN] dot follows.
Repeated addresses (a byte's two nibbles, a block's scale for 32 columns) hit the L1 cache.
Q8_0 and Q4_0, and the two types of a Q4_K_M file (Q4_K, Q6_K); Q5_K and IQ4_XS not yet. Not
yet timed on a GPU (`bench/quant_matmul.py --tiles`), so nothing routes to it.

Triton backend: all indices are arrays, loads past M, N or K are masked; the output is
allocated in whole tiles and sliced, so no store is masked. On CPU it runs in interpret mode.

Shapes: M rows, K contraction (whole blocks of 32 or 256 values), N outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole
from .ggml_blocks import QuantWeight, _byte_f16

QTYPES = ("q8_0", "q4_0", "q4_k", "q6_k")


def _tile(qtype: str, h_ref, b_ref, n, k, ok):
    """Weight values [BN, BK] float32 of rows n [BN, 1] at value columns k [1, BK].

    Each value reads its own code byte(s) from the body and its block's scale bytes from the
    head (layouts in ggml_blocks.QuantWeight; decoding as ggml's dequantize_row_*)."""

    def body(i):
        return plgpu.load(b_ref.at[n, i], mask=ok, other=0).astype(jnp.int32)

    def head(i):
        return plgpu.load(h_ref.at[i, n], mask=ok, other=0).astype(jnp.int32)

    def f16(i):  # the little-endian float16 at head rows i, i + 1
        return _byte_f16(head, i)

    if qtype in ("q8_0", "q4_0"):  # blocks of 32: f16 scale (head 2 bytes), codes
        blk, i = k // 32, k % 32
        if qtype == "q8_0":
            code = (body(blk * 32 + i) ^ 128) - 128  # int8
        else:  # value i: low nibble of byte i, value i + 16 its high nibble
            code = ((body(blk * 16 + i % 16) >> (i // 16 * 4)) & 15) - 8
        return code.astype(jnp.float32) * f16(blk * 2)
    blk, v = k // 256, k % 256
    if qtype == "q4_k":  # head: d, dmin, 12 bytes of 6-bit scales and mins; 128 code bytes
        g, h = v // 32, blk * 16
        code = (body(blk * 128 + 32 * (v // 64) + v % 32) >> (4 * (g % 2))) & 15
        s_g, s_hi = head(h + 4 + g), head(h + 8 + g)  # scales[g], scales[g + 4]
        s_lo = head(h + 4 + g % 4)  # scales[g - 4] (used for the upper groups only)
        low = g < 4
        sc = jnp.where(low, s_g & 63, (s_hi & 15) | ((s_lo >> 6) << 4))
        mn = jnp.where(low, s_hi & 63, (s_hi >> 4) | ((s_g >> 6) << 4))
        return f16(h) * sc.astype(jnp.float32) * code - f16(h + 2) * mn.astype(jnp.float32)
    # q6_k: body ql (128) | qh (64); head: 16 int8 scales, then d
    half, r = v // 128, v % 128
    quarter, lane = r // 32, r % 32
    low = (body(blk * 192 + 64 * half + lane + 32 * (quarter % 2)) >> (4 * (quarter // 2))) & 15
    high = (body(blk * 192 + 128 + 32 * half + lane) >> (2 * quarter)) & 3
    sc = (head(blk * 18 + 8 * half + lane // 16 + 2 * quarter) ^ 128) - 128
    return f16(blk * 18 + 16) * (sc * ((low | (high << 4)) - 32)).astype(jnp.float32)


def _kernel(x_ref, h_ref, b_ref, o_ref, *, qtype, BM, BN, BK, M, N, K):
    i, j = pl.program_id(0), pl.program_id(1)
    rows, cols = i * BM + jnp.arange(BM), j * BN + jnp.arange(BN)
    r_ok, c_ok = rows < M, cols < N
    rc, cc = jnp.minimum(rows, M - 1)[:, None], jnp.minimum(cols, N - 1)[:, None]

    def step(s, acc):
        k = s * BK + jnp.arange(BK)
        k_ok = (k < K)[None, :]
        kc = jnp.minimum(k, K - 1)[None, :]
        x = plgpu.load(x_ref.at[rc, kc], mask=r_ok[:, None] & k_ok, other=0)
        w = _tile(qtype, h_ref, b_ref, cc, kc, c_ok[:, None] & k_ok).astype(x.dtype)
        return acc + jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    acc = jax.lax.fori_loop(0, -(-K // BK), step, jnp.zeros((BM, BN), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret",
                     "out_dtype"),
)  # fmt: skip
def quant_prefill(
    x,
    w: QuantWeight,
    *,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret=None,
    out_dtype=jnp.float32,
):
    """x [M, K] @ W^T for a QuantWeight W [N, K] of a QTYPES type: [M, N] in out_dtype.

    Args:
      block_m, block_n, block_k: the tile (powers of two; block_k a multiple of 32).
    """
    if w.qtype not in QTYPES:
        raise ValueError(f"qtype={w.qtype!r}: quant_prefill takes {QTYPES}")
    M, K = x.shape
    N, Kw = w.shape[-2:]
    if Kw != K or w.body.ndim != 2:
        raise ValueError(f"x {x.shape} and weight {w.shape} do not contract")
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v}: must be a power of two >= 16")
    if block_k % 32:
        raise ValueError(f"block_k={block_k}: must be a multiple of 32 (one block)")
    gm, gn = -(-M // block_m), -(-N // block_n)
    x = x.astype(w.dtype)
    out = pl.pallas_call(
        functools.partial(
            _kernel, qtype=w.qtype, BM=block_m, BN=block_n, BK=block_k, M=M, N=N, K=K
        ),
        grid=(gm, gn),
        in_specs=[whole(x), whole(w.head), whole(w.body)],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((gm * block_m, gn * block_n), jnp.float32),
        name="quant_prefill",
        **call_options(interpret, num_warps, num_stages),
    )(x, w.head, w.body)
    return out[:M, :N].astype(out_dtype)
