"""GGUF tensor bytes to the device: dequantized to a float dtype, or kept in their blocks.

Packed bytes go to the device as uint8 (fewer bytes over PCIe than floats) and are unpacked
there (pallas_kernels/ggml_blocks.py holds the formats).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pallas_kernels.ggml_blocks import QTYPES
from pallas_kernels.ggml_dequant import DEQUANTIZERS
from pallas_kernels.quant_weight import QuantWeight

__all__ = [
    "DEQUANTIZERS",
    "HOST_TYPES",
    "INTEGER_TYPES",
    "QTYPES",
    "dequantize",
    "host_dequantize",
    "keep_quantized",
    "prepare",
    "to_device",
]


@functools.cache
def _jitted(qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype, transpose: bool):
    def f(blocks):
        x = DEQUANTIZERS[qtype](blocks).reshape(shape).astype(dtype)
        return jnp.swapaxes(x, -1, -2) if transpose else x

    return jax.jit(f)


def _blocks(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """raw as [n_blocks, type_size], after checking qtype is supported and the size fits."""
    if qtype not in DEQUANTIZERS:
        raise ValueError(
            f"unsupported GGML tensor type {qtype.name}; supported: "
            f"{sorted(t.name for t in DEQUANTIZERS.keys() | HOST_TYPES)}"
        )
    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    if n % block or raw.size != n // block * size:
        raise ValueError(f"{qtype.name} tensor of shape {shape} cannot hold {raw.size} bytes")
    if not isinstance(raw, np.ndarray):  # traced bytes (params.abstract_params)
        return raw.reshape(-1, size)
    return np.ascontiguousarray(raw).reshape(-1, size)


# Integer tensors (DeepSeek V4's token -> experts table is I32): their values, as they are.
INTEGER_TYPES = {
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
}


def to_device(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> jax.Array:
    """The tensor's bytes on the device, uint8 [n_blocks, type_size] (float32 values for a
    type gguf-py unpacks on the host, HOST_TYPES; an integer type's values), for dequantize's
    `blocks`."""
    if qtype in INTEGER_TYPES:
        if not isinstance(raw, np.ndarray):  # traced: only its shape matters
            return jnp.zeros(shape, INTEGER_TYPES[qtype])
        return jnp.asarray(np.ascontiguousarray(raw).view(INTEGER_TYPES[qtype]).reshape(shape))
    if qtype not in DEQUANTIZERS and qtype in HOST_TYPES:
        if not isinstance(raw, np.ndarray):  # traced: only its shape matters
            return jnp.zeros(shape, jnp.float32)
        return jnp.asarray(host_dequantize(raw, qtype, shape))
    return jnp.asarray(_blocks(raw, qtype, shape))


def dequantize(
    raw: np.ndarray | None,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype=jnp.float32,
    transpose: bool = False,
    blocks: jax.Array | None = None,
) -> jax.Array:
    """Unpack GGML-typed bytes into a device array (cast and transpose fused on device).

    Args:
      raw: uint8 bytes of the tensor, in file order (any shape; flattened).
      qtype: the tensor's GGML type; one of DEQUANTIZERS.
      shape: logical (numpy order) shape of the result; its last axis is a multiple of the
        type's block size.
      dtype: result dtype (values are computed in float32 first).
      transpose: swap the last two axes ([in, out] for a linear weight, per expert for a
        stacked [E, out, in] expert tensor).
      blocks: to_device(raw, ...) when already made (raw is then unread).
    Returns:
      array of `shape` (last two axes swapped if transposed).
    """
    blocks = to_device(raw, qtype, shape) if blocks is None else blocks
    if qtype not in DEQUANTIZERS:  # a HOST_TYPES tensor's float32 values, or integers
        return _cast(blocks, jnp.dtype(dtype), transpose)
    return _jitted(qtype, tuple(shape), jnp.dtype(dtype), transpose)(blocks)


def prepare(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype, keep):
    """What the loader needs of a tensor before its device-side unpacking, made off its thread
    (loading/prefetch.py): a QuantWeight if `keep` and the kernels take qtype, else
    to_device's blocks."""
    x = keep_quantized(raw, qtype, shape, dtype) if keep else None
    return to_device(raw, qtype, shape) if x is None else x


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cast(x, dtype, transpose: bool):
    x = x.astype(dtype)
    return jnp.swapaxes(x, -1, -2) if transpose else x


def _gguf_dequantizable() -> frozenset:
    """GGML types gguf-py can dequantize (on the host, in NumPy)."""
    from gguf import quants

    out = set()
    for t in GGMLQuantizationType:
        cls = getattr(quants, t.name, None)
        if isinstance(cls, type) and "dequantize_blocks" in vars(cls):
            out.add(t)
    return frozenset(out)


# Types we neither keep packed nor unpack on the device (Q4_1, Q5_0, Q5_1, IQ2_XXS, ...:
# llama.cpp's quantizer puts Q5_0 / Q5_1 where a row is not a whole number of 256-value
# blocks): gguf-py unpacks them on the host at load, slower but never a refusal.
HOST_TYPES = _gguf_dequantizable()


def host_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape) -> np.ndarray:
    """float32 values of `shape` from a tensor's bytes, by gguf-py (any type it implements)."""
    from gguf.quants import dequantize as gguf_dequantize

    block, size = GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape))
    if n % block or raw.size != n // block * size:
        raise ValueError(f"{qtype.name} tensor of shape {shape} cannot hold {raw.size} bytes")
    rows = np.ascontiguousarray(raw).reshape(-1, shape[-1] // block * size)
    return gguf_dequantize(rows, qtype).astype(np.float32).reshape(shape)


def keep_quantized(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], dtype
) -> QuantWeight | None:
    """The tensor's blocks on the device as a QuantWeight [..., N, K] (split into scale and
    code bytes on the host), or None for a type the kernels do not take (float types)."""
    if qtype not in QTYPES:
        return None
    blocks = _blocks(raw, qtype, shape)
    *lead, n, _ = shape
    return QuantWeight.from_rows(blocks.reshape(*lead, n, -1), QTYPES[qtype], dtype)
