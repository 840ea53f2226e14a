"""The PTX that turns GGML code bytes into floats, four at a time, gives the very floats of the
portable path: its instructions are run here by a small emulator of the ones it uses, on
random bytes, for every decoding the quantized matmul's vector path asks of it, and for the
f16 planes paged attention makes of q8_0 / q4_0 KV words (pallas_kernels/kv_tiles.py)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_cache, kv_tiles
from pallas_kernels.ggml_asm import asm_text, codes, dots4, dp4a_text

# codes() keyword sets as ggml_asm's decoders use them (Q4_0 / Q4_K nibbles, Q5_K's bit g,
# Q6_K's two high bits)
NIBBLES = [dict(shift=s, mask=15) for s in (0, 4)]
CASES = (
    NIBBLES
    + [dict(n, hi_shift=g, hi_mask=1, hi_to=4) for n in NIBBLES for g in range(8)]
    + [dict(n, hi_shift=h, hi_mask=3, hi_to=4) for n in NIBBLES for h in (0, 2, 4, 6)]
)


def _f16x2(op, a: int, b: int) -> int:
    """A packed f16 operation on two words, each half rounded to f16 as the hardware does."""
    x, y = (np.array([w & 0xFFFF, w >> 16], np.uint16).view(np.float16) for w in (a, b))
    r = (x - y if op == "sub" else x * y).astype(np.float16).view(np.uint16)
    return int(r[0]) | int(r[1]) << 16


def emulate(asm: str, ins: list[int], first: int = 4, outs: int = 4) -> list[int]:
    """Runs the asm's instructions on 32-bit words: $first, ... in, $0 .. $(outs - 1) out."""
    regs = {f"${first + i}": int(v) for i, v in enumerate(ins)}

    def val(tok: str) -> int:
        return int(tok, 16) if tok.startswith("0x") else (int(tok) if tok.isdigit() else regs[tok])

    for line in asm.splitlines():
        m = re.match(r"(\w+)((?:\.\w+)+) (.*);", line.strip())
        if not m or m.group(1) == "reg" or line.strip().startswith("."):
            continue
        op, args = m.group(1), [a.strip() for a in m.group(3).split(",")]
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "mov":
            r = src[0]
        elif op in ("and", "or"):
            r = src[0] & src[1] if op == "and" else src[0] | src[1]
        elif op == "shr":
            r = src[0] >> src[1]
        elif op == "shl":
            r = src[0] << src[1]
        elif op == "dp4a":  # dp4a.atype.btype d, a, b, c: four byte products summed, plus c
            signs = [t == "s32" for t in m.group(2).split(".")[1:]]

            def lanes(w, signed):
                return [b - 256 * (signed and b > 127) for b in w.to_bytes(4, "little")]

            pairs = zip(lanes(src[0], signs[0]), lanes(src[1], signs[1]), strict=True)
            r = sum(a * b for a, b in pairs) + src[2]
        elif op == "lop3":  # bit i of the table is the result for (a, b, c) bits (i>>2, i>>1, i)
            a, b, c, lut = src
            r = 0
            for i in range(8):
                if lut >> i & 1:
                    r |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
        elif op in ("sub", "mul") and m.group(2) == ".f16x2":
            r = _f16x2(op, *src)
        elif op == "prmt":
            pool = src[0].to_bytes(4, "little") + src[1].to_bytes(4, "little")
            r = int.from_bytes(bytes(pool[(src[2] >> 4 * i) & 7] for i in range(4)), "little")
        else:
            raise AssertionError(f"an instruction the emulator does not know: {line}")
        regs[d] = r & 0xFFFFFFFF
    return [regs[f"${k}"] for k in range(outs)]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_the_ptx_gives_the_portable_path_s_floats(kw):
    rng = np.random.default_rng(len(str(kw)))
    lo, hi = (rng.integers(0, 256, 64, dtype=np.uint8) for _ in range(2))
    two = "hi_mask" in kw
    want = np.asarray(codes(jnp.asarray(lo), ptx=False, hi=jnp.asarray(hi) if two else None, **kw))
    words = lambda b: b.view("<u4")  # noqa: E731  four bytes a word, byte k is element 4 i + k
    asm = asm_text(hi=two, **kw)
    got = [emulate(asm, [a, b] if two else [a]) for a, b in zip(words(lo), words(hi), strict=True)]
    got = np.asarray(got, np.uint32).reshape(-1).view(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # and the floats are what they stand for: 1 + q / 128
    q = (lo.astype(np.int64) >> kw["shift"]) & kw["mask"]
    if two:
        q |= ((hi.astype(np.int64) >> kw["hi_shift"]) & kw["hi_mask"]) << kw["hi_to"]
    np.testing.assert_array_equal(want, (1 + q / 128).astype(np.float32))


def test_the_emulator_catches_a_wrong_byte_selector():
    """Negative control: a permute that picks the wrong byte gives other floats."""
    lo = np.arange(64, dtype=np.uint8)
    asm = asm_text(mask=15).replace("0x7144", "0x7044")
    got = [emulate(asm, [w]) for w in lo.view("<u4")]
    got = np.asarray(got, np.uint32).reshape(-1).view(np.float32)
    want = np.asarray(codes(jnp.asarray(lo), ptx=False, mask=15))
    assert not np.array_equal(got, want)


@pytest.mark.parametrize(
    "kw", [dict(signed=True), *CASES], ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items())
)
def test_the_dp4a_ptx_gives_the_portable_path_s_dots(kw):
    """dp4a over codes extracted as above (or Q8_0's int8 bytes) and int8 activations: each
    instance's sum equals the portable path's four products, and those are q times x."""
    rng = np.random.default_rng(len(str(kw)) + 7)
    lo, hi = (rng.integers(0, 256, 64, dtype=np.uint8) for _ in range(2))
    x = rng.integers(-127, 128, 64).astype(np.int8)
    two = "hi_mask" in kw
    hi_j = jnp.asarray(hi) if two else None
    want = np.asarray(dots4(jnp.asarray(lo), jnp.asarray(x), ptx=False, hi=hi_j, **kw))
    asm = dp4a_text(hi=two, **kw)
    words = lambda b: b.view("<u4")  # noqa: E731
    ins = [[a, b, c] if two else [a, c] for a, b, c in zip(*map(words, (lo, hi, x)), strict=True)]
    got = np.asarray([emulate(asm, i) for i in ins], np.uint32).view(np.int32)  # [16, 4]
    np.testing.assert_array_equal(got[:, 0], want.reshape(16, 4).sum(1))
    assert not got[:, 1:].any()
    if kw.get("signed"):
        q = lo.view(np.int8).astype(np.int64)
    else:
        q = (lo.astype(np.int64) >> kw["shift"]) & kw["mask"]
        if two:
            q |= ((hi.astype(np.int64) >> kw["hi_shift"]) & kw["hi_mask"]) << kw["hi_to"]
    np.testing.assert_array_equal(want, q * x)


def test_the_emulator_catches_dp4a_reading_codes_as_signed():
    """Negative control: the emulator tells unsigned codes from signed bytes (0xFF is 255 as a
    code, -1 as Q8_0's int8)."""
    lo = np.full(4, 0xFF, np.uint8)
    x = np.ones(4, np.int8)
    right = emulate(dp4a_text(), [lo.view("<u4")[0], x.view("<u4")[0]])[0]
    wrong = emulate(dp4a_text(signed=True), [lo.view("<u4")[0], x.view("<u4")[0]])[0]
    assert right == 4 * 255 and wrong == (-4) & 0xFFFFFFFF


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_kv_plane_ptx_gives_the_portable_path_s_halves(kind, scaled):
    """Each plane's PTX instance, on two words of codes (and their two f16 scales), gives the
    two f16 halves the portable path gives for them, bit for bit."""
    rng = np.random.default_rng(11 + scaled)
    words = rng.integers(0, 2**32, (64, 2), dtype=np.uint64).astype(np.uint32)
    scales = rng.uniform(-3, 3, (64, 2)).astype(np.float16)
    w = jnp.asarray(words.view(np.int32) if kind == "q8_0" else words)
    want = kv_tiles.planes(w, jnp.asarray(scales) if scaled else None, kind, ptx=False)
    for piece, plane in zip(kv_tiles.PLANE_PIECES[kind], want, strict=True):
        asm = kv_tiles.plane_asm(*piece, scaled)
        for (a, b), sc, halves in zip(words, scales, np.asarray(plane), strict=True):
            ins = [int(a), int(b)] + ([int(sc.view(np.uint32)[0])] if scaled else [])
            (out,) = emulate(asm, ins, first=1, outs=1)
            np.testing.assert_array_equal(np.uint32(out), halves.view(np.uint32))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_kv_planes_joined_are_the_cache_s_values_in_order(kind):
    """The planes of a quantized cache's words, joined as paged attention joins them, are its
    codes less their offset in value order, and times the scales its dequantized values to f16."""
    rng = np.random.default_rng(5)
    q = kv_cache.quantize(jnp.asarray(rng.standard_normal((6, 128)), jnp.float32), kind)
    words = q.data.reshape(6, 4, -1)  # [tokens, groups, words of a group]
    offset = 8 if kind == "q4_0" else 0
    got = kv_tiles.interleaved(kv_tiles.planes(words, None, kind, ptx=False)).reshape(6, 128)
    want = kv_cache.codes(q) - offset
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    sc = jnp.broadcast_to(q.scale[:, :, None], words.shape)
    got = kv_tiles.interleaved(kv_tiles.planes(words, sc, kind, ptx=False)).reshape(6, 128)
    want = (want.reshape(6, 4, 32).astype(jnp.float16) * q.scale[:, :, None]).reshape(6, 128)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind,pieces", [("q8_0", 1), ("q8_0", 4), ("q4_0", 2), ("q4_0", 8)])
@pytest.mark.parametrize("cdt", [jnp.float16, jnp.float32])
def test_tile_pieces_hold_the_values_piece_values_names(kind, pieces, cdt):
    """Column i of piece j is the token's value piece_values[j][i] (the dequantized cache's, to
    f16 in a 16-bit type), and the pieces' columns name every value once."""
    rng = np.random.default_rng(9)
    q = kv_cache.quantize(jnp.asarray(rng.standard_normal((6, 128)), jnp.float32), kind)
    raw = (q.data.reshape(6, 4, -1), q.scale)  # quantized_loads' (words, scales)
    got = kv_tiles.tile_pieces(raw, kind, cdt, ptx=False, pieces=pieces)
    cols = kv_tiles.piece_values(kind, 128, pieces)
    assert sorted(np.concatenate([np.asarray(c) for c in cols])) == list(range(128))
    offset = 8 if kind == "q4_0" else 0
    codes = (kv_cache.codes(q) - offset).reshape(6, 4, 32)
    want = (codes.astype(cdt) * q.scale[:, :, None].astype(cdt)).reshape(6, 128)
    assert len(got) == pieces
    for tile, c in zip(got, cols, strict=True):
        assert tile.dtype == cdt and tile.shape == (6, 128 // pieces)
        np.testing.assert_array_equal(np.asarray(tile), np.asarray(want[:, c]))
