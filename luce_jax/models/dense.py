"""Decoder (llama / qwen2 / qwen3; qwen3moe's FFN in moe.py) as a pure function over a packed,
paged token axis.

Shapes: T packed tokens, S segments (sequence rows), R logits rows, H query heads, K kv
heads, D head dim, P block size, NB KV blocks, MB blocks per sequence, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import kv_cache
from pallas_kernels.int8_rows import rms_norm
from pallas_kernels.rope_write import fits as fits_rope_write

from ..config import ModelConfig
from . import fused_layout, moe
from .attention import paged_attention_xla
from .family import CacheGroup, Kernels, register, stacked
from .linear import Gated, Normed, QuantMatmul, embed, linear, summed, weight_dtype
from .logits import head

KV = list[tuple]  # per layer (k, v): [NB, P, K, D] arrays or kv_cache.Quantized


def rope_tables(positions, cfg: ModelConfig, freq_factors=None):
    """cos/sin [T, rope_dim/2] for absolute positions."""
    half = cfg.rope_dim // 2
    inv_freq = 1.0 / (cfg.rope_base ** (jnp.arange(half, dtype=jnp.float32) * 2 / cfg.rope_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    pos = positions.astype(jnp.float32)
    if cfg.rope_scaling == "linear":
        pos = pos / cfg.rope_scaling_factor
    ang = pos[:, None] * inv_freq[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin, cfg: ModelConfig):
    """Rotate the first rope_dim dims of x [T, N, D]; NEOX rotates halves, llama adjacent pairs."""
    rd = cfg.rope_dim
    xr, rest = x[..., :rd].astype(jnp.float32), x[..., rd:]
    c, s = cos[:, None, :], sin[:, None, :]
    if cfg.rope_neox:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(xr.shape)
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)


def forward(
    params: dict,
    kv: KV,
    batch: dict,
    cfg: ModelConfig,
    attention_fn=None,
    grouped_matmul=None,
    quant_matmul: QuantMatmul | None = None,
    rope_write=None,
    hidden: tuple[int, ...] = (),
    moe_router=None,
    experts=None,
    shards: int = 1,
):
    """One model step over packed tokens; writes this step's K/V and returns requested logits.

    Args:
      params: pytree from loading.params.load_params.
      kv: per-layer (k, v) caches [NB, P, K, D] (or kv_cache.Quantized); block 0 is the sink
        padding rows write to.
      batch: dict of fixed-width int32 arrays:
        tokens [T], positions [T], seg_ids [T] (row into block_tables), write_idx [T]
        (flat KV slot block*P + offset), block_tables [S, MB], kv_lens [S], cu_q_lens [S+1],
        logit_rows [R] (indices into T whose logits are wanted).
      cfg: static model config.
      attention_fn: paged attention with paged_attention_xla's signature.
      grouped_matmul: MoE layers' grouped expert matmul (moe.grouped_matmul_xla's signature).
      quant_matmul: how projections with quantized weights run (models/linear.py).
      rope_write: q and k's norms, rope and the KV write in one kernel
        (pallas_kernels/rope_write.py's signature), for the layers it fits; None: XLA's ops.
      hidden: layer ids L whose residual stream (before block L) to return (what a draft
        head, an MTP block or a DFlash drafter reads; ModelFamily.forward).
      moe_router: MoE layers' fused router (pallas_kernels/moe_router.py), or None: XLA's.
      experts: Kernels.experts (the routed experts where their weights are), or None.
      shards: Kernels.shards (the fused projections' layout: models/fused_layout.py).
    Returns:
      (logits [R, V] float32, new kv, stats): stats holds expert_counts [L_moe, E] int32
      (real tokens routed to each expert in each MoE layer) for MoE models, and with `hidden`
      "hidden": float32 [len(hidden), T, d].
    """
    attn = attention_fn or paged_attention_xla
    with jax.named_scope("embed"):
        x = embed(params["embed"], batch["tokens"])  # residual stream in f32
        cos, sin = rope_tables(batch["positions"], cfg, params.get("rope_freqs"))
    new_kv, pairs = [], []
    live = batch["cu_q_lens"][-1]  # rows past the last segment are padding
    kernels = Kernels(attn, grouped_matmul, quant_matmul, rope_write, moe_router=moe_router,
                      experts=experts, shards=shards)  # fmt: skip
    kept = {}
    for i, (lp, (kc, vc)) in enumerate(zip(params["layers"], kv, strict=True)):
        if i in hidden:
            kept[i] = x
        x, kc, vc, routed = layer(lp, x, kc, vc, cos, sin, batch, live, cfg=cfg, kernels=kernels)
        if routed is not None:
            pairs.append(routed)
        new_kv.append((kc, vc))
    logits = head(params, x, batch, cfg, quant_matmul)
    stats = {"expert_counts": moe.expert_counts(jnp.stack(pairs), cfg.n_experts)} if pairs else {}
    if hidden:
        stats["hidden"] = stacked({**kept, cfg.n_layers: x}, hidden)
    return logits, new_kv, stats


# Jitted so that a step traces and lowers each distinct layer signature once (layers of one
# weight-type mix share it) and calls it per layer; XLA inlines the calls before optimizing,
# so the compiled step is the same. Lowered inline, the 36 layers of a Qwen3-8B-shaped step
# took 1.7 s to trace and lower per bucket (Triton modules included) and a warm start's
# compile-cache lookups waited on it: 22 s of the H200's 30 s warm start for 6 buckets.
@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def layer(lp: dict, x, kc, vc, cos, sin, batch: dict, live, *, cfg: ModelConfig,
          kernels: Kernels):  # fmt: skip
    """One decoder layer: attention (writing this step's K/V) then the FFN, both residual.

    Args:
      lp: the layer's params; x: residual stream [T, d] float32; kc, vc: its caches;
      cos, sin: rope tables; batch, live: forward's; kernels: forward's attention_fn,
      grouped_matmul, quant_matmul and rope_write (hashable: they are static).
    Returns:
      (x, kc, vc, the experts of its (token, expert) pairs [T*k] int32 for an MoE layer (moe.ffn)
       or None).
    """
    attn, grouped_matmul = kernels.attention, kernels.grouped_matmul
    quant_matmul, rope_write = kernels.quant_matmul, kernels.rope_write
    T = x.shape[0]
    H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    # Named scopes label the HLO ops, so a profile attributes kernel time to these parts
    # (bench/engine/profile_step.py); they change no computation.
    with jax.named_scope("qkv"):
        qkv = linear(Normed(x, lp["attn_norm"], cfg.rms_eps), lp["wqkv"], quant_matmul, live)
        if "bqkv" in lp:
            qkv = qkv + lp["bqkv"]
    # The KV write stays apart from the attention kernel: a fused write would have to land
    # before other programs of the same sequence read it, an ordering Triton programs of one
    # grid do not have. It goes with q and k's norms and rope instead (rope_write).
    if rope_write is not None and fits_rope_write(D, cfg.rope_dim or D, kc, vc, cfg.rope_neox):
        with jax.named_scope("kv_write"):
            norms = lp.get("q_norm"), lp.get("k_norm")
            q_dtype = kv_cache.compute_dtype(kc, weight_dtype(lp["wqkv"]))
            # on a mesh, told whether qkv's columns are each device's heads already
            n = kernels.shards
            laid = (
                {}
                if n == 1
                else {"shard_major": fused_layout.stored(lp["wqkv"], "wqkv", cfg, n) > 1}
            )
            q, kc, vc = rope_write(qkv, *norms, cos, sin, batch["write_idx"], kc, vc, heads=H,
                                   kv_heads=K, eps=cfg.rms_eps, neox=cfg.rope_neox,
                                   out_dtype=q_dtype, **laid)  # fmt: skip
        o = attend(attn, q, kc, vc, batch, 1.0 / D**0.5, lp["wqkv"])
    else:
        with jax.named_scope("qkv"):
            q, k, v = fused_layout.unfuse(qkv, "wqkv", cfg, kernels.shards, lp["wqkv"])
            q, k, v = q.reshape(T, H, D), k.reshape(T, K, D), v.reshape(T, K, D)
            if "q_norm" in lp:
                q = rms_norm(q, lp["q_norm"], cfg.rms_eps)
                k = rms_norm(k, lp["k_norm"], cfg.rms_eps)
            q = apply_rope(q, cos, sin, cfg)
            k = apply_rope(k, cos, sin, cfg)
        o, kc, vc = write_and_attend(attn, q, k, v, kc, vc, batch, 1.0 / D**0.5, lp["wqkv"])
    # In a decode step on the int8 kernel the attention output's and the FFN's products come
    # back as split partials of live rows only (the kernel writes no others: at C1 one row of
    # a bucket of 8 is live), which XLA sums with the residual add.
    with jax.named_scope("attn_out"):
        x = x + summed(linear(o.reshape(T, H * D), lp["wo"], quant_matmul, live, splits=True))
    routed = None
    with jax.named_scope("mlp"):
        h = Normed(x, lp["ffn_norm"], cfg.rms_eps)
        if "router" in lp:  # a mixture-of-experts layer (qwen3moe)
            y, routed = moe.ffn(lp, h, cfg, grouped_matmul, live, quant_matmul, kernels.moe_router,
                                experts_on=kernels.experts, shards=kernels.shards)  # fmt: skip
            x = x + y
        else:
            x = x + summed(swiglu(lp, h, quant_matmul, live, splits=True, cfg=cfg,
                                  shards=kernels.shards))  # fmt: skip
    return x, kc, vc, routed


def write_and_attend(attn, q, k, v, kc, vc, batch: dict, scale: float, w_qkv):
    """Write this step's k, v [T, K, D] into the paged caches, then attend with q [T, H, D]
    (in the caches' compute type for the projection weights w_qkv). Returns (o [T, H, D], kc,
    vc)."""
    with jax.named_scope("kv_write"):
        kc = kv_cache.write(kc, batch["write_idx"], k)
        vc = kv_cache.write(vc, batch["write_idx"], v)
    return attend(attn, q, kc, vc, batch, scale, w_qkv), kc, vc


def attend(attn, q, kc, vc, batch: dict, scale: float, w_qkv):
    """Attention of q [T, H, D] over the caches that hold this step's K/V: o [T, H, D]."""
    with jax.named_scope("attention"):
        return attn(
            q.astype(kv_cache.compute_dtype(kc, weight_dtype(w_qkv))),
            kc,
            vc,
            batch["seg_ids"],
            batch["positions"],
            batch["block_tables"],
            batch["kv_lens"],
            scale=scale,
            cu_q_lens=batch["cu_q_lens"],
        )


def swiglu(lp: dict, h, quant_matmul, live, splits=False, *, cfg: ModelConfig | None = None,
           shards: int = 1):  # fmt: skip
    """The dense FFN: w_down(silu(gate) * up) of the normed residual h [T, d] (or Normed); in a
    decode step on the int8 kernel, the gate | up partials go to the glu's kernel unsummed, and
    with `splits` the down projection's come back so (linear's `splits`). shards: Kernels'
    (cfg, needed with more than 1: the layout's parts)."""
    glu = quant_matmul is not None and quant_matmul.glu_int8 is not None
    gu = linear(h, lp["w_gu"], quant_matmul, live, splits=glu)
    gated = Gated(gu, shards=1 if shards == 1 else fused_layout.stored(lp["w_gu"], "w_gu", cfg,
                                                                       shards))  # fmt: skip
    return linear(gated, lp["w_down"], quant_matmul, live, splits=splits)


def init_kv(cfg: ModelConfig, num_blocks: int, block_size: int, k_type, v_type=None) -> KV:
    """Zeroed per-layer (k, v) caches [NB, P, K, D]; a type is a dtype or "q8_0" / "q4_0",
    and V may have its own."""
    shape = (num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
    v_type = k_type if v_type is None else v_type
    return [
        (kv_cache.init(shape, k_type), kv_cache.init(shape, v_type)) for _ in range(cfg.n_layers)
    ]


def attention_params(cfg: ModelConfig, p: str, t, ffn_norm: str) -> dict:
    """An attention layer's params from the file tensors named `p`... (ModelFamily.layer_params'
    t): wqkv [d, (H+2K)*D] fused (a gated query's [d, 2H*D + 2K*D]), wo, the norms (the FFN's
    named `ffn_norm` in the file), and the FFN."""
    layer = {
        "attn_norm": t.tensor(p + "attn_norm.weight", out_dtype=t.f32),
        "wqkv": t.linear(*(p + f"attn_{x}.weight" for x in "qkv")),
        "wo": t.linear(p + "attn_output.weight"),
        "ffn_norm": t.tensor(p + f"{ffn_norm}.weight", out_dtype=t.f32),
        **t.ffn(p),
    }
    if cfg.attn_bias:
        layer["bqkv"] = jnp.concatenate(
            [t.tensor(p + f"attn_{x}.bias", out_dtype=t.f32) for x in "qkv"]
        )
    if cfg.qk_norm:
        layer["q_norm"] = t.tensor(p + "attn_q_norm.weight", out_dtype=t.f32)
        layer["k_norm"] = t.tensor(p + "attn_k_norm.weight", out_dtype=t.f32)
    return layer


class DenseFamily:
    """llama, qwen2, qwen3 and qwen3moe (models/family.py): one full-attention cache group,
    no per-slot model state, every proposer on the device."""

    name = "dense"
    archs = ("llama", "qwen2", "qwen3", "qwen3moe")
    rollback = "kv_length"
    prefix_cacheable = True
    device_proposers = frozenset({"head", "draft", "ngram", "dflash"})
    rope_scalings = ("none", "linear")

    def read_config(self, arch: str, get, md: dict, n_layers: int) -> dict:
        return dict(
            # llama.cpp runs llama with adjacent-pair RoPE (its converter permutes Q/K to
            # match); qwen2 and qwen3 rotate halves (NEOX).
            rope_neox=arch != "llama",
            qk_norm=arch in ("qwen3", "qwen3moe"),
            attn_bias=arch == "qwen2",
            **(moe.read_config(get) if arch == "qwen3moe" else {}),
        )

    def layer_params(self, cfg: ModelConfig, i: int, t) -> dict:
        return attention_params(cfg, f"blk.{i}.", t, "ffn_norm")

    def model_params(self, cfg: ModelConfig, t) -> dict:
        return {}

    def tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple]:
        return {}  # attention and FFN tensors only: loading/params.expected_shapes has them

    def cache_groups(self, cfg: ModelConfig, kv_bytes_per_entry: float) -> list[CacheGroup]:
        return [CacheGroup("full", cfg.n_layers, cfg.n_layers * kv_bytes_per_entry)]

    def init_caches(self, cfg: ModelConfig, spaces, k_type, v_type):
        (full,) = spaces  # one full-attention group
        return init_kv(cfg, full.num_blocks, full.block_size, k_type, v_type)

    def init_slot_state(self, cfg: ModelConfig, max_slots: int, proposals: int = 0) -> None:
        return None

    def forward(self, params, caches, slot_state, batch, cfg, kernels: Kernels, hidden=()):
        logits, caches, stats = forward(params, caches, batch, cfg, kernels.attention,
                                        kernels.grouped_matmul, kernels.quant_matmul,
                                        kernels.rope_write, hidden, kernels.moe_router,
                                        kernels.experts, kernels.shards)  # fmt: skip
        return logits, caches, slot_state, stats


FAMILY = register(DenseFamily())
