"""Gated delta rule over a packed step's segments, each continuing from its slot's state.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

The rule (Gated DeltaNet, as Qwen3.5's linear layers run it), per value head with state
h [Dk, Dv] and per token: h = exp(g) h; h += k (beta (v - h^T k))^T; o = h^T q.

Work split: program (s, j, c) walks segment s's tokens (cu_q_lens[s] to cu_q_lens[s+1]) for
value head j and value columns c * BV to (c + 1) * BV (the rule never mixes value columns), its
[Dk, BV] state in registers. The state array of every linear layer and slot is aliased to the
kernel's output: a program reads its slot's state of the layer (zero on a slot's first row),
writes it back after the segment's first n_keep[s] tokens, then runs on through the rest (a
verify row's speculative proposals: they need outputs, but the slot keeps the state before
them). A padding row (slot -1) does nothing. A prompt chunk and a decode row are the same loop,
of many or one token; a segment never waits for another. Value head j reads key head j % Hk
(llama.cpp's tiled order). Tokens past the last segment (bucket padding) get zero output.

Two forms. The token-recurrent one (chunk=0) costs n dependent rank-1 updates per head for n
tokens; it is all a decode row needs. The chunked (WY / UT) one (chunk=16, 32 or 64) runs a
segment's whole chunks of kept tokens as a few matmuls each (`_chunk`) and the rest token by
token. Both are exact against the reference.

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


def _token(q_ref, k_ref, v_ref, g_ref, b_ref, o_ref, kh, j, cols, t, h):
    """Token t of value head j (key head kh), value columns cols: its output, and the state
    [Dk, BV] after it."""
    f32 = jnp.float32
    qt = q_ref[t, kh, :].astype(f32)  # [Dk]
    kt = k_ref[t, kh, :].astype(f32)
    vt = v_ref[t, j, cols].astype(f32)  # [BV]
    h = h * jnp.exp(g_ref[t, j].astype(f32))
    delta = (vt - jnp.sum(h * kt[:, None], axis=0)) * b_ref[t, j].astype(f32)
    h = h + kt[:, None] * delta[None, :]
    o_ref[t, j, cols] = jnp.sum(h * qt[:, None], axis=0).astype(o_ref.dtype)
    return h


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


def _kernel(
    meta_ref, cu_ref, keep_ref, q_ref, k_ref, v_ref, g_ref, b_ref, st_in, o_ref, st_ref,
    *, n_k, BT, BV,
):  # fmt: skip
    """Program (s, j, c): segment s, value head j, value columns c * BV to (c + 1) * BV.

    The state comes from the slot's row of layer meta[0] of the state array (zero on a fresh
    row) and goes back there after the kept tokens; a padding row (slot < 0) does nothing.
    A segment's whole chunks of BT kept tokens run in the chunked (WY / UT) form (BT > 0), the
    kept tokens after them (fewer than BT: all of a decode row) and the proposals after those
    token by token.

    Per chunk, with G the chunk's cumulative log decay and D[i, j] = exp(G_i - G_j) (j <= i):
    L = strictly_lower(beta_i k_i.k_j D), and (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...
    (L is nilpotent); u = (I + L)^-1 (beta v), w = (I + L)^-1 (beta k exp(G));
    v' = u - w h; o = exp(G) q h + lower(q k^T D) v'; h = exp(G_last) h + (k exp(G_last - G))^T v'.
    """
    s, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, slot, fresh = meta_ref[0], meta_ref[1 + s], meta_ref[1 + meta_ref.shape[0] // 2 + s]
    kh = j % n_k
    Dk = q_ref.shape[2]
    cols = pl.ds(c * BV, BV)
    f32 = jnp.float32

    @pl.when(slot >= 0)
    def _():
        start, end = cu_ref[s], cu_ref[s + 1]
        mid = start + keep_ref[s]  # tokens from here on are not kept in the slot's state
        h = st_in[layer, slot, j, :, cols]  # st_in and st_ref are one buffer (aliased)
        h = jnp.where(fresh != 0, jnp.zeros((Dk, BV), f32), h)
        token = functools.partial(_token, q_ref, k_ref, v_ref, g_ref, b_ref, o_ref, kh, j, cols)
        full = (mid - start) // BT if BT else 0
        if BT:
            h = jax.lax.fori_loop(0, full, functools.partial(_chunk, q_ref, k_ref, v_ref, g_ref,
                                  b_ref, o_ref, kh, j, c, start, BT, BV), h)  # fmt: skip
        h = jax.lax.fori_loop(start + full * BT, mid, token, h)
        st_ref[layer, slot, j, :, cols] = h
        jax.lax.fori_loop(mid, end, token, h)


def _chunk(q_ref, k_ref, v_ref, g_ref, b_ref, o_ref, kh, j, c, start, BT, BV, i, h):
    """Whole chunk i of a segment in the chunked form: its outputs, and the state after it."""
    Dk = q_ref.shape[2]
    r = jnp.arange(BT)
    lower, strict = r[:, None] >= r[None, :], r[:, None] > r[None, :]
    eye = (r[:, None] == r[None, :]).astype(jnp.float32)
    ck, cv = jnp.arange(Dk)[None, :], c * BV + jnp.arange(BV)[None, :]
    f32 = jnp.float32
    t = (start + i * BT + r)[:, None]  # whole chunks: every index is the segment's
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


def _check(q, k, v, g, beta, state, cu_q_lens, chunk):
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    S = cu_q_lens.shape[0] - 1
    if k.shape != q.shape or g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"shapes q {q.shape} k {k.shape} v {v.shape} g {g.shape} b {beta.shape}")
    if Hv % Hk or state.shape[-3:] != (Hv, Dk, Dv) or S < 1:
        raise ValueError(f"Hk={Hk} Hv={Hv} state {state.shape} cu_q_lens {cu_q_lens.shape}")
    if Dk & (Dk - 1) or Dv & (Dv - 1):
        raise ValueError(f"head dims Dk={Dk}, Dv={Dv} must be powers of two")
    if chunk not in (0, 16, 32, 64):
        raise ValueError(f"chunk={chunk}: must be 0 (token form), 16, 32 or 64")
    return S


def gated_delta_in_place_reference(
    q, k, v, g, beta, state, layer, slots, fresh, cu_q_lens, n_keep=None
):
    """gated_delta_reference on the slots' states of one layer of the state array.

    Args:
      q, k, v, g, beta, cu_q_lens, n_keep: as gated_delta_reference;
      state: [Lr, S_max, Hv, Dk, Dv] float32 per-slot states of every linear layer;
      layer: int32 scalar, the layer's index in it; slots: [S] int32 each segment's slot
        (-1: a padding row, which reads slot 0 and writes nowhere); fresh: [S] 1 where the
        segment starts from a zero state (a slot's first row).
    Returns:
      (o [T, Hv, Dv] float32, state with the slots' rows of that layer after their kept tokens).
    """
    read = jnp.maximum(slots, 0)
    write = jnp.where(slots < 0, state.shape[1], slots)
    keep = (fresh == 0) & (slots >= 0)
    h0 = jnp.where(keep[:, None, None, None], state[layer, read], 0.0)
    o, hs = gated_delta_reference(q, k, v, g, beta, h0, cu_q_lens, n_keep)
    return o, state.at[layer, write].set(hs, mode="drop")


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "chunk", "block_v"))
def gated_delta_in_place(
    q, k, v, g, beta, state, layer, slots, fresh, cu_q_lens, n_keep=None, *,
    interpret=None, num_warps=4, chunk=0, block_v=32,
):  # fmt: skip
    """The gated delta rule of every segment, from and into its slot's state (Pallas kernel).

    The state array is aliased to the second output: only the segments' slots' rows of
    `layer` are read and written (a decode row at one live slot moves 2 x Hv x Dk x Dv x 4
    bytes), where gathering the rows of a padded step out and scattering them back had moved
    each row of the bucket three times more.

    Args: as gated_delta_in_place_reference; chunk: 0 for the token-recurrent form, or the
      chunk size (16, 32 or 64) of the chunked form for the kept tokens; block_v: value
      columns a program keeps (BV; a [Dk, BV] float32 state stays in registers: Dk x Dv = 16K
      floats in one program of 4 warps had spilled).
    Returns:
      (o [T, Hv, Dv] float32, zero past the last segment; the updated state array).
    """
    T = q.shape[0]
    Hv, Dv = v.shape[1], v.shape[2]
    S = _check(q, k, v, g, beta, state, cu_q_lens, chunk)
    if state.ndim != 5 or slots.shape != (S,) or fresh.shape != (S,):
        raise ValueError(f"state {state.shape}, slots {slots.shape}, fresh {fresh.shape}")
    if n_keep is None:
        n_keep = cu_q_lens[1:] - cu_q_lens[:-1]
    BV = min(block_v, Dv)
    i32 = jnp.int32
    meta = jnp.concatenate([jnp.reshape(layer, (1,)).astype(i32), slots.astype(i32),
                            fresh.astype(i32)])  # fmt: skip
    args = (meta, cu_q_lens.astype(i32), n_keep.astype(i32), q, k, v, g, beta, state)
    o, state = pl.pallas_call(
        functools.partial(_kernel, n_k=q.shape[1], BT=chunk, BV=BV),
        grid=(S, Hv, Dv // BV),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(jax.ShapeDtypeStruct((T, Hv, Dv), jnp.float32)), whole(state)],
        out_shape=[
            jax.ShapeDtypeStruct((T, Hv, Dv), jnp.float32),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={8: 1},
        name="gated_delta",
        **call_options(interpret, num_warps, 1),
    )(*args)
    real = jnp.arange(T) < cu_q_lens[-1]
    return jnp.where(real[:, None, None], o, 0.0), state


def gated_delta(q, k, v, g, beta, h0, cu_q_lens, n_keep=None, *, interpret=None, num_warps=4,
                chunk=0, block_v=32):  # fmt: skip
    """The gated delta rule of every segment from its initial state (the Pallas kernel on a
    state array of one layer whose slots are the segments).

    Args: as gated_delta_reference; chunk, block_v: as gated_delta_in_place.
    Returns:
      (o [T, Hv, Dv] float32, zero past the last segment; states [S, Hv, Dk, Dv] float32
      after each segment's kept tokens).
    """
    S = _check(q, k, v, g, beta, h0, cu_q_lens, chunk)
    if h0.shape[0] != S:
        raise ValueError(f"h0 {h0.shape} does not fit {S} segments")
    slots, zero = jnp.arange(S, dtype=jnp.int32), jnp.zeros((S,), jnp.int32)
    o, state = gated_delta_in_place(
        q, k, v, g, beta, h0.astype(jnp.float32)[None], jnp.int32(0), slots, zero, cu_q_lens,
        n_keep, interpret=interpret, num_warps=num_warps, chunk=chunk, block_v=block_v,
    )  # fmt: skip
    return o, state[0]
