"""The step's q, k and v from the qkv projection in one kernel: per-head RMS norm, rotary
embedding, and k, v written into the paged caches in place.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

In XLA a decode layer ran these as five small kernels (q norm, k norm + rope, q rope into
attention's layout, a scatter for k and one for v), 1.5 to 2.1 us each on the H200
(results/2026-12-02_profile_qwen3-8b-q4_k_m_c1_9345aba.md). Program (t, g) takes token row t's
kv heads g * KP .. (g + 1) * KP - 1 and their query heads: it loads each head as two halves
(NEOX rotates the halves of a head, llama adjacent pairs: the halves are then its even and odd
values), norms each head over both halves, rotates, stores q and writes k and v at the row's
KV slot. Padding rows write the sink slot their write_idx points at (block 0), as the XLA
scatter does. With a program a row (KP = K) the 8B Q4_K_M's decode step on the H200 was 1% to
2% shorter than with XLA's kernels (3.90 against 3.98 ms at C1), 4 kernels a layer fewer
(results/2026-12-02_engine_decode_qwen3-8b-q4_k_m_pallas_2b8d095.md).

Shapes: T rows, H query heads, K kv heads, D head dim, NB blocks of P slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import kv_cache
from .call_options import call_options, whole


def _halves(D: int, neox: bool):
    """The value indices of a head's two rotated halves, [D / 2] each."""
    j = jnp.arange(D // 2)
    return (j, j + D // 2) if neox else (2 * j, 2 * j + 1)


def _norm_rope(x1, x2, w1, w2, c, s, eps, D):
    """RMS-normed (w1, w2 the weight's halves, or None: no norm) and rotated halves [n, D / 2]."""
    if w1 is not None:
        r = jax.lax.rsqrt((jnp.sum(x1 * x1, -1) + jnp.sum(x2 * x2, -1)) / D + eps)[:, None]
        x1, x2 = x1 * r * w1[None, :], x2 * r * w2[None, :]
    return x1 * c - x2 * s, x2 * c + x1 * s


def rope_write_reference(qkv, q_w, k_w, cos, sin, write_idx, kc, vc, *, heads, kv_heads, eps,
                         neox, out_dtype):  # fmt: skip
    """qkv [T, (H + 2K) * D] float32 -> (q [T, H, D] out_dtype, kc, vc with k, v at
    write_idx [T]); q_w, k_w [D] norm weights or None; cos, sin [T, D / 2]."""
    T = qkv.shape[0]
    H, K = heads, kv_heads
    D = qkv.shape[1] // (H + 2 * K)
    lo, hi = _halves(D, neox)
    c, s = cos[:, None, :], sin[:, None, :]

    def part(first, n, w):
        x = qkv[:, first * D : (first + n) * D].reshape(T, n, D).astype(jnp.float32)
        x1, x2 = x[..., lo], x[..., hi]
        if w is not None:
            r = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
            x1, x2 = x1 * r * w[lo], x2 * r * w[hi]
        return jnp.zeros_like(x).at[..., lo].set(x1 * c - x2 * s).at[..., hi].set(x2 * c + x1 * s)

    q, k = part(0, H, q_w), part(H, K, k_w)
    v = qkv[:, (H + K) * D :].reshape(T, K, D)

    def put(cache, rows):
        nb, p = cache.shape[:2]
        flat = cache.reshape(nb * p, *cache.shape[2:]).at[write_idx].set(rows.astype(cache.dtype))
        return flat.reshape(cache.shape)

    return q.astype(out_dtype), put(kc, k), put(vc, v)


def _kernel(qkv_ref, qw_ref, kw_ref, cos_ref, sin_ref, idx_ref, _kc, _vc, q_ref, kc_ref, vc_ref,
            *, H, K, D, P, eps, neox, norm, KP):  # fmt: skip
    """Program (t, g): row t's kv heads g * KP .. (g + 1) * KP - 1 and their query heads."""
    t, g = pl.program_id(0), pl.program_id(1)
    QP = KP * H // K  # query heads a program
    q0, k0 = g * QP, g * KP
    lo, hi = _halves(D, neox)
    c = plgpu.load(cos_ref.at[t, jnp.arange(D // 2)])[None, :]
    s = plgpu.load(sin_ref.at[t, jnp.arange(D // 2)])[None, :]
    slot = idx_ref[t]
    blk, off = slot // P, slot % P

    def heads(first, n):  # [n'] head offsets (n' a power of two), their mask, clamped rows
        h = jnp.arange(1 << (n - 1).bit_length())
        return h, (h < n)[:, None], (first + jnp.minimum(h, n - 1))[:, None] * D

    def rotated(first, n, w_ref):
        h, ok, base = heads(first, n)
        x1 = plgpu.load(qkv_ref.at[t, base + lo[None, :]])
        x2 = plgpu.load(qkv_ref.at[t, base + hi[None, :]])
        w1 = w2 = None
        if norm:
            w1, w2 = plgpu.load(w_ref.at[lo]), plgpu.load(w_ref.at[hi])
        return h[:, None], ok, _norm_rope(x1, x2, w1, w2, c, s, eps, D)

    h, ok, (q1, q2) = rotated(q0, QP, qw_ref)
    plgpu.store(q_ref.at[t, q0 + h, lo[None, :]], q1.astype(q_ref.dtype), mask=ok)
    plgpu.store(q_ref.at[t, q0 + h, hi[None, :]], q2.astype(q_ref.dtype), mask=ok)
    h, ok, (k1, k2) = rotated(H + k0, KP, kw_ref)
    plgpu.store(kc_ref.at[blk, off, k0 + h, lo[None, :]], k1.astype(kc_ref.dtype), mask=ok)
    plgpu.store(kc_ref.at[blk, off, k0 + h, hi[None, :]], k2.astype(kc_ref.dtype), mask=ok)
    hv, ok, base = heads(H + K + k0, KP)
    d = jnp.arange(D)[None, :]
    v = plgpu.load(qkv_ref.at[t, base + d])
    plgpu.store(vc_ref.at[blk, off, k0 + hv[:, None], d], v.astype(vc_ref.dtype), mask=ok)


def fits(head_dim: int, rope_dim: int, kc, vc) -> bool:
    """Whether the kernel takes this layer: plain caches (not kv_cache.Quantized), the whole
    head rotated, and a power-of-two head dim (Triton tiles)."""
    plain = kv_cache.kind(kc) == kv_cache.kind(vc) == "plain"
    return plain and rope_dim == head_dim and head_dim >= 4 and not head_dim & (head_dim - 1)


def rope_write(qkv, q_w, k_w, cos, sin, write_idx, kc, vc, *, heads: int, kv_heads: int,
               eps: float, neox: bool, out_dtype, kv_heads_per_program: int | None = None,
               interpret: bool | None = None, num_warps: int = 4):  # fmt: skip
    """Pallas rope_write_reference: q normed (q_w) and rotated, k likewise and written with v
    into the caches at write_idx, in place (the caches are aliased to the outputs).

    Args:
      qkv: [T, (H + 2K) * D] the qkv projection's rows (float32).
      q_w, k_w: [D] the per-head norm weights, both or neither (None: no norm).
      cos, sin: [T, D / 2] the rows' rotary tables (float32).
      write_idx: [T] int32 flat KV slots (block * P + offset).
      kc, vc: [NB, P, K, D] plain caches.
      heads, kv_heads: H and K; eps: the norm's epsilon; neox: rotate halves (else pairs).
      out_dtype: q's dtype (the attention's compute dtype).
      kv_heads_per_program: KP, a divisor of K: a program takes one row's KP kv heads and
        their H / K query heads each (grid T x K / KP). None: all K, a program a row (the
        form timed on the H200, 2026-12-02_engine_decode_qwen3-8b-q4_k_m_pallas_2b8d095.md).
      interpret: run in interpret mode (default: when the backend is the CPU).
    Returns:
      (q [T, H, D] out_dtype, kc, vc).
    """
    T, width = qkv.shape
    H, K = heads, kv_heads
    D = width // (H + 2 * K)
    NB, P = kc.shape[:2]
    if width != (H + 2 * K) * D or kc.shape != (NB, P, K, D) or vc.shape != kc.shape:
        raise ValueError(f"qkv {qkv.shape} does not fit {H} + 2 x {K} heads and caches {kc.shape}")
    if not fits(D, 2 * cos.shape[-1], kc, vc) or cos.shape != (T, D // 2):
        raise ValueError(f"rope tables {cos.shape} or head dim {D} do not fit the kernel")
    if (q_w is None) != (k_w is None) or write_idx.shape != (T,):
        raise ValueError(f"norm weights ({q_w is None}, {k_w is None}) or slots {write_idx.shape}")
    KP = K if kv_heads_per_program is None else kv_heads_per_program
    if K % KP:
        raise ValueError(f"kv_heads_per_program {KP} does not divide {K} kv heads")
    norm = q_w is not None
    one = jnp.ones((D,), jnp.float32)
    inputs = (qkv.astype(jnp.float32), one if q_w is None else q_w.astype(jnp.float32),
              one if k_w is None else k_w.astype(jnp.float32), cos.astype(jnp.float32),
              sin.astype(jnp.float32), write_idx.astype(jnp.int32), kc, vc)  # fmt: skip
    kernel = functools.partial(_kernel, H=H, K=K, D=D, P=P, eps=eps, neox=neox, norm=norm, KP=KP)
    outs = (jax.ShapeDtypeStruct((T, H, D), out_dtype), kc, vc)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outs)
    return pl.pallas_call(
        kernel,
        grid=(T, K // KP),
        in_specs=[whole(a) for a in inputs],
        out_specs=[whole(a) for a in shapes],
        out_shape=shapes,
        input_output_aliases={6: 1, 7: 2},
        **call_options(interpret, num_warps, 1),
    )(*inputs)
