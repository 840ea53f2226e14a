"""GGML's block formats a block at a time inside a kernel (`FORMATS`), for weights kept in their
file layout on the device (ggml_dequant.py dequantizes them whole, the reference).

`FORMATS` describe the quantized types for the matmul kernels
(quant_matmul.py, moe_grouping.py): a block of B values splits into groups that share one
scale, and a group's values into pieces (runs of 16 or 32 consecutive values whose codes sit in
consecutive bytes, low or high nibbles, plus high bits for Q5_K / Q6_K). A kernel loads a
piece's bytes for BN weight rows at once, decodes them to small integers (or IQ4_XS's table
values), takes one dot with the matching activations and scales the partial product by the
group's scale row, so scales cost one multiply per group and output column, not per weight.
All offsets below are static: a kernel unrolls a block's groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType
from jax.experimental.pallas import triton as plgpu

from .ggml_dequant import IQ4_VALUES, MXFP4_VALUES, QK_K

T = GGMLQuantizationType


# --- a block at a time inside a kernel -------------------------------------------------------


def _byte_f16(load1, off):
    """float32 from the little-endian f16 whose bytes load1(off), load1(off + 1) give (off a
    static block offset)."""
    lo, hi = load1(off).astype(jnp.uint16), load1(off + 1).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(lo | (hi << 8), jnp.float16).astype(jnp.float32)


def _int(v):
    return v.astype(jnp.int32)


# Codes to floats inside a kernel. The H200 converts integers to floats (I2F) at 16 results per
# clock and SM against 128 FMAs (an eighth of the rate; CUDA's throughput table for sm_90), and
# a kernel converts every weight value it reads, so both helpers stay off that unit
# (`bench/kernels/kernel_ptx.py --vector` counts the I2Fs).


def exact_f32(codes):
    """Small integers (|v| < 2**22) to float32: v added to the bits of 1.5 * 2**23 gives the
    float 1.5 * 2**23 + v exactly, and one float subtraction leaves v."""
    magic = 0x4B400000
    return jax.lax.bitcast_convert_type(codes + magic, jnp.float32) - float(1.5 * 2**23)


def codes_as(codes, dtype):
    """Codes in int8's range to a 16-bit float dtype for a dot: through int8, which Triton
    converts with byte permutes and one packed add per two values rather than an I2F each."""
    return codes.astype(jnp.int8).astype(dtype)


@dataclass(frozen=True)
class BlockFormat:
    """How a kernel decodes one block of a type, a group at a time.

    `decode(load, load1, g)` returns (a, b, pieces) for group g: the group's values are
    a * code + b, with a and b float32 [BN] (b None where there is no offset), and pieces
    [(first value, codes [BN, n] int32)]. load(off, n) gives the block's bytes [BN, n] at a
    static offset (code bytes only), load1(off) one byte [BN] (head bytes only). Offsets are
    the file block's.
    """

    qtype: GGMLQuantizationType
    block: int  # values per block (B)
    type_size: int  # bytes per block
    group: int  # values per scale
    decode: object
    head: tuple[int, int]  # (first byte, bytes) of the scales, the rest being codes
    # The block's bytes in this order before the split into head and codes (None: the file's),
    # where a type's scale bytes are not one run (Q2_K's d and dmin follow its codes); decode's
    # offsets are of the reordered block.
    order: tuple[int, ...] | None = None

    @property
    def groups(self) -> int:
        return self.block // self.group

    @property
    def head_unit(self) -> int:
        """Bytes per element of a QuantWeight's head: the widest of 4, 2 and 1 that divides the
        head's bytes (a padded unit would grow the weight)."""
        hs = self.head[1]
        return 4 if hs % 4 == 0 else 2 if hs % 2 == 0 else 1

    @property
    def body_size(self) -> int:
        return self.type_size - self.head[1]


def _q8_0(load, load1, g):
    return (
        _byte_f16(load1, 0),
        None,
        [(0, _int(jax.lax.bitcast_convert_type(load(2, 32), jnp.int8)))],
    )


def _q4_0(load, load1, g):
    q = _int(load(2, 16))
    return _byte_f16(load1, 0), None, [(0, (q & 15) - 8), (16, (q >> 4) - 8)]


def _k_scale_min_of(load1, g: int):
    """Q4_K / Q5_K's 6-bit scale and min of group g (of 8) from the 12 bytes at offset 4."""
    q = lambda i: _int(load1(4 + i))  # noqa: E731
    if g < 4:
        return q(g) & 63, q(g + 4) & 63
    return (q(g + 4) & 15) | ((q(g - 4) >> 6) << 4), (q(g + 4) >> 4) | ((q(g) >> 6) << 4)


def _k_affine(load1, g):
    sc, m = _k_scale_min_of(load1, g)
    a = _byte_f16(load1, 0) * exact_f32(sc)
    return a, -(_byte_f16(load1, 2) * exact_f32(m))


def _q4_k(load, load1, g):
    # 4 runs of 32 bytes; run r's low nibbles are group 2r, its high nibbles group 2r + 1
    codes = (_int(load(16 + 32 * (g // 2), 32)) >> (4 * (g % 2))) & 15
    return (*_k_affine(load1, g), [(0, codes)])


def _q5_k(load, load1, g):
    low = (_int(load(48 + 32 * (g // 2), 32)) >> (4 * (g % 2))) & 15
    high = (_int(load(16, 32)) >> g) & 1  # bit g of the 32 high-bit bytes
    return (*_k_affine(load1, g), [(0, low | (high << 4))])


def _q6_k(load, load1, g):
    # Two halves of 128 values; in half h, value v (< 128) has its low 4 bits in byte
    # 64 h + v % 64 (high nibble if v >= 64) and its top 2 bits in byte 128 + 32 h + v % 32
    # at bit 2 (v // 32). Groups are 16 values, so one group is one run of each.
    h, v = divmod(g * 16, 128)
    low = (_int(load(64 * h + v % 64, 16)) >> (4 * (v // 64))) & 15
    high = (_int(load(128 + 32 * h + v % 32, 16)) >> (2 * (v // 32))) & 3
    return _q6_k_scale(load1, g), None, [(0, (low | (high << 4)) - 32)]


def _q6_k_scale(load1, g):
    """Q6_K group g's scale: d times its int8 scale byte."""
    sc = jax.lax.bitcast_convert_type(load1(192 + g), jnp.int8).astype(jnp.int32)
    return _byte_f16(load1, 208) * exact_f32(sc)


def _iq4_value(q):
    return _table_value(q, IQ4_VALUES)


def _iq4_xs(load, load1, g):
    low = (_int(load1(4 + g // 2)) >> (4 * (g % 2))) & 15
    high = (_int(load1(2 + g // 4)) >> (2 * (g % 4))) & 3
    a = _byte_f16(load1, 0) * exact_f32((low | (high << 4)) - 32)
    q = _int(load(8 + 16 * g, 16))
    return a, None, [(0, _iq4_value(q & 15)), (16, _iq4_value(q >> 4))]


def _q2_k(load, load1, g):
    # reordered: 16 scale | min bytes, d, dmin, then the 64 code bytes; group g (16 values) is
    # bits 2 ((g % 8) // 2) of the 16-byte run 32 (g // 8) + 16 (g % 2) of the codes
    sc = _int(load1(g))
    a = _byte_f16(load1, 16) * exact_f32(sc & 15)
    b = -(_byte_f16(load1, 18) * exact_f32(sc >> 4))
    codes = (_int(load(20 + 32 * (g // 8) + 16 * (g % 2), 16)) >> (2 * ((g % 8) // 2))) & 3
    return a, b, [(0, codes)]


def _q3_k(load, load1, g):
    # codes as Q2_K's at offset 32, the high bit of group g's values bit g // 2 of the 16 bytes
    # 16 (g % 2) of hmask (a clear bit subtracts 4); 6-bit scales in 12 bytes at 96
    low = (_int(load1(96 + g % 8)) >> (4 * (g // 8))) & 15
    high = (_int(load1(104 + g % 4)) >> (2 * (g // 4))) & 3
    a = _byte_f16(load1, 108) * exact_f32((low | (high << 4)) - 32)
    ql = (_int(load(32 + 32 * (g // 8) + 16 * (g % 2), 16)) >> (2 * ((g % 8) // 2))) & 3
    qh = (_int(load(16 * (g % 2), 16)) >> (g // 2)) & 1
    return a, None, [(0, (ql | (qh << 2)) - 4)]


def _table_value(q, table):
    """table[q] for 4-bit codes, as a tree of selects on q's bits (no table gather)."""
    vals = [jnp.int32(v) for v in table]
    for bit in range(4):  # halve the candidates by one bit of q, lowest bit first
        on = (q >> bit) & 1
        vals = [jnp.where(on == 1, hi, lo) for lo, hi in zip(vals[0::2], vals[1::2], strict=True)]
    return vals[0]


def _mxfp4(load, load1, g):
    e = _int(load1(0))  # E8M0: 2**(e - 128) for the doubled values, as ggml_e8m0_to_fp32_half
    bits = jnp.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    q = _int(load(1, 16))
    vals = [(0, _table_value(q & 15, MXFP4_VALUES)), (16, _table_value(q >> 4, MXFP4_VALUES))]
    return jax.lax.bitcast_convert_type(bits, jnp.float32), None, vals


# Q2_K's block reordered so its scale bytes are one run: scales, d, dmin, codes
Q2_K_ORDER = (*range(16), *range(80, 84), *range(16, 80))

FORMATS = {
    "q8_0": BlockFormat(T.Q8_0, 32, 34, 32, _q8_0, (0, 2)),
    "q4_0": BlockFormat(T.Q4_0, 32, 18, 32, _q4_0, (0, 2)),
    "q4_k": BlockFormat(T.Q4_K, QK_K, 144, 32, _q4_k, (0, 16)),
    "q5_k": BlockFormat(T.Q5_K, QK_K, 176, 32, _q5_k, (0, 16)),
    "q6_k": BlockFormat(T.Q6_K, QK_K, 210, 16, _q6_k, (192, 18)),
    "iq4_xs": BlockFormat(T.IQ4_XS, QK_K, 136, 32, _iq4_xs, (0, 8)),
    "q2_k": BlockFormat(T.Q2_K, QK_K, 84, 16, _q2_k, (0, 20), Q2_K_ORDER),
    "q3_k": BlockFormat(T.Q3_K, QK_K, 110, 16, _q3_k, (96, 14)),
    "mxfp4": BlockFormat(T.MXFP4, 32, 17, 32, _mxfp4, (0, 1)),
}
QTYPES = {f.qtype: name for name, f in FORMATS.items()}  # GGML type -> FORMATS key


def block_loaders(fmt: BlockFormat, body_at, head_at, cols, ok, blk, loaded=None):
    """load(off, n) -> code bytes and load1(off) -> head bytes of block `blk` of weight rows
    `cols` [BN] (BlockFormat.decode's loaders; off is a file-block offset); rows where `ok` is
    False give zeros. The head is loaded a unit at a time (BlockFormat.head_unit bytes) and
    each byte taken from its unit: Q4_K's 16 scale bytes cost 4 loads, not 16.
    body_at(rows, bytes) and head_at(head row, rows) index the weight's refs (an expert's in
    the grouped kernel).

    blk is one block index (load gives [BN, n], load1 [BN], ok is [BN]) or U block indices
    [U] (load gives [BN, U, n], load1 [BN, U], ok is [BN, U]): the vector path decodes U
    blocks at once, so a piece of every block comes in one wide load.
    loaded: the dict the loads go to, keyed ("body", off, n) and ("head", unit); a key already
    in it is not loaded again (the vector path passes in the loads it issued a step earlier).
    """
    h0, hs = fmt.head
    many = jnp.ndim(blk) == 1
    rows = cols[:, None, None] if many else cols[:, None]
    blk_b = blk[None, :, None] if many else blk
    okb = None if ok is None else (ok[:, :, None] if many else ok[:, None])
    rows1, blk1 = (cols[:, None], blk[None, :]) if many else (cols, blk)

    # A block's groups share bytes (Q4_K's groups 2r and 2r + 1 are the two nibbles of one
    # run; every group reads the same d, dmin and packed scales), and a load is not merged with
    # an equal one by the compiler: each distinct load is issued once per block and reused.
    loaded: dict[tuple, jax.Array] = {} if loaded is None else loaded

    def load(off: int, n: int):
        if ("body", off, n) not in loaded:
            b = off - hs if h0 == 0 else off  # the head is at the block's start or its end
            assert 0 <= b and b + n <= fmt.body_size, (fmt.qtype, off, n)
            idx = blk_b * fmt.body_size + b + jnp.arange(n)  # [1, U, n] or [n]
            idx = idx if many else idx[None, :]
            loaded["body", off, n] = plgpu.load(
                body_at(rows, idx), mask=okb, other=None if okb is None else 0
            )
        return loaded["body", off, n]

    def load1(off: int):
        assert h0 <= off < h0 + hs, (fmt.qtype, off)
        unit, byte = divmod(off - h0, fmt.head_unit)  # the byte from its unit, loaded once
        if ("head", unit) not in loaded:
            row = blk1 * (hs // fmt.head_unit) + unit
            loaded["head", unit] = plgpu.load(
                head_at(row, rows1), mask=ok, other=None if ok is None else 0
            )
        return ((loaded["head", unit] >> (8 * byte)) & 0xFF).astype(jnp.uint8)

    return load, load1


def issue_loads(fmt: BlockFormat, load, load1, keys) -> None:
    """Issue block_loaders' loads of `keys` (keys of its `loaded` dict) through load, load1."""
    for key in keys:
        if key[0] == "body":
            load(*key[1:])
        else:
            load1(fmt.head[0] + key[1] * fmt.head_unit)


def contract_block(fmt: BlockFormat, load, load1, load_x, acc, dot):
    """acc [BM, BN] + x's BM rows times one block of BN weight rows, over the block's values.

    Args:
      load, load1: the block's bytes (BlockFormat.decode's).
      load_x(first, n): activations [BM, n] of the block's values first .. first + n.
      dot(x [BM, n], codes [BN, n]) -> [BM, BN] float32.
    """
    for g in range(fmt.groups):
        a, b, pieces = fmt.decode(load, load1, g)
        part = xsum = None
        for first, codes in pieces:
            xb = load_x(g * fmt.group + first, codes.shape[1])
            p = dot(xb, codes)
            part = p if part is None else part + p
            if b is not None:
                s = jnp.sum(xb.astype(jnp.float32), axis=1)
                xsum = s if xsum is None else xsum + s
        acc = acc + part * a[None, :]
        if b is not None:
            acc = acc + xsum[:, None] * b[None, :]
    return acc


def contract_block_int8(fmt: BlockFormat, load, load1, load_x, load_dx, load_sx, acc):
    """contract_block on x's int8 rows (int8_rows.py): per group, x's codes [BM, n] times the
    weight's codes as int8, summed in int32 on the matrix units, then scaled by the group's a
    and x's scale per 32 values, plus b times x's sum over the group (sx: per 16 or 32).

    Args:
      load_x(first, n): x's int8 codes [BM, n] of the block's values first .. first + n.
      load_dx(first), load_sx(first): x's scale of the 32 values and sum of the group's values
        at value `first` of the block, [BM] float32 (load_sx None where no group has b).
    """
    for g in range(fmt.groups):
        a, b, pieces = fmt.decode(load, load1, g)
        dot = 0
        for first, codes in pieces:
            xq = load_x(g * fmt.group + first, codes.shape[1])
            dot = dot + jax.lax.dot_general(xq, codes.astype(jnp.int8), (((1,), (1,)), ((), ())),
                                            preferred_element_type=jnp.int32)  # fmt: skip
        part = exact_f32(dot) * a[None, :]
        if b is not None:
            part = part + load_sx(g * fmt.group)[:, None] * b[None, :]
        acc = acc + load_dx(g * fmt.group)[:, None] * part
    return acc
