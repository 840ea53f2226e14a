"""Dense (bf16) experts at decode sizes: every expert's tile read once, for all the rows that
chose it, with no sort of the pairs.

At decode sizes the grouped matmul (moe_grouping.py) sorts the (token, expert) pairs and gives
each expert's row tile a program that walks all of K, for a tile of one or two live rows.
Here the pairs stay where the router put them (token-major, `per_token` a token): program
(p, j, s) belongs to pair p, and only the first pair of each expert (its leader) works. The
leader finds every token that chose its expert (a token chooses an expert at most once), reads
the expert's [BK, BN] tiles of output tile j over contraction split s once, multiplies them by
those tokens' rows on the matrix units, and writes each token's pair row. Padding pairs
(expert outside [0, E)) write zeros; other pairs' programs exit at once. The caller sums the
splits in its next op (the experts' SwiGLU, or the routing-weighted sum over a token's
experts).

Shapes: T tokens, k pairs a token (`per_token`), P = T * k pairs, K contraction, N outputs,
E experts, S splits; x holds a row per token (fan_out k) or per pair (fan_out 1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole

ROW_TILE = 16  # the matrix units' smallest row tile


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def expert_rows_reference(x, w, experts, *, fan_out: int = 1):
    """[P, N] float32: pair p is x[p // fan_out] @ w[experts[p]]; experts outside [0, E)
    (padding) give zeros. Gathers every pair's expert: a reference, not a decode path."""
    E = w.shape[0]
    ok = (experts >= 0) & (experts < E)
    xr = jnp.repeat(x.astype(jnp.float32), fan_out, axis=0)
    wr = w[jnp.clip(experts, 0, E - 1)].astype(jnp.float32)  # [P, K, N]
    y = jnp.einsum("pk,pkn->pn", xr, wr, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(ok[:, None], y, 0.0)


def _kernel(ex_ref, x_ref, w_ref, o_ref, *, E, T, k, kp, Tp, fan, BK, BN, steps):
    """Program (p, j, s): pair p's expert's output columns j*BN.. over split s, for every
    token that chose it, if p is that expert's first pair."""
    p, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    N = w_ref.shape[2]
    cols = j * BN + jnp.arange(BN)
    col_ok = cols < N
    e = ex_ref[p // k, p % k]
    real = (e >= 0) & (e < E)

    @pl.when(jnp.logical_not(real))
    def _():
        plgpu.store(o_ref.at[s, p, cols], jnp.zeros((BN,), jnp.float32), mask=col_ok)

    toks, slots = jnp.arange(Tp), jnp.arange(kp)
    ok2 = (toks < T)[:, None] & (slots < k)[None, :]
    ex2 = plgpu.load(ex_ref.at[toks[:, None], slots[None, :]], mask=ok2, other=-1)
    match = ok2 & (ex2 == e)  # [Tp, kp]: at most one per token
    flat = toks[:, None] * k + slots[None, :]
    leader = jnp.min(jnp.where(match, flat, k * Tp)) == p

    @pl.when(real & leader)
    def _():
        chose = jnp.max(match.astype(jnp.int32), axis=1) > 0  # [Tp]
        # each choosing token's pair; the others' first pair (never this leader's to write):
        # every lane's row distinct, and within the padded output (interpret mode's masked
        # stores write the untouched lanes back)
        pair = toks * k + jnp.sum(jnp.where(match, slots[None, :], 0), axis=1)
        src = toks if fan == k else pair  # x's row of each token's pair
        ks = jnp.arange(BK)

        def body(c, acc):
            kk = (s * steps + c) * BK + ks
            xs = plgpu.load(x_ref.at[src[:, None], kk[None, :]], mask=chose[:, None], other=0)
            ws = plgpu.load(w_ref.at[e, kk[:, None], cols[None, :]], mask=col_ok[None, :],
                            other=0)  # fmt: skip
            return acc + jax.lax.dot_general(
                xs.astype(ws.dtype), ws, (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # fmt: skip

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((Tp, BN), jnp.float32))
        plgpu.store(o_ref.at[s, pair[:, None], cols[None, :]], acc,
                    mask=chose[:, None] & col_ok[None, :])  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=("fan_out", "per_token", "splits", "block_n", "programs", "interpret",
                     "num_warps"),
)  # fmt: skip
def expert_rows(x, w, *, experts, fan_out: int = 1, per_token: int | None = None,
                splits: bool = False, block_n: int = 64, programs: int = 2048, interpret=None,
                num_warps: int = 4):  # fmt: skip
    """expert_rows_reference in one kernel launch, each expert's tiles read once.

    Args:
      x: [T, K] rows of tokens (fan_out = per_token) or [P, K] rows of pairs (fan_out 1), in
        the weights' dtype on the GPU; w: [E, K, N] dense experts (bfloat16);
      experts: [P] int32, token-major, per_token pairs a token, a token's real experts
        distinct (the router's top-k); outside [0, E): padding, zeros.
      fan_out: pairs per row of x; per_token: pairs per token (default fan_out);
      splits: return the [S, P, N] float32 partials of the contraction's S splits, unsummed;
      block_n: a program's output columns; programs: split the contraction until the grid
        has about this many programs (pairs x output tiles x splits).
    Returns:
      [P, N] float32, or with `splits` [S, P, N] float32.
    """
    R, K = x.shape
    k = per_token or fan_out
    P = experts.shape[0]
    if w.ndim != 3 or w.shape[1] != K:
        raise ValueError(f"x {x.shape} and experts' weights {w.shape} (E, K, N) do not fit")
    if fan_out not in (1, k) or P != R * fan_out or P % k:
        raise ValueError(
            f"experts {experts.shape}: fan_out={fan_out}, per_token={k} for x {x.shape}"
        )
    E, N = w.shape[0], w.shape[2]
    T = P // k
    Tp, kp = max(ROW_TILE, _pow2(T)), _pow2(k)
    BN = max(16, min(block_n, _pow2(N)))
    BK = 16
    while BK * 2 <= min(256, 16384 // Tp) and K % (BK * 2) == 0:  # x's tile <= 16K values
        BK *= 2
    if K % BK:
        raise ValueError(f"K={K} is not a multiple of 16")
    chunks, NJ = K // BK, -(-N // BN)
    S = 1
    while S * 2 <= chunks and chunks % (S * 2) == 0 and P * NJ * S * 2 <= programs:
        S *= 2
    kernel = functools.partial(_kernel, E=E, T=T, k=k, kp=kp, Tp=Tp, fan=fan_out, BK=BK, BN=BN,
                               steps=chunks // S)  # fmt: skip
    ex = experts.astype(jnp.int32).reshape(T, k)
    out = jax.ShapeDtypeStruct((S, Tp * k, N), jnp.float32)  # rows past P: never read
    parts = pl.pallas_call(
        kernel,
        grid=(P, NJ, S),
        in_specs=[whole(a) for a in (ex, x, w)],
        out_specs=whole(out),
        out_shape=out,
        **call_options(interpret, num_warps, 1, name="expert_rows"),
    )(ex, x, w)[:, :P]
    return parts if splits else parts.sum(0)
