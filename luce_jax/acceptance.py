"""Speculative acceptance: which proposed tokens the target keeps, and the token after them.

The standard rule (Leviathan et al. 2023, Chen et al. 2023): proposal x at a position is kept
with probability min(1, p(x) / q(x)), p the target's distribution there and q the proposer's;
at the first rejection the next token is drawn from the residual max(p - q, 0), renormalized;
when every proposal is kept, a bonus token is drawn from p at the position after them. The
emitted tokens are then distributed exactly as the target alone would sample them.

Greedy rows pass p one-hot at the target's argmax: a proposal is kept iff it equals the argmax,
and the residual (and bonus) is the argmax, so greedy output is token-identical to decoding
without speculation. A deterministic proposer (prompt lookup) passes q one-hot at its proposal.

Shapes: R rows (speculating sequences), K proposals per row, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accept(p, q, draft, n, uniforms, key):
    """Apply the rule to every row at once.

    Args:
      p: [R, K+1, V] float32 target probabilities; position i is the distribution of the token
        after the first i proposals.
      q: [R, K, V] float32 proposal probabilities (one-hot rows for a deterministic proposer).
      draft: [R, K] int32 proposed tokens; n: [R] int32 real proposals per row (<= K), the
        positions past n are ignored.
      uniforms: [R, K] float32 in [0, 1); key: PRNG key for the residual or bonus draw.
    Returns:
      (accepted [R] int32: leading proposals kept, next [R] int32: the token after them).
    """
    R, K = draft.shape
    rows = jnp.arange(R)
    pd = jnp.take_along_axis(p[:, :K], draft[..., None], axis=-1)[..., 0]  # [R, K]
    qd = jnp.take_along_axis(q, draft[..., None], axis=-1)[..., 0]
    # u < p / q, written without a division (q(x) > 0 for a proposal drawn from q).
    keep = (uniforms * qd < pd) & (jnp.arange(K)[None, :] < n[:, None])
    accepted = jnp.sum(jnp.cumprod(keep, axis=-1), axis=-1).astype(jnp.int32)
    pa = p[rows, accepted]  # [R, V]
    qa = jnp.where((accepted < n)[:, None], q[rows, jnp.minimum(accepted, K - 1)], 0.0)
    residual = jnp.maximum(pa - qa, 0.0)
    # A zero residual needs p == q at a rejected position, which the rule cannot reject.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, pa)
    nxt = jax.random.categorical(key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, nxt
