"""Attention with a sink logit per head over one shared K = V head (DeepSeek V4): the sink
joins each query's softmax denominator and carries no value, so a query may give its keys
less than all of its weight (transformers' eager_attention_forward with s_aux, gpt-oss's
form; llama.cpp's attention sinks). The XLA reference for a step whose rows have gathered
their keys: the raw window's and the compressed entries' (all visible HCA entries, or the
CSA entries the indexer chose), each with a validity mask.

Shapes: T query rows, H heads, D head width, N keys a row gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sink_attention(q, keys, valid, sinks, scale: float):
    """[T, H, D] float32: per row and head, sum_j p_j k_j with p the softmax of
    [q . k_j * scale (valid keys only), sink_h] without the sink's share.

    Args: q [T, H, D]; keys [T, N, D] (K = V); valid [T, N] bool; sinks [H]; scale: the
      score's factor (1 / sqrt(D) in DeepSeek V4).
    """
    q, keys = q.astype(jnp.float32), keys.astype(jnp.float32)
    s = jnp.einsum("thd,tnd->thn", q, keys, precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (*s.shape[:2], 1))
    logits = jnp.concatenate([s, sink], axis=-1)
    p = jax.nn.softmax(logits, axis=-1)[..., :-1]
    return jnp.einsum("thn,tnd->thd", p, keys, precision=jax.lax.Precision.HIGHEST)
