"""A draft head on the target's hidden states (EAGLE-style): proposes K tokens in one small
forward, on the device, from the residual stream the target's step already computed.

One head step maps (feature f, token t) to the next feature: f' = x + W_d(silu(W_g n) * W_u n)
with x = W_fc [rms(f); rms(embed(t))] and n = rms(x), and its logits are the target's own
lm_head over the target's final norm of f'. Started from the target's last-layer residual
stream h at a sampled position and the token sampled there, the head predicts h at the next
position, and so on for K steps, each fed its own proposal. It has no attention and no KV:
the target's h already summarizes the context, which keeps the head a few matmuls per
proposal (bench/tiny_model/train_head.py trains it; the embedded model ships with one).

Shapes: S rows, d model width, F the head's ffn width, V vocabulary, K proposals.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

ARCH = "luce-draft-head"  # general.architecture of a head's GGUF
NAMES = ("norm_h", "norm_e", "fc", "ffn_norm", "wg", "wu", "wd")  # tensor names: head.<name>


@dataclass(frozen=True)
class HeadConfig:
    d: int  # the target's model width
    ffn: int  # F
    eps: float = 1e-6


def init(cfg: HeadConfig, key) -> dict:
    """Random params: matrices [in, out] float32, norms ones."""
    d, f = cfg.d, cfg.ffn
    k = jax.random.split(key, 4)

    def w(key, shape, scale=0.02):
        return jax.random.normal(key, shape, jnp.float32) * scale

    return {
        "norm_h": jnp.ones(d),
        "norm_e": jnp.ones(d),
        "fc": w(k[0], (2 * d, d)),
        "ffn_norm": jnp.ones(d),
        "wg": w(k[1], (d, f)),
        "wu": w(k[2], (d, f)),
        "wd": w(k[3], (f, d), 0.02 / 2**0.5),
    }


def _rms(x, w, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def step(hp: dict, feature, token_embedding, eps: float):
    """The next feature [..., d] float32 from a feature and the embedding of the token sampled
    after it (both [..., d])."""
    dt = hp["fc"].dtype

    def mm(a, w):
        return jnp.dot(a.astype(dt), w, preferred_element_type=jnp.float32)

    x = mm(
        jnp.concatenate(
            [_rms(feature, hp["norm_h"], eps), _rms(token_embedding, hp["norm_e"], eps)], -1
        ),
        hp["fc"],
    )
    n = _rms(x, hp["ffn_norm"], eps)
    return x + mm(jax.nn.silu(mm(n, hp["wg"])) * mm(n, hp["wu"]), hp["wd"])


def propose(hp: dict, hidden, token, depth: int, embed, logits_of, pick, eps: float):
    """K = depth proposals per row, each fed the one before.

    Args:
      hp: the head's params; hidden: [S, d] the target's residual stream (before its final
        norm) at each row's last sampled position; token: [S] the token sampled there.
      embed: tokens [S] -> [S, d] float32 (the target's embedding); logits_of: features
        [S, d] -> logits [S, V] float32 (the target's final norm and lm_head); pick: (logits,
        j) -> tokens [S]: proposal j's choice (greedy, or sampled with the noise the target
        will draw where it checks proposal j).
    Returns:
      int32 [S, K].
    """
    out, f, t = [], hidden, token
    for j in range(depth):  # K is small and static: unrolled
        f = step(hp, f, embed(t), eps)
        t = pick(logits_of(f), j)
        out.append(t)
    return jnp.stack(out, axis=1).astype(jnp.int32)


def load(path: str, d: int, vocab: int, dtype) -> tuple[HeadConfig, dict]:
    """A head GGUF's config and params (matrices in `dtype`, norms float32).

    Raises:
      ValueError: the file is no draft head, or was trained for another model width or
        vocabulary than the target's (d, vocab).
    """
    from ..loading.gguf import GGUFFile

    f = GGUFFile(path)
    md = f.metadata
    arch = md.get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"draft={path!r}: general.architecture is {arch!r}, not {ARCH!r}")
    cfg = HeadConfig(
        d=int(md[f"{ARCH}.embedding_length"]),
        ffn=int(md[f"{ARCH}.feed_forward_length"]),
        eps=float(md[f"{ARCH}.layer_norm_rms_eps"]),
    )
    head_vocab = int(md[f"{ARCH}.vocab_size"])
    if (cfg.d, head_vocab) != (d, vocab):
        raise ValueError(
            f"draft={path!r}: a head for width {cfg.d} and vocabulary {head_vocab}, "
            f"the model has {d} and {vocab}"
        )
    params = {}
    for name in NAMES:
        info = f.tensors[f"head.{name}"]
        if info.qtype.name not in ("F16", "F32"):
            raise ValueError(f"draft={path!r}: head.{name} is {info.qtype.name}, not F16 or F32")
        x = f.raw(info.name).view(np.float16 if info.qtype.name == "F16" else np.float32)
        x = x.reshape(info.shape)
        x = x.astype(np.float32)  # [out, in] for matrices, GGUF's order
        params[name] = jnp.asarray(x.T, dtype) if x.ndim == 2 else jnp.asarray(x)
    return cfg, params


def save(path: str, cfg: HeadConfig, params: dict, vocab: int, target: str) -> None:
    """Write a head as GGUF: F16 matrices (stored [out, in], as GGUF's), F32 norms."""
    from gguf import GGUFWriter

    w = GGUFWriter(path, ARCH)
    w.add_name(f"{target}-head")
    w.add_uint32(f"{ARCH}.embedding_length", cfg.d)
    w.add_uint32(f"{ARCH}.feed_forward_length", cfg.ffn)
    w.add_float32(f"{ARCH}.layer_norm_rms_eps", cfg.eps)
    w.add_uint32(f"{ARCH}.vocab_size", vocab)
    w.add_string(f"{ARCH}.target", target)
    for name in NAMES:
        x = np.asarray(params[name], np.float32)
        w.add_tensor(f"head.{name}", np.ascontiguousarray(x.T).astype(np.float16) if x.ndim == 2
                     else x)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
