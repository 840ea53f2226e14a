"""KV tiles inside a Pallas (Triton) kernel: BK tokens gathered through a block table from a
plain cache, or from a q8_0 / q4_0 one (kv_cache.py) and dequantized in registers, as
paged_attention.py reads them.

Shapes: BK tokens a tile, D head dim; phys / off [BK] each token's physical block and offset,
kh the kv head; ok [BK] the tokens that are needed (None: all of the tile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from .ggml_blocks import codes_as
from .kv_cache import GROUP


def _masked(ok, shape) -> dict:
    """plgpu.load's mask arguments for a tile's tokens (ok [BK]) over `shape` ([BK, ...]), or
    none where every token of the tile is needed (ok None)."""
    if ok is None:
        return {}
    ok = ok.reshape(ok.shape + (1,) * (len(shape) - 1))
    return {"mask": jnp.broadcast_to(ok, shape), "other": 0}


def load_tile(data_ref, phys, off, kh, ok, cdt, D):
    """One plain KV tile of BK tokens as values [BK, D] in cdt.

    Tokens are gathered by physical block and offset (all-array indices: interpret mode cannot
    mix array indices with slices). Tokens past the needed length (ok False) are masked loads,
    so nothing past a sequence's kv length is read; ok None: the whole tile is needed.
    """
    d = jnp.arange(D)[None, :]
    mask = _masked(ok, (phys.shape[0], D))
    return plgpu.load(data_ref.at[phys[:, None], off[:, None], kh, d], **mask).astype(cdt)


def quantized_loads(data_ref, scale_ref, kind, phys, off, kh, ok, D):
    """The raw loads of a q8_0 / q4_0 KV tile of BK tokens: (codes, scales f16 [BK, D/32]),
    codes int8 [BK, D/32, 32] (q8_0) or uint32 words [BK, D/32, 4] (q4_0). A token's codes
    are one contiguous run (D bytes or D/8 words), its scales another."""
    BK, NG = phys.shape[0], D // GROUP
    g = jnp.arange(NG)[None, :, None]
    sc = plgpu.load(
        scale_ref.at[phys[:, None], off[:, None], kh, g[..., 0]], **_masked(ok, (BK, NG))
    )
    width = GROUP if kind == "q8_0" else 4
    cols = g * width + jnp.arange(width)[None, None, :]
    at = (phys[:, None, None], off[:, None, None], kh, cols)
    return plgpu.load(data_ref.at[at], **_masked(ok, (BK, NG, width))), sc


def dequantized(raw, kind, cdt):
    """quantized_loads' (codes, scales) as values [BK, D] in cdt.

    Each scale multiplies its group's codes after a broadcast in registers, in cdt: packed
    bf16 multiplies took 64 rows x 4096 of q8_0 to 389 us against 455 in float32 on the H200
    (16 splits, bench/results/2026-12-04_attention_partials_by_row_h200.md). The codes are
    exact in cdt; the scale and the product round to it (bf16: 2^-9 relative, under q8_0's
    own step of 1/254 of a group's largest value). The tile then costs one dot like a plain
    one.
    """
    codes, sc = raw
    BK, NG = sc.shape
    sc = sc.astype(cdt)
    if kind == "q8_0":
        return (codes_as(codes, cdt) * sc[:, :, None]).reshape(BK, NG * GROUP)
    # q4_0: byte p of word w holds values 4 w + p (low nibble) and 16 + 4 w + p (high), so
    # [BK, NG, nibble, w, p] is the values' own order.
    shift = (4 * jnp.arange(2, dtype=jnp.uint32)[:, None, None]
             + 8 * jnp.arange(4, dtype=jnp.uint32)[None, None, :])  # [2, 1, 4]  # fmt: skip
    q = (codes[:, :, None, :, None] >> shift[None, None]) & 15  # [BK, NG, 2, 4, 4]
    # 2^23 + q as a float32's bits, so q - 8 is one exact subtraction (no integer convert)
    f = jax.lax.bitcast_convert_type(q | 0x4B000000, jnp.float32) - 8388616.0
    return (f.astype(cdt) * sc[:, :, None, None, None]).reshape(BK, NG * GROUP)
