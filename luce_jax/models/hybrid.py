"""Hybrid decoder (qwen35): Gated DeltaNet layers with recurrent state in the sequence slot,
and gated full-attention layers over the paged KV, as one pure function over a packed step.

Each segment (a prompt chunk, a decode row) starts its linear layers from its slot's state
(zero on the slot's first row: `fresh`) and leaves the state after its last token there, so a
prompt split over several steps ends in the state of one unsplit pass. A verify row leaves the
state after its first token only: its proposals get logits, but which of them are kept is known
only after sampling, so the slot's next pass advances the state over the kept ones first, from
inputs the row stored (models/gated_deltanet.py), on the device.

Shapes: T packed tokens, S segments, S_max slots, C convolution channels (q, k, v), Kc
convolution width, Hk / Hv key / value heads of the linear layers, Dk / Dv their head dims,
H / K / D of the attention layers, V vocabulary.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels import kv_cache
from pallas_kernels.gated_delta import gated_delta_in_place_reference

from ..config import ModelConfig
from . import fused_layout, moe, mtp
from .attention import paged_attention_xla
from .dense import apply_rope, attention_params, rms_norm, rope_tables, swiglu, write_and_attend
from .family import CacheGroup, Kernels, register, stacked
from .gated_deltanet import linear_attention, stored_width
from .linear import Normed, QuantMatmul, embed, linear
from .logits import head


@dataclass(frozen=True)
class HybridConfig:
    """The hybrid family's fields of a ModelConfig (its `own`)."""

    # per layer, True where it is Gated DeltaNet (linear attention, recurrent state in the
    # slot) rather than full attention
    recurrent: tuple[bool, ...]
    ssm_conv: int  # Kc: causal convolution width of the linear layers
    ssm_k_heads: int  # Hk: key heads of the linear layers
    ssm_v_heads: int  # Hv: value heads (Hv / Hk per key head)
    ssm_k_dim: int  # Dk
    ssm_v_dim: int  # Dv

    @property
    def conv_dim(self) -> int:
        """C: channels of a linear layer's convolution (q, k and v)."""
        return 2 * self.ssm_k_heads * self.ssm_k_dim + self.ssm_v_heads * self.ssm_v_dim


def init_state(cfg: ModelConfig, max_slots: int, proposals: int = 0) -> dict:
    """Zeroed per-slot state of the linear layers (float32): conv [Lr, S_max, Kc-1, C] (the
    last inputs of the convolution, oldest first) and ssm [Lr, S_max, Hv, Dk, Dv]; with
    `proposals` K kept on the device, the inputs each slot's last verify row stored for its
    proposals, pend (Lr arrays [S_max, K, W], a layer's own: with one [Lr, ...] array a
    64-layer engine's plain decode step had cost 1.9x off's on the GPU, growing faster than
    the layer count; docs/benchmarks.md, "Hybrid"), and their count, pend_n [S_max]
    (models/gated_deltanet.py)."""
    hc = cfg.own
    n = sum(hc.recurrent)
    out = {
        "conv": jnp.zeros((n, max_slots, hc.ssm_conv - 1, hc.conv_dim), jnp.float32),
        "ssm": jnp.zeros((n, max_slots, hc.ssm_v_heads, hc.ssm_k_dim, hc.ssm_v_dim), jnp.float32),
    }
    if proposals:
        shape = (max_slots, proposals, stored_width(cfg))
        out["pend"] = tuple(jnp.zeros(shape, jnp.float32) for _ in range(n))
        out["pend_n"] = jnp.zeros((max_slots,), jnp.int32)
    return out


def attention_layers(cfg: ModelConfig) -> int:
    """The gated attention layers: those with a KV cache."""
    return cfg.n_layers - sum(cfg.own.recurrent)


def init_kv(cfg: ModelConfig, num_blocks: int, block_size: int, k_type, v_type=None) -> list:
    """Paged (k, v) caches [NB, P, K, D] of the full-attention layers only."""
    shape = (num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
    v_type = k_type if v_type is None else v_type
    return [
        (kv_cache.init(shape, k_type), kv_cache.init(shape, v_type))
        for _ in range(attention_layers(cfg))
    ]


def gated_attention(lp, h, kc, vc, cos, sin, batch, cfg: ModelConfig, attn, qmm, live,
                    shards: int = 1):  # fmt: skip
    """Full attention whose query projection also yields a per-head gate: o * sigmoid(gate).
    shards: Kernels' (models/fused_layout.py)."""
    T = h.shape[0]
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv = linear(h, lp["wqkv"], qmm, live)
    qg, k, v = fused_layout.unfuse(qkv, "wqkv", cfg, shards, lp["wqkv"])
    qg = qg.reshape(T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
    k, v = k.reshape(T, K, D), v.reshape(T, K, D)
    q = apply_rope(rms_norm(q, lp["q_norm"], cfg.rms_eps), cos, sin, cfg)
    k = apply_rope(rms_norm(k, lp["k_norm"], cfg.rms_eps), cos, sin, cfg)
    o, kc, vc = write_and_attend(attn, q, k, v, kc, vc, batch, D**-0.5, lp["wqkv"])
    o = o.reshape(T, H * D) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    return linear(o, lp["wo"], qmm, live), kc, vc


# Jitted as dense.layer is, and for the same reason: a step traces and lowers each distinct
# layer once (two kinds here, times the weight-type mixes), and XLA inlines the calls.
@functools.partial(jax.jit, static_argnames=("cfg", "kernels", "recurrent"))
def layer(lp: dict, x, mix, cos, sin, batch: dict, live, *, cfg: ModelConfig, kernels: Kernels,
          recurrent: bool):  # fmt: skip
    """One hybrid layer: its sequence mixer, then the FFN, both residual.

    Args:
      mix: a Gated DeltaNet layer's (conv history [S, Kc-1, C] of its rows, every linear
        layer's states [Lr, S_max, Hv, Dk, Dv], its index in them, and None or its rows'
        stored proposals and kept counts: gated_deltanet.linear_attention's pend), or a gated
        attention layer's (k, v) caches; kernels: (attention_fn, quant_matmul, delta_fn,
        grouped_matmul), static.
    Returns:
      (x, the mixer's new (history, states, proposals to store) or (k, v) caches, the FFN's
       routing pairs [T*k] (moe.ffn's) or None for a dense FFN).
    """
    attn, qmm, delta = kernels.attention, kernels.quant_matmul, kernels.gated_delta
    grouped_matmul = kernels.grouped_matmul
    h = Normed(x, lp["attn_norm"], cfg.rms_eps)  # its projection's kernel may norm it
    if recurrent and kernels.delta_heads is not None and fused_layout.delta_split(
            lp, cfg, kernels.shards):  # fmt: skip

        def mixer(lp, h, hist, ssm, li, pend, batch, cfg, live, qmm):  # qmm: one device's
            return linear_attention(lp, h, hist, ssm, li, batch, cfg, qmm, live, delta, pend)

        y, *mix = kernels.delta_heads(mixer, lp, h, *mix, batch, live, cfg)
    elif recurrent:
        hist, ssm, li, pend = mix
        y, *mix = linear_attention(lp, h, hist, ssm, li, batch, cfg, qmm, live, delta, pend)
    else:
        y, kc, vc = gated_attention(lp, h, *mix, cos, sin, batch, cfg, attn, qmm, live,
                                    kernels.shards)  # fmt: skip
        mix = (kc, vc)
    x = x + y.astype(x.dtype)
    h = Normed(x, lp["ffn_norm"], cfg.rms_eps)
    if "router" in lp:  # qwen35moe: routed experts and the gated shared expert
        y, routed = moe.ffn(lp, h, cfg, grouped_matmul, live, qmm, kernels.moe_router,
                            experts_on=kernels.experts, shards=kernels.shards)  # fmt: skip
        return x + y, mix, routed
    return x + swiglu(lp, h, qmm, live, cfg=cfg, shards=kernels.shards), mix, None


def forward(
    params: dict,
    kv: list,
    state: dict,
    batch: dict,
    cfg: ModelConfig,
    attention_fn=None,
    quant_matmul: QuantMatmul | None = None,
    delta_fn=None,
    grouped_matmul=None,
    moe_router=None,
    experts=None,
    shards: int = 1,
    delta_heads=None,
    hidden: tuple[int, ...] = (),
):
    """One hybrid model step over packed tokens.

    Args:
      params: params.load_params' pytree of a qwen35 file; kv: init_kv's caches;
      state: init_state's arrays; batch: dense.forward's arrays plus slots [S] (-1 for
        padding rows) and fresh [S] (1 on a slot's first row: its state starts from zero).
      attention_fn, quant_matmul, grouped_matmul, moe_router, experts, shards: as
        dense.forward; delta_heads: Kernels.delta_heads;
        delta_fn: the gated delta rule in place (default: gated_delta_in_place_reference);
      hidden: layer ids whose residual stream to return too (ModelFamily.forward's).
    Returns:
      (logits [R, V] float32, new kv, new state, stats): stats holds expert_counts [L_moe, E]
      int32 for a model with routed experts (dense.forward's), and with `hidden` "hidden":
      those streams [n, T, d].
    """
    attn = attention_fn or paged_attention_xla
    delta = delta_fn or gated_delta_in_place_reference
    live = batch["cu_q_lens"][-1]
    slots = batch["slots"]
    oob = state["ssm"].shape[1]  # padding rows read slot 0 (masked) and write nowhere
    read = jnp.maximum(slots, 0)
    write = jnp.where(slots < 0, oob, slots)
    keep = (batch["fresh"] == 0) & (slots >= 0)  # else the row starts from zero
    x = embed(params["embed"], batch["tokens"])
    cos, sin = rope_tables(batch["positions"], cfg)
    # Updated in place, layer by layer (the runner donates the state): one [Lr, S_max, ...]
    # copy a step would cost as much as reading the state twice. The ssm rows are read and
    # written by the delta rule itself (a decode step gathering a padded bucket's rows and
    # scattering them back had moved 20x the bytes of its live rows' states).
    conv, ssm = state["conv"], state["ssm"]
    # with proposals kept on the device (gated_deltanet.py): each linear layer's array
    stored = list(state["pend"]) if "pend" in state else None
    if stored is not None:  # proposals of the slot's last verify row that it kept
        kept = jnp.where(keep, jnp.minimum(batch["kept"], state["pend_n"][read]), 0)
    new_kv, pairs = [], []
    li = ai = 0
    kernels = Kernels(attn, grouped_matmul, quant_matmul, gated_delta=delta, moe_router=moe_router,
                      experts=experts, shards=shards, delta_heads=delta_heads)  # fmt: skip
    outputs = {}
    for i, (lp, recurrent) in enumerate(zip(params["layers"], cfg.own.recurrent, strict=True)):
        if i in hidden:
            outputs[i] = x
        if recurrent:
            hist = jnp.where(keep[:, None, None], conv[li, read], 0.0)
            pend = None if stored is None else (stored[li][read], kept)
            x, (hist, ssm, own), routed = layer(
                lp, x, (hist, ssm, jnp.int32(li), pend), cos, sin, batch, live, cfg=cfg,
                kernels=kernels, recurrent=True)  # fmt: skip
            conv = conv.at[li, write].set(hist, mode="drop")
            if stored is not None:
                stored[li] = stored[li].at[write].set(own, mode="drop")
            li += 1
        else:
            x, kv_l, routed = layer(lp, x, kv[ai], cos, sin, batch, live, cfg=cfg,
                                    kernels=kernels, recurrent=False)  # fmt: skip
            new_kv.append(kv_l)
            ai += 1
        if routed is not None:
            pairs.append(routed)
    logits = head(params, x, batch, cfg, quant_matmul)
    out = {"conv": conv, "ssm": ssm}
    if stored is not None:
        pend_n = state["pend_n"].at[write].set(batch["n_draft"], mode="drop")
        out.update(pend=tuple(stored), pend_n=pend_n)
    stats = {"expert_counts": moe.expert_counts(jnp.stack(pairs), cfg.n_experts)} if pairs else {}
    if hidden:
        stats["hidden"] = stacked({**outputs, cfg.n_layers: x}, hidden)
    return logits, new_kv, out, stats


# A linear layer's input projections, fused in this order into w_in.
_LINEAR_IN = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")


class HybridFamily:
    """qwen35 and qwen35moe (models/family.py): a full-attention cache group for the gated
    attention layers, the linear layers' state in the slot. That state holds no earlier
    position, so it follows a verify row's kept proposals by replaying them on the device
    ("replay"), the prefix cache (which shares KV blocks only) is off, and a draft model,
    prompt lookup, a DFlash drafter or the file's MTP block (models/mtp.py) proposes on the
    device."""

    name = "hybrid"
    archs = ("qwen35", "qwen35moe")
    rollback = "replay"
    prefix_cacheable = False
    device_proposers = frozenset({"draft", "ngram", "mtp", "dflash"})
    rope_scalings = ("none", "linear")

    def read_config(self, arch: str, get, md: dict, n_layers: int) -> dict:
        """Gated DeltaNet fields, as llama.cpp's qwen35 loader reads them: which layers are
        recurrent (attention.recurrent_layers, else every layer but each
        full_attention_interval-th), and the ssm.* sizes."""
        flags = md.get(f"{arch}.attention.recurrent_layers")
        if flags is None:
            every = int(get("full_attention_interval", 4))
            flags = [(i + 1) % every != 0 for i in range(n_layers)]
        v_heads = int(get("ssm.time_step_rank"))
        own = HybridConfig(
            recurrent=tuple(bool(f) for f in flags[:n_layers]),
            ssm_conv=int(get("ssm.conv_kernel")),
            ssm_k_heads=int(get("ssm.group_count")),
            ssm_v_heads=v_heads,
            ssm_k_dim=int(get("ssm.state_size")),
            ssm_v_dim=int(get("ssm.inner_size")) // v_heads,
        )
        return dict(
            qk_norm=True,
            attn_gate=True,
            own=own,
            **(moe.read_config(get) if arch == "qwen35moe" else {}),
        )

    def model_params(self, cfg: ModelConfig, t) -> dict:
        """The first MTP block, where its params are asked for (ModelConfig.mtp_layers; as
        llama.cpp, which runs one)."""
        return {"mtp": mtp.params(cfg, t, cfg.n_layers)} if cfg.mtp_layers else {}

    def tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple]:
        """Its linear layers' tensors (loading/params.expected_shapes' form)."""
        hc, d = cfg.own, cfg.d_model
        C, Hv, Dv = hc.conv_dim, hc.ssm_v_heads, hc.ssm_v_dim
        return {
            "attn_qkv.weight": (C, d),
            "attn_gate.weight": (Hv * Dv, d),
            "ssm_beta.weight": (Hv, d),
            "ssm_alpha.weight": (Hv, d),
            "ssm_conv1d.weight": (C, hc.ssm_conv),
            "ssm_dt.bias": (Hv,),
            "ssm_a": (Hv,),
            "ssm_norm.weight": (Dv,),
            "ssm_out.weight": (d, Hv * Dv),
            **mtp.tensor_shapes(cfg),
        }

    def layer_params(self, cfg: ModelConfig, i: int, t) -> dict:
        """A Gated DeltaNet layer: w_in [d, C + Hv*Dv + 2Hv] (q, k, v | z | beta | alpha), conv
        [C, Kc], dt_bias, ssm_a [Hv] (-exp(A_log)), ssm_norm [Dv], w_out [Hv*Dv, d]; or a
        gated attention layer (dense.attention_params, its query yielding a gate)."""
        p = f"blk.{i}."
        if not cfg.own.recurrent[i]:
            return attention_params(cfg, p, t, "post_attention_norm")
        f32 = t.f32
        return {
            "attn_norm": t.tensor(p + "attn_norm.weight", out_dtype=f32),
            "w_in": t.linear(*(p + x for x in _LINEAR_IN)),
            "conv": t.tensor(p + "ssm_conv1d.weight", out_dtype=f32),
            "dt_bias": t.tensor(p + "ssm_dt.bias", out_dtype=f32),
            "ssm_a": t.tensor(p + "ssm_a", out_dtype=f32),
            "ssm_norm": t.tensor(p + "ssm_norm.weight", out_dtype=f32),
            "w_out": t.linear(p + "ssm_out.weight"),
            "ffn_norm": t.tensor(p + "post_attention_norm.weight", out_dtype=f32),
            **t.ffn(p),
        }

    def cache_groups(self, cfg: ModelConfig, kv_bytes_per_entry: float) -> list[CacheGroup]:
        n = attention_layers(cfg)
        return [CacheGroup("full", n, n * kv_bytes_per_entry)]

    def init_caches(self, cfg: ModelConfig, spaces, k_type, v_type):
        (full,) = spaces  # one full-attention group
        return init_kv(cfg, full.num_blocks, full.block_size, k_type, v_type)

    def init_slot_state(self, cfg: ModelConfig, max_slots: int, proposals: int = 0) -> dict:
        return init_state(cfg, max_slots, proposals)

    def forward(self, params, caches, slot_state, batch, cfg, kernels: Kernels, hidden=()):
        k = kernels
        return forward(
            params, caches, slot_state, batch, cfg, k.attention, k.quant_matmul, k.gated_delta,
            k.grouped_matmul, k.moe_router, k.experts, k.shards, k.delta_heads, hidden,
        )  # fmt: skip


FAMILY = register(HybridFamily())
