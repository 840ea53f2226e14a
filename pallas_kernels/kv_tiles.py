"""KV tiles inside a Pallas (Triton) kernel: BK tokens gathered through a block table from a
plain cache, or from a q8_0 / q4_0 one (kv_cache.py) and dequantized in registers, as
paged_attention.py reads them.

Quantized codes become f16 through inline PTX, two words of one token at a time (pack 2): one
permute takes the same byte of both words into the low bytes of two halves (q4_0's high nibble
then one shift), one lop3 makes each half the f16 0x64XX = 1024 + XX with the code's bits in XX
(q8_0's sign bit flipped), one packed subtraction leaves the value and one packed multiply
applies the scale. The planes (a word's value m of each word) are contracted in pieces
(`tile_pieces`): each piece joins a run of planes in registers and is a dot of its own, with q's
columns and the output's in the piece's order (one piece is the value order kv_cache.py's word
layouts give). Joins cost permutes; more pieces cost dots. Triton's own
int8 -> bf16 conversion had unpacked the loaded words byte by byte and packed them again (about
5 instructions a code), and q4_0's nibbles had gone through shared memory for their reshape.
Compiled for sm_90a the kernel's loop went from 1191 to 793 instructions an iteration for q8_0
(217 to 194 registers) and from 1440 to 751 for q4_0 (168 to 128 registers). On the H200, 64
decode rows over 4096 keys: q8_0 313 -> 304 us, q4_0 379 -> 289, bf16 269 (bench/results/
history/2026-12-04_attention_kernel_planes_h200.md); instructions no longer bound q8_0, and no
tiling did better (..._planes_tilings_h200.md).

Shapes: BK tokens a tile, D head dim; phys / off [BK] each token's physical block and offset,
kh the kv head; ok [BK] the tokens that are needed (None: all of the tile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from .kv_cache import GROUP, VALUES_PER_WORD


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
    """The raw loads of a q8_0 / q4_0 KV tile of BK tokens: (words, scales f16 [BK, D/32]),
    words int32 [BK, D/32, 8] (q8_0) or uint32 [BK, D/32, 4] (q4_0). A token's codes are one
    contiguous run (D/4 or D/8 words), its scales another."""
    BK, NG = phys.shape[0], D // GROUP
    g = jnp.arange(NG)[None, :, None]
    sc = plgpu.load(
        scale_ref.at[phys[:, None], off[:, None], kh, g[..., 0]], **_masked(ok, (BK, NG))
    )
    width = GROUP // VALUES_PER_WORD[kind]  # words a group
    cols = g * width + jnp.arange(width)[None, None, :]
    at = (phys[:, None, None], off[:, None, None], kh, cols)
    return plgpu.load(data_ref.at[at], **_masked(ok, (BK, NG, width))), sc


# Per type: the planes of a word, each (byte, shift, mask of the code's bits in a half, the
# constant XORed in, the f16x2 subtracted): plane m of word c holds the token's value
# len(planes) * c + m (kv_cache.py's layouts). q8_0: the code byte XOR 0x80 under 0x64 is the
# f16 1152 + code. q4_0: a nibble under 0x64 is 1024 + nibble, and values are nibble - 8.
PLANE_PIECES = {
    "q8_0": [(b, 0, 0x00FF00FF, 0x64806480, 0x64806480) for b in range(4)],
    "q4_0": [(p, 4 * h, 0x000F000F, 0x64006400, 0x64086408) for h in range(2) for p in range(4)],
}


def plane_asm(byte: int, shift: int, mask: int, xor: int, bias: int, scaled: bool) -> str:
    """One instance (pack 2): words $1, $2 (codes of one token) -> $0, the f16x2 of one code of
    each (byte `byte`, shifted right by `shift`, the bits of `mask`), less the bias, times their
    scales $3 (f16x2) when scaled."""
    lines = [
        "{",
        ".reg .b32 t, m, k, c;",
        f"prmt.b32 t, $1, $2, 0x0{4 + byte}0{byte};",  # bytes: `byte` of $1, -, of $2, -
        *([f"shr.b32 t, t, {shift};"] if shift else []),
        f"mov.b32 m, 0x{mask:08X};",
        f"mov.b32 k, 0x{xor:08X};",
        "lop3.b32 t, t, m, k, 0x6A;",  # (t & m) ^ k
        f"mov.b32 c, 0x{bias:08X};",
        f"sub.f16x2 {'t' if scaled else '$0'}, t, c;",
        *(["mul.f16x2 $0, t, $3;"] if scaled else []),
        "}",
    ]
    return "\n".join(lines)


def planes(words, scales, kind: str, ptx: bool) -> list:
    """The code planes of q8_0 / q4_0 words [..., n]: plane m [..., n] f16 holds each word's
    value m (kv_cache.py's layouts), times scales [..., n] f16 where given (None: the values,
    exact). ptx False: the same values from jnp integer ops (interpret mode, ROCm)."""
    out = []
    for byte, shift, mask, xor, bias in PLANE_PIECES[kind]:
        if ptx:
            args = [words] if scales is None else [words, scales]
            out += plgpu.elementwise_inline_asm(
                plane_asm(byte, shift, mask, xor, bias, scales is not None),
                args=args,
                constraints="=r,r,r" + ",r" * (scales is not None),  # 2 words, 2 f16 in 1
                pack=2,
                result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.float16)],
            )
        else:
            # the halves' f16 0x64XX is 1024 + XX; the bias's low byte is its own offset
            code = ((words >> (8 * byte + shift)) & (mask & 0xFF)) ^ (xor & 0xFF)
            value = (code.astype(jnp.int32) - (bias & 0xFF)).astype(jnp.float16)
            out.append(value if scales is None else value * scales)
    return out


def interleaved(planes_: list):
    """Planes [..., n] (a power of two of them) as [..., n * len(planes)], plane m's element c
    at c * len(planes) + m: a tree of joins, each adding a minor axis in registers."""
    return _tree(planes_).reshape(*planes_[0].shape[:-1], -1)


def _tree(planes_: list):
    """[..., n, len(planes)]: the even planes' tree and the odd ones' joined on a minor axis."""
    if len(planes_) == 2:
        return jnp.stack(planes_, -1)
    pair = jnp.stack([_tree(planes_[0::2]), _tree(planes_[1::2])], -1)
    return pair.reshape(*pair.shape[:-2], -1)


def tile_pieces(raw, kind, cdt, ptx: bool, pieces: int = 1) -> list:
    """quantized_loads' (words, scales) as `pieces` tiles [BK, D / pieces] in cdt, each for a
    dot of its own: piece j joins planes j*k .. j*k + k - 1 (k = len(planes) / pieces) in
    registers, so its column k*c + i is the token's value len(planes)*c + j*k + i
    (`piece_values`); one piece is the tile in value order. Fewer joins cost more dots.

    In a 16-bit cdt the values are the f16 products of the PTX above (the code exact, the
    product rounded to f16, 2^-11 relative); in float32 the exact codes times the scale.
    """
    words, sc = raw
    BK = sc.shape[0]
    exact = jnp.dtype(cdt).itemsize > 2
    scales = jnp.broadcast_to(sc[:, :, None], words.shape)
    ps = planes(words, None if exact else scales, kind, ptx)
    if exact:
        ps = [p.astype(cdt) * scales.astype(cdt) for p in ps]
    k = len(ps) // pieces
    group = [ps[j * k : (j + 1) * k] for j in range(pieces)]
    return [(g[0] if k == 1 else interleaved(g)).reshape(BK, -1).astype(cdt) for g in group]


def piece_values(kind: str, D: int, pieces: int) -> list:
    """Per piece of `tile_pieces`, the values [D / pieces] its columns hold."""
    n = VALUES_PER_WORD[kind]
    k = n // pieces
    cols = jnp.arange(D // pieces)
    return [n * (cols // k) + j * k + cols % k for j in range(pieces)]
