"""Attention with a sink logit per head over keys gathered by row index (DeepSeek V4): each
query row reads its keys, one shared K = V head, from flat caches at the rows it is given (a
raw window's, then compressed entries': all visible HCA entries or the CSA entries its
indexer picked), -1 for none. The sink joins the softmax's denominator and carries no value.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops. Program
(t, b) takes query row t and BH of its heads, walks each key set in tiles of BN rows with an
online softmax (a tile's rows are one gather from the cache, rows of -1 masked loads, never
read) and folds the sink in at the end. Its cost is the keys it is given, not the context:
Flash's CSA row reads 128 window rows and 512 picked entries however long the sequence.

Triton backend (CUDA; ROCm through Triton as well); on CPU the kernel runs in interpret mode.
Heads are padded to BH (16, a dot's smallest side) with masked loads; D is a power of two.

Shapes: T query rows, H heads, D head width, NR cache rows, N keys a row is given.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole
from .split_combine import MASK_VALUE

BH, BN = 16, 16  # heads a program takes; key rows a tile gathers


def sink_attention_keys(q, keys, valid, sinks, scale: float):
    """[T, H, D] float32 over keys already gathered: per row and head, sum_j p_j k_j with p
    the softmax of [q . k_j * scale (valid keys only), sink_h], the sink's share dropped
    (transformers' eager_attention_forward with s_aux, gpt-oss's form).

    Args: q [T, H, D]; keys [T, N, D] (K = V); valid [T, N] bool; sinks [H]; scale: the
      scores' factor (1 / sqrt(D) in DeepSeek V4).
    """
    hi = jax.lax.Precision.HIGHEST
    q, keys = q.astype(jnp.float32), keys.astype(jnp.float32)
    s = jnp.einsum("thd,tnd->thn", q, keys, precision=hi) * scale
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (*s.shape[:2], 1))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("thn,tnd->thd", p, keys, precision=hi)


def sink_attention_reference(q, caches, rows, sinks, *, scale: float):
    """The kernel's result by XLA: each row's keys gathered, then sink_attention_keys.

    Args: q [T, H, D]; caches: flat caches [NR_i, D] (K = V); rows: for each cache, int32
      [T, N_i] rows of it, -1 for none; sinks [H]; scale: the scores' factor.
    """
    keys = jnp.concatenate(
        [c[jnp.maximum(r, 0)] for c, r in zip(caches, rows, strict=True)], axis=1
    )  # [T, N, D]
    valid = jnp.concatenate([r >= 0 for r in rows], axis=1)
    return sink_attention_keys(q, keys, valid, sinks, scale)


def _dot(a, b, contract_b: int):
    return jax.lax.dot_general(
        a, b, (((1,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32
    )


def _kernel(q_ref, sink_ref, *refs, scale: float, sets: int):
    cache_refs, row_refs, out_ref = refs[:sets], refs[sets : 2 * sets], refs[-1]
    T, H, D = q_ref.shape
    t, b = pl.program_id(0), pl.program_id(1)
    h = b * BH + jnp.arange(BH)
    head_ok = h < H
    hq = jnp.minimum(h, H - 1)
    d = jnp.arange(D)
    cdt = cache_refs[0].dtype
    q = plgpu.load(q_ref.at[t, hq[:, None], d[None, :]], mask=head_ok[:, None], other=0)
    q = q.astype(cdt)

    def walk(cache_ref, rows_ref, carry):
        def body(j, carry):
            m, den, acc = carry
            r = plgpu.load(rows_ref.at[t, j * BN + jnp.arange(BN)])  # [BN]
            ok = r >= 0
            k = plgpu.load(cache_ref.at[jnp.maximum(r, 0)[:, None], d[None, :]],
                           mask=ok[:, None], other=0)  # fmt: skip
            s = jnp.where(ok[None, :], _dot(q, k, 1) * scale, MASK_VALUE)  # [BH, BN]
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
            alpha = jnp.exp(m - m_new)
            acc = acc * alpha[:, None] + _dot(p.astype(cdt), k, 0)
            return m_new, den * alpha + jnp.sum(p, axis=1), acc

        return jax.lax.fori_loop(0, rows_ref.shape[1] // BN, body, carry)

    carry = (
        jnp.full((BH,), MASK_VALUE, jnp.float32),
        jnp.zeros((BH,), jnp.float32),
        jnp.zeros((BH, D), jnp.float32),
    )
    for cache_ref, rows_ref in zip(cache_refs, row_refs, strict=True):
        carry = walk(cache_ref, rows_ref, carry)
    m, den, acc = carry
    sink = plgpu.load(sink_ref.at[hq]).astype(jnp.float32)
    top = jnp.maximum(m, sink)
    keep = jnp.exp(m - top)
    den = den * keep + jnp.exp(sink - top)
    # the output has BH-padded heads: no two rows of a store share an address
    plgpu.store(out_ref.at[t, h[:, None], d[None, :]], acc * (keep / den)[:, None])


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_warps", "num_stages"))
def sink_attention(q, caches, rows, sinks, *, scale: float, interpret: bool | None = None,
                   num_warps: int = 4, num_stages: int = 2):  # fmt: skip
    """sink_attention_reference's result from one kernel: [T, H, D] float32.

    Args: as the reference's (caches a tuple of [NR_i, D], rows a tuple of [T, N_i]).
    """
    T, H, D = q.shape
    if D & (D - 1):
        raise ValueError(f"head dim {D}: the kernel takes powers of two")
    caches, rows = tuple(caches), tuple(rows)
    # each key set padded with rows of -1 to whole tiles
    rows = tuple(
        jnp.pad(r.astype(jnp.int32), ((0, 0), (0, -r.shape[1] % BN)), constant_values=-1)
        for r in rows
    )
    kernel = functools.partial(_kernel, scale=scale, sets=len(caches))
    operands = (q, sinks.astype(jnp.float32), *caches, *rows)
    Hp = -(-H // BH) * BH
    out = pl.pallas_call(
        kernel,
        grid=(T, Hp // BH),
        in_specs=[whole(a) for a in operands],
        out_specs=pl.BlockSpec((T, Hp, D), lambda *_: (0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((T, Hp, D), jnp.float32),
        **call_options(interpret, num_warps, num_stages, name="sink_attention"),
    )(*operands)
    return out[:, :H]
