"""Prefill-sized products on a file's own Q8_0 and Q4_K blocks, decoded inside XLA's GEMM.

A quantized prefill step today writes each weight in bf16 (pallas_kernels/dequantize.py) and
then takes XLA's dot, at least 5.4 ms a step on the 8B for the write alone. XLA's GPU backend
can fuse a producer of convert and multiply into its Triton GEMM's operand, and both types
split that way without a copy of their codes:

    Q8_0:  W[n, k] = d[n, k // 32] * q[n, k]                 (q: the code bytes as int8)
    Q4_K:  W[n, k] = d*sc[n, g] * q[n, k] - dmin*m[n, g]      (g = k // 32, q in 0..15)
           x @ W^T = x' @ (A * q')^T - xs @ B^T

where q' is Q4_K's code bytes read as uint4 (a block's values in the order run r, byte j,
nibble h -> value 64r + 32h + j of group 2r + h), x' is x's columns put in that order (x is
small), A = d*sc and B = dmin*m per group, and xs x's sums per group. Not used by the
engine: bench/int4_gemm.py times the products against the bf16 dot. On the H200 at 512 rows
they took 1.38x to 1.79x its time, slower than dequantize.py then the dot, with no Triton GEMM
fusion (results/history/2026-12-02_int4_gemm_h200.md), so the engine's prefill stays on
dequantize.py.

Shapes: M rows, K contraction, N outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ggml_dequant import k_scale_min
from pallas_kernels.quant_weight import QuantWeight

GROUP = 32


def dot_t(x, w):
    """x [M, K] @ w [N, K]^T in float32."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def scaled(q, a, dtype):
    """convert(q) * a broadcast over each group of 32: q [N, K], a [N, K / 32] -> [N, K] in
    dtype (the GEMM's operand)."""
    N, K = q.shape
    w = q.astype(dtype).reshape(N, K // GROUP, GROUP) * a.astype(dtype)[:, :, None]
    return w.reshape(N, K)


def q8_0_product(x, w: QuantWeight):
    """x [M, K] @ W^T for Q8_0: convert(q) * d as the GEMM's operand, in x's dtype."""
    d = jax.lax.bitcast_convert_type(w.head_bytes(), jnp.float16)  # [N, K / 32]
    return dot_t(x, scaled(jax.lax.bitcast_convert_type(w.body, jnp.int8), d, x.dtype))


def q4_k_product(x, w: QuantWeight):
    """x [M, K] @ W^T for Q4_K: convert(q') * A as the GEMM's operand against x', minus the
    offsets' product (module docstring)."""
    M, K = x.shape
    h = w.head_bytes()  # [N, K / 256, 16]: d, dmin, then 12 bytes of 6-bit scales and mins
    N, nb = h.shape[:2]
    d = jax.lax.bitcast_convert_type(h[..., 0:4].reshape(N, nb, 2, 2), jnp.float16)
    d = d.astype(jnp.float32)
    sc, mn = k_scale_min(h[..., 4:16].reshape(N * nb, 12))
    a = d[..., 0:1] * sc.reshape(N, nb, 8).astype(jnp.float32)
    b = d[..., 1:2] * mn.reshape(N, nb, 8).astype(jnp.float32)
    q = jax.lax.bitcast_convert_type(w.body, jnp.uint4).reshape(N, nb, 4, 32, 2)
    wq = q.astype(x.dtype) * a.astype(x.dtype).reshape(N, nb, 4, 1, 2)
    xq = x.reshape(M, nb, 4, 2, 32).transpose(0, 1, 2, 4, 3).reshape(M, K)
    xs = jnp.sum(x.astype(jnp.float32).reshape(M, nb * 8, GROUP), axis=-1)
    return dot_t(xq, wq.reshape(N, K)) - dot_t(xs, b.reshape(N, nb * 8))


PRODUCTS = {"q8_0": q8_0_product, "q4_k": q4_k_product}


def block_gemm(x, w: QuantWeight, fallback=None):
    """x [M, K] @ W^T in float32 for a Q8_0 or Q4_K weight on its blocks; other types through
    `fallback` (x, w) (the engine's dequantize.py then dot)."""
    product = PRODUCTS.get(w.qtype)
    if product is None:
        if fallback is None:
            raise ValueError(f"block_gemm takes q8_0 and q4_k weights, not {w.qtype}")
        return fallback(x, w)
    return product(x, w)
