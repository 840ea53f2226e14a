"""The embedded models' architecture for training: qwen3 (QK-norm, GQA, NEOX RoPE, SwiGLU,
tied embeddings), full-sequence causal. Same math as luce_jax.models.dense, which serves them.

Shapes: B batch, S sequence, d model width, H heads, K kv heads, D head dim, F ffn, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Size:
    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_base: float = 10000.0
    eps: float = 1e-6

    def n_params(self) -> int:
        per = self.d * (self.heads + 2 * self.kv_heads) * self.head_dim
        per += self.heads * self.head_dim * self.d + 3 * self.d * self.ffn + 2 * self.d
        per += 2 * self.head_dim
        return self.vocab * self.d + self.layers * per + self.d


SIZES = {
    "main": Size(vocab=8192, d=384, layers=8, heads=6, kv_heads=2, head_dim=64, ffn=960),
    "draft": Size(vocab=8192, d=128, layers=4, heads=4, kv_heads=2, head_dim=32, ffn=384),
}


def init(size: Size, key) -> dict:
    """Params: linear weights [in, out], norms float32 ones."""
    s = size
    keys = iter(jax.random.split(key, 2 + 7 * s.layers))

    def w(shape, scale=0.02):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    out_scale = 0.02 / (2 * s.layers) ** 0.5  # GPT-2's residual scaling
    layers = []
    for _ in range(s.layers):
        layers.append(
            {
                "attn_norm": jnp.ones(s.d),
                "ffn_norm": jnp.ones(s.d),
                "q_norm": jnp.ones(s.head_dim),
                "k_norm": jnp.ones(s.head_dim),
                "wq": w((s.d, s.heads * s.head_dim)),
                "wk": w((s.d, s.kv_heads * s.head_dim)),
                "wv": w((s.d, s.kv_heads * s.head_dim)),
                "wo": w((s.heads * s.head_dim, s.d), out_scale),
                "wg": w((s.d, s.ffn)),
                "wu": w((s.d, s.ffn)),
                "wd": w((s.ffn, s.d), out_scale),
            }
        )
    return {"embed": w((s.vocab, s.d)), "final_norm": jnp.ones(s.d), "layers": layers}


def _rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, base):
    half = x.shape[-1] // 2
    inv = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1]))
    ang = pos[:, None] * inv[None, :]  # [S, D/2]
    c, s = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def forward(params: dict, tokens, size: Size, compute=jnp.bfloat16):
    """Logits [B, S, V] float32 for tokens [B, S]."""
    return unembed(params, hidden(params, tokens, size, compute), size, compute)


def unembed(params: dict, x, size: Size, compute=jnp.bfloat16):
    """Logits [..., V] float32 of residual-stream rows x [..., d] (final norm, tied lm_head)."""
    h = _rms(x, params["final_norm"], size.eps)
    return jnp.einsum(
        "...d,vd->...v",
        h.astype(compute),
        params["embed"].astype(compute),
        preferred_element_type=jnp.float32,
    )


def hidden(params: dict, tokens, size: Size, compute=jnp.bfloat16, keep: tuple = ()):
    """The last layer's residual stream [B, S, d] float32 (before the final norm) for tokens
    [B, S]: what a draft head reads (luce_jax/models/draft_head.py). With `keep` (layer ids L:
    the stream before block L, `layers` the last one's output), those streams [n, B, S, d]
    instead: what a DFlash drafter reads (luce_jax/models/dflash.py)."""
    s = size
    B, S = tokens.shape
    x = params["embed"][tokens]
    pos = jnp.arange(S, dtype=jnp.float32)
    mask = jnp.tril(jnp.ones((S, S), bool))
    G = s.heads // s.kv_heads

    def mm(a, w):
        return jnp.dot(a.astype(compute), w.astype(compute), preferred_element_type=jnp.float32)

    kept = {}
    for i, lp in enumerate(params["layers"]):
        kept[i] = x
        h = _rms(x, lp["attn_norm"], s.eps)
        q = mm(h, lp["wq"]).reshape(B, S, s.heads, s.head_dim)
        k = mm(h, lp["wk"]).reshape(B, S, s.kv_heads, s.head_dim)
        v = mm(h, lp["wv"]).reshape(B, S, s.kv_heads, s.head_dim)
        q = _rope(_rms(q, lp["q_norm"], s.eps), pos, s.rope_base)
        k = _rope(_rms(k, lp["k_norm"], s.eps), pos, s.rope_base)
        q = q.reshape(B, S, s.kv_heads, G, s.head_dim)
        att = (
            jnp.einsum(
                "bqkgd,bskd->bkgqs",
                q.astype(compute),
                k.astype(compute),
                preferred_element_type=jnp.float32,
            )
            / s.head_dim**0.5
        )
        att = jax.nn.softmax(jnp.where(mask, att, -1e30), -1)
        o = jnp.einsum(
            "bkgqs,bskd->bqkgd",
            att.astype(compute),
            v.astype(compute),
            preferred_element_type=jnp.float32,
        ).reshape(B, S, -1)
        x = x + mm(o, lp["wo"])
        h = _rms(x, lp["ffn_norm"], s.eps)
        x = x + mm(jax.nn.silu(mm(h, lp["wg"])) * mm(h, lp["wu"]), lp["wd"])
    if keep:
        kept[s.layers] = x
        return jnp.stack([kept[i] for i in keep])
    return x


def loss_fn(params, tokens, size: Size):
    """Mean next-token cross entropy over tokens [B, S+1]."""
    logits = forward(params, tokens[:, :-1], size)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))
