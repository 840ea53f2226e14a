"""Gated delta rule over a packed step's segments, each continuing from its slot's state.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

The rule (Gated DeltaNet, as Qwen3.5's linear layers run it), per value head with state
h [Dk, Dv] and per token: h = exp(g) h; h += k (beta (v - h^T k))^T; o = h^T q.

Work split: program (s, j) walks segment s's tokens (cu_q_lens[s] to cu_q_lens[s+1]) for value
head j, its [Dk, Dv] state in registers from h0[s, j]. It writes the state back after the
segment's first n_keep[s] tokens, then runs on through the rest (a verify row's speculative
proposals: they need outputs, but the slot keeps the state before them). A prompt chunk and a
decode row are the same loop, of many or one token; a segment never waits for another. Value
head j reads key head j % Hk (llama.cpp's tiled order). Tokens past the last segment (bucket
padding) get zero output.

This is the token-recurrent form: a prompt of n tokens costs n dependent rank-1 updates per
head. The chunked (WY / UT) form that turns a chunk's updates into matmuls is the faster
prefill form; this one is exact, and for decode rows it is the whole work.

Triton backend (CUDA; ROCm through Triton too): no scalar prefetch, so cu_q_lens is an ordinary
input read in the kernel, and the token loop has a dynamic trip count. Dk and Dv must be powers
of two. On CPU the kernel runs in interpret mode.

Shapes: T packed tokens, S segments, Hk key heads, Hv value heads, Dk / Dv head dims.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .call_options import call_options, whole


def gated_delta_reference(q, k, v, g, beta, h0, cu_q_lens, n_keep=None):
    """Token-at-a-time jnp reference (lax.scan over the packed axis).

    Args:
      q, k: [T, Hk, Dk] (normalized and scaled as the model wants); v: [T, Hv, Dv];
      g, beta: [T, Hv] log decay (<= 0) and write strength; h0: [S, Hv, Dk, Dv] states the
      segments start from; cu_q_lens: [S+1] int32 segment starts (padding past the last);
      n_keep: [S] int32 leading tokens of each segment whose updates the returned state holds
        (default: all); the rest (speculative proposals) still get outputs.
    Returns:
      (o [T, Hv, Dv] float32, states [S, Hv, Dk, Dv] float32 after each segment's kept
      tokens).
    """
    T, Hk, _ = q.shape
    Hv = v.shape[1]
    seg = jnp.clip(jnp.searchsorted(cu_q_lens, jnp.arange(T), side="right") - 1, 0, h0.shape[0] - 1)
    real = jnp.arange(T) < cu_q_lens[-1]
    if n_keep is None:
        n_keep = cu_q_lens[1:] - cu_q_lens[:-1]
    kept = jnp.arange(T) < cu_q_lens[:-1][seg] + n_keep[seg]
    heads = jnp.arange(Hv) % Hk

    def step(carry, t):
        run, keep = carry  # running states, and the states after the kept tokens
        qt, kt, vt, gt, bt, s, ok, kt_ok = t
        qt, kt = qt[heads], kt[heads]
        h = run[s] * jnp.exp(gt)[:, None, None]
        delta = (vt - jnp.einsum("hkv,hk->hv", h, kt)) * bt[:, None]
        h = h + kt[:, :, None] * delta[:, None, :]
        o = jnp.where(ok, jnp.einsum("hkv,hk->hv", h, qt), 0.0)
        run = run.at[s].set(jnp.where(ok, h, run[s]))
        keep = keep.at[s].set(jnp.where(ok & kt_ok, h, keep[s]))
        return (run, keep), o

    f32 = jnp.float32
    xs = (q.astype(f32), k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32), seg, real)
    h0 = h0.astype(f32)
    (_, hs), o = jax.lax.scan(step, (h0, h0), (*xs, kept))
    return o, hs


def _kernel(cu_ref, keep_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, h_ref, *, n_k):
    s, j = pl.program_id(0), pl.program_id(1)
    kh = j % n_k
    start, end = cu_ref[s], cu_ref[s + 1]
    mid = start + keep_ref[s]  # tokens from here on are not kept in the returned state
    f32 = jnp.float32

    def token(t, h):
        qt = q_ref[t, kh, :].astype(f32)  # [Dk]
        kt = k_ref[t, kh, :].astype(f32)
        vt = v_ref[t, j, :].astype(f32)  # [Dv]
        h = h * jnp.exp(g_ref[t, j].astype(f32))
        delta = (vt - jnp.sum(h * kt[:, None], axis=0)) * b_ref[t, j].astype(f32)
        h = h + kt[:, None] * delta[None, :]
        o_ref[t, j, :] = jnp.sum(h * qt[:, None], axis=0).astype(o_ref.dtype)
        return h

    h = jax.lax.fori_loop(start, mid, token, h0_ref[s, j].astype(f32))
    h_ref[s, j] = h.astype(h_ref.dtype)
    jax.lax.fori_loop(mid, end, token, h)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def gated_delta(q, k, v, g, beta, h0, cu_q_lens, n_keep=None, *, interpret=None, num_warps=4):
    """The gated delta rule of every segment, from its initial state (Pallas kernel).

    Args: as gated_delta_reference.
    Returns:
      (o [T, Hv, Dv] float32, zero past the last segment; states [S, Hv, Dk, Dv] float32
      after each segment's kept tokens).
    """
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    S = h0.shape[0]
    if k.shape != q.shape or g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"shapes q {q.shape} k {k.shape} v {v.shape} g {g.shape} b {beta.shape}")
    if Hv % Hk or h0.shape != (S, Hv, Dk, Dv) or cu_q_lens.shape != (S + 1,):
        raise ValueError(f"Hk={Hk} Hv={Hv} h0 {h0.shape} cu_q_lens {cu_q_lens.shape}")
    if Dk & (Dk - 1) or Dv & (Dv - 1):
        raise ValueError(f"head dims Dk={Dk}, Dv={Dv} must be powers of two")
    if n_keep is None:
        n_keep = cu_q_lens[1:] - cu_q_lens[:-1]
    cu = cu_q_lens.astype(jnp.int32)
    args = (cu, n_keep.astype(jnp.int32), q, k, v, g, beta, h0.astype(jnp.float32))
    o, h = pl.pallas_call(
        functools.partial(_kernel, n_k=Hk),
        grid=(S, Hv),
        in_specs=[whole(a) for a in args],
        out_specs=[
            pl.BlockSpec((T, Hv, Dv), lambda *_: (0, 0, 0)),
            pl.BlockSpec((S, Hv, Dk, Dv), lambda *_: (0, 0, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((T, Hv, Dv), jnp.float32),
            jax.ShapeDtypeStruct((S, Hv, Dk, Dv), jnp.float32),
        ],
        name="gated_delta",
        **call_options(interpret, num_warps, 1),
    )(*args)
    real = jnp.arange(T) < cu_q_lens[-1]
    return jnp.where(real[:, None, None], o, 0.0), h
