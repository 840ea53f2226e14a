"""Matmuls with GGML-quantized weights dequantized in registers: x[M, K] @ W[N, K]^T.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

Weight layout: a `QuantWeight` (ggml_blocks.py) holds the file's bytes, each block's scale
bytes split from its code bytes at load (uint8 head [K / B * hs, N] and body [N, K / B * bs]),
so a weight takes on the device what it takes in the file (Q8_0 1.0625 bytes per value, Q4_K
0.5625, IQ4_XS 0.53) and every row of codes is aligned for wide loads.

Work split. Program (i, j, s) takes row tile i (BM rows of x), weight-row tile j (BN outputs)
and contraction split s, and walks its split U blocks per loop step. Two paths decode a block
one group at a time (`BlockFormat.decode`):
- dots (`ggml_blocks.contract_block`): the codes of a piece (16 or 32 values of BN weight rows)
  are dotted with the matching [BM, n] activations and the partial product is scaled by the
  group's scale row (plus the group's offset times the activations' sum for Q4_K / Q5_K), so a
  scale costs one multiply per group and output, never one per weight;
- vectors, for a step whose live rows (its real tokens) are few: per live row, codes times
  activations summed on the vector units, no matrix unit and no layout change for the dot.
  The step's live row count is an input, and the kernel branches on it, so one compiled
  bucket of 8 rows serves one token as a one-row product.
Decode-sized calls (few rows) with a narrow N have few tiles, so the contraction is split
until there are about `min_programs` programs (`vector_programs` for the vector path) to fill
the GPU; the splits' float32 partials are summed afterwards.

Speed (H200, Qwen3-8B shapes, M 8, bench/quant_matmul.py; results/2026-12-01_quant_matmul_*).
One live row: gate/up Q8_0 47 us, Q4_K 65, the bf16 dot 55; down Q8_0 31, Q4_K 44, the bf16 dot
32 to 44. Nsight Compute found Q4_K bound by instruction issue (16 thread instructions per
weight value, 18% of DRAM bandwidth) when the path decoded two rows for one; it now decodes for
the live rows only. The vector path beats the dots at M 8 (Q8_0 88 / 66, Q4_K 90 / 58 us). At
M 512 the kernel is 6x to 15x slower than the bf16 dot and XLA's dequantize-then-dot 1.3x to
1.7x (2026-11-30_quant_matmul_types_h200.md), which is why models/linear.py sends steps of more
than 64 rows to XLA.

Triton backend: all indices are arrays and loads are masked where a tile or split runs past
N or K, so M and N need not be tile multiples (K is a whole number of blocks, as in every
GGUF tensor). On CPU the kernel runs in interpret mode; tests/test_triton_lowering.py verifies
its Triton module.

Shapes: M rows, K contraction, N outputs, B values per block, U blocks per loop step.
"""

from __future__ import annotations

import functools

import jax
import jax.extend.backend
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole
from .ggml_asm import DECODERS as FLOAT_DECODERS
from .ggml_blocks import (
    QTYPES,
    BlockFormat,
    QuantWeight,
    codes_as,
    contract_block,
    dequantize_weight,
    exact_f32,
)
from .ggml_words import WORDS


def quant_matmul_reference(x, w: QuantWeight):
    """x [M, K] @ W^T in float32, W dequantized first (bit-exact with gguf)."""
    return jnp.dot(x.astype(jnp.float32), dequantize_weight(w).T, precision="highest")


def quant_matmul_xla(x, w: QuantWeight, *, out_dtype=jnp.float32):
    """XLA's x @ W^T with W dequantized to the activations' dtype inside the step: the path
    without Triton (CPU) and the baseline the kernel is timed against."""
    wd = dequantize_weight(w, x.dtype)
    return jax.lax.dot_general(
        x, wd, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    ).astype(out_dtype)


def dot_nt(x, codes):
    """x [BM, n] times codes [BN, n] (integers) over n: [BM, BN] float32. The codes are exact
    in x's dtype (|code| <= 128), so bf16 operands lose nothing but the activations' bits."""
    return jax.lax.dot_general(
        x, codes_as(codes, x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )


def dot_nn(x, w):
    """x [BM, n] @ w [n, BN] in x's dtype (w cast to it): [BM, BN] float32."""
    return jax.lax.dot_general(
        x, w.astype(x.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )


def block_loaders(fmt: BlockFormat, body_at, head_at, cols, ok, blk):
    """load(off, n) -> code bytes and load1(off) -> head bytes of block `blk` of weight rows
    `cols` [BN] (BlockFormat.decode's loaders; off is a file-block offset); rows where `ok` is
    False give zeros. body_at(rows, bytes) and head_at(head row, rows) index the weight's refs
    (an expert's in the grouped kernel).

    blk is one block index (load gives [BN, n], load1 [BN], ok is [BN]) or U block indices
    [U] (load gives [BN, U, n], load1 [BN, U], ok is [BN, U]): the vector path decodes U
    blocks at once, so a piece of every block comes in one wide load.
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
    loaded: dict[tuple, jax.Array] = {}

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
        if ("head", off) not in loaded:
            assert h0 <= off < h0 + hs, (fmt.qtype, off)
            loaded["head", off] = plgpu.load(
                head_at(blk1 * hs + off - h0, rows1), mask=ok, other=None if ok is None else 0
            )
        return loaded["head", off]

    return load, load1


def _kernel(live_ref, x_ref, xw_ref, xg_ref, h_ref, b_ref, o_ref, *, fmt, BM, BN, U, S, steps,
            n_blocks, R, words, unit, ptx):  # fmt: skip
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    float_decode = FLOAT_DECODERS.get(QTYPES[fmt.qtype]) if unit else None
    M, K = x_ref.shape
    N = b_ref.shape[0]
    # N a whole number of tiles and K of splits (every projection and the head of Qwen3-8B's
    # shape): the vector path's loads are all in bounds, and predicating them took
    # instructions and registers (not timed on a GPU)
    exact = N % BN == 0 and S * steps * U == n_blocks
    cols = j * BN + jnp.arange(BN)
    col_ok = cols < N

    def block(c, u, unmasked=False):
        blk = (s * steps + c) * U + u
        ok = blk < n_blocks  # the last split's tail is past K: it adds zeros
        w_ok = (col_ok[:, None] & ok[None, :]) if jnp.ndim(blk) else col_ok & ok
        w_ok = None if unmasked else w_ok  # every load in bounds: no masks to set up
        loaders = block_loaders(
            fmt, lambda r, b: b_ref.at[r, b], lambda h, r: h_ref.at[h, r], cols, w_ok, blk
        )
        return blk, ok, loaders

    def dots():
        rows = i * BM + jnp.arange(BM)
        row_ok = rows < M
        rows = jnp.minimum(rows, M - 1)

        def body(c, acc):
            for u in range(U):
                blk, ok, (load, load1) = block(c, u)

                def load_x(first: int, n: int, blk=blk, ok=ok):
                    ks = blk * fmt.block + first + jnp.arange(n)
                    m = row_ok[:, None] & ok
                    return plgpu.load(x_ref.at[rows[:, None], ks[None, :]], mask=m, other=0)

                acc = contract_block(fmt, load, load1, load_x, acc, dot_nt)
            return acc

        return jax.lax.fori_loop(0, steps, body, jnp.zeros((BM, BN), jnp.float32))

    def vectors(R):
        """Rows 0 .. R-1 on the vector units: per row, codes times activations summed. A loop
        step decodes its U blocks together ([BN, U, n] codes per piece) and the partial sums
        stay [BN, U] until the loop ends, so each step has few wide loads and no reduction
        across U."""

        def body(c, accs):
            accs = list(accs)
            blk, ok, (load, load1) = block(c, jnp.arange(U), exact)
            for g in range(fmt.groups):
                if float_decode is None:  # integer codes (IQ4_XS: through its table)
                    a, b, pieces = fmt.decode(load, load1, g)
                    pieces = [(first, exact_f32(q)) for first, q in pieces]
                else:  # unit floats, four code bytes at a time (ggml_asm.py)
                    a, b, pieces = float_decode(load, load1, g, ptx)
                for m in range(R):
                    part = xsum = 0.0
                    for first, codes in pieces:
                        ks = blk[:, None] * fmt.block + g * fmt.group + first
                        ks = ks + jnp.arange(codes.shape[-1])[None, :]  # [U, n]
                        # xw: with unit codes, x in float32, converted once by the wrapper
                        # (in the kernel each thread converts its own x values: Q4_K's one-row
                        # path 824 -> 1016 SASS, the whole kernel's registers 150 -> 122)
                        xm = plgpu.load(xw_ref.at[m, ks], mask=None if exact else ks < K,
                                        other=None if exact else 0)  # fmt: skip
                        xm = xm.astype(jnp.float32)  # with unit codes xw is float32 already
                        part += jnp.sum(codes * xm[None], axis=-1)
                        if b is not None:
                            xsum += jnp.sum(xm, axis=-1)[None, :]
                    accs[m] = accs[m] + a * part + (0.0 if b is None else xsum * b)
            return tuple(accs)

        zero = jnp.zeros((BN, U), jnp.float32)
        return rows_out(jax.lax.fori_loop(0, steps, body, (zero,) * R))

    def vectors_words(R):
        """The vector path a 32-bit word of codes at a time (ggml_words.py): each code becomes
        f in [1, 2) with a shift and a mask-and-or, and row m accumulates, elementwise over
        [BN, U, nw], A * f * x + B * x per group; one reduction after the loop."""
        decode, nw = WORDS[QTYPES[fmt.qtype]]

        def body(c, accs):
            accs = list(accs)
            blk, ok, (load, load1) = block(c, jnp.arange(U))
            shift = 8 * jnp.arange(4, dtype=jnp.uint32)

            def loadw(off: int, nw: int):  # [BN, U, nw] uint32, off a file-block byte offset
                # the block's bytes, each 4 reassembled into a little-endian word (the weight
                # stays uint8: a uint32 view made by XLA would copy it)
                byt = load(off, 4 * nw).reshape(BN, U, nw, 4).astype(jnp.uint32)
                return jnp.sum(byt << shift, axis=-1, dtype=jnp.uint32)

            for g in range(fmt.groups):
                A, B, pieces = decode(loadw, load1, g)
                for m in range(R):

                    def row(acc, m=m, g=g, A=A, B=B, pieces=pieces):
                        fx = 0.0
                        for first, f in pieces:
                            # xw holds each span of 4 nw values byte-major: value 4 i + p of
                            # a span at p nw + i, so a piece's nw values are contiguous
                            p = first % 4
                            ks = blk[:, None] * fmt.block + g * fmt.group + first - p + p * nw
                            ks = ks + jnp.arange(nw)[None, :]  # [U, nw]
                            xm = plgpu.load(xw_ref.at[m, ks], mask=ks < K, other=0)
                            fx = fx + f * xm[None]
                        # B times the group's sum of x, spread over the nw slots (exact: nw
                        # is a power of two) that the loop's end sums again
                        xs = plgpu.load(xg_ref.at[m, blk * fmt.groups + g], mask=ok, other=0)
                        return acc + A[..., None] * fx + (B * (xs / nw)[None, :])[..., None]

                    accs[m] = row(accs[m])
            return tuple(accs)

        zero = jnp.zeros((BN, U, nw), jnp.float32)
        accs = jax.lax.fori_loop(0, steps, body, (zero,) * R)
        return rows_out(tuple(jnp.sum(a, axis=2) for a in accs))

    def rows_out(accs):  # r accumulators [BN, U] -> rows 0 .. r-1 of the [BM, BN] tile
        r = jnp.arange(BM)[:, None]
        out = jnp.zeros((BM, BN), jnp.float32)
        for m in range(len(accs)):
            out = jnp.where(r == m, jnp.sum(accs[m], axis=1)[None, :], out)
        return out

    # A step of r <= R live rows decodes for r rows, not R: the vector path is bound by
    # instruction issue (ncu on the H200: Q4_K gate/up at 0.77 instructions a clock per
    # scheduler, 18% of DRAM bandwidth), and one token in a bucket of 8 (decode at C1) had
    # paid for two rows. The branch is uniform over a program, so only its code is shared.
    out = dots
    for r in range(1, R + 1)[::-1]:
        path = functools.partial(vectors_words if words else vectors, r)
        out = functools.partial(jax.lax.cond, (live_ref[0] <= r) & (i == 0), path, out)
    out = out()
    # The partials hold M rows, not NI * BM: a tile's rows past M are not stored (at M 8 the
    # padded tile doubled the partials' traffic, which a decode call writes and reads again).
    rows = i * BM + jnp.arange(BM)
    ok = (rows < M)[:, None] & col_ok[None, :]
    plgpu.store(o_ref.at[s, rows[:, None], cols[None, :]], out, mask=ok)


def uses_ptx(interpret: bool | None) -> bool:
    """Whether a Triton kernel may hold PTX: not in interpret mode and not on a ROCm backend.
    Lowering for cuda from the CPU (tests, bench/kernel_ptx.py) takes the PTX."""
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return not interpret and "rocm" not in jax.extend.backend.get_backend().platform_version


def _pow2(n: int, lo: int, hi: int) -> int:
    """The power of two nearest above n, within [lo, hi]."""
    return max(lo, min(hi, 1 << max(n - 1, 0).bit_length()))


def tiling(M: int, N: int, n_blocks: int, U: int, block_m=64, block_n=64, min_programs=264):
    """(BM, BN, S, steps): tile sizes, contraction splits and U-block steps per split.

    Splits only where row and column tiles alone give fewer than `min_programs` programs, and
    never more than one per step.
    """
    BM, BN = _pow2(M, 16, block_m), _pow2(N, 16, block_n)
    tiles = -(-M // BM) * -(-N // BN)
    n_steps = -(-n_blocks // U)
    S = max(1, min(n_steps, min_programs // tiles))
    steps = -(-n_steps // S)  # per split; the last split's tail is masked
    return BM, BN, -(-n_steps // steps), steps


def quant_matmul(
    x,
    w: QuantWeight,
    live=None,
    *,
    out_dtype=jnp.float32,
    block_m: int = 64,
    block_n: int = 64,
    values_per_step: int = 256,
    min_programs: int = 2112,
    vector_rows: int = 2,
    vector_programs: int = 2112,
    words: bool = False,
    unit_codes: bool = False,
    ptx: bool | None = None,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Pallas x @ W^T with W quantized (quant_matmul_reference's signature).

    Args:
      x: [M, K] activations (bfloat16 on GPU; the dots run in x's dtype).
      w: QuantWeight [N, K] of any ggml_blocks.FORMATS type.
      live: int32 scalar, the rows that matter (the step's real tokens; rows at or past it are
        padding and their results unspecified), or None (all M). A call with at most
        `vector_rows` live rows takes the vector-unit path.
      out_dtype: result dtype (accumulation is float32).
      block_m, block_n: caps on BM (rows, at least 16) and BN (weight rows). The defaults
        (64 weight rows, 256 values per step, 4 warps, 2 stages) were the fastest of six
        tilings at decode (2026-11-30_quant_matmul_tiling_h200.md).
      values_per_step: contraction values per loop step (U = this / B blocks, at least 1).
      min_programs: split the contraction until the grid has about this many programs (16
        per SM of an H200), never below one step per split. At M 8, 2112 rather than 264
        programs took the dots from 94 to 70 us (Q8_0 gate/up) and 66 to 47 (Q8_0 down), 58
        to 48 (Q4_K down), Q4_K gate/up unchanged (2026-12-01_quant_matmul_vector_h200.md).
      vector_rows, vector_programs: with `live`, a call of r <= vector_rows live rows takes
        the vector path for r rows, and the grid is split to about vector_programs programs.
        At 1 and 2 live rows the vector path beat the dots in every case measured; at 4 it
        lost to them (Q8_0 gate/up 91 vs 70 us, Q4_K 121 vs 89; same file).
      words: the vector path decodes 32-bit words of codes into floats in [1, 2)
        (ggml_words.py) for the types that have such a decoder (all but IQ4_XS), rather than
        a code at a time through integers; x goes in float32 with its spans reordered and
        its group sums taken by XLA first. Off: on the H200 it ran 1.6x slower than the
        default path, its reassembled words moving through shared memory (Nsight Compute,
        2026-12-01_quant_matmul_live_rows_h200.md).
      unit_codes: the vector path decodes Q4_0, Q4_K, Q5_K and Q6_K codes q into the floats
        1 + q / 128 four bytes at a time (ggml_asm.py). Off until timed on a GPU; the one-row
        path's SASS drops by a third (Q4_K 1288 -> 824; README "Quantized weights").
      ptx: unit codes through PTX (else the same arithmetic in jnp). Default: `uses_ptx`.
      interpret: run in interpret mode (default: when the backend is the CPU).
    Returns:
      [M, N] in out_dtype.
    """
    M, K = x.shape
    if len(w.shape) != 2 or w.shape[1] != K:
        raise ValueError(f"x {x.shape} and {w.qtype} weight {w.shape} (N, K) do not fit")
    N = w.shape[0]
    fmt = w.format
    R = 0 if live is None else min(vector_rows, M)
    n_blocks, U = K // fmt.block, max(1, values_per_step // fmt.block)
    programs = vector_programs if R else min_programs
    BM, BN, S, steps = tiling(M, N, n_blocks, U, block_m, block_n, programs)
    NI, NJ = -(-M // BM), -(-N // BN)
    words = words and QTYPES[fmt.qtype] in WORDS
    ptx = uses_ptx(interpret) if ptx is None else ptx
    kernel = functools.partial(_kernel, fmt=fmt, BM=BM, BN=BN, U=U, S=S, steps=steps,
                               n_blocks=n_blocks, R=R, words=words, unit=unit_codes,
                               ptx=ptx)  # fmt: skip
    xw, xg = (x.astype(jnp.float32) if unit_codes else x), x  # xg: unread without words
    if words:
        nw = WORDS[QTYPES[fmt.qtype]][1]
        # x in float32, its spans of 4 nw values byte-major (a piece's nw values contiguous),
        # and its sums per group [M, K / group], which the groups' offsets multiply
        xw = x.astype(jnp.float32)
        xg = xw.reshape(M, -1, fmt.group).sum(-1)
        xw = xw.reshape(M, -1, nw, 4).swapaxes(-1, -2).reshape(M, K)
    live = jnp.full((1,), M if live is None else live, jnp.int32)
    out = jax.ShapeDtypeStruct((S, M, N), jnp.float32)
    parts = pl.pallas_call(
        kernel,
        grid=(NI, NJ, S),
        in_specs=[whole(a) for a in (live, x, xw, xg, w.head, w.body)],
        out_specs=whole(out),
        out_shape=out,
        **call_options(interpret, num_warps, num_stages),
    )(live, x, xw, xg, w.head, w.body)
    return parts.sum(0).astype(out_dtype)
