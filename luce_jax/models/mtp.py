"""A model's own MTP (multi-token prediction) block, as Qwen3.5 ships it and llama.cpp's
converter writes it: the block after the model's last, `blk.{n_layers}.nextn.*` beside a
full-attention decoder block's tensors, counted by `{arch}.nextn_predict_layers`.

The block maps (the target's final-normed hidden state h at position p - 1, the token x at
position p) to a hidden state that predicts the token at p + 1:

    u = eh_proj([enorm(embed(x)); hnorm(h)]),  o = head_norm(decoder_block(u at position p))

and its logits are the target's lm_head over o (llama.cpp's graph_mtp in src/models/qwen35.cpp,
whose pairing of x at p with h at p - 1 this follows). Drafting K tokens chains it: o stands for
h at the next position, fed with the token just proposed. The decoder block attends over its
own paged KV of every earlier position (device/mtp_proposer.py keeps it on the target's block
ids).

Shapes: T tokens, d model width, V vocabulary.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..config import ModelConfig
from .dense import attention_params, rms_norm, rope_tables
from .family import Kernels
from .linear import embed, linear
from .logits import logits_of

NEXTN = ("eh_proj", "enorm", "hnorm", "shared_head_norm")  # blk.N.nextn.<name>.weight


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Its tensors beside the decoder block's (loading/params.expected_shapes' form)."""
    d = cfg.d_model
    shapes = {f"nextn.{n}.weight": (d,) for n in NEXTN}
    return {**shapes, "nextn.eh_proj.weight": (d, 2 * d)}


def params(cfg: ModelConfig, t, i: int) -> dict:
    """Block i's params (ModelFamily.layer_params' t): eh_proj [2d, d], enorm, hnorm,
    head_norm [d] (the shared head norm, else the model's final norm: llama.cpp's fallback),
    and the decoder block's (dense.attention_params) under "layer"."""
    p = f"blk.{i}."
    head_norm = t.tensor(p + "nextn.shared_head_norm.weight", optional=True, out_dtype=t.f32)
    if head_norm is None:
        head_norm = t.tensor("output_norm.weight", out_dtype=t.f32)
    return {
        "eh_proj": t.linear(p + "nextn.eh_proj.weight"),
        "enorm": t.tensor(p + "nextn.enorm.weight", out_dtype=t.f32),
        "hnorm": t.tensor(p + "nextn.hnorm.weight", out_dtype=t.f32),
        "head_norm": head_norm,
        "layer": attention_params(cfg, p, t, "post_attention_norm"),
    }


def block(mp: dict, embed_table, hidden, tokens, kv, batch: dict, cfg: ModelConfig,
          kernels: Kernels):  # fmt: skip
    """The block over a packed batch (the target step's form: positions, write_idx,
    block_tables, kv_lens, cu_q_lens, seg_ids), writing each token's K and V at its position.

    Args: mp: `params`; embed_table: the target's embedding; hidden: float32 [T, d], each
      token's h (the target's final-normed hidden state of the position before it, or the
      block's own output o while drafting); tokens: int32 [T]; kv: the block's (k, v) caches.
    Returns: (x float32 [T, d], the block's output before its head norm; kv).
    """
    from .hybrid import layer  # the block is one of its gated attention layers

    live = batch["cu_q_lens"][-1]
    e = rms_norm(embed(embed_table, tokens), mp["enorm"], cfg.rms_eps)
    h = rms_norm(hidden, mp["hnorm"], cfg.rms_eps)
    u = linear(jnp.concatenate([e, h], -1), mp["eh_proj"], kernels.quant_matmul, live)
    cos, sin = rope_tables(batch["positions"], cfg)
    x, kv, _ = layer(mp["layer"], u.astype(jnp.float32), kv, cos, sin, batch, live, cfg=cfg,
                  kernels=kernels, recurrent=False)  # fmt: skip
    return x.astype(jnp.float32), kv


def target_hidden(final_norm, x, cfg: ModelConfig):
    """h float32 [T, d]: the target's last-layer outputs x [T, d] under its final norm, what
    the block pairs with the next tokens (llama.cpp's h_nextn)."""
    return rms_norm(x, final_norm, cfg.rms_eps)


def output(mp: dict, x, cfg: ModelConfig):
    """o [.., d] float32: the block's output x under its head norm (the next draft step's h)."""
    return rms_norm(x, mp["head_norm"], cfg.rms_eps)


def logits(mp: dict, lm: dict, x, cfg: ModelConfig, quant_matmul):
    """Logits [R, V] float32 of block outputs x [R, d]: the head norm, then the target's
    lm_head (or tied embedding); lm: the target's params that hold them."""
    return logits_of({**lm, "final_norm": mp["head_norm"]}, x, cfg, quant_matmul)
