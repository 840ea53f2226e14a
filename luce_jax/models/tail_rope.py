"""DeepSeek V4's rotary embedding: interleaved pairs (2i, 2i + 1) rotated on the trailing r
dims of each head ([nope | rope]), with YaRN frequencies on the compressed layers and the
attention factor 1.0 (transformers forces it; llama.cpp cancels ggml's). The attention
output's rope slice is rotated back by its query position (`inverse`), since K and V share
one head that carried the rotation (transformers' apply_rotary_pos_emb with -sin, llama.cpp's
ggml_rope_ext_back).

Shapes: T tokens, r rotated dims (r / 2 frequencies).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def inv_freq(r: int, base: float) -> np.ndarray:
    """[r / 2] float32: base ** (-2i / r)."""
    return (1.0 / base ** (np.arange(0, r, 2, dtype=np.float32) / r)).astype(np.float32)


def yarn_inv_freq(r: int, base: float, factor: float, original: int, beta_fast: float = 32,
                  beta_slow: float = 1) -> np.ndarray:  # fmt: skip
    """[r / 2] float32: YaRN's blend of the interpolated (base frequencies / factor) and the
    original frequencies, with a linear ramp between the dims that turn beta_fast and
    beta_slow times over `original` positions (floored and ceiled, as transformers' truncate)."""

    def dim_of(turns: float) -> float:
        return r * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(beta_fast)), 0)
    high = min(math.ceil(dim_of(beta_slow)), r - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(r // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of the original frequency
    base_freq = inv_freq(r, base)
    return (base_freq / factor * ramp + base_freq * extrapolation).astype(np.float32)


def rope_tail(x, pos, freqs, inverse: bool = False):
    """x [T, ..., D] with its last r = 2 * len(freqs) dims rotated in interleaved pairs by
    pos [T] * freqs (backwards with `inverse`), float32."""
    x = x.astype(jnp.float32)
    r = 2 * freqs.shape[0]
    ang = pos.astype(jnp.float32)[:, None] * jnp.asarray(freqs)[None, :]  # [T, r / 2]
    ang = ang.reshape(ang.shape[0], *(1,) * (x.ndim - 2), -1)
    cos, sin = jnp.cos(ang), jnp.sin(ang) * (-1.0 if inverse else 1.0)
    tail = x[..., -r:].reshape(*x.shape[:-1], r // 2, 2)
    a, b = tail[..., 0], tail[..., 1]
    rot = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(*x.shape[:-1], r)
    return jnp.concatenate([x[..., :-r], rot], axis=-1)
