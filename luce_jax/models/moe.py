"""Mixture-of-experts FFN (qwen3moe): router softmax, top-k, grouped expert matmuls.

The rest of a qwen3moe layer is the dense decoder's (models/dense.py calls `ffn` for layers
whose params hold a router). Rows are grouped by expert with a stable sort, so each expert's
rows are contiguous, and the grouped matmuls run over those groups (`jax.lax.ragged_dot`):
no expert is padded to the largest group and empty experts cost nothing. Experts at decode
sizes skip the sort (`by_rows`): quantized experts run each (token, expert) pair as a row of
its own against its expert's blocks, and dense ones read each expert's tiles once for the
tokens that chose it (pallas_kernels/expert_rows.py), which fills the GPU where a few row
tiles could not.

Shapes: T tokens, d model width, E experts, k experts per token, F expert FFN width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe_grouping import expert_weights
from pallas_kernels.moe_router import moe_router_reference
from pallas_kernels.quant_weight import QuantWeight
from pallas_kernels.swiglu import swiglu as glu  # (grouped_matmul's `swiglu` is a flag)

from ..config import ModelConfig
from . import fused_layout
from .linear import Gated, Normed, linear

# llama.cpp's expert_gating_func values: the router's scoring
GATING = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}
# Steps of at most this many rows route in the fused router kernel (Kernels.moe_router): the
# decode and small verify buckets, whose router was four or more kernels a layer; larger
# buckets keep XLA's ops, where a program per row would read the router matrix once a row.
ROUTER_MAX_ROWS = 64


def read_config(get) -> dict:
    """Expert fields of ModelConfig from a file's metadata (a family's read_config calls it
    for its MoE architectures). llama.cpp renormalizes qwen3moe's top-k router weights unless
    the file says otherwise (expert_weights_norm), as Qwen3-MoE's norm_topk_prob does."""
    gating = int(get("expert_gating_func", 1))
    if gating not in GATING:
        raise ValueError(f"expert_gating_func={gating}: supported {GATING}")
    # DeepSeek V4: a SwiGLU clamp per block for the routed and the shared experts (one value
    # here: the kernels take it as a constant)
    given = [get(key, ()) for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp")]
    limits = {float(v) for g in given for v in np.ravel(g)} or {0.0}
    if len(limits) > 1:
        raise ValueError(f"swiglu_clamp_exp / swiglu_clamp_shexp={sorted(limits)}: one value")
    return dict(
        n_experts=int(get("expert_count")),
        n_experts_used=int(get("expert_used_count")),
        expert_ffn_dim=int(get("expert_feed_forward_length")),
        expert_weights_norm=bool(get("expert_weights_norm", True)),
        shared_expert_ffn_dim=int(get("expert_shared_feed_forward_length", 0)),
        expert_scoring=GATING[gating],
        expert_weights_scale=float(get("expert_weights_scale", 1.0)),
        expert_groups=int(get("expert_group_count", 1)),
        expert_groups_used=int(get("expert_group_used_count", 1)),
        swiglu_limit=limits.pop(),
    )


def route(h, lp: dict, cfg: ModelConfig, router=None, live=None, tokens=None):
    """Top-k experts of each token and their weights (pallas_kernels/moe_router.py's routing:
    the config's scoring, selection bias, groups, renormalization and scale).

    Args:
      h: Normed rows of the FFN input, or [T, d] float32 already normed; lp: the layer's
        router [d, E] and router_bias [E] if any; router: the router kernel
        (Kernels.moe_router), run on buckets of at most ROUTER_MAX_ROWS rows, or None;
      live: int32 scalar, the real rows (None: all); tokens: [T] int32 token ids, for a
        hash-routed layer (lp's tid2eid [V, k] table chooses its experts).
    Returns:
      (weights [T, k] float32, experts [T, k] int32); rows at or past live: expert E, weight 0.
    """
    kw = dict(k=cfg.n_experts_used, scoring=cfg.expert_scoring, renorm=cfg.expert_weights_norm,
              scale=cfg.expert_weights_scale, groups=cfg.expert_groups,
              groups_used=cfg.expert_groups_used)  # fmt: skip
    bias = lp.get("router_bias")
    if "tid2eid" in lp:  # hash routing: the experts by token id, their weights by the scores
        x = h.array() if isinstance(h, Normed) else h
        chosen = lp["tid2eid"][tokens].astype(jnp.int32)
        return moe_router_reference(x, lp["router"], live=live, experts=chosen, **kw)
    if router is not None and h.shape[0] <= ROUTER_MAX_ROWS:
        if isinstance(h, Normed):
            return router(h.x, lp["router"], bias, h.w, eps=h.eps, live=live, **kw)
        return router(h, lp["router"], bias, live=live, **kw)
    x = h.array() if isinstance(h, Normed) else h
    return moe_router_reference(x, lp["router"], bias, live=live, **kw)


def group(experts, n_experts: int):
    """Order the T*k (token, expert) pairs by expert.

    Args:
      experts: [T, k] int32, n_experts for bucket padding (route's): padding pairs sort after
        every expert's rows and count in no group, so the grouped matmuls skip them and they
        touch no expert weights that real tokens do not need.
    Returns:
      (order [T*k]: pair indices sorted stably by expert, padding last; sizes [E]: real rows
       per expert).
    """
    flat = experts.reshape(-1)
    return jnp.argsort(flat, stable=True), expert_counts(flat, n_experts)


def expert_counts(flat, n_experts: int):
    """[..., E] int32: the pairs routed to each expert, per leading index, from their experts
    flat [..., P] (n_experts, padding, counts nowhere). One scatter: dense.forward counts every
    MoE layer of a step at once, since a scatter a layer had been two kernels of a decode step's
    graph, which the host updates kernel by kernel every step (models/dense.py)."""
    lead = jnp.indices(flat.shape, sparse=True)[:-1]
    out = jnp.zeros((*flat.shape[:-1], n_experts), jnp.int32)
    return out.at[(*lead, flat)].add(1, mode="drop")


def by_rows(ws: tuple, pairs: int, qmm) -> bool:
    """Whether a step's experts (their weights ws) run a (token, expert) pair at a time: at
    most qmm.max_pairs pairs (linear.QuantMatmul says why that many), quantized experts with a
    Pallas quant_matmul and dense ones with qmm.expert_rows. The grouped kernel gave each
    expert's row tile a program that walked all of K: 30B-A3B Q4_K_M decode spent 6.7 of its
    16.3 ms step in the gate/up call; a pair at a time the step took 6.0 ms (bench/results/
    history/2026-12-01_profile_qwen3-30b-a3b-q4_k_m_{6a8b89c,a415112}.md)."""
    if qmm is None or pairs > qmm.max_pairs:
        return False
    return all(_pairs(w, qmm) is not None for w in ws)


def normed_rows(h, w, qmm):
    """(normed rows [T, d], their int8 rows or None) of the FFN input h (Normed or an array):
    in one kernel for quantized experts w (qmm.norm_int8 where the engine rounds activations to
    int8, with their int8 rows; else qmm.norm), so the router and the experts read the same
    normed rows and nobody norms them again."""
    # float32 rows: the router's choices from bf16-rounded rows differed from float32's
    # (bench/results/moe_decode_kernel_qwen3-30b-a3b_h100.md)
    if not isinstance(h, Normed):
        return h, None
    rows = h.kernel_rows(qmm, jnp.float32) if isinstance(w, QuantWeight) else None
    return (h.array(), None) if rows is None else rows


def _pairs(w, qmm):
    """The pair-at-a-time matmul of experts w: quant_matmul's experts mode, or expert_rows
    (None where qmm has none)."""
    if isinstance(w, QuantWeight):
        return getattr(qmm, "kernel", None)
    return getattr(qmm, "expert_rows", None) if w.shape[1] % 16 == 0 else None  # its tiles


def ffn_rows(lp: dict, h, x8, experts, k: int, qmm, limit: float = 0.0):
    """The experts' SwiGLU for each (token, expert) pair, a row at a time (quant_matmul's
    experts mode; expert_rows for dense experts, a tile for all of an expert's tokens), in
    three kernels where the engine rounds activations to int8: gate | up (each token's row
    read by its k pairs: `fan_out`), then glu_int8_rows (the splits' sum, silu(gate) * up and
    its int8 rows), then down.

    Args: h: normed rows [T, d] and x8 their int8 rows or None (normed_rows); experts [T*k]
      (padding: E); k: pairs a token; limit: the SwiGLU's clamp (ModelConfig.swiglu_limit).
    Returns: [S, T*k, d] float32 split partials of the down projection (summed by the
      caller with the routing weights, in one XLA fusion)."""
    w_gu, w_down = lp["w_gu_exps"], lp["w_down_exps"]
    wdt = w_gu.dtype
    x, kw = (h.astype(wdt), {}) if x8 is None else (h, {"x8": x8})  # x8: the kernel's rows
    parts = _pairs(w_gu, qmm)(x, w_gu, experts=experts, fan_out=k, splits=True, **kw)
    quantized = isinstance(w_down, QuantWeight)
    if quantized and qmm.glu_int8 is not None and parts.shape[-1] % 64 == 0:
        act, act8 = qmm.glu_int8(parts, jnp.int32(parts.shape[1]), dtype=wdt, limit=limit)
        kw = {"x8": act8}
    else:  # expert_rows takes the pairs' tokens, to read an expert's tiles once for them
        gate, up = jnp.split(parts.sum(0), 2, axis=-1)
        act, kw = glu(gate, up, limit).astype(wdt), ({} if quantized else {"per_token": k})
    return _pairs(w_down, qmm)(act, w_down, experts=experts, splits=True, **kw)


def grouped_matmul_xla(x, w, sizes, *, swiglu: bool = False, limit: float = 0.0,
                       out_dtype=jnp.float32):  # fmt: skip
    """XLA's grouped matmul, with the Pallas kernel's signature (pallas_kernels/moe_grouping.py).

    Args:
      x: [M, K] rows grouped by expert; w: [E, K, N] (with swiglu [E, K, 2N]: gate | up), or
        a QuantWeight [E, N, K];
      sizes: [E] int32 rows per expert.
    Returns:
      [M, N] in out_dtype: x @ w[expert], then silu(gate) * up with swiglu.
    """
    w = expert_weights(w)  # a quantized stack is dequantized whole, every step (CPU path)
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), sizes, preferred_element_type=jnp.float32)
    if swiglu:
        gate, up = jnp.split(y, 2, axis=-1)
        y = glu(gate, up, limit)
    return y.astype(out_dtype)


def ffn(lp: dict, h, cfg: ModelConfig, grouped_matmul=None, live=None, qmm=None, router=None,
        tokens=None, experts_on=None, shards: int = 1):  # fmt: skip
    """The MoE FFN of one layer.

    Args:
      lp: layer params with router [d, E] (router_bias [E] if any), w_gu_exps [E, d, 2F],
        w_down_exps [E, F, d].
      h: the FFN input: Normed rows (the norm goes into the router's and the experts'
        kernels where they run) or [T, d] float32 already normed.
      grouped_matmul: grouped_matmul_xla's signature (default: it).
      live: int32 scalar, the real rows; padding rows' output is zero (default: all real).
      qmm: how quantized projections run (models/linear.py): a shared expert's, and at decode
        sizes the experts', a (token, expert) pair at a time (`by_rows`).
      router: the router kernel (Kernels.moe_router), or None (`route`); tokens: [T] token
        ids, for a hash-routed layer (`route`).
      experts_on: Kernels.experts: runs `routed` where the experts' weights are (each device
        its own experts, the outputs summed), or None (here, all of them).
      shards: Kernels.shards (the shared expert's gate | up layout: models/fused_layout.py).
    Returns:
      ([T, d] float32: sum over each token's k experts of weight * down(silu(gate) * up),
       plus the shared expert's output where there is one (times sigmoid(h . shexp_gate)
       where the layer has that gate),
       pairs [T*k] int32: each (token, expert) pair's expert, n_experts for padding: the
       step's routing, which `expert_counts` turns into its statistics).
    """
    gmm = grouped_matmul or grouped_matmul_xla
    run = functools.partial(routed, cfg=cfg, gmm=gmm, qmm=qmm, router=router)
    own = {k: lp[k] for k in ROUTED if k in lp}
    out, flat = run(own, h, live, tokens) if experts_on is None else experts_on(
        run, own, h, live, tokens)  # fmt: skip
    if "w_gu_shexp" in lp:  # every token also takes the shared expert (qwen35moe's gated)
        gu = linear(h, lp["w_gu_shexp"], qmm)
        shards = fused_layout.stored(lp["w_gu_shexp"], "w_gu_shexp", cfg, shards)
        shared = linear(Gated(gu, cfg.swiglu_limit, shards), lp["w_down_shexp"], qmm)
        shared = shared.astype(jnp.float32)
        if "shexp_gate" in lp:
            hx = h.array() if isinstance(h, Normed) else h
            shared = jax.nn.sigmoid(hx @ lp["shexp_gate"])[:, None] * shared
        out = out + shared
    return out, flat


# A layer's params that `routed` reads: the router's and the routed experts'.
ROUTED = ("router", "router_bias", "tid2eid", "w_gu_exps", "w_down_exps")


def routed(lp: dict, h, live, tokens, *, cfg: ModelConfig, gmm, qmm, router, first=None):
    """`ffn`'s routed experts: ([T, d] float32, pairs [T*k]), `ffn`'s arguments.

    first: None where lp holds every expert; else the id of the first of the E / n experts lp
    holds (a device's, device/sharded_kernels.py): every token is routed over all E, and only
    the pairs whose expert is held here are computed (the others weigh 0 and count in no
    group), so the sum over devices is the whole output. pairs are all E's ids either way."""
    T, k = h.shape[0], cfg.n_experts_used
    E = lp["w_gu_exps"].shape[0]  # the experts held here

    def held(w, experts):  # pairs of other experts: weight 0, expert E (padding)
        if first is None:
            return w, experts
        e = experts - first
        mine = (e >= 0) & (e < E)
        return jnp.where(mine, w, 0.0), jnp.where(mine, e, E)

    if by_rows((lp["w_gu_exps"], lp["w_down_exps"]), T * k, qmm):
        hn, x8 = normed_rows(h, lp["w_gu_exps"], qmm)
        w, experts = route(hn, lp, cfg, router, live, tokens)
        flat = experts.reshape(-1)  # padding rows' pairs: expert E, in no group
        w, experts = held(w, experts)
        y = ffn_rows(lp, hn, x8, experts.reshape(-1), k, qmm, cfg.swiglu_limit)  # [S, T*k, d]
        # the splits and a token's k experts summed in one reduction (one kernel, not two)
        return jnp.sum(y.reshape(y.shape[0], T, k, -1) * w[None, :, :, None], axis=(0, 2)), flat
    w, experts = route(h, lp, cfg, router, live, tokens)
    flat = experts.reshape(-1)
    w, experts = held(w, experts)
    h = h.array() if isinstance(h, Normed) else h
    order, sizes = group(experts, E)
    tok = order // k  # token of each grouped row
    wdt = lp["w_gu_exps"].dtype
    x = h[tok].astype(wdt)  # [T*k, d], grouped by expert
    act = gmm(x, lp["w_gu_exps"], sizes, swiglu=True, limit=cfg.swiglu_limit, out_dtype=wdt)
    y = gmm(act, lp["w_down_exps"], sizes, out_dtype=jnp.float32)  # [T*k, d]
    y = y * w.reshape(-1)[order][:, None]
    return jnp.zeros((T, h.shape[1]), jnp.float32).at[tok].add(y), flat
