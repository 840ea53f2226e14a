"""Dense (bf16) experts a (token, expert) pair at a time: quant_matmul's experts mode for
weights kept as plain arrays.

At decode sizes the grouped matmul (moe_grouping.py) gives each expert's row tile a program
that walks all of K on the matrix units, for a tile of one or two live rows. Here each pair's
product is a GEMV spread over (pair, output tile, contraction split) programs: a program reads
its expert's [BK, BN] tile once, with its token's row of x (`fan_out`: a token's k pairs read
its one row), and writes its split's partial sums; the caller sums the splits in the next op
(the experts' SwiGLU, or the routing-weighted sum over a token's experts).

Shapes: M rows of x, P = M * fan_out pairs, K contraction, N outputs, E experts, S splits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole


def expert_rows_reference(x, w, experts, *, fan_out: int = 1):
    """[P, N] float32: pair p is x[p // fan_out] @ w[experts[p]]; experts outside [0, E)
    (padding) give zeros. Gathers every pair's expert: a reference, not a decode path."""
    E = w.shape[0]
    ok = (experts >= 0) & (experts < E)
    xr = jnp.repeat(x.astype(jnp.float32), fan_out, axis=0)
    wr = w[jnp.clip(experts, 0, E - 1)].astype(jnp.float32)  # [P, K, N]
    y = jnp.einsum("pk,pkn->pn", xr, wr, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(ok[:, None], y, 0.0)


def _kernel(ex_ref, x_ref, w_ref, o_ref, *, E, BK, BN, fan):
    """Program (p, j, s): pair p's output columns j*BN.. over contraction split s."""
    p, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    N = w_ref.shape[2]
    e = ex_ref[p]
    ok = (e >= 0) & (e < E)  # padding pairs load nothing and write zeros
    cols = j * BN + jnp.arange(BN)
    col_ok = cols < N
    ks = s * BK + jnp.arange(BK)
    xv = plgpu.load(x_ref.at[p // fan, ks], mask=ok, other=0.0).astype(jnp.float32)
    wv = plgpu.load(w_ref.at[jnp.clip(e, 0, E - 1), ks[:, None], cols[None, :]],
                    mask=ok & col_ok[None, :], other=0.0)  # fmt: skip
    acc = jnp.sum(xv[:, None] * wv.astype(jnp.float32), axis=0)
    plgpu.store(o_ref.at[s, p, cols], acc, mask=col_ok)


def _pow2_at_most(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= min(n, cap) and n % (b * 2) == 0:
        b *= 2
    return b


@functools.partial(
    jax.jit, static_argnames=("fan_out", "splits", "block_k", "block_n", "interpret", "num_warps")
)
def expert_rows(x, w, *, experts, fan_out: int = 1, splits: bool = False, block_k: int = 256,
                block_n: int = 64, interpret=None, num_warps: int = 4):  # fmt: skip
    """expert_rows_reference in one kernel launch.

    Args:
      x: [M, K] rows (bfloat16 on the GPU); w: [E, K, N] dense experts (bfloat16);
      experts: [M * fan_out] int32, pair p's expert (outside [0, E): padding, zeros);
      fan_out: pairs per row of x; splits: return the [S, P, N] float32 partials of the
        contraction's S splits, unsummed (the caller's next op sums them);
      block_k, block_n: caps on a program's tile (BK divides K; BN a power of two).
    Returns:
      [P, N] float32, or with `splits` [S, P, N] float32.
    """
    M, K = x.shape
    if w.ndim != 3 or w.shape[1] != K:
        raise ValueError(f"x {x.shape} and experts' weights {w.shape} (E, K, N) do not fit")
    P = M * fan_out
    if experts.shape != (P,):
        raise ValueError(f"experts {experts.shape}: fan_out={fan_out} per row of x {x.shape}")
    E, N = w.shape[0], w.shape[2]
    BK = _pow2_at_most(K, block_k)
    BN = min(block_n, 1 << max(N - 1, 0).bit_length())
    S = K // BK
    kernel = functools.partial(_kernel, E=E, BK=BK, BN=BN, fan=fan_out)
    ex = experts.astype(jnp.int32)
    out = jax.ShapeDtypeStruct((S, P, N), jnp.float32)
    parts = pl.pallas_call(
        kernel,
        grid=(P, -(-N // BN), S),
        in_specs=[whole(a) for a in (ex, x, w)],
        out_specs=whole(out),
        out_shape=out,
        **call_options(interpret, num_warps, 1),
    )(ex, x, w)
    return parts if splits else parts.sum(0)
