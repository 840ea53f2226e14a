"""Linear layers over dense or GGML-quantized weights: one call site for every projection.

A weight is a dense array [in, out], a QuantWeight [out, in] (the file's blocks, kept on the
device), or a tuple of these whose outputs are concatenated (q / k / v or gate / up stored in
different GGML types, which cannot share one block matrix). An input is an array, or rows
linear() computes itself: Normed (an RMSNorm) and Gated (a SwiGLU's silu(gate) * up), so that
a decode step on the quantized kernel's int8 rows computes them and their rounding in one
kernel (pallas_kernels/int8_rows.py), and on float activations a decode step's norm is one
kernel too (norm_rows).

Shapes: T tokens, K input width, N output width, V vocabulary, d model width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from pallas_kernels.int8_rows import live_sum, rms_norm
from pallas_kernels.quant_matmul import quant_matmul_xla
from pallas_kernels.quant_weight import QuantWeight, dequantize_weight
from pallas_kernels.swiglu import swiglu

from . import fused_layout


class QuantMatmul(NamedTuple):
    """How quantized projections run: `kernel` (quant_matmul's signature, None: XLA only) for
    calls of at most `max_rows` rows; above it `prefill` (x, w) -> [T, N] float32, or XLA's
    dequantize-then-dot where that is None.

    Per bucket, since T is static: on the H200 the Pallas kernel beat XLA's dequantize-then-dot
    at decode sizes (Q4_K gate/up M 1: 95 vs 125 us) and lost badly at prefill sizes (M 512:
    1011 vs 231 us), bench/results/history/2026-11-30_quant_matmul_types_h200.md. Above max_rows the
    engine's prefill is pallas_kernels/dequantize.py then XLA's dot, faster than XLA's own
    dequantizing (Q4_K gate/up M 512: 207 vs 260 us; history/2026-12-02_dequantize_prefill_h200.md).
    """

    kernel: object = None
    max_rows: int = 64
    # Quantized experts a (token, expert) pair at a time up to this many pairs (models/moe.
    # by_rows), grouped above. Q4_K, 30B-A3B shapes, H200 (bench/results/
    # history/2026-12-01_moe_kernel_rows_q4_k_0b2eb14.md), float activations, us per call, grouped
    # vs pairs: gate/up 306 vs 104 at 64 pairs, 447 vs 328 at 256, 464 vs 628 at 512; down 169
    # vs 177 at 256.
    max_pairs: int = 256
    # The smallest token bucket: the only one whose steps can hold as few live rows as the
    # kernel's vector path takes (2). Buckets double (step_format.buckets) and a step takes the
    # smallest that fits, so a larger bucket's steps are more than half live; their calls get
    # no `live` and compile without that path, which cut a Q4_K call's Triton compile from 3.4
    # to 1.4 s and Q6_K's from 7.8 to 2.8 s (bench/kernel_ptx.py's modules, this CPU). The
    # logits head lifts the limit (logits.head): a row bucket of any size can hold one live row.
    live_rows_max: int = 8  # build.py passes step_format.SMALLEST_TOKEN_BUCKET
    prefill: object = None  # (x [T, K], w) -> [T, N] float32; None: XLA's dequantize-then-dot
    # (x [T, K], w [K], eps=, dtype=) -> (h, x8): the norm of a Normed input and the int8 rows
    # the kernel rounds h to, in one kernel (pallas_kernels/int8_rows.norm_int8_rows), where
    # the kernel takes int8 activations; None: XLA's norm, and the kernel rounds h itself.
    norm_int8: object = None
    # (x [T, K], w [K], eps=, dtype=) -> h: the norm alone in one kernel (int8_rows.norm_rows),
    # for decode-sized calls on float activations; None: XLA's norm (two kernels at one row).
    norm: object = None
    # (parts [S, T, 2F], dtype=) -> (h, x8): a Gated input's silu(gate) * up from the gate | up
    # kernel's split partials and its int8 rows, in one kernel (int8_rows.glu_int8_rows).
    glu_int8: object = None
    # (x [T, K], w [E, K, N], experts=, fan_out=, splits=) -> [S, T * fan_out, N] float32:
    # dense experts a (token, expert) pair at a time (pallas_kernels/expert_rows.py), up to
    # max_pairs pairs as quantized ones; None: the grouped matmul.
    expert_rows: object = None


def _int8_rows_call(T: int, w, qmm: QuantMatmul | None, live) -> bool:
    """Whether linear(x [T, K], w, qmm, live) runs the kernel on int8 rows of x: a quantized
    weight in a call that gets `live` (its vector path)."""
    if qmm is None or qmm.kernel is None or live is None:
        return False
    parts = w if isinstance(w, tuple) else (w,)
    on = T <= min(qmm.max_rows, qmm.live_rows_max)
    return on and any(isinstance(p, QuantWeight) for p in parts)


class Splits(NamedTuple):
    """The kernel's split-contraction partials [S, T, N] float32 of a product, unsummed, of
    which rows at or past `live` were not written (quant_matmul's `splits`)."""

    parts: object
    live: object

    def array(self):
        return live_sum(self.parts, self.live)


class Normed(NamedTuple):
    """rms_norm(x, w, eps) of x [T, K], computed by the linear() that takes it: a decode step's
    norm and the kernel's int8 rounding of its result are then one kernel, not two (XLA's norm
    fusion and int8_rows), for each norm of a layer."""

    x: object
    w: object
    eps: float

    @property
    def shape(self):
        return self.x.shape

    def array(self):
        return rms_norm(self.x, self.w, self.eps)

    def rows(self, w, qmm: QuantMatmul | None, live):
        """(h [T, K], its int8 rows or None) for linear(self, w, qmm, live)."""
        if _int8_rows_call(self.shape[0], w, qmm, live):
            rows = self.kernel_rows(qmm, weight_dtype(w))
            if rows is not None:
                return rows
        return self.array(), None

    def kernel_rows(self, qmm: QuantMatmul, dtype):
        """(h in dtype, its int8 rows or None) from one kernel: qmm.norm_int8 where the kernel
        takes int8 activations, else qmm.norm; None where qmm has neither."""
        if qmm.norm_int8 is not None:
            return qmm.norm_int8(self.x, self.w, eps=self.eps, dtype=dtype)
        if qmm.norm is not None:
            return qmm.norm(self.x, self.w, eps=self.eps, dtype=dtype), None
        return None


class Gated(NamedTuple):
    """silu(gate) * up [T, F] of a gate | up product gu [T, 2F] (an array, or the kernel's
    Splits), computed by the linear() that takes it: in a decode step the partials' sum, the
    product and the int8 rounding the next kernel takes are then one kernel, not two (XLA's
    fusion and int8_rows)."""

    gu: object
    limit: float = 0.0  # the clamp of pallas_kernels/swiglu.py (DeepSeek V4's experts)
    # gu's columns shard-major for this many devices (models/fused_layout.py), 1: in order
    shards: int = 1

    @property
    def shape(self):
        T, F2 = self.gu.parts.shape[1:] if isinstance(self.gu, Splits) else self.gu.shape
        return (T, F2 // 2)

    def array(self):
        gu = summed(self.gu)
        gate, up = fused_layout.split(gu, (gu.shape[-1] // 2,) * 2, self.shards)
        return swiglu(gate, up, self.limit)

    def rows(self, w, qmm: QuantMatmul | None, live):
        """(h [T, F], its int8 rows or None) for linear(self, w, qmm, live)."""
        fused = isinstance(self.gu, Splits) and _int8_rows_call(self.shape[0], w, qmm, live)
        # the kernel reads gate | up in order: shard-major columns go through XLA's glu
        if fused and qmm.glu_int8 is not None and self.shards == 1:
            return qmm.glu_int8(self.gu.parts, self.gu.live, dtype=weight_dtype(w),
                                limit=self.limit)  # fmt: skip
        return self.array(), None


def summed(y):
    """y [T, N] as an array: a Splits' live rows summed (zeros in its padding rows), else y."""
    return y.array() if isinstance(y, Splits) else y


def linear(x, w, qmm: QuantMatmul | None = None, live=None, x8=None, splits=False):
    """x [T, K] @ w -> [T, N] float32.

    Args:
      x: activations (cast to the weight's dtype: the dots run in it), or Normed / Gated rows.
      w: dense [K, N], QuantWeight [N, K], or a tuple of these (outputs concatenated).
      qmm: how quantized weights run (default: XLA's dequantize-then-dot).
      live: int32 scalar, the leading rows of x that are real (None: all); the Pallas kernel
        may leave the rest unspecified, so a decode step of one token in a bucket of 8 runs
        as a one-row product.
      x8: x's int8 rows for the kernel (Normed / Gated rows'), or None.
      splits: where one quantized w runs on the kernel's int8 rows, return its partials as
        Splits, unsummed, of live rows only (for Gated, or `summed`); elsewhere the product as
        always.
    """
    if isinstance(x, (Normed, Gated)):
        x, x8 = x.rows(w, qmm, live)
    if isinstance(w, tuple):
        return jnp.concatenate([linear(x, p, qmm, live, x8) for p in w], axis=-1)
    if isinstance(w, QuantWeight):
        x = x.astype(w.dtype)
        if qmm is not None and qmm.kernel is not None and x.shape[0] <= qmm.max_rows:
            live = live if x.shape[0] <= qmm.live_rows_max else None
            kw = {} if x8 is None or live is None else {"x8": x8}
            if splits and _int8_rows_call(x.shape[0], w, qmm, live):
                return Splits(qmm.kernel(x, w, live, splits=True, **kw), live)
            return qmm.kernel(x, w, live, **kw)
        if qmm is not None and qmm.prefill is not None and x.shape[0] > qmm.max_rows:
            return qmm.prefill(x, w)
        return quant_matmul_xla(x, w)
    return jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def embed(table, tokens):
    """Rows of the embedding table [V, d] for tokens [T], float32; a quantized table is
    gathered a row of blocks at a time and only those rows are dequantized."""
    if isinstance(table, QuantWeight):
        return dequantize_weight(table.take(tokens))
    return table[tokens].astype(jnp.float32)


def unembed(h, table, qmm: QuantMatmul | None = None, live=None):
    """Logits h [R, d] (or Normed rows) @ table^T for tied embeddings (table [V, d], dense or
    quantized)."""
    if isinstance(table, QuantWeight):  # [V, d] is a QuantWeight's [N, K] already
        return linear(h, table, qmm, live)
    h = h.array() if isinstance(h, Normed) else h
    return jnp.einsum("rd,vd->rv", h.astype(table.dtype), table, preferred_element_type=jnp.float32)


def weight_dtype(w) -> jnp.dtype:
    """The dtype projections with w run in (a tuple's first part's)."""
    if isinstance(w, tuple):
        return weight_dtype(w[0])
    return jnp.dtype(w.dtype)
