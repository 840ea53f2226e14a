"""A GGML-quantized weight dequantized whole, in one kernel: prefill-sized steps' weights.

Kernel, wrapper and reference together, in the style of JAX's Pallas ops. Steps of more than
64 rows run x @ W^T as the dequantized W [N, K] and XLA's dot (models/linear.py): the dot is
as fast as the bf16 model's, so W's decoding is all a quantized prefill step adds. XLA's own
dequantizing fusions ran that at 35 to 45% of the copy bandwidth (a 512-token step of the 8B
Q4_K_M took 23.7 ms against 13.7 with bf16 weights; bench/results/
history/2026-12-02_profile_prefill_qwen3-8b-q4_k_m.md). Here a program decodes BN weight rows by U
blocks a piece at a time (`BlockFormat.decode`, the runs of code bytes quant_matmul loads) and
stores each piece's values [BN, n] where they go: every byte of W is read once and every
value written once.

Speed (H200, Qwen3-8B shapes, M 512, with the dot; history/2026-12-02_dequantize_prefill_h200.md):
Q4_K gate/up 207 us against XLA's dequantize-then-dot 260 and the bf16 dot 157; down 111
against 149. A 4k-token prompt's TTFT on the 8B Q4_K_M went from 341 to 243 ms, the bf16
model's being 174 (history/2026-12-02_ttft4k_qwen3-8b-q4_k_m_dequant.md).

Shapes: N rows (outputs), K values per row, B values per block, U blocks per program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .call_options import call_options, whole
from .ggml_blocks import block_loaders, exact_f32
from .quant_weight import QuantWeight, dequantize_weight


def dequantize_reference(w: QuantWeight, dtype=jnp.bfloat16):
    """W [N, K] in dtype (ggml_blocks.dequantize_weight, XLA's fusions)."""
    return dequantize_weight(w, dtype)


def _kernel(h_ref, b_ref, o_ref, *, fmt, BN, U, transpose):
    """Program (j, c): rows j * BN .. j * BN + BN - 1, blocks c * U .. c * U + U - 1; o_ref is
    W [N, K], or W^T [K, N] with `transpose`."""
    j, c = pl.program_id(0), pl.program_id(1)
    N, K = o_ref.shape[::-1] if transpose else o_ref.shape
    cols = j * BN + jnp.arange(BN)
    col_ok = cols < N
    for u in range(U):
        blk = c * U + u
        ok = col_ok & (blk * fmt.block < K)
        load, load1 = block_loaders(
            fmt, lambda r, b: b_ref.at[r, b], lambda h, r: h_ref.at[h, r], cols, ok, blk
        )
        for g in range(fmt.groups):
            a, b, pieces = fmt.decode(load, load1, g)
            for first, codes in pieces:
                v = a[:, None] * exact_f32(codes)
                v = v if b is None else v + b[:, None]
                ks = blk * fmt.block + g * fmt.group + first + jnp.arange(codes.shape[1])
                if transpose:  # [n, BN]: each k's BN outputs are one contiguous run
                    plgpu.store(o_ref.at[ks[:, None], cols[None, :]], v.T.astype(o_ref.dtype),
                                mask=ok[None, :])  # fmt: skip
                else:
                    plgpu.store(o_ref.at[cols[:, None], ks[None, :]], v.astype(o_ref.dtype),
                                mask=ok[:, None])  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=(
        "dtype",
        "block_n",
        "values_per_program",
        "num_warps",
        "transpose",
        "interpret",
    ),
)
def dequantize(
    w: QuantWeight,
    dtype=jnp.bfloat16,
    *,
    block_n: int = 32,
    values_per_program: int = 512,
    num_warps: int = 4,
    transpose: bool = False,
    interpret: bool | None = None,
):
    """W [N, K] (or W^T [K, N]) in dtype, decoded in one Pallas kernel.

    Args:
      w: QuantWeight [N, K] of any ggml_blocks.FORMATS type.
      dtype: the result's dtype.
      block_n: weight rows per program (BN).
      values_per_program: values of each row per program (U = this / B blocks, at least 1).
        32 rows by 512 values were the fastest of four tilings on the H200 (Q4_K gate/up at
        M 512: 207 us with the dot, 229 at 64 by 1024).
      num_warps: Triton warps per program.
      transpose: write W^T [K, N], the layout a bf16 model's weights have (the 2048-token
        step's GEMMs on W [N, K] took 2.4 ms more than the bf16 model's on [K, N]:
        bench/results/history/2026-12-02_profile_prefill2048_qwen3-8b-q4_k_m.md). Off until timed.
      interpret: run in interpret mode (default: when the backend is the CPU).
    Returns:
      [N, K] ([K, N] with transpose) in dtype, equal to dequantize_reference(w, dtype) (float32
      arithmetic, one rounding to dtype).
    """
    if len(w.shape) != 2:
        raise ValueError(f"dequantize takes one [N, K] weight, got {w.qtype} {w.shape}")
    N, K = w.shape
    fmt = w.format
    U = max(1, values_per_program // fmt.block)
    out = jax.ShapeDtypeStruct((K, N) if transpose else (N, K), dtype)
    return pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, BN=block_n, U=U, transpose=transpose),
        grid=(-(-N // block_n), -(-(K // fmt.block) // U)),
        in_specs=[whole(w.head), whole(w.body)],
        out_specs=whole(out),
        out_shape=out,
        **call_options(interpret, num_warps, 1, name=f"dequantize_{w.qtype}"),
    )(w.head, w.body)


def dequantized_matmul(x, w: QuantWeight, *, transpose: bool = False, **kw):
    """x [M, K] @ W^T as XLA's dot over dequantize(w, x.dtype, transpose=...): [M, N] float32."""
    wd = dequantize(w, x.dtype, transpose=transpose, **kw)
    k_axis = 0 if transpose else 1
    dims = (((1,), (k_axis,)), ((), ()))
    return jax.lax.dot_general(x, wd, dims, preferred_element_type=jnp.float32)
