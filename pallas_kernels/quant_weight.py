"""GGML-quantized weights on the device: a file tensor's blocks, split into scale and code bytes.

The container the matmul kernels take (quant_matmul.py, dequantize.py, moe_grouping.py); the
block formats it holds are ggml_blocks.py's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .ggml_blocks import FORMATS, BlockFormat
from .ggml_dequant import DEQUANTIZERS


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["head", "body"], meta_fields=["qtype", "dtype"]
)
@dataclass(frozen=True)
class QuantWeight:
    """A GGML-quantized matrix of N rows of K values (a file tensor, [out, in]) on the device.

    The file's bytes, reordered once at load into two arrays (together exactly the file's
    size): each block's few scale bytes (`BlockFormat.head`) go to `head`, its code bytes to
    `body`. Q8_0's 34-byte blocks (and Q6_K's 210) put the codes at offsets no wider load can
    use; split, every row of codes starts aligned and Triton reads it 16 bytes per load, and a
    block's scale byte for BN outputs is one contiguous run. On the H200 this split took a
    Q8_0 decode-sized call from 141 to 94 us (bench/results/history/2026-12-01_quant_gemv_h200.md).

    head: [..., K / B * hs / u, N] of u-byte little-endian units (`BlockFormat.head_unit`:
      uint32 for Q4_K, Q5_K and IQ4_XS, uint16 for the rest): bytes u * w .. u * w + u - 1
      of block k of every row are row k * hs / u + w, so a kernel reads Q4_K's 16 scale bytes
      in 4 loads, not 16 (on the H200 that and one load for x's sums per group took its
      decode-sized gate/up from 42.7 to 35 us, history/2026-12-02_quant_matmul_head_words_h200.md).
    body: uint8 [..., N, K / B * bs]: one row of code bytes per output, blocks in order.
      (hs + bs = type_size; leading axes for stacked experts.)
    qtype: a FORMATS key. dtype: the activations' dtype the matmuls run in (the dtype the
      weight would have had if dequantized).
    """

    head: jax.Array
    body: jax.Array
    qtype: str
    dtype: str = "bfloat16"

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.qtype]

    @property
    def shape(self) -> tuple[int, ...]:
        """(..., N, K)."""
        *lead, n, body_bytes = self.body.shape
        return (*lead, n, body_bytes // self.format.body_size * self.format.block)

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.body.nbytes

    @classmethod
    def from_rows(cls, rows, qtype: str, dtype="bfloat16") -> QuantWeight:
        """From the file's bytes, uint8 [..., N, K / B * type_size] (NumPy: reordered on the
        host, so the device never holds both layouts)."""
        xp = np if isinstance(rows, np.ndarray) else jnp
        fmt = FORMATS[qtype]
        h0, hs = fmt.head
        *lead, n, row_bytes = rows.shape
        b = rows.reshape(*lead, n, row_bytes // fmt.type_size, fmt.type_size)
        if fmt.order is not None:  # the scale bytes made one run (BlockFormat.order)
            b = b[..., np.asarray(fmt.order)]
        u = fmt.head_unit
        head = b[..., h0 : h0 + hs].reshape(*lead, n, -1, hs // u, u)  # little-endian units
        unit = np.dtype(f"<u{u}")
        head = (
            xp.ascontiguousarray(head).view(unit)[..., 0]
            if xp is np
            else jax.lax.bitcast_convert_type(head, unit)
        )
        head = xp.swapaxes(head.reshape(*lead, n, -1), -1, -2)
        body = xp.concatenate([b[..., :h0], b[..., h0 + hs :]], axis=-1)
        return cls(
            jnp.asarray(xp.ascontiguousarray(head) if xp is np else head),
            jnp.asarray(body.reshape(*lead, n, -1)),
            qtype,
            jnp.dtype(dtype).name,
        )

    def head_bytes(self) -> jax.Array:
        """Each block's scale bytes, uint8 [..., N, K / B, hs] (the head's units undone)."""
        *lead, n, _ = self.body.shape
        head = jnp.swapaxes(self.head, -1, -2)
        head = jax.lax.bitcast_convert_type(head, jnp.uint8)  # [..., n, units, u]
        return head.reshape(*lead, n, -1, self.format.head[1])

    def rows(self) -> jax.Array:
        """The file's bytes, uint8 [..., N, K / B * type_size] (from_rows undone)."""
        fmt = self.format
        h0 = fmt.head[0]
        *lead, n, _ = self.body.shape
        head = self.head_bytes()
        body = self.body.reshape(*lead, n, head.shape[-2], fmt.body_size)
        b = jnp.concatenate([body[..., :h0], head, body[..., h0:]], axis=-1)
        if fmt.order is not None:
            b = b[..., np.argsort(fmt.order)]
        return b.reshape(*lead, n, -1)

    def take(self, ids) -> QuantWeight:
        """Rows ids [T] of a [N, K] weight (an embedding lookup), a QuantWeight [T, K]."""
        return QuantWeight(self.head[:, ids], self.body[ids], self.qtype, self.dtype)

    def take_blocks(self, ids) -> QuantWeight:
        """Blocks ids [K' / B] of every row of a [N, K] weight, in that order: a QuantWeight
        [N, K'] (its inputs reordered or cut a whole block at a time)."""
        fmt = self.format
        n = self.body.shape[-2]
        head = self.head.reshape(-1, fmt.head[1] // fmt.head_unit, n)[ids].reshape(-1, n)
        body = self.body.reshape(n, -1, fmt.body_size)[:, ids].reshape(n, -1)
        return QuantWeight(head, body, self.qtype, self.dtype)


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """QuantWeights of one type and K stacked along their rows (N)."""
    return QuantWeight(
        jnp.concatenate([p.head for p in parts], axis=-1),
        jnp.concatenate([p.body for p in parts], axis=-2),
        parts[0].qtype,
        parts[0].dtype,
    )


def dequantize_weight(w: QuantWeight, dtype=jnp.float32) -> jax.Array:
    """W [..., N, K] in dtype (bit-exact with gguf in float32)."""
    fmt = w.format
    vals = DEQUANTIZERS[fmt.qtype](w.rows().reshape(-1, fmt.type_size))
    return vals.reshape(w.shape).astype(dtype)
