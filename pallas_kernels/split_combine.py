"""Flash-decoding's last step: the kv splits' partial softmax states combined into attention rows.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

paged_attention.py spreads a query block's keys over NS programs (splits), each storing a
partial state (max m, sum l, accumulator acc) at its rows and heads. Output row t, head h is
sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max m) over the splits that saw a key.

The reference is XLA's: a reduction over every partial row of the bucket, valid or not (the
kernel never writes rows outside every segment). The Pallas kernel takes program (t, h), loads
row t's NS partials of head h only where t is a real row, and writes zeros elsewhere, so a decode
bucket of 8 rows with one live reads one row's partials. On the H200 with 64 splits (one decode
row over 16k keys, bf16 KV) the attention call took 37.5 -> 32.6 us, over 32k keys 52.8 -> 47.9,
q8_0 KV at 16k 43.5 -> 37.0; at 16 splits (4k keys) it was within 1 us either way, and a
512-row prompt chunk was 13% slower (bench/results/attention_split_combine_h200.md):
paged_attention takes it from 32 splits on.

Shapes: NS splits, T rows (+ spare rows of the last query block), K kv heads, G heads a kv head
padded to a power of two (Gr real), H = K * Gr query heads, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole

PALLAS_FROM_SPLITS = 32  # fewer splits: XLA's reduction was as fast (see the docstring)
MASK_VALUE = -1e30  # finite: a fully masked row keeps m finite and contributes nothing


def split_combine_reference(acc, m, den, cu_q_lens, T: int, H: int, dtype):
    """XLA's combine.

    Args:
      acc: [NS, T', K, G, D] f32 partial accumulators (T' >= T rows);
      m, den: [NS, T', K, G] f32 partial maxima and sums;
      cu_q_lens: [S+1] int32 row offsets (rows from cu_q_lens[-1] on are outside every segment);
      T: rows of the output; H: query heads (the first H / K of each kv head's G); dtype: out's.
    Returns:
      [T, H, D] in dtype; rows outside every segment are zero.
    """
    K = m.shape[2]
    mx = jnp.max(m, axis=0)
    w = jnp.where(den > 0, jnp.exp(m - mx), 0.0)
    o = (
        jnp.sum(w[..., None] * acc, axis=0)
        / jnp.maximum(jnp.sum(w * den, axis=0), 1e-30)[..., None]
    )
    o = o[:T, :, : H // K].reshape(T, H, acc.shape[-1])
    real = jnp.arange(T) < cu_q_lens[-1]
    return jnp.where(real[:, None, None], o, 0).astype(dtype)


def _kernel(cu_ref, acc_ref, m_ref, l_ref, o_ref, *, NS, NSP, Gr):
    """Program (t, h): row t's head h from its NS splits' partials, or zeros past the rows."""
    t, h = pl.program_id(0), pl.program_id(1)
    kh, g = h // Gr, h % Gr
    D = acc_ref.shape[-1]
    s = jnp.arange(NSP)  # splits padded to a power of two (Triton tiles), masked
    real = t < cu_ref[cu_ref.shape[0] - 1]
    ok = (s < NS) & real  # rows past the segments were never written: not read
    sc = jnp.minimum(s, NS - 1)
    m = plgpu.load(m_ref.at[sc, t, kh, g], mask=ok, other=MASK_VALUE)
    den = plgpu.load(l_ref.at[sc, t, kh, g], mask=ok, other=0.0)
    d = jnp.arange(D)
    acc = plgpu.load(acc_ref.at[sc[:, None], t, kh, g, d[None, :]], mask=ok[:, None], other=0.0)
    w = jnp.where(den > 0, jnp.exp(m - jnp.max(m)), 0.0)
    o = jnp.sum(w[:, None] * acc, axis=0) / jnp.maximum(jnp.sum(w * den), 1e-30)
    plgpu.store(o_ref.at[t, h, d], jnp.where(real, o, 0.0).astype(o_ref.dtype))


def split_combine(acc, m, den, cu_q_lens, T: int, H: int, dtype, *, interpret=None, num_warps=4):
    """Pallas split_combine_reference (same arguments): a program a row and head.

    Args:
      interpret: run in interpret mode (default: when the backend is the CPU).
      num_warps: Triton's warps a program.
    """
    NS, _, K, G = m.shape
    if H % K or H // K > G or acc.shape[:4] != m.shape or den.shape != m.shape:
        raise ValueError(f"partials {acc.shape}, {m.shape}, {den.shape} do not fit {H} heads")
    kernel = functools.partial(_kernel, NS=NS, NSP=1 << (NS - 1).bit_length(), Gr=H // K)
    inputs = (cu_q_lens, acc, m, den)
    shape = jax.ShapeDtypeStruct((T, H, acc.shape[-1]), dtype)
    return pl.pallas_call(
        kernel,
        grid=(T, H),
        in_specs=[whole(x) for x in inputs],
        out_specs=whole(shape),
        out_shape=shape,
        **call_options(interpret, num_warps, 1, name="split_combine"),
    )(*inputs)
