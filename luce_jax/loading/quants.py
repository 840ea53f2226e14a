"""GGML block formats dequantized on device (jnp), bit-exact with gguf.quants.dequantize.

Packed bytes go to the device as uint8 (fewer bytes over PCIe than floats) and are unpacked
there. Each function maps uint8 blocks [N, type_size] to float32 values [N, block_size].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

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


def _k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K and Q5_K into [N, 8] each."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def q4_k(b: jax.Array) -> jax.Array:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (d * sc.astype(jnp.float32))[..., None]
    dm = (dmin * mn.astype(jnp.float32))[..., None]
    q = _nibbles(b[:, 16:], 4, 32).reshape(-1, 8, 32).astype(jnp.float32)
    return (d * q - dm).reshape(-1, QK_K)


def q5_k(b: jax.Array) -> jax.Array:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
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
}


@functools.cache
def _jitted(qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype, transpose: bool):
    def f(blocks):
        x = DEQUANTIZERS[qtype](blocks).reshape(shape).astype(dtype)
        return jnp.swapaxes(x, -1, -2) if transpose else x

    return jax.jit(f)


def dequantize(
    raw: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype=jnp.float32,
    transpose: bool = False,
) -> jax.Array:
    """Unpack GGML-typed bytes into a device array (cast and transpose fused on device).

    Args:
      raw: uint8 bytes of the tensor, in file order (any shape; flattened).
      qtype: the tensor's GGML type; one of DEQUANTIZERS.
      shape: logical (numpy order) shape of the result; its last axis is a multiple of the
        type's block size.
      dtype: result dtype (values are computed in float32 first).
      transpose: swap the last two axes ([in, out] for a linear weight, per expert for a
        stacked [E, out, in] expert tensor).
    Returns:
      array of `shape` (last two axes swapped if transposed).
    """
    if qtype not in DEQUANTIZERS:
        raise ValueError(
            f"unsupported GGML tensor type {qtype.name}; supported: "
            f"{[t.name for t in DEQUANTIZERS]}"
        )
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    if n % block or raw.size != n // block * size:
        raise ValueError(f"{qtype.name} tensor of shape {shape} cannot hold {raw.size} bytes")
    blocks = jnp.asarray(np.ascontiguousarray(raw).reshape(-1, size))
    return _jitted(qtype, tuple(shape), jnp.dtype(dtype), transpose)(blocks)
