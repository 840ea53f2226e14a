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
segment's whole chunks of kept tokens in two phases: what a chunk contributes independently of
the state (its WY inverse, u, w, the masked q k^T) for every chunk of the step at once in XLA
(`_chunk_parts`), then in the kernel the chunk-to-chunk recurrence of the state, four small
matmuls a chunk; the rest of a segment token by token. (Computing a chunk's parts inside the
serial loop, 13 dependent matmuls a chunk, took 177 ms of a 512-token prompt step of the 27B
hybrid on the H200: bench/results/history/2026-12-03_profile_prefill_qwen35-27b-q4_k_m_e53d7e7.md.)
Both forms are exact against the reference.

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
    meta_ref, cu_ref, keep_ref, first_ref, q_ref, k_ref, v_ref, g_ref, b_ref, *refs,
    n_k, BT, BV,
):  # fmt: skip
    """Program (s, j, c): segment s, value head j, value columns c * BV to (c + 1) * BV.

    The state comes from the slot's row of layer meta[0] of the state array (zero on a fresh
    row) and goes back there after the kept tokens; a padding row (slot < 0) does nothing.
    A segment's whole chunks of BT kept tokens (BT > 0; their chunk-local parts computed
    beforehand by `_chunk_parts`, from chunk first_ref[s] on) carry the state in four small
    matmuls each; the kept tokens after them (fewer than BT: all of a decode row) and the
    proposals after those run token by token.
    """
    if BT:
        u_ref, w_ref, a_ref, qg_ref, kg_ref, decay_ref, st_in, o_ref, st_ref = refs
    else:
        st_in, o_ref, st_ref = refs
    s, j, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, slot, fresh = meta_ref[0], meta_ref[1 + s], meta_ref[1 + meta_ref.shape[0] // 2 + s]
    kh = j % n_k
    Dk = q_ref.shape[2]
    cols = pl.ds(c * BV, BV)
    f32 = jnp.float32

    def chunk(start, i, h):
        """Whole chunk i of the segment: v' = u - w h; o = q exp(G) h + A v';
        h = exp(G_last) h + (k exp(G_last - G))^T v'."""
        ci = first_ref[s] + i
        vn = u_ref[ci, j, :, cols] - _dot(w_ref[ci, j], h)  # [BT, BV]
        o = _dot(qg_ref[ci, j], h) + _dot(a_ref[ci, j], vn)
        o_ref[pl.ds(start + i * BT, BT), j, cols] = o.astype(o_ref.dtype)
        return h * decay_ref[ci, j] + _dot(kg_ref[ci, j], vn)  # kg stored [Dk, BT]

    @pl.when(slot >= 0)
    def _():
        start, end = cu_ref[s], cu_ref[s + 1]
        mid = start + keep_ref[s]  # tokens from here on are not kept in the slot's state
        h = st_in[layer, slot, j, :, cols]  # st_in and st_ref are one buffer (aliased)
        h = jnp.where(fresh != 0, jnp.zeros((Dk, BV), f32), h)
        token = functools.partial(_token, q_ref, k_ref, v_ref, g_ref, b_ref, o_ref, kh, j, cols)
        full = (mid - start) // BT if BT else 0
        if BT:
            h = jax.lax.fori_loop(0, full, functools.partial(chunk, start), h)
        h = jax.lax.fori_loop(start + full * BT, mid, token, h)
        st_ref[layer, slot, j, :, cols] = h
        jax.lax.fori_loop(mid, end, token, h)


def _chunk_parts(q, k, v, g, beta, cu_q_lens, n_keep, BT: int):
    """What each whole chunk of BT kept tokens contributes independently of the state, for
    every chunk of every segment at once (XLA, float32).

    Per chunk, with G the chunk's cumulative log decay and D[i, j] = exp(G_i - G_j) (j <= i):
    L = strictly_lower(beta_i k_i.k_j D), and (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...
    (L is nilpotent); u = (I + L)^-1 (beta v), w = (I + L)^-1 (beta k exp(G)),
    A = lower(q k^T D), q exp(G), (k exp(G_last - G))^T and exp(G_last).

    Returns:
      (first [S] int32: each segment's first chunk; (u [NC, Hv, BT, Dv], w [NC, Hv, BT, Dk],
      A [NC, Hv, BT, BT], q exp(G) [NC, Hv, BT, Dk], kg [NC, Hv, Dk, BT], exp(G_last)
      [NC, Hv])), NC = T // BT + 1 chunks (the last never used: a bound that keeps NC >= 1).
    """
    T, Hk, _ = q.shape
    Hv = v.shape[1]
    full = n_keep // BT
    ends = jnp.cumsum(full)
    first = (ends - full).astype(jnp.int32)
    NC = T // BT + 1
    i = jnp.arange(NC)
    seg = jnp.minimum(jnp.searchsorted(ends, i, side="right", method="compare_all"), len(full) - 1)
    start = cu_q_lens[seg] + (i - first[seg]) * BT
    t = jnp.clip(start[:, None] + jnp.arange(BT)[None, :], 0, T - 1)  # [NC, BT]
    heads = jnp.arange(Hv) % Hk
    f32 = jnp.float32

    def chunks(x, key_heads=False):  # [T, H, D] -> [NC, Hv, BT, D]
        x = x.astype(f32)[t]
        return jnp.moveaxis(x[:, :, heads] if key_heads else x, 2, 1)

    qc, kc, vc = chunks(q, True), chunks(k, True), chunks(v)
    gc, bc = jnp.moveaxis(g.astype(f32)[t], 2, 1), jnp.moveaxis(beta.astype(f32)[t], 2, 1)
    r = jnp.arange(BT)
    lower, strict = r[:, None] >= r[None, :], r[:, None] > r[None, :]
    eye = jnp.eye(BT, dtype=f32)
    G = jnp.cumsum(gc, axis=-1)  # [NC, Hv, BT]
    D = jnp.exp(jnp.where(lower, G[..., :, None] - G[..., None, :], -1e30))

    def mm(a, b):
        return jnp.einsum("...ij,...jk->...ik", a, b, precision=jax.lax.Precision.HIGHEST)

    kb = kc * bc[..., None]
    L = jnp.where(strict, mm(kb, jnp.swapaxes(kc, -1, -2)) * D, 0.0)
    inv, p = eye - L, L
    for _ in range(BT.bit_length() - 2):  # L^(2^i) for 2^i < BT
        p = mm(p, p)
        inv = mm(inv, eye + p)
    eg = jnp.exp(G)
    g_last = G[..., -1]
    u = mm(inv, vc * bc[..., None])
    w = mm(inv, kb * eg[..., None])
    a = jnp.where(lower, mm(qc, jnp.swapaxes(kc, -1, -2)) * D, 0.0)
    kg = jnp.swapaxes(kc * jnp.exp(g_last[..., None] - G)[..., None], -1, -2)
    return first, (u, w, a, qc * eg[..., None], kg, jnp.exp(g_last))


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
    chunk = chunk if chunk <= T else 0  # no whole chunk fits the step
    i32 = jnp.int32
    meta = jnp.concatenate([jnp.reshape(layer, (1,)).astype(i32), slots.astype(i32),
                            fresh.astype(i32)])  # fmt: skip
    cu, keep = cu_q_lens.astype(i32), n_keep.astype(i32)
    # without chunks the kernel reads no chunk parts, and `first` only stands in its place
    first, parts = _chunk_parts(q, k, v, g, beta, cu, keep, chunk) if chunk else (keep, ())
    args = (meta, cu, keep, first, q, k, v, g, beta, *parts, state)
    o, state = pl.pallas_call(
        functools.partial(_kernel, n_k=q.shape[1], BT=chunk, BV=BV),
        grid=(S, Hv, Dv // BV),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(jax.ShapeDtypeStruct((T, Hv, Dv), jnp.float32)), whole(state)],
        out_shape=[
            jax.ShapeDtypeStruct((T, Hv, Dv), jnp.float32),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(args) - 1: 1},
        **call_options(interpret, num_warps, 1, name="gated_delta"),
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
    S = cu_q_lens.shape[0] - 1  # the rest gated_delta_in_place checks
    if h0.shape[0] != S:
        raise ValueError(f"h0 {h0.shape} does not fit {S} segments")
    slots, zero = jnp.arange(S, dtype=jnp.int32), jnp.zeros((S,), jnp.int32)
    o, state = gated_delta_in_place(
        q, k, v, g, beta, h0.astype(jnp.float32)[None], jnp.int32(0), slots, zero, cu_q_lens,
        n_keep, interpret=interpret, num_warps=num_warps, chunk=chunk, block_v=block_v,
    )  # fmt: skip
    return o, state[0]
