"""KV tiles inside a Pallas (Triton) kernel: BK tokens gathered through a block table from a
plain cache, or a scale group of a q8_0 / q4_0 one (kv_cache.py), as paged_attention.py reads
them.

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
    """plgpu.load's mask arguments for a tile's tokens (ok [BK]) over `shape` ([BK] or
    [BK, n]), or none where every token of the tile is needed (ok None)."""
    if ok is None:
        return {}
    return {"mask": ok if len(shape) == 1 else jnp.broadcast_to(ok[:, None], shape), "other": 0}


def load_tile(data_ref, phys, off, kh, ok, cdt, D):
    """One plain KV tile of BK tokens as values [BK, D] in cdt.

    Tokens are gathered by physical block and offset (all-array indices: interpret mode cannot
    mix array indices with slices). Tokens past the needed length (ok False) are masked loads,
    so nothing past a sequence's kv length is read; ok None: the whole tile is needed.
    """
    d = jnp.arange(D)[None, :]
    mask = _masked(ok, (phys.shape[0], D))
    return plgpu.load(data_ref.at[phys[:, None], off[:, None], kh, d], **mask).astype(cdt)


def pieces(kind: str) -> list[tuple[int, int]]:
    """(first value, values) of a scale group's pieces: q8_0 one run of 32 bytes, q4_0 two."""
    half = GROUP // 2
    return [(0, GROUP)] if kind == "q8_0" else [(0, half), (half, half)]


def group_pieces(data_ref, scale_ref, kind, phys, off, kh, ok, g, cdt):
    """Scale group g of a quantized tile: (scale float32 [BK], [(first value, f [BK, n])],
    (a, b)), the codes being a * f + b with f in cdt.

    q8_0's codes (-127..127) are f itself (a 1, b 0), exact in any float dtype. q4_0's nibble
    q goes into the mantissa of 1.0 as a bf16 (bits 0x3F80 | q << 3: f = 1 + q / 16, exact),
    so the code q - 8 is 16 f - 24: two bit operations per value. Through integers (mask,
    subtract, convert through int8) the kernel had compiled to 6344 SASS instructions a step,
    4464 this way (`bench/kernel_ptx.py paged_attention --kv-types q4_0`). Either way a tile
    contracts with one dot per piece, and the scale multiplies the dot's [.., BK] result (keys)
    or the probabilities (values): one multiply per token and group, not per value. Each piece
    is one run of consecutive bytes per token (32 for q8_0, 16 for q4_0: byte i of a group
    holds value i in its low nibble and value i + 16 in its high nibble).
    """
    BK = phys.shape[0]
    sc = plgpu.load(scale_ref.at[phys, off, kh, g], **_masked(ok, (BK,))).astype(jnp.float32)

    def load(first: int, n: int):
        cols = jnp.arange(n)[None, :] + first
        return plgpu.load(
            data_ref.at[phys[:, None], off[:, None], kh, cols], **_masked(ok, (BK, n))
        )

    if kind == "q8_0":
        return sc, [(0, codes_as(load(g * GROUP, GROUP).astype(jnp.int32), cdt))], (1.0, 0.0)
    # q4_0's data is uint32 words (4 bytes, 8 nibbles; kv_cache.py): a group's 16 bytes per
    # token are 4 word loads, and byte p of word w holds values 4 w + p
    # (low nibble) and 16 + 4 w + p (high nibble)
    w = load(g * GROUP // 8, GROUP // 8)[:, :, None]  # [BK, 4, 1]
    shift = 8 * jnp.arange(4, dtype=jnp.uint32)[None, None, :]
    (lo, _), (hi, _) = pieces(kind)
    BK = w.shape[0]

    def unit(nibble_at):  # bf16 1 + q / 16 from q << 3 in its mantissa, in cdt (exact in any)
        bits = (((w >> (shift + nibble_at)) & 15) << 3) | 0x3F80  # [BK, 4 words, 4 bytes]
        bits = bits.reshape(BK, GROUP // 2).astype(jnp.uint16)
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(cdt)

    return sc, [(lo, unit(0)), (hi, unit(4))], (16.0, -24.0)
