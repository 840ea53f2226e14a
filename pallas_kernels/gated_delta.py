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

Two forms. The token-recurrent one (chunk=0) costs n dependent rank-1 updates per head for n
tokens; it is all a decode row needs. The chunked (WY / UT) one (chunk=16, 32 or 64) runs a
segment's whole chunks of kept tokens as a few matmuls each (`_kernel_chunked`) and the rest
token by token. Both are exact against the reference; which is faster for prefill on a GPU is
not yet measured.

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
from jax.experimental.pallas import triton as plgpu

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


def _token(q_ref, k_ref, v_ref, g_ref, b_ref, o_ref, kh, j, t, h):
    """Token t of value head j (key head kh): its output, and the state after it."""
    f32 = jnp.float32
    qt = q_ref[t, kh, :].astype(f32)  # [Dk]
    kt = k_ref[t, kh, :].astype(f32)
    vt = v_ref[t, j, :].astype(f32)  # [Dv]
    h = h * jnp.exp(g_ref[t, j].astype(f32))
    delta = (vt - jnp.sum(h * kt[:, None], axis=0)) * b_ref[t, j].astype(f32)
    h = h + kt[:, None] * delta[None, :]
    o_ref[t, j, :] = jnp.sum(h * qt[:, None], axis=0).astype(o_ref.dtype)
    return h


def _kernel(cu_ref, keep_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, h_ref, *, n_k):
    s, j = pl.program_id(0), pl.program_id(1)
    start, end = cu_ref[s], cu_ref[s + 1]
    mid = start + keep_ref[s]  # tokens from here on are not kept in the returned state
    token = functools.partial(_token, q_ref, k_ref, v_ref, g_ref, b_ref, o_ref, j % n_k, j)
    h = jax.lax.fori_loop(start, mid, token, h0_ref[s, j].astype(jnp.float32))
    h_ref[s, j] = h.astype(h_ref.dtype)
    jax.lax.fori_loop(mid, end, token, h)


def _dot(a, b, ta: bool = False, tb: bool = False):
    """a @ b in float32 (either operand transposed), without TF32: the state is carried from
    chunk to chunk, and TF32's 10-bit mantissa would drift it from the reference."""
    return jax.lax.dot_general(
        a,
        b,
        (((0 if ta else 1,), (1 if tb else 0,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _kernel_chunked(
    cu_ref, keep_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref, h_ref, *, n_k, BT
):
    """A segment's whole chunks of BT kept tokens in the chunked (WY / UT) form; the kept
    tokens after them (fewer than BT: all of a decode row) and the proposals after those
    token by token, as `_kernel` does.

    Per chunk, with G the chunk's cumulative log decay and D[i, j] = exp(G_i - G_j) (j <= i):
    L = strictly_lower(beta_i k_i.k_j D), and (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...
    (L is nilpotent); u = (I + L)^-1 (beta v), w = (I + L)^-1 (beta k exp(G));
    v' = u - w h; o = exp(G) q h + lower(q k^T D) v'; h = exp(G_last) h + (k exp(G_last - G))^T v'.
    """
    s, j = pl.program_id(0), pl.program_id(1)
    kh = j % n_k
    start, end = cu_ref[s], cu_ref[s + 1]
    mid = start + keep_ref[s]
    full = (mid - start) // BT
    Dk, Dv = q_ref.shape[2], v_ref.shape[2]
    r = jnp.arange(BT)
    lower, strict = r[:, None] >= r[None, :], r[:, None] > r[None, :]
    eye = (r[:, None] == r[None, :]).astype(jnp.float32)
    ck, cv = jnp.arange(Dk)[None, :], jnp.arange(Dv)[None, :]
    f32 = jnp.float32

    def chunk(c, h):
        t = (start + c * BT + r)[:, None]  # whole chunks: every index is the segment's
        q = plgpu.load(q_ref.at[t, kh, ck]).astype(f32)
        k = plgpu.load(k_ref.at[t, kh, ck]).astype(f32)
        v = plgpu.load(v_ref.at[t, j, cv]).astype(f32)
        g = plgpu.load(g_ref.at[t[:, 0], j]).astype(f32)
        b = plgpu.load(b_ref.at[t[:, 0], j]).astype(f32)
        G = jnp.sum(jnp.where(lower, g[None, :], 0.0), axis=1)  # inclusive cumsum
        D = jnp.exp(jnp.where(lower, G[:, None] - G[None, :], -1e30))
        kb = k * b[:, None]
        L = jnp.where(strict, _dot(kb, k, tb=True) * D, 0.0)
        inv, p = eye - L, L
        for _ in range(BT.bit_length() - 2):  # L^(2^i) for 2^i < BT
            p = _dot(p, p)
            inv = _dot(inv, eye + p)
        eg = jnp.exp(G)
        u = _dot(inv, v * b[:, None])
        w = _dot(inv, kb * eg[:, None])
        vn = u - _dot(w, h)
        a = jnp.where(lower, _dot(q, k, tb=True) * D, 0.0)
        o = _dot(q * eg[:, None], h) + _dot(a, vn)
        plgpu.store(o_ref.at[t, j, cv], o.astype(o_ref.dtype))
        g_last = jnp.sum(jnp.where(r == BT - 1, G, 0.0))
        return h * jnp.exp(g_last) + _dot(k * jnp.exp(g_last - G)[:, None], vn, ta=True)

    token = functools.partial(_token, q_ref, k_ref, v_ref, g_ref, b_ref, o_ref, kh, j)
    h = jax.lax.fori_loop(0, full, chunk, h0_ref[s, j].astype(f32))
    h = jax.lax.fori_loop(start + full * BT, mid, token, h)
    h_ref[s, j] = h.astype(h_ref.dtype)
    jax.lax.fori_loop(mid, end, token, h)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "chunk"))
def gated_delta(
    q, k, v, g, beta, h0, cu_q_lens, n_keep=None, *, interpret=None, num_warps=4, chunk=0
):
    """The gated delta rule of every segment, from its initial state (Pallas kernel).

    Args: as gated_delta_reference; chunk: 0 for the token-recurrent form, or the chunk size
      (16, 32 or 64) of the chunked form for the kept tokens.
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
    if chunk not in (0, 16, 32, 64):
        raise ValueError(f"chunk={chunk}: must be 0 (token form), 16, 32 or 64")
    body = functools.partial(_kernel_chunked, BT=chunk) if chunk else _kernel
    cu = cu_q_lens.astype(jnp.int32)
    args = (cu, n_keep.astype(jnp.int32), q, k, v, g, beta, h0.astype(jnp.float32))
    o, h = pl.pallas_call(
        functools.partial(body, n_k=Hk),
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
