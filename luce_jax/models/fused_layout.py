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


# A Gated DeltaNet layer's params (models/hybrid.py) split by head on a mesh, and the axis of
# each that runs over its channels, heads or value rows (w_in's outputs, w_out's inputs) where
# it is a float array (a QuantWeight's: device/mesh.py's delta_spec).
DELTA = {"w_in": -1, "conv": 0, "dt_bias": 0, "ssm_a": 0, "w_out": 0}


def delta_shards(cfg: ModelConfig, n: int) -> int:
    """The devices a hybrid model's Gated DeltaNet layers split their heads over: n where the
    key heads divide by n (each device then holds whole key heads and the value heads that
    read them), else 1 (every device runs them whole)."""
    hc = getattr(cfg, "own", None)
    if n == 1 or not hasattr(hc, "ssm_k_heads") or hc.ssm_k_heads % n:
        return 1
    return n


def delta_heads(cfg: ModelConfig, n: int) -> np.ndarray:
    """[Hv] the value heads device by device: device i's value heads are those that read its
    key heads (value head j reads key head j % Hk), in the order a model of Hk / n key heads
    reads them (its value head j' reads its key head j' % (Hk / n))."""
    hc = cfg.own
    Hk, r, hk = hc.ssm_k_heads, hc.ssm_v_heads // hc.ssm_k_heads, hc.ssm_k_heads // n
    return np.array([t * Hk + i * hk + h for i in range(n) for t in range(r) for h in range(hk)])


def delta_orders(cfg: ModelConfig, n: int) -> dict[str, np.ndarray]:
    """The stored order, device by device, of each DELTA param's split axis: w_in's outputs
    (q, k, v | z | beta | alpha: each device's q and k of its key heads, then v, z, beta and
    alpha of its value heads), conv's channels (q, k, v), dt_bias' and ssm_a's heads, and
    w_out's input rows."""
    hc = cfg.own
    Hk, Hv, Dk, Dv, hk = (
        hc.ssm_k_heads,
        hc.ssm_v_heads,
        hc.ssm_k_dim,
        hc.ssm_v_dim,
        hc.ssm_k_heads // n,
    )
    vh = delta_heads(cfg, n).reshape(n, -1)
    C = hc.conv_dim

    def cols(first, heads, width):  # each head's `width` columns from `first` on
        return (first + heads[:, None] * width + np.arange(width)[None]).ravel()

    conv, w_in = [], []
    for i in range(n):
        kh = np.arange(i * hk, (i + 1) * hk)
        qkv = [cols(0, kh, Dk), cols(Hk * Dk, kh, Dk), cols(2 * Hk * Dk, vh[i], Dv)]
        conv += qkv
        w_in += qkv + [cols(C, vh[i], Dv), C + Hv * Dv + vh[i], C + Hv * Dv + Hv + vh[i]]
    return {"w_in": np.concatenate(w_in), "conv": np.concatenate(conv), "dt_bias": vh.ravel(),
            "ssm_a": vh.ravel(), "w_out": cols(0, vh.ravel(), Dv)}  # fmt: skip


def delta_split(lp: dict, cfg: ModelConfig, n: int) -> bool:
    """Whether Gated DeltaNet layer params lp split their heads over n devices: the heads
    divide (delta_shards), and a quantized w_out's inputs reorder a whole block at a time
    (each device's value heads come in runs of Hk / n heads, which must fill whole blocks).
    w_in may be float, quantized or a tuple of both (its rows reorder freely)."""
    from pallas_kernels.quant_weight import QuantWeight

    if "w_in" not in lp or delta_shards(cfg, n) == 1:
        return False
    w = lp["w_out"]
    run = cfg.own.ssm_k_heads // n * cfg.own.ssm_v_dim
    return not isinstance(w, tuple) and (
        not isinstance(w, QuantWeight) or run % w.format.block == 0
    )


def _delta_w_in(w, idx: np.ndarray):
    """w_in (float [d, N], QuantWeight [N, d], or a tuple of parts in output order) with its
    outputs in delta_orders' order `idx`, part by part: each part keeps its own outputs,
    device by device, so each device's parts read back, concatenated, in its own order."""
    from pallas_kernels.quant_weight import QuantWeight

    parts = w if isinstance(w, tuple) else (w,)
    out, start = [], 0
    for p in parts:
        size = p.shape[-2] if isinstance(p, QuantWeight) else p.shape[-1]
        own = idx[(idx >= start) & (idx < start + size)] - start
        out.append(p.take(own) if isinstance(p, QuantWeight) else jnp.take(p, own, axis=-1))
        start += size
    return tuple(out) if isinstance(w, tuple) else out[0]


def _delta_w_out(w, idx: np.ndarray):
    """w_out (float [Hv*Dv, d] or QuantWeight [d, Hv*Dv]) with its inputs in order `idx`
    (runs of whole blocks for a QuantWeight: delta_split)."""
    from pallas_kernels.quant_weight import QuantWeight

    if not isinstance(w, QuantWeight):
        return jnp.take(w, idx, axis=0)
    B = w.format.block
    runs = idx.reshape(-1, B)
    assert (runs[:, 0] % B == 0).all() and (np.diff(runs, axis=1) == 1).all(), "cuts a block"
    return w.take_blocks(runs[:, 0] // B)


def store(lp: dict, cfg: ModelConfig, n: int, delta: bool = True) -> dict:
    """A layer's params as a mesh of n devices stores them: each fused param shard-major where
    `shards` allows it (a tuple of differently typed weights, and its bias, stay in order), and
    with `delta` (the mesh splits these layers: device/mesh.py's Placement.delta) a Gated
    DeltaNet layer's params device by device (delta_orders) where they split."""
    from pallas_kernels.quant_weight import QuantWeight

    out = dict(lp)
    if delta and delta_split(lp, cfg, n):
        for name, idx in delta_orders(cfg, n).items():
            take = {"w_in": _delta_w_in, "w_out": _delta_w_out}.get(name)
            out[name] = take(lp[name], idx) if take else jnp.take(lp[name], idx, axis=DELTA[name])
    for name, weight in FUSED.items():
        w = lp.get(name)
        s = 1 if w is None else stored(lp[weight], weight, cfg, n)  # a bias as its weight
        if s == 1:
            continue
        idx = order(parts(name, cfg, w.shape[-2] if isinstance(w, QuantWeight) else w.shape[-1]), s)
        out[name] = w.take(idx) if isinstance(w, QuantWeight) else jnp.take(w, idx, axis=-1)
    return out


def stored(w, name: str, cfg: ModelConfig, n: int) -> int:
    """The devices fused weight w (param `name`) is stored shard-major for on a mesh of n (1:
    in order)."""
    if n == 1 or isinstance(w, tuple):
        return 1
    from pallas_kernels.quant_weight import QuantWeight

    return shards(name, cfg, w.shape[-2] if isinstance(w, QuantWeight) else w.shape[-1], n)


def unfuse(y, name: str, cfg: ModelConfig, n: int, w) -> list:
    """The parts of fused param `name`'s product y [..., N] (its weight w: a tuple is stored in
    order), as `store` laid them out for a mesh of n devices."""
    return split(y, parts(name, cfg, y.shape[-1]), stored(w, name, cfg, n))


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
