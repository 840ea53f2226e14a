"""KV cache arrays per cache type: plain float blocks, or q8_0 / q4_0 blocks with f16 scales.

A plain cache is one [NB, P, K, D] array. A quantized cache is a `Quantized` pair:
  q8_0: data int32 [NB, P, K, D/4]: little-endian words of ggml's int8 values (byte b of word
        c is value 4c + b), one f16 scale per 32 values, scale [NB, P, K, D/32];
  q4_0: data uint32 [NB, P, K, D/8]: ggml's 4-bit codes, eight a word: byte p of word c holds
        value 8c + p in its low nibble and 8c + 4 + p in its high one (ggml's own bytes pair
        value i with i + 16 of its group instead), scale [NB, P, K, D/32].
Words because paged attention's PTX takes a word's codes at once (kv_tiles.py) and loads a
group as 8 or 4 of them: a byte cache viewed as words inside the step would be a copy of the
cache. A word holds consecutive values so that the PTX's planes join into a tile in registers.
Quantization equals ggml's reference (gguf.quants.quantize) bit for bit: the same codes and
scales (`codes` gives them in value order). The type of a cache is read off its arrays (int32
data: q8_0, uint32: q4_0), so caches stay plain pytrees.

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
VALUES_PER_WORD = {"q8_0": 4, "q4_0": 8}  # codes a data word holds (the layouts above)


class Quantized(NamedTuple):
    data: jax.Array  # int32 [..., D/4] (q8_0) or uint32 [..., D/8] (q4_0)
    scale: jax.Array  # float16 [..., D/32]


def kind(cache) -> str:
    """'plain', 'q8_0' or 'q4_0'."""
    if not isinstance(cache, Quantized):
        return "plain"
    return "q8_0" if cache.data.dtype == jnp.int32 else "q4_0"


def leading_shape(cache) -> tuple[int, int, int]:
    """(NB, P, K): blocks, block size and kv heads of either kind."""
    return (cache.data if isinstance(cache, Quantized) else cache).shape[:3]


def head_dim(cache) -> int:
    """D, the values a token's head holds, of either kind."""
    if not isinstance(cache, Quantized):
        return cache.shape[-1]
    return cache.data.shape[-1] * VALUES_PER_WORD[kind(cache)]


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
    dt = jnp.int32 if cache_type == "q8_0" else jnp.uint32
    width = D // VALUES_PER_WORD[cache_type]
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
        data = q.astype(jnp.int8).reshape(*lead, D // 4, 4)
        data = jax.lax.bitcast_convert_type(data, jnp.int32)  # [..., D/4]
    else:
        i = jnp.argmax(jnp.abs(g), axis=-1, keepdims=True)
        d = jnp.take_along_axis(g, i, axis=-1) / -8
        inv = jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))
        q = jnp.clip(jnp.trunc(g * inv + 8.5), 0, 15).astype(jnp.uint8)
        q = q.reshape(*lead, D // 8, 2, 4)  # [..., word, nibble, byte]
        data = jax.lax.bitcast_convert_type(q[..., 0, :] | (q[..., 1, :] << 4), jnp.uint32)
    return Quantized(data, d[..., 0].astype(jnp.float16))


def codes(c: Quantized):
    """The codes [..., D] int32 of a quantized cache in value order: q8_0's int8 values, q4_0's
    nibbles (0 .. 15, the value being nibble - 8)."""
    *lead, n = c.data.shape
    if c.data.dtype == jnp.int32:
        return (
            jax.lax.bitcast_convert_type(c.data, jnp.int8).reshape(*lead, n * 4).astype(jnp.int32)
        )
    b = jax.lax.bitcast_convert_type(c.data, jnp.uint8)  # [..., word, byte]
    return jnp.stack([b & 15, b >> 4], axis=-2).reshape(*lead, n * 8).astype(jnp.int32)


def dequantize(c: Quantized, dtype=jnp.float32):
    """Values [..., D] of a quantized cache (or any slice of one that keeps the last axis)."""
    q = codes(c)
    *lead, D = q.shape
    v = q.astype(jnp.float32) - (8 if c.data.dtype == jnp.uint32 else 0)
    s = c.scale.astype(jnp.float32)[..., None]
    return (v.reshape(*lead, D // GROUP, GROUP) * s).reshape(*lead, D).astype(dtype)


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
