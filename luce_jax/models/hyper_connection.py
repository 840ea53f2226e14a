"""Manifold-constrained hyper-connections (DeepSeek V4's mHC): each token carries n residual
streams, collapsed into a block's input by `pre` weights and expanded back from the block's
output by `post` weights, while a doubly-stochastic matrix `comb` (Sinkhorn-normalized) mixes
the streams themselves. All three come from one projection of the token's normed streams.

Both references (transformers' DeepseekV4HyperConnection / HyperHead, llama.cpp's
build_hc_pre / sinkhorn / post / head) run this in float32, as here. A site's weights, as the
GGUF holds them (blk.N.hc_attn_* / hc_ffn_*, output_hc_*): fn [(2 + n) n, n D], base
[(2 + n) n], scale [3]; the head's: fn [n, n D], base [n], scale [1].

Shapes: T tokens, n streams, D model width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.int8_rows import rms_norm
from pallas_kernels.sinkhorn import sinkhorn_reference


def _flat_normed(X, eps: float):
    """The streams [T, n, D] flattened to [T, n D] and RMS-normed without weights."""
    return rms_norm(X.reshape(X.shape[0], -1), 1.0, eps)


def _dot(v, fn):
    return jnp.dot(v, fn.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)


def hc_pre(X, site: dict, *, eps: float, hc_eps: float, iters: int, sinkhorn=None):
    """The block's input and the site's mixing weights.

    Args:
      X: [T, n, D] streams; site: {"fn", "base", "scale"} of the site (attention or FFN);
      eps: the norm's epsilon; hc_eps: the weights' epsilon; iters: Sinkhorn iterations;
      sinkhorn: Kernels.sinkhorn, or None (pallas_kernels/sinkhorn.py's jnp reference).
    Returns:
      (y [T, D] float32: sum_i pre[i] X[i], post [T, n], comb [T, n, n]).
    """
    n = X.shape[1]
    m = _dot(_flat_normed(X, eps), site["fn"])  # [T, (2 + n) n]
    base, scale = site["base"].astype(jnp.float32), site["scale"].astype(jnp.float32)
    pre = jax.nn.sigmoid(m[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * jax.nn.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (m[:, 2 * n :] * scale[2] + base[2 * n :]).reshape(-1, n, n)
    comb = (sinkhorn or sinkhorn_reference)(comb_logits, iters=iters, eps=hc_eps)
    y = jnp.sum(pre[..., None] * X.astype(jnp.float32), axis=1)
    return y, post, comb


def hc_post(out, X, post, comb):
    """The streams after a block: post[b] * out + sum_a comb[a, b] X[a] ([T, n, D] float32)."""
    mixed = jnp.einsum("tab,tad->tbd", comb, X.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    return post[..., None] * out.astype(jnp.float32)[:, None, :] + mixed


def hc_head(X, head: dict, *, eps: float, hc_eps: float):
    """The final collapse of the streams into one row per token before the output norm:
    sum_i (sigmoid(fn . v * scale + base)[i] + hc_eps) X[i], [T, D] float32."""
    m = _dot(_flat_normed(X, eps), head["fn"])
    pre = jax.nn.sigmoid(m * head["scale"].astype(jnp.float32)[0] + head["base"]) + hc_eps
    return jnp.sum(pre[..., None] * X.astype(jnp.float32), axis=1)
