"""DeepSeek V4's lightning indexer: which compressed entries a CSA query attends to.

A query scores every entry its sequence has closed and may see (entry i once (i + 1) m <= t +
1): the sum over the indexer's heads of w[t, h] * ReLU(q[t, h] . K[i]) / sqrt(dI), w the
token's head weights (weights_proj . x, over sqrt(H)), and keeps the top k (512 in Flash). A
query with fewer visible entries than k marks the rest -1. Among equal scores the order is
the implementation's (transformers and llama.cpp differ there too).

Shapes: T query rows, H indexer heads, dI its head width, NE entries a row can reach.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visible_entries(pos, m: int):
    """[T] int32: how many entries a query at pos sees, (pos + 1) // m."""
    return (pos + 1) // m


def index_scores(q, w, keys, n_visible):
    """[T, NE] float32 scores, -inf past each row's visible entries.

    Args: q [T, H, dI] roped queries; w [T, H] head weights (already over sqrt(H)); keys
      [T, NE, dI] each row's sequence's entries in order; n_visible [T] (visible_entries).
    """
    dots = jnp.einsum("thd,ted->the", q.astype(jnp.float32), keys.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    s = jnp.einsum("the,th->te", jax.nn.relu(dots) * q.shape[-1] ** -0.5, w.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    return jnp.where(jnp.arange(keys.shape[1])[None, :] < n_visible[:, None], s, -jnp.inf)


def select_entries(scores, k: int, n_visible):
    """[T, k] int32: each row's k best entries by score (-1 where fewer are visible)."""
    _, idx = jax.lax.top_k(scores, k)
    return jnp.where(idx < n_visible[:, None], idx, -1).astype(jnp.int32)
