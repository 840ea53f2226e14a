"""Activation rows rounded to int8 per 32 values (llama.cpp's q8_1) in one kernel launch.

quant_matmul's int8 path (`int8_x`) dots the weights' codes with x rounded this way. As jnp,
XLA ran the rounding as three kernels per call (the block maxima, the scales, the codes and
their sums): on the H200 a 30B-A3B Q4_K_M decode step at C1 ran 1652 kernels, 530 of them
these, and 0.83 of its 4.54 ms of kernel time; the step's CUDA graph (XLA's command buffer)
is prepared on the host in time that grows with its kernels, and the step went from 8.7 to
15.6 ms (bench/results/history/2026-12-01_profile_qwen3-30b-a3b-q4_k_m_int8_0b2eb14.md). Here a
call is one kernel: a program rounds BK values of one row.

`norm_int8_rows` puts the RMSNorm before a projection in the same kernel (a program per row):
the H200 profile of the 8B Q4_K_M's C1 decode step (777 kernels, 21 a layer; bench/results/
history/2026-12-02_profile_qwen3-8b-q4_k_m_c1_9345aba.md) ran XLA's norm fusion (2.0 us) then
int8_rows (1.4 us) twice a layer, each kernel of a step adding its launch and a round trip
through memory; that took the device step 5.23 -> 5.17 ms at C1
(history/2026-12-02_engine_decode_qwen3-8b-q4_k_m_156141c.md). `glu_int8_rows` does the same for the
FFN's hidden rows: the gate | up kernel's split partials summed, silu(gate) * up and the
rounding, where XLA's fusion (2.1 us) and int8_rows (1.5 us) were two kernels. quant_matmul's
`splits` writes the partials of live rows only (at C1 one row of a bucket of 8 is live) and
glu_int8_rows reads no others; with the gate | up, attention output and down projections'
partials so and glu_int8_rows' programs at 128 values (PARTS_BLOCK), the device step went 5.17
-> 4.97 ms at C1 (history/2026-12-02_engine_decode_qwen3-8b-q4_k_m_5c5faaf.md).
`norm_rows` is that norm alone, for projections on float activations (quant_activations=float).
A kernel for the residual add of the attention output's and the down projection's partials
and the norm after it was tried the same way and dropped: a program per row (the norm needs
the whole row) was 0.2 ms a step slower than XLA's sum and norm_int8_rows, and chunks of a row
with the norm's factor moved into the next product were no faster (4.98 against 4.97 ms).

Shapes: M rows, K values per row (a multiple of 32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, uses_ptx, whole
from .swiglu import swiglu

# cvt.rni: a float32 to the nearest int32, ties to even (jnp.round's rounding); Triton has no
# lowering for lax.round. Adding and subtracting 1.5 * 2**23 instead was contracted into an
# FMA with the scaling (x * inv + R), which rounds the exact product: ties decided otherwise
# than the reference's rounded one.
RINT = "cvt.rni.s32.f32 $0, $1;"


def _rint(v, ptx: bool):
    """float32 v to int32, rounded to nearest, ties to even."""
    if ptx:
        return plgpu.elementwise_inline_asm(
            RINT, args=[v], constraints="=r,f", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.int32)],
        )[0]  # fmt: skip
    return jnp.round(v).astype(jnp.int32)


def _scales(amax):
    """(d, 1 / d) of groups whose largest |x| is amax, 1 / d as llama.cpp's id (0 where d is)."""
    d = amax / 127.0
    return d, jnp.where(d == 0, 0.0, 1.0 / jnp.where(d == 0, 1.0, d))


def int8_rows_reference(x):
    """x [M, K] as int8 per 32 values (max |x| to 127, as llama.cpp's q8_1):
    (q [M, K] int8, d [M, K / 32] float32 scales, s16 [M, K / 16] and s32 [M, K / 32] float32
    sums of q per 16 and per 32 values)."""
    M, K = x.shape
    xb = x.astype(jnp.float32).reshape(M, K // 32, 32)
    d, inv = _scales(jnp.max(jnp.abs(xb), axis=-1))
    q = jnp.round(xb * inv[..., None]).astype(jnp.int8).reshape(M, K)
    s16 = q.astype(jnp.float32).reshape(M, K // 16, 16).sum(-1)
    return q, d, s16, s16.reshape(M, K // 32, 2).sum(-1)


def _round_groups(x, m, g, half, ks, q_ref, d_ref, s16_ref, s32_ref, ptx, ok=None):
    """Round row m's groups g [G] of 32 values x [G, 2, 16] (halves of 16 at `half` [G, 2],
    values at `ks`) and store their codes, scales and sums; `ok` [G] masks groups past K."""
    d, inv = _scales(jnp.max(jnp.max(jnp.abs(x), axis=2), axis=1))  # [G]
    q = _rint(x * inv[:, None, None], ptx)
    s = jnp.sum(q, axis=2).astype(jnp.float32)  # [G, 2]
    ok3, ok2 = (None, None) if ok is None else (ok[:, None, None], ok[:, None])
    plgpu.store(q_ref.at[m, ks], q.astype(jnp.int8), mask=ok3)
    plgpu.store(d_ref.at[m, g], d, mask=ok)
    plgpu.store(s16_ref.at[m, half], s, mask=ok2)
    plgpu.store(s32_ref.at[m, g], jnp.sum(s, axis=1), mask=ok)


def _groups(first, G):
    """Groups first .. first + G - 1: their indices [G], halves [G, 2] and values [G, 2, 16]."""
    g = first + jnp.arange(G)
    half = g[:, None] * 2 + jnp.arange(2)[None, :]
    return g, half, half[:, :, None] * 16 + jnp.arange(16)[None, None, :]


def _kernel(x_ref, q_ref, d_ref, s16_ref, s32_ref, *, G, ptx):
    """Program (m, c): row m's groups c * G .. c * G + G - 1 of 32 values, each as two halves
    of 16 ([G, 2, 16]) so the sums per 16 need no reshape."""
    m, c = pl.program_id(0), pl.program_id(1)
    g, half, ks = _groups(c * G, G)
    x = plgpu.load(x_ref.at[m, ks]).astype(jnp.float32)
    _round_groups(x, m, g, half, ks, q_ref, d_ref, s16_ref, s32_ref, ptx)


def _normed_row(x_ref, w_ref, m, G: int, eps: float, dtype):
    """Row m of x [M, K] RMS-normed in dtype, as [G, 2, 16] groups (those past K masked), with
    the groups' indices (_groups) and mask."""
    K = x_ref.shape[1]
    g, half, ks = _groups(0, G)
    ok = g < K // 32
    x = plgpu.load(x_ref.at[m, ks], mask=ok[:, None, None], other=0).astype(jnp.float32)
    w = plgpu.load(w_ref.at[ks], mask=ok[:, None, None], other=0).astype(jnp.float32)
    ms = jnp.sum(jnp.sum(jnp.sum(x * x, axis=2), axis=1), axis=0) / K
    return (x * jax.lax.rsqrt(ms + eps) * w).astype(dtype), (g, half, ks), ok


def _norm_kernel(x_ref, w_ref, h_ref, q_ref, d_ref, s16_ref, s32_ref, *, G, eps, ptx):
    """Program m: row m whole (its RMS needs every value), G groups a power of two, those past
    K masked."""
    m = pl.program_id(0)
    h, (g, half, ks), ok = _normed_row(x_ref, w_ref, m, G, eps, h_ref.dtype)
    plgpu.store(h_ref.at[m, ks], h, mask=ok[:, None, None])
    # the codes round h as the matmul's dots see it: in its dtype
    _round_groups(h.astype(jnp.float32), m, g, half, ks, q_ref, d_ref, s16_ref, s32_ref, ptx, ok)


def _norm_only_kernel(x_ref, w_ref, h_ref, *, G, eps):
    """_norm_kernel's h alone."""
    m = pl.program_id(0)
    h, (_, _, ks), ok = _normed_row(x_ref, w_ref, m, G, eps, h_ref.dtype)
    plgpu.store(h_ref.at[m, ks], h, mask=ok[:, None, None])


def _glu_kernel(p_ref, live_ref, h_ref, q_ref, d_ref, s16_ref, s32_ref, *, G, ptx, limit):
    """Program (m, c): row m's values c * G * 32 .. of silu(gate) * up, gate and up the sums of
    the S partials of [S, M, 2F] (gate the first F columns); a padding row (m >= live) reads no
    partials (quant_matmul's `splits` does not write them) and gives zeros."""
    m, c = pl.program_id(0), pl.program_id(1)
    S, F = p_ref.shape[0], h_ref.shape[1]
    g, half, ks = _groups(c * G, G)
    real = (m < live_ref[0]) & (ks >= 0)  # the row's liveness as a mask of the chunk's shape
    gate = up = 0.0
    for s in range(S):  # S is static and small (the kernel's contraction splits)
        gate = gate + plgpu.load(p_ref.at[s, m, ks], mask=real, other=0)
        up = up + plgpu.load(p_ref.at[s, m, ks + F], mask=real, other=0)
    h = swiglu(gate, up, limit).astype(h_ref.dtype)
    plgpu.store(h_ref.at[m, ks], h)
    _round_groups(h.astype(jnp.float32), m, g, half, ks, q_ref, d_ref, s16_ref, s32_ref, ptx)


def _call(kernel, grid, inputs, M: int, K: int, dtype=None, *, interpret, name: str):
    """The pallas_call of a kernel that writes int8 rows of [M, K] values (q, d, s16, s32), and
    first those values [M, K] in dtype where dtype is given."""
    out = (
        jax.ShapeDtypeStruct((M, K), jnp.int8),
        jax.ShapeDtypeStruct((M, K // 32), jnp.float32),
        jax.ShapeDtypeStruct((M, K // 16), jnp.float32),
        jax.ShapeDtypeStruct((M, K // 32), jnp.float32),
    )
    out = out if dtype is None else (jax.ShapeDtypeStruct((M, K), dtype), *out)
    res = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(a) for a in inputs],
        out_specs=[whole(o) for o in out],
        out_shape=out,
        **call_options(interpret, 4, 1, name=name),
    )(*inputs)
    return tuple(res) if dtype is None else (res[0], tuple(res[1:]))


def _block(K: int, most: int = 1024) -> int:
    """Values per program of a row: the largest of `most` .. 32 that divides K."""
    return next(b for b in (1024, 512, 256, 128, 64, 32) if b <= most and K % b == 0)


# Values per program of glu_int8_rows, which sums S split partials of each chunk: many small
# programs keep more of those loads in flight than a few large ones. At 1024 values the 8B's
# gate | up (F 12288) took 12 programs a live row, each reading 4 splits x 2 x 4 KB; a kernel
# of the same shape over the down projection's 24 splits made the decode step slower
# (history/2026-12-02_engine_decode_qwen3-8b-q4_k_m_5c5faaf.md).
PARTS_BLOCK = 128


@functools.partial(jax.jit, static_argnames=("ptx", "interpret"))
def int8_rows(x, *, ptx: bool | None = None, interpret: bool | None = None):
    """x [M, K] rounded to int8 per 32 values, as int8_rows_reference, in one kernel.

    The sums come per 16 and per 32 values, so a weight group of either size takes its offset
    in one load, and every matmul of one x (a q / k / v tuple of two GGML types) makes the
    same call.

    Args:
      x: [M, K] float activations, K a multiple of 32.
      ptx: round with PTX's cvt.rni (else jnp.round). Default: call_options.uses_ptx.
      interpret: run in interpret mode (default: when the backend is the CPU).
    Returns:
      (q [M, K] int8, d [M, K / 32] float32, s16 [M, K / 16] float32, s32 [M, K / 32]
      float32).
    """
    M, K = x.shape
    if K % 32:
        raise ValueError(f"int8 rows need K a multiple of 32, got x {x.shape}")
    BK, ptx = _block(K), uses_ptx(interpret) if ptx is None else ptx
    kernel = functools.partial(_kernel, G=BK // 32, ptx=ptx)
    return _call(kernel, (M, K // BK), (x,), M, K, interpret=interpret, name="int8_rows")


def rms_norm(x, w, eps):
    """x [..., K] * rsqrt(mean(x^2) + eps) * w [K], in float32 (the models' RMSNorm)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w


def norm_int8_rows_reference(x, w, eps: float, dtype):
    """(h, int8_rows_reference(h)) for h = rms_norm(x, w, eps) in dtype."""
    h = rms_norm(x, w, eps).astype(dtype)
    return h, int8_rows_reference(h)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "ptx", "interpret"))
def norm_int8_rows(x, w, *, eps: float, dtype, ptx: bool | None = None, interpret=None):
    """RMSNorm then int8 rounding in one kernel (norm_int8_rows_reference): a decode step's
    normed residual both as the matmul's activations h and as its int8 rows, where XLA's norm
    and int8_rows were two kernels.

    Args:
      x: [M, K] float32 rows (the residual stream), K a multiple of 32; w: [K] norm weights;
      eps: the norm's epsilon; dtype: h's dtype (the weights' compute dtype).
      ptx, interpret: as int8_rows'.
    Returns:
      (h [M, K] dtype, (q, d, s16, s32) as int8_rows returns them for h).
    """
    M, K = x.shape
    if K % 32 or w.shape != (K,):
        raise ValueError(f"norm_int8_rows needs K a multiple of 32 and w [K]: {x.shape}, {w.shape}")
    G = 1 << max(K // 32 - 1, 0).bit_length()  # a power of two for Triton's tensors
    ptx = uses_ptx(interpret) if ptx is None else ptx
    kernel = functools.partial(_norm_kernel, G=G, eps=eps, ptx=ptx)
    return _call(kernel, (M,), (x, w), M, K, dtype, interpret=interpret, name="norm_int8_rows")


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "interpret"))
def norm_rows(x, w, *, eps: float, dtype, interpret=None):
    """rms_norm(x, w, eps) in dtype as one kernel (a program per row), for projections on float
    activations: at one row XLA ran the norm as two kernels, a reduction to a scalar and the
    scaling (bench/results/history/2026-12-06_c1_step_call_qwen3-30b-a3b-q4_k_m_h100.md).

    Args: x [M, K] float32 rows, K a multiple of 32; w [K]; eps; dtype: the result's dtype;
      interpret: as int8_rows'.
    Returns: h [M, K] dtype.
    """
    M, K = x.shape
    if K % 32 or w.shape != (K,):
        raise ValueError(f"norm_rows needs K a multiple of 32 and w [K]: {x.shape}, {w.shape}")
    G = 1 << max(K // 32 - 1, 0).bit_length()
    out = jax.ShapeDtypeStruct((M, K), dtype)
    return pl.pallas_call(
        functools.partial(_norm_only_kernel, G=G, eps=eps),
        grid=(M,),
        in_specs=[whole(x), whole(w)],
        out_specs=whole(out),
        out_shape=out,
        **call_options(interpret, 4, 1, name="norm_rows"),
    )(x, w)


def live_sum(parts, live):
    """The sum over S of split partials [S, M, N] in the live rows (< live), zeros below them
    (where quant_matmul's `splits` wrote nothing)."""
    return jnp.where(jnp.arange(parts.shape[1])[:, None] < live, parts.sum(0), 0.0)


def glu_int8_rows_reference(parts, live, dtype, limit: float = 0.0):
    """(h, int8_rows_reference(h)) for h = silu(gate) * up in dtype (swiglu.py's, clamped by
    limit), [gate | up] the sum of the partials parts [S, M, 2F] (live_sum's)."""
    gate, up = jnp.split(live_sum(parts, live), 2, axis=-1)
    h = swiglu(gate, up, limit).astype(dtype)
    return h, int8_rows_reference(h)


@functools.partial(jax.jit, static_argnames=("dtype", "limit", "ptx", "interpret"))
def glu_int8_rows(parts, live, *, dtype, limit: float = 0.0, ptx: bool | None = None,
                  interpret=None):  # fmt: skip
    """A SwiGLU FFN's hidden rows and their int8 rounding in one kernel
    (glu_int8_rows_reference), from the gate | up product's split partials as quant_matmul
    leaves them (`splits=True`): the partials' sum, silu(gate) * up and int8_rows were two
    kernels (an XLA fusion and int8_rows).

    Args:
      parts: [S, M, 2F] float32 partials of [gate | up], F a multiple of 32; live: int32
      scalar, the rows whose partials were written (the rest give zeros); dtype: h's dtype
      (the down projection's compute dtype); limit: swiglu.py's clamp (0: none); ptx,
      interpret: as int8_rows'.
    Returns:
      (h [M, F] dtype, (q, d, s16, s32) as int8_rows returns them for h).
    """
    S, M, F2 = parts.shape
    F = F2 // 2
    if F2 % 64:
        raise ValueError(f"glu_int8_rows needs 2F a multiple of 64, got partials {parts.shape}")
    BK, ptx = _block(F, PARTS_BLOCK), uses_ptx(interpret) if ptx is None else ptx
    kernel = functools.partial(_glu_kernel, G=BK // 32, ptx=ptx, limit=limit)
    live = jnp.full((1,), live, jnp.int32)
    return _call(
        kernel, (M, F // BK), (parts, live), M, F, dtype, interpret=interpret, name="glu_int8_rows"
    )
