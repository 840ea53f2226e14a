"""KV cache arrays per cache type: plain float blocks, or q8_0 / q4_0 blocks with f16 scales.

A plain cache is one [NB, P, K, D] array. A quantized cache is a `Quantized` pair:
  q8_0: data int8 [NB, P, K, D], one f16 scale per 32 values, scale [NB, P, K, D/32];
  q4_0: data uint32 [NB, P, K, D/8]: little-endian words of ggml's bytes, two 4-bit values a
        byte (within a group of 32, byte i holds value i in its low nibble and value i+16 in its
        high nibble), scale [NB, P, K, D/32]. Words because paged attention loads a group as 4
        of them: a uint8 cache viewed as words inside the step would be a copy of the cache.
Quantization equals ggml's reference (gguf.quants.quantize) bit for bit. The type of a cache is
read off its arrays (int8 data: q8_0, uint32: q4_0), so caches stay plain pytrees.

This is the format the kernels read, so it lives beside them (pallas_kernels imports nothing from
luce_jax); the model writes its KV through it too. Shapes: NB blocks, P block size, K kv heads,
D head dim, T rows.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

GROUP = 32  # values per scale, as in ggml's q8_0 / q4_0 blocks
QUANT_BYTES = {"q8_0": 34 / 32, "q4_0": 18 / 32}  # per value: 32 values + an f16 scale
QUANT_TYPES = tuple(QUANT_BYTES)


class Quantized(NamedTuple):
    data: jax.Array  # int8 [..., D] (q8_0) or uint32 [..., D/8] (q4_0)
    scale: jax.Array  # float16 [..., D/32]


def kind(cache) -> str:
    """'plain', 'q8_0' or 'q4_0'."""
    if not isinstance(cache, Quantized):
        return "plain"
    return "q8_0" if cache.data.dtype == jnp.int8 else "q4_0"


def leading_shape(cache) -> tuple[int, int, int]:
    """(NB, P, K): blocks, block size and kv heads of either kind."""
    return (cache.data if isinstance(cache, Quantized) else cache).shape[:3]


def _is_quant(cache_type) -> bool:
    return isinstance(cache_type, str) and cache_type in QUANT_BYTES


def bytes_per_value(cache_type) -> float:
    """Bytes one cached value of cache_type ("q8_0", "q4_0" or a dtype) takes, scales included."""
    return QUANT_BYTES[cache_type] if _is_quant(cache_type) else jnp.dtype(cache_type).itemsize


def init(shape: tuple[int, ...], cache_type):
    """A zeroed cache of `shape` [NB, P, K, D]: cache_type is "q8_0", "q4_0" or a dtype."""
    if not _is_quant(cache_type):
        return jnp.zeros(shape, cache_type)
    *lead, D = shape
    if D % GROUP:
        raise ValueError(f"cache type {cache_type} needs a head dim divisible by {GROUP}, got {D}")
    width, dt = (D, jnp.int8) if cache_type == "q8_0" else (D // 8, jnp.uint32)
    return Quantized(jnp.zeros((*lead, width), dt), jnp.zeros((*lead, D // GROUP), jnp.float16))


def quantize(x, cache_type: str) -> Quantized:
    """ggml's q8_0 / q4_0 quantization of x [..., D] over groups of 32 along D."""
    *lead, D = x.shape
    g = x.astype(jnp.float32).reshape(*lead, D // GROUP, GROUP)
    if cache_type == "q8_0":
        d = jnp.max(jnp.abs(g), axis=-1, keepdims=True) / 127
        inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
        y = g * inv
        q = jnp.sign(y) * jnp.floor(jnp.abs(y) + 0.5)  # round half away from zero, as ggml
        data = q.astype(jnp.int8).reshape(*lead, D)
    else:
        i = jnp.argmax(jnp.abs(g), axis=-1, keepdims=True)
        d = jnp.take_along_axis(g, i, axis=-1) / -8
        inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
        q = jnp.clip(jnp.trunc(g * inv + 8.5), 0, 15).astype(jnp.uint8)
        data = (q[..., :16] | (q[..., 16:] << 4)).reshape(*lead, D // 8, 4)
        data = jax.lax.bitcast_convert_type(data, jnp.uint32)  # [..., D/8]
    return Quantized(data, d[..., 0].astype(jnp.float16))


def dequantize(c: Quantized, dtype=jnp.float32):
    """Values [..., D] of a quantized cache (or any slice of one that keeps the last axis)."""
    s = c.scale.astype(jnp.float32)[..., None]
    *lead, n = c.data.shape
    if c.data.dtype == jnp.int8:
        v = c.data.reshape(*lead, n // GROUP, GROUP).astype(jnp.float32)
    else:
        b = jax.lax.bitcast_convert_type(c.data, jnp.uint8).reshape(*lead, n // 4, 16)
        v = jnp.concatenate([b & 15, b >> 4], axis=-1).astype(jnp.float32) - 8
    return (v * s).reshape(*lead, -1).astype(dtype)


def values(cache, dtype):
    """The cache (or a gathered slice of it) as plain values of dtype."""
    return dequantize(cache, dtype) if isinstance(cache, Quantized) else cache.astype(dtype)


def gather(cache, idx):
    """cache[idx] along the block axis, for either kind."""
    if isinstance(cache, Quantized):
        return Quantized(cache.data[idx], cache.scale[idx])
    return cache[idx]


def write(cache, write_idx, new):
    """Scatter new [T, K, D] rows into cache blocks at flat slots write_idx [T] (block*P + offset).

    Quantized caches quantize the rows first; a row's groups are quantized on their own, so
    writing a token never changes another token's values.
    """

    def put(arr, rows):
        nb, p = arr.shape[:2]
        flat = arr.reshape(nb * p, *arr.shape[2:]).at[write_idx].set(rows.astype(arr.dtype))
        return flat.reshape(arr.shape)

    if isinstance(cache, Quantized):
        q = quantize(new, kind(cache))
        return Quantized(put(cache.data, q.data), put(cache.scale, q.scale))
    return put(cache, new)


def compute_dtype(cache, default):
    """The dtype attention computes in: a plain cache's own, else `default` (the weights')."""
    return default if isinstance(cache, Quantized) else cache.dtype
