"""How a fused projection's outputs are stored: in order on one device, shard by shard on a mesh.

A fused projection (q | k | v in `wqkv`, gate | up in `w_gu`) is split by its outputs over the
n devices of a mesh (device/mesh.py: column-parallel). Stored in order, device 0 would hold
all of q and device 1 the k and v, and every step would move activations between devices to
bring each device's heads together (collective-permutes). So on a mesh the loader stores each
such weight shard-major: device i's columns are its n-th of every part, in order (its query
heads, its KV heads' k, its KV heads' v), and the model reads the parts back with `unfuse`,
which on split activations is a reshape on each device. On one device (n = 1) the layout is
the file's.

A part must split into whole heads (the query and KV head counts divide by n) or whole FFN
columns; where it does not, or where the parts are weights of different quantized types
(a tuple, models/linear.py), the weight stays in order and so do its readers.

Shapes: N a fused projection's outputs, n devices.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig

# the fused params stored shard-major on a mesh, and the weight whose layout a bias follows
FUSED = {"wqkv": "wqkv", "bqkv": "wqkv", "w_gu": "w_gu", "w_gu_shexp": "w_gu_shexp"}


def parts(name: str, cfg: ModelConfig, N: int) -> tuple[int, ...]:
    """The sizes of fused param `name`'s parts, N outputs in all: q (with a gated query's
    gate, head by head), k, v; or gate, up."""
    if FUSED[name] == "wqkv":
        kv = cfg.n_kv_heads * cfg.head_dim
        return (N - 2 * kv, kv, kv)
    return (N // 2, N // 2)


def shards(name: str, cfg: ModelConfig, N: int, n: int) -> int:
    """The devices `name` is stored shard-major for: n where every part splits into whole heads
    (or FFN columns) over n devices, else 1 (in order)."""
    if n == 1:
        return 1
    if FUSED[name] == "wqkv":
        return n if cfg.n_heads % n == 0 and cfg.n_kv_heads % n == 0 else 1
    return n if (N // 2) % n == 0 else 1


def order(sizes: tuple[int, ...], n: int) -> np.ndarray:
    """[N] the stored column of each shard-major position: device by device, part by part."""
    starts = np.cumsum((0, *sizes[:-1]))
    return np.concatenate([
        start + i * (size // n) + np.arange(size // n)
        for i in range(n)
        for start, size in zip(starts, sizes, strict=True)
    ])  # fmt: skip


def store(lp: dict, cfg: ModelConfig, n: int) -> dict:
    """A layer's params as a mesh of n devices stores them: each fused param shard-major where
    `shards` allows it (a tuple of differently typed weights, and its bias, stay in order)."""
    from pallas_kernels.quant_weight import QuantWeight

    out = dict(lp)
    for name, weight in FUSED.items():
        w = lp.get(name)
        if w is None or isinstance(lp.get(weight), tuple):
            continue
        N = w.shape[-2] if isinstance(w, QuantWeight) else w.shape[-1]
        s = shards(name, cfg, N, n)
        if s == 1:
            continue
        idx = order(parts(name, cfg, N), s)
        out[name] = w.take(idx) if isinstance(w, QuantWeight) else jnp.take(w, idx, axis=-1)
    return out


def stored(w, name: str, cfg: ModelConfig, n: int) -> int:
    """The devices fused weight w (param `name`) is stored shard-major for on a mesh of n (1:
    in order)."""
    if n == 1 or isinstance(w, tuple):
        return 1
    from pallas_kernels.quant_weight import QuantWeight

    return shards(name, cfg, w.shape[-2] if isinstance(w, QuantWeight) else w.shape[-1], n)


def is_shard_major(w, name: str, cfg: ModelConfig, n: int) -> bool:
    return stored(w, name, cfg, n) > 1


def unfuse(y, name: str, cfg: ModelConfig, n: int, w=None) -> list:
    """The parts of fused param `name`'s product y [..., N] (its weight w: a tuple is stored in
    order), as `store` laid them out for a mesh of n devices."""
    return split(y, parts(name, cfg, y.shape[-1]), stored(w, name, cfg, n) if w is not None
                 else shards(name, cfg, y.shape[-1], n))  # fmt: skip


def split(y, sizes: tuple[int, ...], s: int) -> list:
    """y [..., N] cut into parts of `sizes`, stored shard-major for s devices (1: in order)."""
    N = y.shape[-1]
    if s == 1:
        return jnp.split(y, np.cumsum(sizes[:-1]).tolist(), axis=-1)
    lead = y.shape[:-1]
    y = y.reshape(*lead, s, N // s)  # device i's columns
    cut = np.cumsum([size // s for size in sizes[:-1]]).tolist()
    return [p.reshape(*lead, size) for p, size in zip(jnp.split(y, cut, axis=-1), sizes,
                                                      strict=True)]  # fmt: skip
