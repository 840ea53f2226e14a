"""A mixture-of-experts router in two kernels: XLA's dot for the router's logits, then one
program per row for their scores, top-k (optionally group-limited, with a selection bias) and
the routing weights.

As XLA ops a decode step's router was the logits' dot, top-k, the softmax and the padding
rows' select: four or more kernels of every MoE layer, each a node of the step's CUDA graph,
which the host updates node by node every step (1,190-1,383 kernels a 48-layer step:
bench/results/history/2026-12-02_profile_qwen3-30b-a3b-q4_k_m_int8_9ed94c9.md). Here a
program routes one row: k rounds of "largest score, lowest index on ties" (jax.lax.top_k's
order) over its scores. With `fused_dot` the program also computes the row's logits on the
vector units (and its RMSNorm): one kernel, but a program per row reads the whole router
matrix, which on the H200 made a 48-layer step 6 ms slower at one row
(bench/results/history/2026-12-05_engine_decode_moe_router_h200.md).

Scoring (llama.cpp's expert_gating_func): softmax over all E, sigmoid, or sqrt(softplus)
(DeepSeek V4). A selection `bias` (DeepSeek's e_score_correction_bias) is added to the scores
for choosing only; the weights are the unbiased scores, renormalized over the k chosen if
asked (their sum floored at NORM_FLOOR, as llama.cpp clamps it) and times `scale`.
Group-limited routing (DeepSeek V3): E experts in G groups, a group scored by the sum of its
two best biased scores, only the `groups_used` best groups' experts eligible.

Shapes: T rows, d model width, E experts, k experts per row, G groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole
from .int8_rows import rms_norm

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
NORM_FLOOR = 6.103515625e-5  # llama.cpp clamps the renormalizing sum at 2**-14


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _scores(logits, scoring: str, valid):
    """Scores of logits [.., E] (padding columns: invalid) by `scoring`."""
    if scoring == "softmax":
        z = jnp.where(valid, logits, -jnp.inf)
        e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
        return e / jnp.sum(e, axis=-1, keepdims=True)
    if scoring == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jnp.logaddexp(logits, 0.0))  # sqrt(softplus)


def moe_router_reference(x, router, bias=None, norm=None, *, k: int, scoring: str = "softmax",
                         renorm: bool = True, scale: float = 1.0, groups: int = 1,
                         groups_used: int = 1, eps: float = 1e-6, live=None,
                         experts=None):  # fmt: skip
    """(weights [T, k] float32, experts [T, k] int32) of rows x [T, d] (normed by `norm` [d]
    first where given) under router [d, E]; rows at or past `live` (padding) get expert E and
    weight 0. `experts` [T, k]: the experts chosen already (DeepSeek V4's hash-routed layers
    take them from a token-id table); only their weights come from the scores."""
    x = x.astype(jnp.float32)
    if norm is not None:
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * norm
    logits = jnp.dot(x, router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    E = logits.shape[-1]
    if experts is not None:
        w = jnp.take_along_axis(_scores(logits, scoring, True), experts, axis=-1)
        if renorm:
            w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), NORM_FLOOR)
        return _padded(w * scale, experts.astype(jnp.int32), E, live)
    if scoring == "softmax" and renorm and bias is None and groups == 1:
        # the top k of the softmax, renormalized, is the softmax of the top k logits: no
        # reduction over all E (XLA's kernels of every decode step, each MoE layer's)
        z, idx = jax.lax.top_k(logits, k)
        w, idx = jax.nn.softmax(z, axis=-1) * scale, idx.astype(jnp.int32)
        return _padded(w, idx, E, live)
    s = _scores(logits, scoring, True)
    choice = s if bias is None else s + bias
    if groups > 1:
        per = choice.reshape(-1, groups, E // groups)
        top2 = jax.lax.top_k(per, 2)[0].sum(-1)  # [T, G]
        _, best = jax.lax.top_k(top2, groups_used)
        keep = jnp.zeros(top2.shape, bool).at[jnp.arange(top2.shape[0])[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(keep, E // groups, axis=-1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if renorm:
        w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), NORM_FLOOR)
    return _padded(w * scale, idx.astype(jnp.int32), E, live)


def _padded(w, idx, E: int, live):
    """Rows at or past `live` (padding): expert E, weight 0."""
    if live is None:
        return w, idx
    pad = (jnp.arange(w.shape[0]) >= live)[:, None]
    return jnp.where(pad, 0.0, w), jnp.where(pad, E, idx)


def _kernel(live_ref, x_ref, r_ref, b_ref, n_ref, w_ref, e_ref, *, E, Ep, BD, k, KP, scoring,
            renorm, scale, G, groups_used, eps, norm, dot):  # fmt: skip
    """Program i: row i's routing (padding rows: expert E, weight 0). With `dot` x holds the
    rows and r the router matrix; without, x holds the logits [T, E] and r is unused."""
    i = pl.program_id(0)
    cols = jnp.arange(Ep)
    valid = cols < E
    slots = jnp.arange(KP)

    @pl.when(i >= live_ref[0])
    def _():
        plgpu.store(w_ref.at[i, slots], jnp.zeros((KP,), jnp.float32))
        plgpu.store(e_ref.at[i, slots], jnp.full((KP,), E, jnp.int32))

    @pl.when(i < live_ref[0])
    def _():
        if dot:
            logits = _logits(i, x_ref, r_ref, n_ref, cols, valid, BD=BD, eps=eps, norm=norm)
        else:
            logits = plgpu.load(x_ref.at[i, cols], mask=valid, other=0.0).astype(jnp.float32)
        s = _scores(logits, scoring, valid)
        choice = jnp.where(valid, s + plgpu.load(b_ref.at[cols], mask=valid, other=0.0), -jnp.inf)
        if G > 1:
            choice = _group_limit(choice, cols, valid, E=E, Ep=Ep, G=G, groups_used=groups_used)
        w = jnp.zeros((KP,), jnp.float32)
        ex = jnp.full((KP,), E, jnp.int32)
        for j in range(k):  # the largest left, the lowest index among equals
            m = jnp.max(choice)
            at = jnp.min(jnp.where(choice == m, cols, Ep))
            hit = cols == at
            ex = jnp.where(slots == j, at, ex)
            w = jnp.where(slots == j, jnp.sum(jnp.where(hit, s, 0.0)), w)
            choice = jnp.where(hit, -jnp.inf, choice)
        if renorm:
            w = w / jnp.maximum(jnp.sum(w), NORM_FLOOR)
        plgpu.store(w_ref.at[i, slots], w * scale)
        plgpu.store(e_ref.at[i, slots], ex)


def _logits(i, x_ref, r_ref, n_ref, cols, valid, *, BD, eps, norm):
    """Row i's logits [Ep] on the vector units, over chunks of the model width (the RMSNorm of
    the row first where `norm`)."""
    d = x_ref.shape[1]
    ks = jnp.arange(BD)
    inv = 1.0
    if norm:  # the row's RMS first: a pass over its values

        def sq(c, acc):
            v = plgpu.load(x_ref.at[i, c * BD + ks])
            return acc + jnp.sum(v * v)

        ss = jax.lax.fori_loop(0, d // BD, sq, jnp.float32(0.0))
        inv = jax.lax.rsqrt(ss / d + eps)

    def body(c, acc):
        v = plgpu.load(x_ref.at[i, c * BD + ks]).astype(jnp.float32) * inv
        if norm:
            v = v * plgpu.load(n_ref.at[c * BD + ks])
        r = plgpu.load(r_ref.at[(c * BD + ks)[:, None], cols[None, :]],
                       mask=valid[None, :], other=0.0).astype(jnp.float32)  # fmt: skip
        return acc + jnp.sum(v[:, None] * r, axis=0)

    return jax.lax.fori_loop(0, d // BD, body, jnp.zeros((cols.shape[0],), jnp.float32))


def _group_limit(choice, cols, valid, *, E, Ep, G, groups_used):
    """choice with every expert outside the groups_used best groups at -inf; a group's score
    is the sum of its two best choices."""
    gid = cols // (E // G)
    Gp = _pow2(G)
    garr = jnp.arange(Gp)
    gv = jnp.full((Gp,), -jnp.inf, jnp.float32)
    for g in range(G):
        in_g = valid & (gid == g)
        m1 = jnp.max(jnp.where(in_g, choice, -jnp.inf))
        i1 = jnp.min(jnp.where(in_g & (choice == m1), cols, Ep))
        top2 = m1 + jnp.max(jnp.where(in_g & (cols != i1), choice, -jnp.inf))
        gv = jnp.where(garr == g, top2, gv)
    keep = cols < 0
    for _ in range(groups_used):  # the best group left, the lowest index among equals
        at = jnp.min(jnp.where(gv == jnp.max(gv), garr, Gp))
        keep = keep | (gid == at)
        gv = jnp.where(garr == at, -jnp.inf, gv)
    return jnp.where(keep, choice, -jnp.inf)


@functools.partial(
    jax.jit,
    static_argnames=("k", "scoring", "renorm", "scale", "groups", "groups_used", "eps",
                     "fused_dot", "interpret", "num_warps"),
)  # fmt: skip
def moe_router(x, router, bias=None, norm=None, *, k: int, scoring: str = "softmax",
               renorm: bool = True, scale: float = 1.0, groups: int = 1, groups_used: int = 1,
               eps: float = 1e-6, live=None, fused_dot: bool = False, interpret=None,
               num_warps: int = 4):  # fmt: skip
    """moe_router_reference in two kernels, XLA's dot for the logits (spread over the whole
    GPU) and a program per row for the rest, or with `fused_dot` in one, whose program per row
    reads the whole router matrix (slower on the H200: backends.moe_router_fn).

    Args:
      x: [T, d] float32 rows (the normed FFN input, or with `norm` the residual rows);
        router: [d, E] (float32 as files hold it); bias: [E] selection bias or None;
        norm: [d] RMSNorm weights applied to x first, or None.
      k: experts per row; scoring: one of SCORINGS; renorm: weights over the k sum to 1;
        scale: the weights' factor; groups, groups_used: group-limited routing (E % groups
        == 0); eps: the norm's epsilon; live: int32 scalar, the rows that matter (None: all).
    Returns:
      (weights [T, k] float32, experts [T, k] int32); padding rows: expert E, weight 0.
    """
    T, d = x.shape
    E = router.shape[1]
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r}: must be one of {SCORINGS}")
    if router.shape[0] != d or not 0 < k <= E or E % groups or not 0 < groups_used <= groups:
        raise ValueError(
            f"router {router.shape} for x {x.shape}, k={k}, groups={groups}/{groups_used}"
        )
    Ep, KP = _pow2(E), _pow2(k)
    BD = max(1, min(_pow2(d), 8192 // Ep))  # a chunk's router tile: BD x Ep values
    while d % BD:
        BD //= 2
    bias = jnp.zeros((E,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    nw = jnp.ones((d,), jnp.float32) if norm is None else norm.astype(jnp.float32)
    live = jnp.full((1,), T if live is None else live, jnp.int32)
    if not fused_dot:
        x = x.astype(jnp.float32) if norm is None else rms_norm(x, nw, eps)
        x = jnp.dot(x, router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        router = jnp.zeros((1, 1), jnp.float32)  # unread
    kernel = functools.partial(
        _kernel, E=E, Ep=Ep, BD=BD, k=k, KP=KP, scoring=scoring, renorm=renorm, scale=scale,
        G=groups, groups_used=groups_used, eps=eps, norm=norm is not None, dot=fused_dot,
    )  # fmt: skip
    shapes = (jax.ShapeDtypeStruct((T, KP), jnp.float32), jax.ShapeDtypeStruct((T, KP), jnp.int32))
    w, ex = pl.pallas_call(
        kernel,
        grid=(T,),
        in_specs=[whole(a) for a in (live, x, router, bias, nw)],
        out_specs=[whole(s) for s in shapes],
        out_shape=shapes,
        **call_options(interpret, num_warps, 1, name="moe_router"),
    )(live, x, router, bias, nw)
    return w[:, :k], ex[:, :k]
