"""The attention kernels on a mesh: each device runs them on its own heads (`jax.shard_map`).

XLA partitions its own ops by their inputs' shardings, but not a Pallas kernel (a custom call
to it): given split operands it gathers them whole onto every device first, which for the
attention would gather every layer's KV cache each step. Attention is per head, and the KV
caches are split by KV head (device/mesh.py), so each device runs the kernel on its H / n
query heads and K / n KV heads, as written for one device, with no collective. This holds
where both head counts divide by the mesh size n; elsewhere (fewer KV heads than devices) the
kernels stay as they are, whole on every device.

DeepSeek V4's sink attention has one K = V head, replicated; its query heads and their sinks
are split.

The quantized matmul kernels run on each device's output rows: a QuantWeight is split by its
rows N (device/mesh.py), so each device multiplies the whole x by its N / n rows, blocks whole,
and the product comes out split along N, where XLA's ops take it as a column-parallel
projection's. A weight kept whole on every device (a row-parallel one) runs the same way from
its local slice: each device reads 1/n of it, and the [T, N] product is gathered (activations,
not weights, cross between devices). Experts' calls (`experts=`) stay whole.

With expert parallelism the routed experts run where their weights are: every device routes
every token (the router is replicated), computes only the (token, expert) pairs of its own
E / n experts, and the [T, d] outputs are summed over the devices, one all-reduce a MoE layer
(replicated activations and a reduce: the routed pairs never move between devices).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.quant_weight import QuantWeight
from pallas_kernels.sink_attention import sink_attention_reference

from ..config import ModelConfig
from ..models import fused_layout
from ..models.family import Kernels
from ..models.linear import Normed
from .mesh import AXIS, Placement, delta_spec

HEADS = P(None, AXIS, None)  # [T, H, D] and the row-major views of a fused projection
CACHE = P(None, None, AXIS, None)  # [NB, P, K, D] (a quantized cache's data and scales)
WHOLE = P()


def _attention(attn, mesh, q, kc, vc, seg_ids, positions, block_tables, kv_lens, *, scale,
               cu_q_lens=None):  # fmt: skip
    """Paged attention (paged_attention_xla's signature) on each device's heads."""

    def local(q, kc, vc, seg_ids, positions, block_tables, kv_lens, cu_q_lens):
        return attn(q, kc, vc, seg_ids, positions, block_tables, kv_lens, scale=scale,
                    cu_q_lens=cu_q_lens)  # fmt: skip

    specs = (HEADS, CACHE, CACHE) + (WHOLE,) * 5
    f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=HEADS, check_vma=False)
    return f(q, kc, vc, seg_ids, positions, block_tables, kv_lens, cu_q_lens)


def shard_major_view(qkv, heads: int, kv_heads: int, n: int):
    """A fused q|k|v projection's rows [T, (H + 2K) * D] as [T, n, (H + 2K) / n * D]: device
    i's part holds its query heads, then its K / n KV heads' k and v (heads in order)."""
    T = qkv.shape[0]
    D = qkv.shape[1] // (heads + 2 * kv_heads)
    q, k, v = jnp.split(qkv, [heads * D, (heads + kv_heads) * D], axis=1)
    return jnp.concatenate([x.reshape(T, n, -1) for x in (q, k, v)], axis=2)


def _rope_write(rope_write, mesh, n, qkv, q_w, k_w, cos, sin, write_idx, kc, vc, *, heads,
                kv_heads, shard_major: bool = False, **kw):  # fmt: skip
    """rope_write (pallas_kernels/rope_write.py) on each device's heads: (q [T, H, D], kc,
    vc). shard_major: qkv's columns are each device's heads already (models/fused_layout.py),
    else they are in order and each device's are gathered (collective-permutes)."""

    def local(qkv, q_w, k_w, cos, sin, write_idx, kc, vc):
        return rope_write(qkv[:, 0], q_w, k_w, cos, sin, write_idx, kc, vc, heads=heads // n,
                          kv_heads=kv_heads // n, **kw)  # fmt: skip

    specs = (HEADS,) + (WHOLE,) * 5 + (CACHE, CACHE)
    f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(HEADS, CACHE, CACHE),
                      check_vma=False)  # fmt: skip
    qkv = qkv.reshape(qkv.shape[0], n, -1) if shard_major else shard_major_view(
        qkv, heads, kv_heads, n)  # fmt: skip
    return f(qkv, q_w, k_w, cos, sin, write_idx, kc, vc)


def _sink_attention(attn, mesh, q, caches, rows, sinks, *, scale):
    """Sink attention (DeepSeek V4) on each device's query heads; the keys are replicated."""

    def local(q, caches, rows, sinks):
        return attn(q, caches, rows, sinks, scale=scale)

    f = jax.shard_map(local, mesh=mesh, in_specs=(HEADS, WHOLE, WHOLE, P(AXIS)),
                      out_specs=HEADS, check_vma=False)  # fmt: skip
    return f(q, tuple(caches), tuple(rows), sinks)


def _rows(kernel, mesh, n, x, w, live=None, **kw):
    """A quantized matmul (quant_matmul's signature, or the prefill's (x, w)) on each device's
    output rows of a QuantWeight [N, K] whose N divides by n; anything else whole."""
    call = lambda x, w, live, **kw: kernel(x, w, live, **kw) if live is not None or kw else (
        kernel(x, w))  # fmt: skip
    if not isinstance(w, QuantWeight) or w.body.ndim != 2 or w.shape[0] % n or "experts" in kw:
        return call(x, w, live, **kw)
    is_arrays = lambda v: all(isinstance(a, jax.Array) for a in jax.tree.leaves(v) or [None])
    arrays = sorted(k for k, v in kw.items() if is_arrays(v))  # x8: x's int8 rows (a tuple)
    static = {k: v for k, v in kw.items() if k not in arrays}

    def local(x, w, live, *extra):
        return call(x, w, live, **dict(zip(arrays, extra, strict=True)), **static)

    rows = QuantWeight(P(None, AXIS), P(AXIS, None), w.qtype, w.dtype)  # head [hK, N], body
    out = P(None, None, AXIS) if kw.get("splits") else P(None, AXIS)  # [S, T, N] or [T, N]
    f = jax.shard_map(local, mesh=mesh, in_specs=(WHOLE, rows, WHOLE) + (WHOLE,) * len(arrays),
                      out_specs=out, check_vma=False)  # fmt: skip
    return f(x, w, live, *(kw[k] for k in arrays))


def _spec_tree(x, spec):
    """`spec` for every leaf of x (a QuantWeight's head and body alike)."""
    return jax.tree.map(lambda _: spec, x)


def _experts(mesh, routed, lp, h, live, tokens):
    """moe.routed on each device's experts (lp's stacked experts split along E; the router
    whole), the outputs summed: ([T, d] float32, pairs [T*k]) as one device's."""
    eps = h.eps if isinstance(h, Normed) else None  # static: the norm kernels take it so
    x = (h.x, h.w) if eps is not None else h
    specs = {k: _spec_tree(v, P(AXIS) if k.endswith("_exps") else WHOLE) for k, v in lp.items()}

    def local(lp, x, live, tokens):
        h = Normed(*x, eps) if eps is not None else x
        first = jax.lax.axis_index(AXIS) * lp["w_gu_exps"].shape[0]
        out, pairs = routed(lp, h, live, tokens, first=first)
        return jax.lax.psum(out, AXIS), pairs

    f = jax.shard_map(local, mesh=mesh, in_specs=(specs, WHOLE, WHOLE, WHOLE),
                      out_specs=(WHOLE, WHOLE), check_vma=False)  # fmt: skip
    return f(lp, x, live, tokens)


def _delta_heads(mesh, n, qmm, mixer, lp, h, hist, ssm, li, pend, batch, live, cfg):
    """A Gated DeltaNet layer (mixer: models/gated_deltanet.py's linear_attention with its
    kernels) on each device's heads: the device's share of the params (stored device by
    device: models/fused_layout.py), of the conv history [S, Kc-1, C], of the states [Lr, S,
    Hv, Dk, Dv] and of the stored proposals' inputs [S, K, W] (pend's first; its kept counts
    whole), run as a model of Hk / n key and Hv / n value heads, its quantized projections
    with qmm (the kernels as on one device) on the device's rows and input blocks; the [T, d]
    output summed. Returns (out [T, d], hist, ssm, proposals to store or None) as one
    device's."""
    hc = cfg.own
    local = dataclasses.replace(cfg, own=dataclasses.replace(
        hc, ssm_k_heads=hc.ssm_k_heads // n, ssm_v_heads=hc.ssm_v_heads // n))  # fmt: skip
    own = {k: lp[k] for k in (*fused_layout.DELTA, "ssm_norm")}
    specs = {k: delta_spec(k, v) if k in fused_layout.DELTA else WHOLE for k, v in own.items()}
    eps = h.eps if isinstance(h, Normed) else None
    x = (h.x, h.w) if eps is not None else h

    def local_fn(own, x, hist, ssm, pend, li, batch, live):
        h = Normed(*x, eps) if eps is not None else x
        out, hist, ssm, stored = mixer(own, h, hist, ssm, li, pend, batch, local, live, qmm)
        return jax.lax.psum(out, AXIS), hist, ssm, stored

    # hist [S, Kc-1, C] by C, the states [Lr, S, Hv, ...] by Hv, stored inputs [S, K, W] by W
    third = P(None, None, AXIS)
    pend_spec = None if pend is None else (third, WHOLE)
    f = jax.shard_map(local_fn, mesh=mesh,
                      in_specs=(specs, WHOLE, third, third, pend_spec) + (WHOLE,) * 3,
                      out_specs=(WHOLE, third, third, None if pend is None else third),
                      check_vma=False)  # fmt: skip
    return f(own, x, hist, ssm, pend, li, batch, live)


def shard_quant_matmul(qmm, mesh, n: int):
    """A models.linear.QuantMatmul whose kernel and prefill run on each device's rows."""
    if qmm is None or (qmm.kernel is None and qmm.prefill is None):
        return qmm
    wrap = lambda k: None if k is None else functools.partial(_rows, k, mesh, n)
    return qmm._replace(kernel=wrap(qmm.kernel), prefill=wrap(qmm.prefill))


def shard_kernels(kernels: Kernels, cfg: ModelConfig, placement: Placement) -> Kernels:
    """`kernels` with the attention kernels run per device where the heads divide evenly, and
    the quantized matmuls on each device's rows."""
    mesh, n = placement.mesh, placement.n
    out = {"quant_matmul": shard_quant_matmul(kernels.quant_matmul, mesh, n), "shards": n}
    if cfg.n_heads % n == 0 and cfg.n_kv_heads % n == 0:
        out["attention"] = functools.partial(_attention, kernels.attention, mesh)
        if kernels.rope_write is not None:
            out["rope_write"] = functools.partial(_rope_write, kernels.rope_write, mesh, n)
    if placement.expert_parallel and cfg.n_experts % n == 0:  # Placement's split along E
        out["experts"] = functools.partial(_experts, mesh)
    if placement.delta is not None:  # the Gated DeltaNet layers split (Placement.delta)
        out["delta_heads"] = functools.partial(_delta_heads, mesh, n, kernels.quant_matmul)
    if cfg.n_heads % n == 0:  # a family without sink attention never calls it
        attn = kernels.sink_attention or sink_attention_reference
        out["sink_attention"] = functools.partial(_sink_attention, attn, mesh)
    return kernels._replace(**out)
