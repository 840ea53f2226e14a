"""Activation rows rounded to int8 per 32 values (llama.cpp's q8_1) in one kernel launch.

quant_matmul's int8 path (`int8_x`) dots the weights' codes with x rounded this way. As jnp,
XLA ran the rounding as three kernels per call (the block maxima, the scales, the codes and
their sums): on the H200 a 30B-A3B Q4_K_M decode step at C1 ran 1652 kernels, 530 of them
these, and 0.83 of its 4.54 ms of kernel time; the step's CUDA graph (XLA's command buffer)
is prepared on the host in time that grows with its kernels, and the step went from 8.7 to
15.6 ms (bench/results/2026-12-01_profile_qwen3-30b-a3b-q4_k_m_int8_0b2eb14.md). Here a
call is one kernel: a program rounds BK values of one row.

Shapes: M rows, K values per row (a multiple of 32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, uses_ptx, whole

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


def _kernel(x_ref, q_ref, d_ref, s16_ref, s32_ref, *, G, ptx):
    """Program (m, c): row m's groups c * G .. c * G + G - 1 of 32 values, each as two halves
    of 16 ([G, 2, 16]) so the sums per 16 need no reshape."""
    m, c = pl.program_id(0), pl.program_id(1)
    g = c * G + jnp.arange(G)
    half = g[:, None] * 2 + jnp.arange(2)[None, :]  # [G, 2]
    ks = half[:, :, None] * 16 + jnp.arange(16)[None, None, :]  # [G, 2, 16]
    x = plgpu.load(x_ref.at[m, ks]).astype(jnp.float32)
    d, inv = _scales(jnp.max(jnp.max(jnp.abs(x), axis=2), axis=1))  # [G]
    q = _rint(x * inv[:, None, None], ptx)
    plgpu.store(q_ref.at[m, ks], q.astype(jnp.int8))
    plgpu.store(d_ref.at[m, g], d)
    s = jnp.sum(q, axis=2).astype(jnp.float32)  # [G, 2]
    plgpu.store(s16_ref.at[m, half], s)
    plgpu.store(s32_ref.at[m, g], jnp.sum(s, axis=1))


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
    BK = next(b for b in (1024, 512, 256, 128, 64, 32) if K % b == 0)
    out = (
        jax.ShapeDtypeStruct((M, K), jnp.int8),
        jax.ShapeDtypeStruct((M, K // 32), jnp.float32),
        jax.ShapeDtypeStruct((M, K // 16), jnp.float32),
        jax.ShapeDtypeStruct((M, K // 32), jnp.float32),
    )
    ptx = uses_ptx(interpret) if ptx is None else ptx
    return pl.pallas_call(
        functools.partial(_kernel, G=BK // 32, ptx=ptx),
        grid=(M, K // BK),
        in_specs=[whole(x)],
        out_specs=[whole(o) for o in out],
        out_shape=out,
        **call_options(interpret, num_warps=4, num_stages=1),
    )(x)
