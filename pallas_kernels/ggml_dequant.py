"""GGML's block formats dequantized whole: `DEQUANTIZERS` map uint8 blocks [N, type_size] to
float32 values [N, block_size], bit-exact with gguf.quants.dequantize. The reference for the
kernels' block-at-a-time decoding (ggml_blocks.py) and the loader's path for the types no
kernel keeps packed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType

QK_K = 256


def _f16(b: jax.Array) -> jax.Array:
    """[N, 2] uint8 little-endian -> [N, 1] float32."""
    return jax.lax.bitcast_convert_type(b.reshape(-1, 1, 2), jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array, groups: int, width: int) -> jax.Array:
    """[N, groups*width] uint8 -> [N, groups, 2, width]: low nibbles then high nibbles."""
    qs = qs.reshape(-1, groups, 1, width)
    return (qs >> jnp.array([0, 4], jnp.uint8).reshape(1, 1, 2, 1)) & jnp.uint8(0x0F)


def q8_0(b: jax.Array) -> jax.Array:
    d = _f16(b[:, :2])
    x = jax.lax.bitcast_convert_type(b[:, 2:], jnp.int8).astype(jnp.float32)
    return x * d


def q4_0(b: jax.Array) -> jax.Array:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 1, 16).reshape(-1, 32).astype(jnp.int8) - jnp.int8(8)
    return d * q.astype(jnp.float32)


def k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K and Q5_K into [N, 8] each."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def q4_k(b: jax.Array) -> jax.Array:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_scale_min(b[:, 4:16])
    d = (d * sc.astype(jnp.float32))[..., None]
    dm = (dmin * mn.astype(jnp.float32))[..., None]
    q = _nibbles(b[:, 16:], 4, 32).reshape(-1, 8, 32).astype(jnp.float32)
    return (d * q - dm).reshape(-1, QK_K)


def q5_k(b: jax.Array) -> jax.Array:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k_scale_min(b[:, 4:16])
    d = (d * sc.astype(jnp.float32))[..., None]
    dm = (dmin * mn.astype(jnp.float32))[..., None]
    qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> jnp.arange(8, dtype=jnp.uint8).reshape(1, 1, 8, 1)
    qh = (qh & jnp.uint8(1)).reshape(-1, 8, 32)
    ql = _nibbles(b[:, 48:], 4, 32).reshape(-1, 8, 32)
    q = (ql | (qh << jnp.uint8(4))).astype(jnp.float32)
    return (d * q - dm).reshape(-1, QK_K)


def q6_k(b: jax.Array) -> jax.Array:
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], b[:, 208:210]
    scales = jax.lax.bitcast_convert_type(scales, jnp.int8).astype(jnp.float32)
    d = (_f16(d) * scales).reshape(-1, 16, 1)
    ql = _nibbles(ql, 2, 64).reshape(-1, 8, 32)
    qh = qh.reshape(-1, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)
    qh = (qh & jnp.uint8(3)).reshape(-1, 8, 32)
    q = (ql | (qh << jnp.uint8(4))).astype(jnp.int8) - jnp.int8(32)
    return (d * q.reshape(-1, 16, 16).astype(jnp.float32)).reshape(-1, QK_K)


# IQ4_NL / IQ4_XS: a 4-bit index into this non-linear table of int8 values (ggml's kvalues).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def iq4_xs(b: jax.Array) -> jax.Array:
    """Super-blocks of 256: f16 d, 8 six-bit scales (2 high bits each in a uint16, 4 low bits
    in 4 bytes), then 8 groups of 32 four-bit indices into IQ4_VALUES."""
    d = _f16(b[:, 0:2])
    hi = jax.lax.bitcast_convert_type(b[:, 2:4].reshape(-1, 1, 2), jnp.uint16)  # [N, 1]
    hi = (hi >> jnp.arange(0, 16, 2, dtype=jnp.uint16)) & jnp.uint16(3)  # [N, 8]
    lo = (b[:, 4:8, None] >> jnp.array([0, 4], jnp.uint8)) & jnp.uint8(0x0F)  # [N, 4, 2]
    scales = (lo.reshape(-1, 8) | (hi.astype(jnp.uint8) << 4)).astype(jnp.int8) - jnp.int8(32)
    dl = (d * scales.astype(jnp.float32))[..., None]  # [N, 8, 1]
    idx = _nibbles(b[:, 8:], 8, 16).reshape(-1, 8, 32)
    vals = jnp.asarray(IQ4_VALUES, jnp.float32)[idx]
    return (dl * vals).reshape(-1, QK_K)


def q2_k(b: jax.Array) -> jax.Array:
    """Super-blocks of 256: 16 bytes of 4-bit scale | 4-bit min per 16 values, 64 bytes of
    2-bit codes (value v: byte 32 (v // 128) + v % 32, bits 2 ((v % 128) // 32)), f16 d, dmin."""
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).astype(jnp.float32)).reshape(-1, 16, 1)
    ml = (dmin * (scales >> 4).astype(jnp.float32)).reshape(-1, 16, 1)
    q = (qs.reshape(-1, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)) & 3
    return (dl * q.reshape(-1, 16, 16).astype(jnp.float32) - ml).reshape(-1, QK_K)


def q3_k(b: jax.Array) -> jax.Array:
    """Super-blocks of 256: 32 bytes of high bits (value v: bit v // 32 of byte v % 32; a set
    bit means no -4), 64 bytes of 2-bit codes laid out as Q2_K's, 16 six-bit scales in 12
    bytes (low nibbles in bytes 0-7, high pairs in 8-11), f16 d."""
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = scales[:, :8].reshape(-1, 1, 8) >> jnp.array([0, 4], jnp.uint8).reshape(1, 2, 1)
    high = scales[:, 8:].reshape(-1, 1, 4) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 4, 1)
    sc = (low.reshape(-1, 16) & 15) | ((high.reshape(-1, 16) & 3) << 4)
    dl = (d * (sc.astype(jnp.int8) - jnp.int8(32)).astype(jnp.float32)).reshape(-1, 16, 1)
    ql = (qs.reshape(-1, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(1, 1, 4, 1)) & 3
    qh = (hmask.reshape(-1, 1, 1, 32) >> jnp.arange(8, dtype=jnp.uint8).reshape(1, 1, 8, 1)) & 1
    q = ql.reshape(-1, 16, 16).astype(jnp.int8) - ((qh.reshape(-1, 16, 16) ^ 1) << 2).astype(
        jnp.int8
    )
    return (dl * q.astype(jnp.float32)).reshape(-1, QK_K)


# MXFP4: a 4-bit index into these values (twice the FP4 E2M1 values), scaled by an E8M0 byte
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: jax.Array) -> jax.Array:
    """float32 2**(e - 128) of E8M0 bytes e (ggml_e8m0_to_fp32_half: half the scale, since
    MXFP4_VALUES are doubled), subnormal for e < 2 (XLA flushes values that small to zero,
    where gguf's NumPy keeps them: below 2**-126, no weight a converter writes)."""
    e = e.astype(jnp.uint32)
    bits = jnp.where(e < 2, jnp.uint32(0x00200000) << e, (e - 1) << 23)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def mxfp4(b: jax.Array) -> jax.Array:
    """Blocks of 32: an E8M0 scale byte, then 16 bytes of 4-bit indices into MXFP4_VALUES
    (low nibbles values 0-15, high nibbles 16-31)."""
    d = e8m0_half(b[:, :1])
    idx = _nibbles(b[:, 1:], 1, 16).reshape(-1, 32)
    return d * jnp.asarray(MXFP4_VALUES, jnp.float32)[idx]


def bf16(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b.reshape(-1, 1, 2), jnp.bfloat16).astype(jnp.float32)


def f16(b: jax.Array) -> jax.Array:
    return _f16(b)


def f32(b: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(b.reshape(-1, 1, 4), jnp.float32)


T = GGMLQuantizationType
DEQUANTIZERS = {
    T.F32: f32,
    T.F16: f16,
    T.BF16: bf16,
    T.Q8_0: q8_0,
    T.Q4_0: q4_0,
    T.Q4_K: q4_k,
    T.Q5_K: q5_k,
    T.Q6_K: q6_k,
    T.IQ4_XS: iq4_xs,
    T.Q2_K: q2_k,
    T.Q3_K: q3_k,
    T.MXFP4: mxfp4,
}
