"""GGML code bytes decoded a 32-bit word at a time, each code as the float 1 + code / 2**n.

quant_matmul's vector path (few live rows) is bound by instruction issue, not bandwidth: on
the H200 a warp issues one instruction a clock per scheduler, and decoding a code through an
integer (extract the byte or nibble, widen, convert, scale) took 9 (Q8_0) to 15 (Q4_K)
instructions per weight value (bench/kernel_ptx.py), so Q4_K's gate/up ran at 29% of the copy
bandwidth while reading half of Q8_0's bytes.

Here a code's bits are moved straight into the mantissa of 1.0 (one shift, one mask-and-or),
giving f = 1 + code / 2**n in [1, 2) exactly, and the group's affine map is folded into two
per-group numbers: a group whose values are `A * f + B` contributes A * sum(f * x) +
B * sum(x). A value costs a shift, a LOP3 and a fused multiply-add. Unlike adding the code to
2**23 and subtracting it again, f stays near 1, so sum(f * x) loses no more to rounding than
sum(code * x) does (A scales it by at most 256).

Each decoder takes loadw(off, nw), nw uint32 words of the block's code bytes at the file-block
byte offset off (little-endian: byte p of word i is byte 4 i + p), and load1(off), a head byte,
and returns (A, B, pieces) for group g: pieces [(first, f)] where f [..., nw] holds the codes of
values first + 4 i of the group (i < nw). Types whose codes index a table (IQ4_XS) have none.
The kernel loads the bytes as the byte path does (16 at a time) and reassembles each 4 into a
word; a uint32 view of the weight made by XLA outside the kernel would copy it every call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .ggml_blocks import _byte_f16, _k_affine, _q6_k_scale

ONE = 0x3F800000  # float32 1.0: mantissa bits below it add bits / 2**23


def bits(w, src: int, dst: int, width: int):
    """The `width` bits of uint32 words w that start at bit src, moved to start at bit dst."""
    v = w << (dst - src) if dst >= src else w >> (src - dst)
    return v & jnp.uint32(((1 << width) - 1) << dst)


def unit(mantissa):
    """Mantissa bits (below bit 23) to the float32 1 + mantissa / 2**23, exactly."""
    return jax.lax.bitcast_convert_type(mantissa | jnp.uint32(ONE), jnp.float32)


def _q8_0(loadw, load1, g):
    # int8 code c, XORed to the unsigned c + 128 in bits 15..22: f = 1 + (c + 128) / 256
    w = loadw(2, 8) ^ jnp.uint32(0x80808080)
    d = _byte_f16(load1, 0)
    return 256.0 * d, -384.0 * d, [(p, unit(bits(w, 8 * p, 15, 8))) for p in range(4)]


def _q4_0(loadw, load1, g):
    # nibble q (value d * (q - 8)) in bits 19..22: f = 1 + q / 16; low nibbles are values 0-15
    w = loadw(2, 4)
    d = _byte_f16(load1, 0)
    pieces = [(16 * h + p, unit(bits(w, 8 * p + 4 * h, 19, 4))) for h in (0, 1) for p in range(4)]
    return 16.0 * d, -24.0 * d, pieces


def _q4_k(loadw, load1, g):
    # run g // 2 of 32 bytes: low nibbles are group 2r, high nibbles 2r + 1; value a * q + b
    w, h = loadw(16 + 32 * (g // 2), 8), g % 2
    a, b = _k_affine(load1, g)
    return 16.0 * a, b - 16.0 * a, [(p, unit(bits(w, 8 * p + 4 * h, 19, 4))) for p in range(4)]


def _q5_k(loadw, load1, g):
    # the low nibble as Q4_K's and bit g of the 32 high-bit bytes on top: q5 in bits 18..22
    lo, hi, h = loadw(48 + 32 * (g // 2), 8), loadw(16, 8), g % 2
    a, b = _k_affine(load1, g)
    pieces = [
        (p, unit(bits(lo, 8 * p + 4 * h, 18, 4) | bits(hi, 8 * p + g, 22, 1))) for p in range(4)
    ]
    return 32.0 * a, b - 32.0 * a, pieces


def _q6_k(loadw, load1, g):
    # 16-value groups; q6 = low nibble | top 2 bits << 4 in bits 17..22, value a * (q6 - 32).
    # The byte layout is ggml_blocks._q6_k's.
    h, v = divmod(g * 16, 128)
    lo, nib = loadw(64 * h + v % 64, 4), 4 * (v // 64)
    hi, two = loadw(128 + 32 * h + v % 32, 4), 2 * (v // 32)
    a = _q6_k_scale(load1, g)
    pieces = [
        (p, unit(bits(lo, 8 * p + nib, 17, 4) | bits(hi, 8 * p + two, 21, 2))) for p in range(4)
    ]
    return 64.0 * a, -96.0 * a, pieces


# type -> (decoder, nw: the words of every piece)
WORDS = {"q8_0": (_q8_0, 8), "q4_0": (_q4_0, 4), "q4_k": (_q4_k, 8), "q5_k": (_q5_k, 8),
         "q6_k": (_q6_k, 4)}  # fmt: skip
