"""GGML code bytes through inline PTX four at a time: as floats (one permute) or int8 dots (dp4a).

quant_matmul's vector path (a decode step's one or two live rows) is bound by instruction
issue, not memory. On the H200, Nsight Compute counted 16 thread instructions per Q4_K weight
value, 0.77 warp instructions issued a clock per scheduler, and 18% of DRAM's bandwidth
(bench/results/history/2026-12-01_quant_matmul_live_rows_h200.md). About 5 of those instructions
turned a code into a float: extract the byte from its register, widen it, shift, mask, add the bits
of 1.5 * 2**23, and subtract that float (`ggml_blocks.exact_f32`).

Here a Triton inline-asm instance takes four code bytes in one 32-bit register (pack 4). It
shifts and masks all four at once, ORs in 0x80, and builds each float with one `prmt`: the byte
0x80 | q under 0x3F, above two zero bytes, is the float 1 + q / 128, exact for q < 128 (every
type here but Q8_0). A group whose values are a * (q - bias) + b then adds
A * sum(f * x) + B * sum(x), with A = 128 a and B = b - (128 + bias) a: no conversion and no
subtraction per value. f stays in [1, 2), so f * x rounds no worse than q * x.

Unit codes: `codes(lo, ...)` takes uint8 tensors lo (and hi) of one shape and gives float32 of
that shape; `DECODERS` give quant_matmul's vector path each type's group in this form
(`unit_codes=True`). Off by default: timed on the H200 against the integer codes, one live row
gained 2 to 7% for Q4_K and lost 3 to 17% for Q6_K, and two live rows lost 20 to 60%
(bench/results/history/2026-12-01_quant_matmul_unit_codes_h200.md).

Int8 dots: `dots4(lo, x, ...)` extracts the codes the same way and sums their products with four
int8 activations in one `dp4a`; `INT_DECODERS` give the vector path each type's group against
activations rounded to int8 (`int8_x=True`, on in the engine for dense models: Q4_K 22 to 29%
and Q8_0 2 to 9% faster on the H200, bench/results/history/2026-12-01_quant_matmul_int8_x_h200.md).
Both read the byte layouts from one table, `PIECES`.

With ptx=False (interpret mode on the CPU, and ROCm) the same results come from jnp integer ops
(and a bitcast). tests/test_ggml_asm.py runs the PTX through a small emulator of its
instructions and compares against that path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from .ggml_blocks import _byte_f16, _k_affine, _q6_k_scale

UNIT = 0x3F000000  # over a byte 0x80 | q in bits 16-23: the float 1 + q / 128


def _rep(byte: int) -> str:
    """A byte repeated into each byte of a 32-bit immediate."""
    return f"0x{byte * 0x01010101:08X}"


def _extract(lo: str, hi: str | None, shift=0, mask=0xFF, hi_shift=0, hi_mask=0, hi_to=0):
    """PTX lines that leave in t the four codes q = (lo >> shift) & mask |
    ((hi >> hi_shift) & hi_mask) << hi_to of the four bytes in registers lo (and hi)."""
    lines = [".reg .b32 t, u, m;", f"mov.b32 t, {lo};"]
    if shift:
        lines.append(f"shr.b32 t, t, {shift};")
    if mask != 0xFF:
        lines.append(f"and.b32 t, t, {_rep(mask)};")
    if hi:
        lines.append(f"shr.b32 u, {hi}, {hi_shift};" if hi_shift else f"mov.b32 u, {hi};")
        lines.append(f"and.b32 u, u, {_rep(hi_mask)};")
        if hi_to:
            lines.append(f"shl.b32 u, u, {hi_to};")
        lines.append("or.b32 t, t, u;")
    return lines


def asm_text(shift=0, mask=0xFF, hi=False, hi_shift=0, hi_mask=0, hi_to=0) -> str:
    """The asm of one instance: $4 (and $5 with hi) hold four code bytes; of each,
    q = (lo >> shift) & mask | ((hi >> hi_shift) & hi_mask) << hi_to (q < 128), and $0 .. $3
    get the floats 1 + q / 128."""
    lines = _extract("$4", "$5" if hi else None, shift, mask, hi_shift, hi_mask, hi_to)
    # prmt d, a, b, sel: byte i of d is byte (sel >> 4 i) & 7 of b:a (a's bytes 0-3, b's
    # 4-7); d = 0x3F, 0x80 | q, 0x00, 0x00 (bytes 7, k, 4, 4 of m:t)
    lines += ["or.b32 t, t, 0x80808080;", f"mov.b32 m, 0x{UNIT:08X};"]
    lines += [f"prmt.b32 ${k}, t, m, 0x7{k}44;" for k in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


def codes(lo, *, ptx: bool, shift=0, mask=0xFF, hi=None, hi_shift=0, hi_mask=0, hi_to=0):
    """Of each element of the uint8 tensors lo (and hi, same shape), the code
    q = (lo >> shift) & mask | ((hi >> hi_shift) & hi_mask) << hi_to (q < 128) as the float32
    1 + q / 128: exact, one permute per value, and f * x rounds no worse than q * x would."""
    kw = dict(shift=shift, mask=mask, hi_shift=hi_shift, hi_mask=hi_mask, hi_to=hi_to)
    if ptx:
        args = [lo] if hi is None else [lo, hi]
        out = plgpu.elementwise_inline_asm(
            asm_text(hi=hi is not None, **kw),
            args=args,
            constraints="=r,=r,=r,=r," + ",".join("r" * len(args)),
            pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(lo.shape, jnp.float32)],
        )
        return out[0]
    q = (lo.astype(jnp.int32) >> shift) & mask
    if hi is not None:
        q = q | (((hi.astype(jnp.int32) >> hi_shift) & hi_mask) << hi_to)
    return jax.lax.bitcast_convert_type((q << 16) | 0x3F800000, jnp.float32)


def _unit(a, b, bias: int):
    """(A, B) of a group whose values are a * (q - bias) + b, given its codes as f = 1 + q / 128:
    the group adds A * sum(f * x) + B * sum(x)."""
    return 128.0 * a, (0.0 if b is None else b) - (128.0 + bias) * a


# Per type: (load, load1, g, piece) -> (a, b, bias, pieces [(first value, code bytes lo,
# extraction keywords)]): a value of group g is a * (q - bias) + b (b None for zero), q extracted
# from lo (and the keywords' hi) as `codes` and `dots4` take it, and no piece spans more than
# `piece` code bytes (32 or 16: runs of 32 loaded as two halves). The byte layouts are
# ggml_blocks' decoders'. IQ4_XS (a table) has none.


def _q8_0(load, load1, g, piece=32):
    pieces = [(h, load(2 + h, piece), dict(signed=True)) for h in range(0, 32, piece)]
    return _byte_f16(load1, 0), None, 0, pieces


def _q4_0(load, load1, g, piece=32):
    pieces = [(16 * h, load(2, 16), dict(shift=4 * h, mask=15)) for h in (0, 1)]
    return _byte_f16(load1, 0), None, 8, pieces


def _q4_k(load, load1, g, piece=32):
    # run g // 2 of 32 bytes: low nibbles are group 2r, high nibbles 2r + 1
    off, kw = 16 + 32 * (g // 2), dict(shift=4 * (g % 2), mask=15)
    return (*_k_affine(load1, g), 0, [(h, load(off + h, piece), kw) for h in range(0, 32, piece)])


def _q5_k(load, load1, g, piece=32):
    # Q4_K's low nibble and bit g of the 32 high-bit bytes on top
    kw = dict(shift=4 * (g % 2), mask=15, hi_shift=g, hi_mask=1, hi_to=4)
    lo = 48 + 32 * (g // 2)
    pieces = [
        (h, load(lo + h, piece), dict(kw, hi=load(16 + h, piece))) for h in range(0, 32, piece)
    ]
    return (*_k_affine(load1, g), 0, pieces)


def _q6_k(load, load1, g, piece=32):
    # A group at a time. Two groups as one 32-byte run (half the loads, no shuffle in the SASS
    # a newer Triton compiled) ran 2.3x slower on the H200 (history/2026-12-02_q6_k_pairs_h200.md).
    h, v = divmod(g * 16, 128)  # ggml_blocks._q6_k's layout
    kw = dict(shift=4 * (v // 64), mask=15, hi=load(128 + 32 * h + v % 32, 16),
              hi_shift=2 * (v // 32), hi_mask=3, hi_to=4)  # fmt: skip
    return _q6_k_scale(load1, g), None, 32, [(0, load(64 * h + v % 64, 16), kw)]


PIECES = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


def unit_group(qtype: str, load, load1, g, ptx):
    """(A, B, pieces [(first value, float32 f [..., n])]) of group g with its codes as the floats
    f = 1 + q / 128: the group adds A * sum(f * x) + B * sum(x) over its pieces."""
    a, b, bias, pieces = PIECES[qtype](load, load1, g)
    return (*_unit(a, b, bias), [(first, codes(lo, ptx=ptx, **kw)) for first, lo, kw in pieces])


# The unit codes' types: Q8_0's 8-bit codes do not fit 1 + q / 128 exactly.
DECODERS = {t: functools.partial(unit_group, t) for t in PIECES if t != "q8_0"}


# dp4a: codes times int8 activations, four products and their sum in one instruction (as
# llama.cpp's vec-dot kernels do over q8_1 activations). An instance takes four code bytes and
# four activation bytes; $0 gets the sum of the four products, $1 .. $3 zero (elementwise asm
# returns as many values as it takes; ptxas folds the zeros out of the sums that follow).


def dp4a_text(signed=False, shift=0, mask=0xFF, hi=False, hi_shift=0, hi_mask=0, hi_to=0) -> str:
    """The asm of one instance: $4 (and $5 with hi) hold four code bytes, extracted as
    asm_text's (or, signed, read as int8 as they are), the next register four int8 activations;
    $0 gets the four products' sum."""
    x = "$6" if hi else "$5"
    lines = _extract("$4", "$5" if hi else None, shift, mask, hi_shift, hi_mask, hi_to)
    lines += ["mov.b32 m, 0;", f"dp4a.{'s32' if signed else 'u32'}.s32 $0, t, {x}, m;"]
    lines += [f"mov.b32 ${k}, 0;" for k in (1, 2, 3)]
    return "{\n" + "\n".join(lines) + "\n}"


def dots4(lo, x, *, ptx: bool, signed=False, hi=None, **kw):
    """int32 of lo's shape whose sum over any run of four aligned elements is the dot of their
    codes (extracted as `codes` does, or lo's bytes as int8 when signed) with the int8 x."""
    if ptx:
        args = [lo, x] if hi is None else [lo, hi, x]
        out = plgpu.elementwise_inline_asm(
            dp4a_text(signed=signed, hi=hi is not None, **kw),
            args=args,
            constraints="=r,=r,=r,=r," + ",".join("r" * len(args)),
            pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(lo.shape, jnp.int32)],
        )
        return out[0]
    if signed:
        q = jax.lax.bitcast_convert_type(lo, jnp.int8).astype(jnp.int32)
    else:
        q = (lo.astype(jnp.int32) >> kw.get("shift", 0)) & kw.get("mask", 0xFF)
        if hi is not None:
            high = (hi.astype(jnp.int32) >> kw.get("hi_shift", 0)) & kw.get("hi_mask", 0)
            q = q | (high << kw.get("hi_to", 0))
    return q * x.astype(jnp.int32)


def int_group(qtype: str, load, load1, g, piece: int = 32):
    """(a, c, pieces [(first value, code bytes, dots4's keywords)]) of group g against integer
    activations x, no piece over `piece` bytes: the group adds a * sum(q * x) + c * sum(x) over
    its pieces (c folds b with the codes' bias; None for zero)."""
    a, b, bias, pieces = PIECES[qtype](load, load1, g, piece)
    if bias == 0:  # b as it is: 0 * a would stay in the kernel
        return a, b, pieces
    return a, (0.0 if b is None else b) - bias * a, pieces


INT_DECODERS = {t: functools.partial(int_group, t) for t in PIECES}
