"""The Gated DeltaNet mixer of the hybrid family (HF's Qwen3_5GatedDeltaNet; V heads in
llama.cpp's tiled order: value head j reads key head j % Hk), and how its slot state follows a
verify row's kept proposals on the device.

A verify row [token, proposal 1..K] gets outputs at every position, but its slot's state
(convolution history and delta-rule state) stays after the token: which proposals are kept is
known only once the step's sampling has run. The row stores each proposal's pre-convolution
inputs in the slot (`pend` [K, W]: its convolution inputs, and the delta rule's inputs the
row computed for it), and the slot's next pass first advances its state over the first `kept`
of them (`replay`), the kept count read on the device (device/proposals.py's `acc`). The
history takes the stored inputs as they are and the delta rule runs on the very inputs the row
computed, from the state it left, so the state equals that of feeding the kept tokens, bit for
bit, and no host round trip or second feed of those tokens is needed. (Recomputing the
convolution and the gates in another program is not bitwise the same: XLA fuses them
differently.)

Shapes: T packed tokens, S segments, C convolution channels (q, k, v), Kc convolution width,
Hk / Hv key / value heads, Dk / Dv their head dims, K proposals a row, W stored values a
proposal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from .dense import rms_norm
from .linear import linear, weight_dtype


def causal_conv(x, w, hist, seg_ids, offsets, cu_q_lens, n_keep):
    """Depthwise causal convolution of each segment, continuing from its history.

    Args:
      x: [T, C] inputs; w: [C, Kc] weights (the last column multiplies the current input);
      hist: [S, Kc-1, C] each segment's previous inputs, oldest first; seg_ids, offsets: [T]
      segment and index in it of each token; cu_q_lens: [S+1]; n_keep: [S] leading tokens of
      each segment the new history follows (a verify row's proposals are not kept).
    Returns:
      (silu of the convolution [T, C] float32, each segment's new history [S, Kc-1, C]).
    """
    T, Kc = x.shape[0], w.shape[1]
    x = x.astype(jnp.float32)
    out = jnp.zeros_like(x)
    for i in range(Kc):  # tap i reads the input Kc-1-i tokens back
        r = offsets - (Kc - 1 - i)  # index in the segment; < 0: from the history
        own = x[jnp.clip(jnp.arange(T) - (Kc - 1 - i), 0, T - 1)]
        old = hist[seg_ids, jnp.clip(Kc - 1 + r, 0, Kc - 2)]
        out = out + jnp.where((r >= 0)[:, None], own, old) * w[:, i]
    starts = cu_q_lens[:-1]
    m = n_keep[:, None] - (Kc - 1) + jnp.arange(Kc - 1)[None, :]  # [S, Kc-1] index in segment
    own = x[jnp.clip(starts[:, None] + m, 0, T - 1)]
    old = jnp.take_along_axis(hist, jnp.clip(Kc - 1 + m, 0, Kc - 2)[..., None], axis=1)
    new_hist = jnp.where((m >= 0)[..., None], own, old)
    return jax.nn.silu(out), new_hist


def l2norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _delta_inputs(lp, pre, hist, segs, cfg: ModelConfig):
    """The convolution over pre [T, W0] (each token's convolution inputs, then beta's and
    alpha's pre-activations, float32) from hist, and the delta rule's inputs it gives.

    segs: (seg_ids, offsets [T], cu_q_lens [S+1], n_keep [S]).
    Returns: ((q [T, Hk, Dk] normed and scaled, k [T, Hk, Dk] normed, v [T, Hv, Dv], g, beta
    [T, Hv]), new hist [S, Kc-1, C])."""
    hc = cfg.own
    Hk, Hv, Dk, Dv, C = hc.ssm_k_heads, hc.ssm_v_heads, hc.ssm_k_dim, hc.ssm_v_dim, hc.conv_dim
    T = pre.shape[0]
    mixed, new_hist = causal_conv(pre[:, :C], lp["conv"], hist, *segs)
    q = mixed[:, : Hk * Dk].reshape(T, Hk, Dk)
    k = mixed[:, Hk * Dk : 2 * Hk * Dk].reshape(T, Hk, Dk)
    v = mixed[:, 2 * Hk * Dk :].reshape(T, Hv, Dv)
    b, a = pre[:, C : C + Hv], pre[:, C + Hv :]
    g = lp["ssm_a"] * jax.nn.softplus(a + lp["dt_bias"])
    return (l2norm(q) * Dk**-0.5, l2norm(k), v, g, jax.nn.sigmoid(b)), new_hist


def stored_width(cfg: ModelConfig) -> int:
    """W: the values a verify row stores per proposal: its convolution inputs (C) and the
    delta rule's inputs (q, k, v: C; g, beta: 2 Hv)."""
    return 2 * cfg.own.conv_dim + 2 * cfg.own.ssm_v_heads


def _unstore(x, cfg: ModelConfig):
    """The convolution inputs [T, C] and delta rule inputs (q, k, v, g, beta) of stored rows
    x [T, W] (`stored_width`'s order)."""
    hc = cfg.own
    Hk, Hv, Dk, Dv, C = hc.ssm_k_heads, hc.ssm_v_heads, hc.ssm_k_dim, hc.ssm_v_dim, hc.conv_dim
    T = x.shape[0]
    cuts = [C, C + Hk * Dk, C + 2 * Hk * Dk, 2 * C, 2 * C + Hv]
    mixed, q, k, v, g, beta = jnp.split(x, cuts, axis=-1)
    return mixed, (q.reshape(T, Hk, Dk), k.reshape(T, Hk, Dk), v.reshape(T, Hv, Dv), g, beta)


def replay(lp, pend, kept, hist, ssm, li, slots, cfg: ModelConfig, delta_fn):
    """Each row's slot state advanced over the first kept [S] of pend [S, K, W] (the proposals
    its slot's last verify row stored): the history shifted by those convolution inputs, and
    the delta rule run on the inputs the row computed for them, so the state is what feeding
    them would leave: (hist [S, Kc-1, C], ssm). kept 0 leaves a row's state as it was."""
    S, K, W = pend.shape
    cu = jnp.arange(S + 1, dtype=jnp.int32) * K
    seg, offsets = jnp.repeat(jnp.arange(S), K), jnp.tile(jnp.arange(K), S)
    mixed, ins = _unstore(pend.reshape(S * K, W), cfg)
    _, hist = causal_conv(mixed, lp["conv"], hist, seg, offsets, cu, kept)
    # The delta rule walks the kept proposals only, packed row after row (a segment's tokens
    # past its kept ones would be walked for outputs nobody reads), and a row that kept none
    # is a padding row to it: its state is neither read nor written. A speculating engine's
    # every step replays, most rows keeping few or none.
    cu_kept = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(kept).astype(jnp.int32)])
    t = jnp.arange(S * K, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(cu_kept[1:], t, side="right"), S - 1)
    src = jnp.where(t < cu_kept[-1], row * K + t - cu_kept[row], 0)
    ins = tuple(x[src] for x in ins)
    rows = jnp.where(kept > 0, slots, -1)
    _, ssm = delta_fn(*ins, ssm, li, rows, jnp.zeros_like(slots), cu_kept, kept)
    return hist, ssm


def linear_attention(lp, h, conv_hist, ssm, li, batch, cfg: ModelConfig, qmm, live, delta_fn,
                     pend=None):  # fmt: skip
    """One Gated DeltaNet mixer over the packed step.

    ssm, li: every linear layer's per-slot states [Lr, S_max, Hv, Dk, Dv] and this layer's
    index in them; delta_fn: the gated delta rule in place (pallas_kernels/gated_delta.py: the
    kernel or its reference), which reads and writes the rows of the step's slots only;
    pend: None, or (stored [S, K, W], kept [S]): each row's slot's stored proposals and how many
    of them to `replay` into the state first (with proposals kept on the device).
    Returns: (out [T, d], new conv history [S, Kc-1, C], the updated ssm, and with pend the
    rows' own proposals' inputs [S, K, W] to store, else None)."""
    T = h.shape[0]
    hc = cfg.own
    Hv, Dv, C = hc.ssm_v_heads, hc.ssm_v_dim, hc.conv_dim
    proj = linear(h, lp["w_in"], qmm, live).astype(jnp.float32)
    z = proj[:, C : C + Hv * Dv]
    pre = jnp.concatenate([proj[:, :C], proj[:, C + Hv * Dv :]], axis=-1)  # [T, C + 2 Hv]
    cu = batch["cu_q_lens"]
    seg = batch["seg_ids"]
    if pend is not None:
        conv_hist, ssm = replay(lp, *pend, conv_hist, ssm, li, batch["slots"], cfg, delta_fn)
    n_keep = cu[1:] - cu[:-1] - batch["n_draft"]  # the state stays before a row's proposals
    ins, new_hist = _delta_inputs(lp, pre, conv_hist, (seg, jnp.arange(T) - cu[seg], cu, n_keep),
                                  cfg)  # fmt: skip
    o, ssm = delta_fn(*ins, ssm, li, batch["slots"], batch["fresh"], cu, n_keep)
    o = rms_norm(o, lp["ssm_norm"], cfg.rms_eps) * jax.nn.silu(z.reshape(T, Hv, Dv))
    out = linear(o.reshape(T, Hv * Dv).astype(weight_dtype(lp["w_out"])), lp["w_out"], qmm, live)
    stored = None
    if pend is not None:  # the rows' proposals, from the first after the kept tokens
        K = pend[0].shape[1]
        at = jnp.clip((cu[:-1] + n_keep)[:, None] + jnp.arange(K)[None], 0, T - 1)
        # gathered first: a prompt step's [T, W] would be written whole for K rows a slot
        stored = jnp.concatenate([x.reshape(T, -1)[at] for x in (pre[:, :C], *ins)], axis=-1)
    return out, new_hist, ssm, stored
