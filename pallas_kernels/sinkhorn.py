"""DeepSeek V4's Sinkhorn normalization of the hyper-connections' stream-mixing matrices in one
kernel launch: a program normalizes the [n, n] matrices of BT tokens through every iteration
in registers.

As XLA ops (the reference here, a fori_loop of iters - 1 column and row passes) each
iteration of each site's loop was its own kernels on the GPU: a reduction, a division and the
loop counter's add, with the loop state copied device to device, and XLA:GPU reads a while
loop's predicate on the host each iteration (device/sampling.py says what that cost). The 12-layer
DeepSeek-V4-Flash-shaped C1 decode step ran 2,643 kernels, about 1,600 of them these, two
sites a layer (bench/results/profile_deepseek4-flash-q2_k.md: `input_reduce_fusion`,
`loop_divide_fusion`, `loop_add_fusion`, `MemcpyD2D`).

Shapes: T tokens, n streams (a matrix is [n, n]: source stream a, target b).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole

BT = 16  # tokens a program


def sinkhorn_reference(logits, iters: int, eps: float):
    """[T, n, n] row softmax plus eps, then columns and rows normalized in turn (iters column
    passes, iters - 1 row passes between them): comb[t, a, b], source stream a, target b
    (transformers' DeepseekV4HyperConnection, llama.cpp's sinkhorn)."""
    c = jax.nn.softmax(logits.astype(jnp.float32), axis=-1) + eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    def body(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, body, c)


def _kernel(x_ref, o_ref, *, n: int, N: int, iters: int, eps: float):
    """Program i: tokens i * BT .. i * BT + BT - 1 (those past T masked), as [BT, N, N] with the
    padding streams (N: n to a power of two) held at zero."""
    T = x_ref.shape[0]
    t = pl.program_id(0) * BT + jnp.arange(BT)
    a, b = jnp.arange(N), jnp.arange(N)
    valid = (a[:, None] < n) & (b[None, :] < n)  # [N, N]
    mask = (t < T)[:, None, None] & valid[None]
    at = (t[:, None, None], a[None, :, None], b[None, None, :])
    x = plgpu.load(x_ref.at[at], mask=mask, other=-jnp.inf).astype(jnp.float32)
    e = jnp.exp(x - jnp.max(x, axis=2)[:, :, None])  # padding rows (all -inf): NaN, zeroed next
    c = jnp.where(valid[None], e / jnp.sum(e, axis=2)[:, :, None] + eps, 0.0)
    c = c / (jnp.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):  # unrolled: iters is small (20 in DeepSeek V4)
        c = c / (jnp.sum(c, axis=2)[:, :, None] + eps)
        c = c / (jnp.sum(c, axis=1)[:, None, :] + eps)
    plgpu.store(o_ref.at[at], c, mask=mask)


@functools.partial(jax.jit, static_argnames=("iters", "eps", "interpret", "num_warps"))
def sinkhorn(logits, *, iters: int, eps: float, interpret=None, num_warps: int = 1):
    """sinkhorn_reference of logits [T, n, n] in one kernel: comb [T, n, n] float32."""
    T, n, n2 = logits.shape
    if n != n2 or iters < 1:
        raise ValueError(f"logits {logits.shape}, iters={iters}: want [T, n, n] and iters >= 1")
    N = 1 << max(n - 1, 0).bit_length()
    x = logits.astype(jnp.float32)
    shape = jax.ShapeDtypeStruct((T, n, n), jnp.float32)
    return pl.pallas_call(
        functools.partial(_kernel, n=n, N=N, iters=iters, eps=eps),
        grid=(pl.cdiv(T, BT),),
        in_specs=[whole(x)],
        out_specs=whole(shape),
        out_shape=shape,
        **call_options(interpret, num_warps, 1, name="sinkhorn"),
    )(x)
