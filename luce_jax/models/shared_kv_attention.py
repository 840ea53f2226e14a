"""DeepSeek V4's attention around its core: the query through its LoRA (q_a, a weighted
RMSNorm, q_b, an unweighted RMSNorm per head), the one K = V head (kv, its norm), both roped on
their trailing dims; after the core (pallas_kernels/sink_attention.py) the output's rope slice
rotated back by the query position, then the grouped output LoRA (wo_a per group of heads,
wo_b).
transformers' DeepseekV4Attention, llama.cpp's build_attention_impl.

Weights as [in, out] arrays: wq_a [d, Rq], q_norm [Rq], wq_b [Rq, H D], wkv [d, D], kv_norm
[D], wo_a [g, H D / g, Ro], wo_b [g Ro, d].

Shapes: T tokens, d model width, H heads, D head width, g output groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.int8_rows import rms_norm

from .tail_rope import rope_tail

HIGHEST = jax.lax.Precision.HIGHEST


def dot(x, w):
    """x @ w for dense [in, out] weights (a family passes models.linear's projection instead,
    which takes quantized ones too)."""
    return jnp.dot(x, w, precision=HIGHEST)


def queries_and_kv(x, lp: dict, pos, freqs, *, heads: int, eps: float, proj=dot):
    """(q [T, H, D] roped, q_lora [T, Rq] (the indexer's input), kv [T, D] roped) of the
    normed layer input x [T, d]; proj(x, w): the projection."""
    qr = rms_norm(proj(x, lp["wq_a"]), lp["q_norm"], eps)
    q = proj(qr, lp["wq_b"]).reshape(x.shape[0], heads, -1)
    q = rope_tail(rms_norm(q, 1.0, eps), pos, freqs)  # per head, unweighted
    kv = rms_norm(proj(x, lp["wkv"]), lp["kv_norm"], eps)
    return q, qr, rope_tail(kv, pos, freqs)


def output(o, lp: dict, pos, freqs, proj=dot):
    """The layer's output [T, d] from the core's o [T, H, D]: its rope slice rotated back by
    the query position, then wo_a per group of H / g heads and wo_b over the groups."""
    o = rope_tail(o, pos, freqs, inverse=True)
    g = lp["wo_a"].shape[0]
    z = jnp.einsum("tgi,gio->tgo", o.reshape(o.shape[0], g, -1), lp["wo_a"].astype(jnp.float32),
                   precision=HIGHEST)  # fmt: skip
    return proj(z.reshape(o.shape[0], -1), lp["wo_b"])
