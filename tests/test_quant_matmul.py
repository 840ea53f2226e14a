"""The quantized-weight matmul kernel (interpret mode) against its reference for every GGML
type the device keeps quantized, and the kept layout against gguf's own dequantization."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from test_quants import random_blocks

from luce_jax.loading.quants import keep_quantized
from pallas_kernels.ggml_asm import DECODERS as FLOAT_DECODERS
from pallas_kernels.ggml_asm import INT_DECODERS
from pallas_kernels.ggml_blocks import FORMATS
from pallas_kernels.int8_rows import int8_rows_reference
from pallas_kernels.quant_matmul import INT8_DOTS, quant_matmul, quant_matmul_reference
from pallas_kernels.quant_tiling import tiling
from pallas_kernels.quant_weight import QuantWeight, dequantize_weight

T = GGMLQuantizationType
TYPES = list(FORMATS)


def weight(qtype: str, N: int, K: int, seed=0, lead=()) -> QuantWeight:
    t = FORMATS[qtype].qtype
    rows = int(np.prod(lead, dtype=int)) * N
    raw = random_blocks(t, rows, K, np.random.default_rng(seed))
    return keep_quantized(raw, t, (*lead, N, K), jnp.float32)


@pytest.mark.parametrize("qtype", TYPES)
def test_kept_blocks_dequantize_as_gguf_does(qtype):
    """A file tensor of N rows of K values stays its bytes on the device (split into scale and
    code bytes, together the file's size, and reassembled exactly) and dequantizes bit-exactly
    to gguf's values. Scale bytes are held as little-endian units: uint32 where they are a
    multiple of 4, uint16 where even, else bytes (MXFP4's one); Q2_K's d and dmin join its
    scale bytes (BlockFormat.order)."""
    fmt = FORMATS[qtype]
    raw = random_blocks(fmt.qtype, 6, 512, np.random.default_rng(1))
    w = keep_quantized(raw, fmt.qtype, (6, 512), jnp.bfloat16)
    assert w.shape == (6, 512) and w.nbytes == raw.nbytes and w.dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(w.rows()), raw.reshape(6, -1))
    h0, hs = fmt.head
    u = {"q4_k": 4, "q5_k": 4, "iq4_xs": 4, "q2_k": 4, "mxfp4": 1}.get(qtype, 2)
    head = np.asarray(w.head[: hs // u, 2])  # block 0 of row 2
    assert fmt.head_unit == u and head.dtype == np.dtype(f"uint{8 * u}")
    blocks = raw.reshape(6, -1, fmt.type_size)
    if fmt.order is not None:
        blocks = blocks[..., list(fmt.order)]
    np.testing.assert_array_equal(head.astype(f"<u{u}").view(np.uint8), blocks[2, 0, h0 : h0 + hs])
    np.testing.assert_array_equal(np.asarray(dequantize_weight(w)), dequantize(raw, fmt.qtype))


def test_float_tensors_are_not_kept():
    raw = np.zeros((4, 8), np.float32).view(np.uint8)
    assert keep_quantized(raw, T.F32, (4, 8), jnp.float32) is None


# Types whose blocks decode alike in the kernel's loop (16-value groups as Q6_K's, 32-value
# blocks as Q8_0's): their own decoders are held to gguf by test_dequantize.py and the cases
# below that end inside a step; the whole-step grid runs for the types before them.
LATER_TYPES = ("q2_k", "q3_k", "mxfp4")


def kernel_cases():
    """(qtype, K, N, values_per_step): a K of whole loop steps and N of whole 16-row tiles,
    and a K that ends inside a step (3 blocks, 2 or 8 per step) with N = 40."""
    for q in TYPES:
        B = FORMATS[q].block
        if q not in LATER_TYPES:
            yield q, 2 * max(B, 256), 64, 256
        yield q, 3 * B, 40, 2 * B if B == 256 else 256


def ragged_cases():
    """kernel_cases' K that ends inside a step, one per type."""
    return [c for c in kernel_cases() if c[2] == 40]


# Rows reach the kernel's branches at M = 3 (one 16-row tile, ragged) and 80 (two 64-row tiles,
# the second ragged: row tiling, the same for every type, run for one type of each block size
# and of 16-value groups); the rest of the grid runs with `-m slow` (docs/development.md).
ROW_TYPES = ("q8_0", "q4_k", "q6_k")


def row_cases():
    slow = pytest.mark.slow
    for c in kernel_cases():
        for m in (3, 80, 1, 8, 64, 300):
            default = m == 3 or (m == 80 and c[0] in ROW_TYPES)
            yield pytest.param(*c, m, marks=() if default else slow, id=f"{c}-{m}")


@pytest.mark.parametrize("qtype, K, N, vps, M", list(row_cases()))
def test_kernel_matches_reference(qtype, K, N, vps, M):
    w = weight(qtype, N, K, seed=M)
    x = jax.random.normal(jax.random.key(M + K), (M, K), jnp.float32)
    got = quant_matmul(x, w, block_n=32, values_per_step=vps, min_programs=1, interpret=True)
    ref = quant_matmul_reference(x, w)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    ref = np.asarray(ref)  # sums of hundreds of terms: compare against the output's scale
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def live_cases():
    """ragged_cases with one live row (the vector path) and three (the dot path); LATER_TYPES
    take the vector path only (their dot path over a ragged K: test_kernel_matches_reference
    at M = 3). The live-row masks are the same for every type: ROW_TYPES run by default, the
    rest with `-m slow`."""
    for c in ragged_cases():
        for live in (1, 3):
            if live == 1 or c[0] not in LATER_TYPES:
                slow = () if c[0] in ROW_TYPES else pytest.mark.slow  # masks alike for all
                yield pytest.param(*c, live, 2, marks=slow, id=f"{c}-{live}")


# (two live rows on the vector path: test_the_int8_activation_path_matches_..., the default)
@pytest.mark.parametrize("qtype, K, N, vps, live, vector_rows", list(live_cases()))
def test_live_rows_match_the_reference_on_either_path(qtype, K, N, vps, live, vector_rows):
    """A step's real rows lead x; with at most vector_rows of them the vector-unit path runs
    for just that many rows (the dot path otherwise), and the real rows equal the reference
    every way."""
    w = weight(qtype, N, K, seed=live)
    x = jax.random.normal(jax.random.key(live + K), (8, K), jnp.float32)
    got = quant_matmul(x, w, jnp.int32(live), block_n=32, values_per_step=vps,
                       vector_rows=vector_rows, vector_programs=4, interpret=True)  # fmt: skip
    ref = np.asarray(quant_matmul_reference(x, w))[:live]
    np.testing.assert_allclose(np.asarray(got)[:live], ref, rtol=1e-4,
                               atol=1e-5 * np.abs(ref).max())  # fmt: skip


# Integer codes with masked loads are test_live_rows_match_the_reference_on_either_path's;
# here they run over whole tiles and splits (no masks); unit codes (off by default: slower on
# the H200) on two rows and an N inside a tile (masked).
VECTOR_CASES = [(q, False, 1, 64) for q in TYPES] + [
    (q, True, 2, 40) for q in sorted(FLOAT_DECODERS)
]


@pytest.mark.parametrize("qtype, unit, live, N", VECTOR_CASES, ids=str)
def test_vector_path_codes_match_the_reference(qtype, unit, live, N):
    """The vector path with integer codes, and with codes as the floats 1 + q / 128
    (ggml_asm.py: the group's scale, offset and bias folded into two numbers), over a K that
    ends inside a step and an N that ends inside a tile (masked loads), and over whole tiles
    and splits (no masks). Interpret mode runs the jnp twin of the PTX (test_ggml_asm.py holds
    the two equal)."""
    B = FORMATS[qtype].block
    K = 3 * B if N == 40 else 2 * max(B, 256)
    w = weight(qtype, N, K, seed=live)
    x = jax.random.normal(jax.random.key(live), (8, K), jnp.float32)
    got = quant_matmul(x, w, jnp.int32(live), block_n=32, values_per_step=2 * max(B, 256),
                       vector_programs=4, unit_codes=unit, interpret=True)  # fmt: skip
    ref = np.asarray(quant_matmul_reference(x, w))[:live]
    np.testing.assert_allclose(np.asarray(got)[:live], ref, rtol=1e-4,
                               atol=1e-5 * np.abs(ref).max())  # fmt: skip


def rounded_rows(x):
    """x as the int8 path sees it: quantized per 32 values and scaled back (float32)."""
    q, d, s, _ = int8_rows_reference(x)
    M, K = x.shape
    assert np.array_equal(np.asarray(s), np.asarray(q, np.float32).reshape(M, -1, 16).sum(-1))
    return (q.astype(jnp.float32).reshape(M, -1, 32) * d[..., None]).reshape(M, K)


# the types with integer decoders, and one without (every such type ignores the flag alike)
@pytest.mark.parametrize("qtype", [*(q for q in TYPES if q in INT_DECODERS), "iq4_xs"])
def test_the_int8_activation_path_matches_the_reference_on_its_rounded_x(qtype, live=2):
    """int8_x: x rounded to int8 per 32 values (llama.cpp's q8_1 rounding) and dotted with the
    codes as integers equals the reference on that rounded x to float32 rounding, over a K that
    ends inside a step and an N inside a tile, and stays within 2% of the unrounded product;
    IQ4_XS, which has no integer decoder, ignores the flag."""
    B = FORMATS[qtype].block
    w = weight(qtype, 40, 3 * B, seed=live + 4)
    x = jax.random.normal(jax.random.key(live), (8, 3 * B), jnp.float32)
    got = quant_matmul(x, w, jnp.int32(live), block_n=32, values_per_step=2 * max(B, 256),
                       vector_programs=4, int8_x=True, interpret=True)  # fmt: skip
    got = np.asarray(got)[:live]
    rounded = x if qtype not in INT_DECODERS else rounded_rows(x)
    ref = np.asarray(quant_matmul_reference(rounded, w))[:live]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    exact = np.asarray(quant_matmul_reference(x, w))[:live]
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


# Q6_K, the type it is on for by default: int8 sums (dense decode) and float codes (experts)
@pytest.mark.parametrize("qtype, int8", [("q6_k", True), ("q6_k", False)])
def test_weight_loads_a_step_ahead_give_the_same_bits(qtype, int8):
    """prefetch: the vector path's loop step issues the next step's weight loads before it
    decodes its own; over 4 steps of a split (the last one partial, so its loads are masked)
    and an N inside a tile, the live rows equal those of loads in their own step (bit for bit
    with integer sums; float sums to float32 rounding, as interpret mode's XLA may order
    them differently)."""
    B = FORMATS[qtype].block
    step = max(B, 256)
    w = weight(qtype, 40, 3 * step + B, seed=11)
    x = jax.random.normal(jax.random.key(11), (8, w.shape[1]), jnp.float32)
    run = functools.partial(quant_matmul, x, w, jnp.int32(2), block_n=32, values_per_step=step,
                            vector_programs=1, int8_x=int8, interpret=True)  # fmt: skip
    got = np.asarray(run(prefetch=True))[:2]
    same = np.asarray(run(prefetch=False))[:2]
    if int8 and qtype in INT_DECODERS:
        np.testing.assert_array_equal(got, same)
    np.testing.assert_allclose(got, same, rtol=1e-6, atol=1e-6 * np.abs(same).max())
    ref = np.asarray(quant_matmul_reference(rounded_rows(x) if int8 else x, w))[:2]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", ["q4_k", "q8_0"])  # offsets, signed
def test_int8_dots_match_the_reference_on_the_rounded_x(qtype):
    """int8_dots: a call of more live rows than the vector path takes (5 of a bucket of 8)
    dots x's int8 rows with the codes as int8 on the matrix units; it equals the reference on
    x as rounded to int8 (float32 rounding), over a K that ends inside a step and an N inside
    a tile, and agrees with the vector path's int8 sums on the rows both compute; a call
    without a live count (a prefill-sized call) runs every row so."""
    B = FORMATS[qtype].block
    w = weight(qtype, 40, 3 * B, seed=13)
    x = jax.random.normal(jax.random.key(13), (8, 3 * B), jnp.float32)
    run = functools.partial(quant_matmul, x, w, block_n=32, values_per_step=2 * max(B, 256),
                            vector_programs=4, min_programs=4, int8_x=True, int8_dots=True,
                            interpret=True)  # fmt: skip
    got = np.asarray(run(jnp.int32(5)))[:5]
    ref = np.asarray(quant_matmul_reference(rounded_rows(x), w))[:5]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
    one = np.asarray(run(jnp.int32(1)))[:1]  # the vector path's dp4a sums
    np.testing.assert_allclose(got[:1], one, rtol=1e-5, atol=1e-6 * np.abs(one).max())
    every = np.asarray(run(None))  # no live count: every row on the int8 dots
    ref = np.asarray(quant_matmul_reference(rounded_rows(x), w))
    np.testing.assert_allclose(every, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", ["q6_k", "q4_0"])  # 16-value pieces
def test_int8_dots_leave_types_with_16_value_pieces_on_the_float_dots(qtype):
    """Types whose pieces are 16 values wide are not in INT8_DOTS (on the H200 Q6_K's int8
    dots came out wrong): asking for int8_dots gives the float dots' result, bit for bit."""
    assert qtype not in INT8_DOTS
    B = FORMATS[qtype].block
    w = weight(qtype, 40, 2 * max(B, 256), seed=17)
    x = jax.random.normal(jax.random.key(17), (8, w.shape[1]), jnp.float32)
    run = functools.partial(quant_matmul, x, w, jnp.int32(5), block_n=32, vector_programs=4,
                            min_programs=4, int8_x=True, interpret=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(run(int8_dots=True))[:5],
                                  np.asarray(run(int8_dots=False))[:5])  # fmt: skip


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q5_k"])
def test_a_tile_of_a_row_per_thread_loads_runs_as_halves_with_the_same_bits(qtype):
    """At 128 weight rows a tile (a row for each of 4 warps' threads) the int8 path loads each
    32-byte run of codes as two 16-byte pieces; integer dot sums make the result bit-identical
    to whole runs at 32 rows a tile (one split each, so the float sums run in one order), over
    an N whose second tile is partial."""
    B = FORMATS[qtype].block
    w = weight(qtype, 160, 2 * max(B, 256), seed=9)
    x = jax.random.normal(jax.random.key(9), (8, w.shape[1]), jnp.float32)
    run = functools.partial(quant_matmul, x, w, jnp.int32(1), vector_programs=1, int8_x=True,
                            num_warps=4, interpret=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(run(block_n=128))[:1], np.asarray(run(block_n=32))[:1])


def test_int8_activations_leave_the_dots_path_exact():
    """Calls without a live count (larger buckets) take the dots path, which int8_x leaves on
    the unrounded activations."""
    w = weight("q8_0", 32, 256, seed=6)
    x = jax.random.normal(jax.random.key(6), (8, 256), jnp.float32)
    got = np.asarray(quant_matmul(x, w, int8_x=True, interpret=True))
    ref = np.asarray(quant_matmul_reference(x, w))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_int8_activations_reach_the_experts_rows():
    w = weight("q4_k", 40, 512, seed=3, lead=(3,))
    x = jax.random.normal(jax.random.key(3), (4, 512), jnp.float32)
    experts = jnp.array([2, 0, 3, 1], jnp.int32)
    got = np.asarray(quant_matmul(x, w, experts=experts, int8_x=True, interpret=True))
    dense, xr = np.asarray(dequantize_weight(w)), np.asarray(rounded_rows(x))
    for m, e in enumerate([2, 0, None, 1]):
        want = np.zeros(40) if e is None else xr[m] @ dense[e].T
        np.testing.assert_allclose(got[m], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def by_block_structure():
    """Every type, those outside ROW_TYPES marked slow: for paths whose decoding is the same
    loop as test_kernel_matches_reference's (held there for every type), one type of each
    block size and of 16-value groups runs by default."""
    return [pytest.param(q, marks=() if q in ROW_TYPES else pytest.mark.slow) for q in TYPES]


@pytest.mark.parametrize("qtype", by_block_structure())
def test_rows_times_their_own_experts_match_the_reference(qtype):
    """With a stack of expert weights, each row is multiplied by the weights of its expert
    (repeated experts, any order, a K that ends inside a step and an N inside a tile), and rows
    whose expert is out of range (padding) come back zero."""
    B, E, N = FORMATS[qtype].block, 5, 40
    K = 3 * B
    w = weight(qtype, N, K, seed=9, lead=(E,))
    x = jax.random.normal(jax.random.key(2), (7, K), jnp.float32)
    experts = jnp.array([3, 0, 3, 4, E, -1, 1], jnp.int32)
    got = np.asarray(quant_matmul(x, w, experts=experts, block_n=32, interpret=True))
    dense = np.asarray(dequantize_weight(w))  # [E, N, K]
    for m, e in enumerate(np.asarray(experts)):
        if 0 <= e < E:
            ref = np.asarray(x[m]) @ dense[e].T
            np.testing.assert_allclose(got[m], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
        else:
            assert not got[m].any()
    with pytest.raises(ValueError, match="experts"):
        quant_matmul(x, w, experts=experts[:3], interpret=True)
    with pytest.raises(ValueError, match="with experts"):
        quant_matmul(x, weight(qtype, N, K), experts=experts, interpret=True)


def test_experts_split_into_loops_give_the_same_rows():
    """expert_splits: a pair's contraction in fewer programs, each looping over its steps (the
    last split's tail past K adds nothing); the summed splits are the one-step-a-program rows."""
    w = weight("q4_k", 40, 3 * 256, seed=5, lead=(3,))
    x = jax.random.normal(jax.random.key(4), (2, 3 * 256), jnp.float32)
    experts = jnp.array([2, 0, 1, 2], jnp.int32)  # fan_out 2: token m takes pairs 2m, 2m + 1
    one = quant_matmul(x, w, experts=experts, fan_out=2, splits=True, interpret=True)
    two = quant_matmul(x, w, experts=experts, fan_out=2, splits=True, expert_splits=2,
                       interpret=True)  # fmt: skip
    assert one.shape == (3, 4, 40) and two.shape == (2, 4, 40)  # 3 steps of one Q4_K block
    np.testing.assert_allclose(np.asarray(two.sum(0)), np.asarray(one.sum(0)), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(one.sum(0)).max()))  # fmt: skip


@pytest.mark.parametrize("qtype", by_block_structure())
def test_bfloat16_activations_and_output(qtype):
    w = weight(qtype, 32, 512, seed=3)
    x = jax.random.normal(jax.random.key(1), (8, 512), jnp.float32).astype(jnp.bfloat16)
    ref = quant_matmul_reference(x, w)
    got = quant_matmul(x, w, out_dtype=jnp.bfloat16, interpret=True)
    assert got.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(got, np.float32) - ref) / np.linalg.norm(ref)
    assert err < 1e-2  # the codes are exact in bf16; the output's rounding remains


def test_a_split_whose_tail_is_past_k_adds_nothing():
    w = weight("q8_0", 48, 320)  # 10 blocks of 32, 2 per step: 5 steps
    x = jax.random.normal(jax.random.key(7), (2, 320), jnp.float32)
    assert tiling(2, 48, 10, 2, block_n=16, min_programs=9)[2:] == (3, 2)  # 5 steps in 3 x 2
    got = quant_matmul(x, w, block_n=16, values_per_step=64, min_programs=9, interpret=True)
    np.testing.assert_allclose(got, quant_matmul_reference(x, w), rtol=1e-4, atol=1e-4)


def test_the_contraction_is_split_only_where_tiles_are_too_few_to_fill_the_gpu():
    # decode, N = 4096 (an attention output) in 64-row tiles: 64 tiles; K = 4096 is 16 steps
    BM, BN, S, steps = tiling(1, 4096, 16, 1)
    assert (BM, BN) == (16, 64) and S == 4 and S * steps == 16
    assert tiling(1, 24576, 16, 1)[2] == 1  # gate/up: 384 tiles fill the GPU
    assert tiling(512, 4096, 16, 1)[2] == 1  # prefill: 8 x 64 tiles
    assert tiling(1, 16, 2, 1)[2:] == (2, 1)  # never more splits than steps


def test_bad_shapes_are_refused():
    w = weight("q8_0", 16, 64)
    with pytest.raises(ValueError, match="do not fit"):
        quant_matmul(jnp.ones((2, 32), jnp.float32), w, interpret=True)
