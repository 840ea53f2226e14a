"""Mixture-of-experts FFN (qwen3moe): router softmax, top-k, grouped expert matmuls.

The rest of a qwen3moe layer is the dense decoder's (models/dense.py calls `ffn` for layers
whose params hold a router). Rows are grouped by expert with a stable sort, so each expert's
rows are contiguous, and the grouped matmuls run over those groups (`jax.lax.ragged_dot`):
no expert is padded to the largest group and empty experts cost nothing. Quantized experts at
decode sizes skip the grouping: each (token, expert) pair is a row of its own against its
expert's blocks (`by_rows`), which fills the GPU where a few row tiles could not.

Shapes: T tokens, d model width, E experts, k experts per token, F expert FFN width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.moe_grouping import expert_weights
from pallas_kernels.quant_weight import QuantWeight

from ..config import ModelConfig
from .linear import Gated, linear


def read_config(get) -> dict:
    """Expert fields of ModelConfig from a file's metadata (a family's read_config calls it
    for its MoE architectures). llama.cpp renormalizes qwen3moe's top-k router weights unless
    the file says otherwise (expert_weights_norm), as Qwen3-MoE's norm_topk_prob does."""
    return dict(
        n_experts=int(get("expert_count")),
        n_experts_used=int(get("expert_used_count")),
        expert_ffn_dim=int(get("expert_feed_forward_length")),
        expert_weights_norm=bool(get("expert_weights_norm", True)),
        shared_expert_ffn_dim=int(get("expert_shared_feed_forward_length", 0)),
    )


def route(h, router, cfg: ModelConfig):
    """Top-k experts of each token and their weights.

    Args:
      h: [T, d] float32 normed hidden states; router: [d, E] float32.
    Returns:
      (weights [T, k] float32, experts [T, k] int32): softmax over all E, then the top k,
      renormalized to sum to 1 when the architecture says so (expert_weights_norm).
    """
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)
    if cfg.expert_weights_norm:
        # The top k of the softmax, renormalized, is the softmax of the top k logits: no
        # reduction over all E experts (kernels of every decode step, each layer's)
        z, idx = jax.lax.top_k(logits, cfg.n_experts_used)
        return jax.nn.softmax(z, axis=-1), idx.astype(jnp.int32)
    w, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.n_experts_used)
    return w, idx.astype(jnp.int32)


def group(experts, n_experts: int, real=None):
    """Order the T*k (token, expert) pairs by expert.

    Args:
      experts: [T, k] int32.
      real: [T] bool, False for bucket padding (default: every token is real). Padding pairs
        sort after every expert's rows and count in no group, so the grouped matmuls skip them
        and they touch no expert weights that real tokens do not need.
    Returns:
      (order [T*k]: pair indices sorted stably by expert, padding last; sizes [E]: real rows
       per expert).
    """
    flat = pair_experts(experts, n_experts, real)
    return jnp.argsort(flat, stable=True), expert_counts(flat, n_experts)


def expert_counts(flat, n_experts: int):
    """[..., E] int32: the pairs routed to each expert, per leading index, from their experts
    flat [..., P] (n_experts, padding, counts nowhere). One scatter: dense.forward counts every
    MoE layer of a step at once, since a scatter a layer had been two kernels of a decode step's
    graph, which the host updates kernel by kernel every step (models/dense.py)."""
    lead = jnp.indices(flat.shape, sparse=True)[:-1]
    out = jnp.zeros((*flat.shape[:-1], n_experts), jnp.int32)
    return out.at[(*lead, flat)].add(1, mode="drop")


def pair_experts(experts, n_experts: int, real=None):
    """[T*k] int32: the expert of each (token, expert) pair, n_experts (no expert) for padding."""
    flat = experts.reshape(-1)
    if real is None:
        return flat
    return jnp.where(jnp.repeat(real, experts.shape[1]), flat, n_experts)


def by_rows(w, pairs: int, qmm) -> bool:
    """Whether a step's experts run a (token, expert) pair at a time: quantized expert weights,
    a Pallas quant_matmul, and at most qmm.max_pairs pairs (linear.QuantMatmul says why that
    many). The grouped kernel gave each expert's row tile a program that walked all of K:
    30B-A3B Q4_K_M decode spent 6.7 of its 16.3 ms step in the gate/up call; a pair at a time
    the step took 6.0 ms (bench/results/history/2026-12-01_profile_qwen3-30b-a3b-q4_k_m_{6a8b89c,
    a415112}.md)."""
    kernel = getattr(qmm, "kernel", None)
    return isinstance(w, QuantWeight) and kernel is not None and pairs <= qmm.max_pairs


def ffn_rows(lp: dict, h, experts, qmm):
    """The experts' SwiGLU for each (token, expert) pair, a row at a time (quant_matmul's
    experts mode): h [T, d], experts [T*k] (padding: E) -> [T*k, d] float32."""
    wdt = lp["w_gu_exps"].dtype
    x = jnp.repeat(h, experts.shape[0] // h.shape[0], axis=0).astype(wdt)  # pair p = token p // k
    gate, up = jnp.split(qmm.kernel(x, lp["w_gu_exps"], experts=experts), 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(wdt)
    return qmm.kernel(act, lp["w_down_exps"], experts=experts)


def grouped_matmul_xla(x, w, sizes, *, swiglu: bool = False, out_dtype=jnp.float32):
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
        y = jax.nn.silu(gate) * up
    return y.astype(out_dtype)


def ffn(lp: dict, h, cfg: ModelConfig, grouped_matmul=None, real=None, qmm=None):
    """The MoE FFN of one layer.

    Args:
      lp: layer params with router [d, E], w_gu_exps [E, d, 2F], w_down_exps [E, F, d].
      h: [T, d] float32 normed hidden states.
      grouped_matmul: grouped_matmul_xla's signature (default: it).
      real: [T] bool, False for bucket padding, whose output is zero (default: all real).
      qmm: how quantized projections run (models/linear.py): a shared expert's, and at decode
        sizes the experts', a (token, expert) pair at a time (`by_rows`).
    Returns:
      ([T, d] float32: sum over each token's k experts of weight * down(silu(gate) * up),
       plus sigmoid(h . shexp_gate) times the shared expert's output where there is one,
       pairs [T*k] int32: each (token, expert) pair's expert, n_experts for padding: the
       step's routing, which `expert_counts` turns into its statistics).
    """
    gmm = grouped_matmul or grouped_matmul_xla
    T, k = h.shape[0], cfg.n_experts_used
    w, experts = route(h, lp["router"], cfg)
    flat = pair_experts(experts, cfg.n_experts, real)
    if by_rows(lp["w_gu_exps"], T * k, qmm):
        y = ffn_rows(lp, h, flat, qmm) * w.reshape(-1)[:, None]  # [T*k, d]
        out = y.reshape(T, k, -1).sum(1)
    else:
        order, sizes = group(experts, cfg.n_experts, real)
        tok = order // k  # token of each grouped row
        wdt = lp["w_gu_exps"].dtype
        x = h[tok].astype(wdt)  # [T*k, d], grouped by expert
        act = gmm(x, lp["w_gu_exps"], sizes, swiglu=True, out_dtype=wdt)  # [T*k, F]
        y = gmm(act, lp["w_down_exps"], sizes, out_dtype=jnp.float32)  # [T*k, d]
        y = y * w.reshape(-1)[order][:, None]
        out = jnp.zeros((T, h.shape[1]), jnp.float32).at[tok].add(y)
    if "w_gu_shexp" in lp:  # qwen35moe: every token also takes the shared expert, gated
        gu = linear(h, lp["w_gu_shexp"], qmm)
        shared = linear(Gated(gu), lp["w_down_shexp"], qmm).astype(jnp.float32)
        out = out + jax.nn.sigmoid(h @ lp["shexp_gate"])[:, None] * shared
    return out, flat
