"""Matmuls with GGML-quantized weights dequantized in registers: x[M, K] @ W[N, K]^T.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

Weight layout: a `QuantWeight` (quant_weight.py) holds the file's bytes, each block's scale
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
  activations summed on the vector units. The live count is an input the kernel branches on,
  so one compiled bucket of 8 rows serves one token as a one-row product.
With `experts` (a stack of E experts' weights), row m takes expert experts[m]'s weights, each
row alone on the vector path: a MoE decode step's (token, expert) pairs, no grouping needed.
Decode-sized calls have few tiles, so the contraction is split until there are about
`min_programs` programs (`vector_programs` on the vector path); the partials are summed after.

Speed (H200; the history is in the README's "Quantized weights"): one live row with int8
activations, gate/up Q8_0 42 us (78% of the copy bandwidth), Q4_K 35 (50%). At M 512 the
kernel is 6x to 15x slower than the bf16 dot, so steps of over 64 rows take dequantize.py.

Triton backend: all indices are arrays and loads are masked where a tile or split runs past
N or K, so M and N need not be tile multiples (K is a whole number of blocks, as in every
GGUF tensor). On CPU the kernel runs in interpret mode; tests/test_triton_lowering.py verifies
its Triton module.

Shapes: M rows, K contraction, N outputs, B values per block, U blocks per loop step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, uses_ptx, whole
from .ggml_asm import DECODERS as FLOAT_DECODERS
from .ggml_asm import INT_DECODERS, dots4
from .ggml_blocks import (
    QTYPES,
    block_loaders,
    codes_as,
    contract_block,
    contract_block_int8,
    exact_f32,
    issue_loads,
)
from .int8_rows import int8_rows
from .quant_tiling import expert_tiling, tiling
from .quant_weight import QuantWeight, dequantize_weight

# Types whose int8_dots run on int8 codes (pieces of 32 values): Q6_K's 16-value pieces, a K
# below Triton's int8 MMA shape, came out wrong on the H200, so types with 16-value pieces keep
# the bf16 dots; Q5_K is unchecked on a GPU (history/2026-12-02_quant_matmul_int8_dots_h200.md)
INT8_DOTS = ("q8_0", "q4_k")


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


def _kernel(live_ref, ex_ref, x_ref, xw_ref, dx_ref, sx_ref, h_ref, b_ref, o_ref, *, fmt, BM,
            BN, U, S, steps, n_blocks, R, E, unit, int8, ptx, piece, live_only,
            prefetch, int8_dots, fan):  # fmt: skip
    """Program (i, j, s); with E experts, row i alone (x's row i // fan) times expert
    ex_ref[i] (BM 1)."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    float_decode = FLOAT_DECODERS.get(QTYPES[fmt.qtype]) if unit else None
    int_decode = INT_DECODERS[QTYPES[fmt.qtype]] if int8 else None
    M, K = x_ref.shape[0] * fan, x_ref.shape[1]
    N = b_ref.shape[-2]
    e = jnp.minimum(ex_ref[i], E - 1) if E else None  # clamped: loads stay in bounds
    body_at = (lambda r, b: b_ref.at[r, b]) if e is None else (lambda r, b: b_ref.at[e, r, b])
    head_at = (lambda h, r: h_ref.at[h, r]) if e is None else (lambda h, r: h_ref.at[e, h, r])
    # N a whole number of tiles and K of splits (every Qwen3-8B projection): the vector path's
    # loads are all in bounds and need no predicates (Q4_K's one-row path 1376 -> 1288 SASS)
    exact = N % BN == 0 and S * steps * U == n_blocks
    cols = j * BN + jnp.arange(BN)
    col_ok = cols < N

    def block(c, u, unmasked=False, loaded=None):
        blk = (s * steps + c) * U + u
        ok = blk < n_blocks  # the last split's tail is past K: it adds zeros
        w_ok = (col_ok[:, None] & ok[None, :]) if jnp.ndim(blk) else col_ok & ok
        w_ok = None if unmasked else w_ok  # every load in bounds: no masks to set up
        loaders = block_loaders(fmt, body_at, head_at, cols, w_ok, blk, loaded)
        return blk, ok, loaders

    def dots(on_int8=False):
        """Tiles on the matrix units; on_int8: x's int8 rows times int8 codes, int32 a group
        (ggml_blocks.contract_block_int8), else x as it is times the codes in its dtype."""
        rows = i * BM + jnp.arange(BM)
        row_ok = rows < M
        rows = jnp.minimum(rows, M - 1)

        def body(c, acc):
            for u in range(U):
                blk, ok, (load, load1) = block(c, u)

                def load_x(first: int, n: int, blk=blk, ok=ok):
                    ks = blk * fmt.block + first + jnp.arange(n)
                    ref, m = xw_ref if on_int8 else x_ref, row_ok[:, None] & ok
                    return plgpu.load(ref.at[rows[:, None], ks[None, :]], mask=m, other=0)

                def load_rows(ref, per: int, first: int, blk=blk, ok=ok):  # x's [BM] per `per`
                    k = (blk * fmt.block + first) // per
                    return plgpu.load(ref.at[rows, k], mask=row_ok & ok, other=0)

                if on_int8:  # sx holds x's sums per group (the wrapper's choice of s16, s32)
                    dx = functools.partial(load_rows, dx_ref, 32)
                    sx = functools.partial(load_rows, sx_ref, fmt.group)
                    acc = contract_block_int8(fmt, load, load1, load_x, dx, sx, acc)
                else:
                    acc = contract_block(fmt, load, load1, load_x, acc, dot_nt)
            return acc

        return jax.lax.fori_loop(0, steps, body, jnp.zeros((BM, BN), jnp.float32))

    def vectors(R, row0=0):
        """Rows row0 .. row0 + R - 1 on the vector units: per row, codes times activations
        summed. A loop step decodes its U blocks together ([BN, U, n] codes per piece), the
        partial sums staying [BN, U] until the loop ends (few wide loads, no reduction).
        With `prefetch`, step c issues the weight loads of step c + 1 before it decodes its
        own (they ride in the loop's carry), so a block's load latency overlaps the decoding
        of the one before it."""
        us = jnp.arange(U)

        def decode(load, load1, g):
            if int_decode is not None:
                return int_decode(load, load1, g, piece)
            return (fmt.decode if float_decode is None else
                    functools.partial(float_decode, ptx=ptx))(load, load1, g)  # fmt: skip

        keys, first = (), ()
        if prefetch:  # step 0's loads, issued by decoding it once (the decoding is dead code)
            loaded = {}
            _, _, (load, load1) = block(0, us, exact, loaded)
            for g in range(fmt.groups):
                decode(load, load1, g)
            keys = tuple(loaded)
            first = tuple(loaded[k] for k in keys)

        def body(c, carry):
            accs, pre = list(carry[:R]), carry[R:]
            loaded = dict(zip(keys, pre, strict=True)) if prefetch else None
            if prefetch:  # the last step reloads its own block (clamped: in bounds, cached)
                nxt = {}
                _, _, (load, load1) = block(jnp.minimum(c + 1, steps - 1), us, exact, nxt)
                issue_loads(fmt, load, load1, keys)
                pre = tuple(nxt[k] for k in keys)
            blk, ok, (load, load1) = block(c, us, exact, loaded)
            dxs = {}  # x's scales by (row, 32 values): Q6_K's groups of 16 share one
            for g in range(fmt.groups):
                if int_decode is not None:
                    accs = int_group(accs, g, blk, ok, load, load1, dxs)
                    continue
                # integer codes (IQ4_XS: through its table) or unit floats, four code bytes
                # at a time (ggml_asm.py)
                a, b, pieces = decode(load, load1, g)
                if float_decode is None:
                    pieces = [(first, exact_f32(q)) for first, q in pieces]
                for m in range(R):
                    part = xsum = 0.0
                    for first, codes in pieces:
                        ks = blk[:, None] * fmt.block + g * fmt.group + first
                        ks = ks + jnp.arange(codes.shape[-1])[None, :]  # [U, n]
                        # xw: with unit codes, x in float32, converted once by the wrapper
                        # (in the kernel each thread converts its own x values: Q4_K's one-row
                        # path 824 -> 1016 SASS, the whole kernel's registers 150 -> 122)
                        xm = plgpu.load(xw_ref.at[row0 + m, ks], mask=None if exact else ks < K,
                                        other=None if exact else 0)  # fmt: skip
                        xm = xm.astype(jnp.float32)  # with unit codes xw is float32 already
                        part += jnp.sum(codes * xm[None], axis=-1)
                        if b is not None:
                            xsum += jnp.sum(xm, axis=-1)[None, :]
                    accs[m] = accs[m] + a * part + (0.0 if b is None else xsum * b)
            return tuple(accs) + tuple(pre)

        def int_group(accs, g, blk, ok, load, load1, dxs):
            """Group g against int8 activations: per piece, dots4's products summed as int32,
            then scaled by the group's a and the activations' block scale (from dxs, loaded
            once per 32 values); c times their sums."""
            a, c, pieces = int_decode(load, load1, g, piece)
            first_k = blk * fmt.block + g * fmt.group  # [U]
            for m in range(R):
                dot, xs = 0, 0.0
                for first, lo, kw in pieces:
                    ks = (first_k + first)[:, None] + jnp.arange(lo.shape[-1])[None, :]
                    xq = plgpu.load(xw_ref.at[row0 + m, ks], mask=None if exact else ks < K,
                                    other=None if exact else 0)  # fmt: skip
                    xq = jnp.broadcast_to(xq[None], lo.shape)
                    dot = dot + jnp.sum(dots4(lo, xq, ptx=ptx, **kw), axis=-1)  # [BN, U]
                if c is not None:  # the group's sum of x: one load (int8_rows sums per group)
                    k_sum = first_k // fmt.group
                    xs = plgpu.load(sx_ref.at[row0 + m, k_sum], mask=None if exact else ok,
                                    other=None if exact else 0)  # fmt: skip
                key = (m, g * fmt.group // 32)
                if key not in dxs:
                    dxs[key] = plgpu.load(dx_ref.at[row0 + m, first_k // 32],
                                          mask=None if exact else ok,
                                          other=None if exact else 0)  # fmt: skip
                dx = dxs[key]
                part = a * exact_f32(dot) + (0.0 if c is None else c * xs[None, :])
                accs[m] = accs[m] + dx[None, :] * part
            return accs

        zero = jnp.zeros((BN, U), jnp.float32)
        return rows_out(jax.lax.fori_loop(0, steps, body, (zero,) * R + first)[:R])

    def rows_out(accs):  # r accumulators [BN, U] -> rows 0 .. r-1 of the [BM, BN] tile
        r = jnp.arange(BM)[:, None]
        out = jnp.zeros((BM, BN), jnp.float32)
        for m in range(len(accs)):
            out = jnp.where(r == m, jnp.sum(accs[m], axis=1)[None, :], out)
        return out

    # A step of r <= R live rows decodes for r rows, not R (one token at C1 had paid for two);
    # the branch is uniform over a program, so only its code is shared.
    out = functools.partial(dots, int8 and int8_dots)
    for r in range(1, R + 1)[::-1]:
        path = functools.partial(vectors, r)
        out = functools.partial(jax.lax.cond, (live_ref[0] <= r) & (i == 0), path, out)
    if E:
        zero = functools.partial(jnp.zeros, (BM, BN), jnp.float32)
        out = functools.partial(jax.lax.cond, (0 <= ex_ref[i]) & (ex_ref[i] < E),
                                functools.partial(vectors, 1, i // fan), zero)  # fmt: skip
    out = out()
    # The partials hold M rows, not NI * BM (a padded tile doubled their traffic at M 8), and
    # with `live_only` (unsummed splits) the padding rows past live are not stored either.
    rows = i * BM + jnp.arange(BM)
    ok = (rows < (jnp.minimum(live_ref[0], M) if live_only else M))[:, None] & col_ok[None, :]
    plgpu.store(o_ref.at[s, rows[:, None], cols[None, :]], out, mask=ok)


def quant_matmul(
    x,
    w: QuantWeight,
    live=None,
    *,
    experts=None,
    fan_out: int = 1,
    x8=None,
    splits: bool = False,
    out_dtype=jnp.float32,
    block_m: int = 64,
    block_n: int = 64,
    values_per_step: int = 256,
    min_programs: int = 2112,
    vector_rows: int = 2,
    vector_programs: int = 2112,
    expert_splits: int | None = None,
    unit_codes: bool = False,
    int8_x: bool = False,
    prefetch: bool | None = None,
    int8_dots: bool = False,
    ptx: bool | None = None,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """Pallas x @ W^T with W quantized (quant_matmul_reference's signature).

    Args:
      x: [M, K] activations (bfloat16 on GPU; the dots run in x's dtype).
      w: QuantWeight [N, K] of any ggml_blocks.FORMATS type, or with `experts` a stack of E
        experts' weights [E, N, K].
      live: int32 scalar, the rows that matter (the step's real tokens; rows at or past it are
        padding and their results unspecified), or None (all M). A call with at most
        `vector_rows` live rows takes the vector-unit path.
      experts: [M * fan_out] int32, with a stack w: row m times expert experts[m]'s weights,
        each row alone on the vector path, every loop step its own program; rows whose
        expert is not in [0, E) (padding) give zeros. fan_out: rows of the product per row
        of x (a token's k experts read its one row: no repeated copy of x).
      x8: x's int8 rows (q, d, s16, s32) as int8_rows gives them, where the caller has them
        (int8_rows.norm_int8_rows rounds a normed x in the norm's kernel); None: rounded here.
      splits: return the contraction splits' float32 partials [S, M, N], unsummed, for a
        consumer that sums them (int8_rows.glu_int8_rows, live_sum); rows at or past `live`
        are not written, so a consumer reads the live rows only.
      out_dtype: result dtype (accumulation is float32).
      block_m, block_n: caps on BM (rows, at least 16) and BN (weight rows); the defaults
        were the fastest of six decode tilings (history/2026-11-30_quant_matmul_tiling_h200.md).
      values_per_step: contraction values per loop step (U = this / B blocks, at least 1).
      min_programs: split the contraction until the grid has about this many programs (16
        per SM of an H200), never below one step per split.
      vector_rows, vector_programs: with `live`, a call of r <= vector_rows live rows takes
        the vector path for r rows on a grid of about vector_programs programs.
      expert_splits: with `experts`, the contraction splits a pair's programs take (each a
        loop over its share of U-block steps); None: one step each.
      unit_codes: the vector path decodes Q4_0, Q4_K, Q5_K and Q6_K codes q into the floats
        1 + q / 128 four bytes at a time (ggml_asm.py); off: mostly slower on the H200.
      int8_x: the vector path takes x quantized to int8 per 32 values (int8_rows.py; llama.cpp's
        q8_1 rounding) and dots Q8_0, Q4_0, Q4_K, Q5_K and Q6_K codes with it four at a time
        (dp4a); other types ignore it. On for dense models (EngineConfig.quant_activations).
      prefetch: the vector path issues a loop step's weight loads one step ahead. Default: for
        Q6_K only, the type it sped up (history/2026-12-02_quant_matmul_prefetch_h200.md).
      int8_dots: with int8_x, the dots (a call of more live rows than vector_rows, or any
        call without `live`) run on x's int8 rows and the codes as int8 (int32 sums a group)
        rather than on bf16 x and codes; for the INT8_DOTS types only.
      ptx: unit codes, dp4a and int8_rows' rounding through PTX, else jnp (default: uses_ptx).
      interpret: run in interpret mode (default: when the backend is the CPU).
    Returns:
      [M, N] in out_dtype (with `splits`, [S, M, N] float32).
    """
    M, K = x.shape
    E = 0 if experts is None else w.shape[0]
    if len(w.shape) != 2 + bool(E) or w.shape[-1] != K:
        want = "(E, N, K) with experts" if E else "(N, K)"
        raise ValueError(f"x {x.shape} and {w.qtype} weight {w.shape} {want} do not fit")
    if E and experts.shape != (M * fan_out,) or fan_out != 1 and not E:
        raise ValueError(f"experts {experts.shape}: fan_out={fan_out} per row of x {x.shape}")
    M *= fan_out  # the product's rows
    N = w.shape[-2]
    fmt = w.format
    R = 0 if live is None or E else min(vector_rows, M)
    n_blocks, U = K // fmt.block, max(1, values_per_step // fmt.block)
    if E:
        BM, (BN, S, steps) = 1, expert_tiling(N, n_blocks, U, block_n, expert_splits)
    else:
        programs = vector_programs if R else min_programs
        BM, BN, S, steps = tiling(M, N, n_blocks, U, block_m, block_n, programs)
    NI, NJ = -(-M // BM), -(-N // BN)
    ptx = uses_ptx(interpret) if ptx is None else ptx
    # xw: the vector path's activations (int8 with scales dx and sums sx, or float32), if any
    vector = bool(R or E)
    int8_dots = int8_dots and QTYPES[fmt.qtype] in INT8_DOTS
    int8_x = int8_x and (vector or int8_dots) and QTYPES[fmt.qtype] in INT_DECODERS
    unit_codes = unit_codes and vector and not int8_x
    # The int8 path's pieces: a run of 32 code bytes is loaded as two halves where the tile
    # has a weight row for every thread (BN >= threads), so each thread sums a group without a
    # shuffle (BN 128 lost to 64 on the H200: history/2026-12-02_quant_matmul_units_block_n_h200.md)
    piece = 16 if BN >= 32 * num_warps else 32
    prefetch = QTYPES[fmt.qtype] == "q6_k" if prefetch is None else prefetch
    kernel = functools.partial(_kernel, fmt=fmt, BM=BM, BN=BN, U=U, S=S, steps=steps,
                               n_blocks=n_blocks, R=R, E=E, unit=unit_codes, int8=int8_x,
                               ptx=ptx, piece=piece, live_only=splits,
                               prefetch=prefetch, int8_dots=int8_dots, fan=fan_out)  # fmt: skip
    xw, dx, sx = x, jnp.zeros((1, 1), jnp.float32), jnp.zeros((1, 1), jnp.float32)
    if int8_x:
        xw, dx, s16, s32 = int8_rows(x, ptx=ptx, interpret=interpret) if x8 is None else x8
        sx = s32 if fmt.group == 32 else s16  # per group: its offset takes one load
    elif unit_codes:
        xw = x.astype(jnp.float32)
    live = jnp.full((1,), M if live is None else live, jnp.int32)
    ex = jnp.zeros((1,), jnp.int32) if experts is None else experts.astype(jnp.int32)
    # the launch's name in a profile: quant_matmul_q4_k_experts, quant_matmul_q6_k_vector (a
    # call that takes the vector path when few rows are live), quant_matmul_q8_0_dots
    name = f"quant_matmul_{w.qtype}_{'experts' if E else 'vector' if R else 'dots'}"
    out = jax.ShapeDtypeStruct((S, M, N), jnp.float32)
    parts = pl.pallas_call(
        kernel,
        grid=(NI, NJ, S),
        in_specs=[whole(a) for a in (live, ex, x, xw, dx, sx, w.head, w.body)],
        out_specs=whole(out),
        out_shape=out,
        **call_options(interpret, num_warps, num_stages, name=name),
    )(live, ex, x, xw, dx, sx, w.head, w.body)
    return parts if splits else parts.sum(0).astype(out_dtype)
