"""A MoE model's routing histogram, and the expert order that evens it out over devices.

`--record-expert-stats FILE` writes, when the engine stops, how many real tokens each MoE layer
routed to each of its experts (the forward pass counts them every step: models/moe.py's
expert_counts, summed on the device). `--expert-placement FILE` reads such a file and, with
expert parallelism, places the experts so that each device's experts take about the same share
of the routed tokens: the experts of a layer are split E / n to a device along E, and an
expert order chosen per layer puts each device's chosen experts together (`balanced_order`);
the loader stores the stacked experts and the router's columns in that order
(loading/params.py), which changes no output: a token's experts are the same experts, found
at their new places. Counts are kept in the file's expert order.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

FORMAT = "luce_jax expert stats"


def save(path: str, counts: np.ndarray) -> None:
    """Write counts [L_moe, E] (tokens routed to each expert of each MoE layer)."""
    counts = np.asarray(counts, np.int64)
    data = {"format": FORMAT, "tokens": int(counts[0].sum()) if len(counts) else 0,
            "layers": counts.tolist()}  # fmt: skip
    Path(path).write_text(json.dumps(data))
    log.info("expert stats of %d routed tokens written to %s", data["tokens"], path)


def load(path: str, layers: int, experts: int) -> np.ndarray:
    """counts [layers, experts] from a `save`d file, checked against the model's shape."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"expert_placement={path!r}: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"expert_placement={path!r}: not a --record-expert-stats file")
    counts = np.asarray(data["layers"])
    if counts.shape != (layers, experts) or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ValueError(
            f"expert_placement={path!r}: counts of shape {counts.shape}; the model has "
            f"{layers} MoE layers of {experts} experts"
        )
    return counts


def balanced_order(counts: np.ndarray, n: int) -> np.ndarray:
    """orders [L, E]: per layer, the experts (file ids) in the order they are stored, so that
    the E / n stored at each device's places take about the same share of the tokens. Greedy
    by count, most used first, each to the device with the fewest tokens so far that has room;
    each device's experts stay in id order."""
    L, E = counts.shape
    if E % n:
        raise ValueError(f"{E} experts do not split over {n} devices")
    orders = np.empty((L, E), np.int64)
    for i, c in enumerate(counts):
        load_, room = np.zeros(n), np.full(n, E // n)
        owner = np.empty(E, np.int64)
        for e in np.argsort(-c, kind="stable"):
            d = min((j for j in range(n) if room[j]), key=lambda j: load_[j])
            owner[e], load_[d], room[d] = d, load_[d] + c[e], room[d] - 1
        orders[i] = np.concatenate([np.flatnonzero(owner == d) for d in range(n)])
    return orders


def placement_orders(path: str, mc, moe_layers: int, placement) -> np.ndarray:
    """`--expert-placement path`: each MoE layer's stored expert order (`balanced_order` over
    the placement's devices) for the model `mc`, with what it does to the busiest device's
    share logged."""
    bad = lambda why: ValueError(f"expert_placement={path!r}: {why}")
    if not mc.n_experts:
        raise bad("the model has no experts")
    if placement is None or not placement.expert_parallel:
        raise bad("places experts over devices: needs expert parallelism (expert_parallel 0)")
    if mc.expert_groups > 1:  # group-limited routing reads experts in their stored groups
        raise bad(f"the model routes within groups of experts (expert_groups={mc.expert_groups})")
    counts = load(path, moe_layers, mc.n_experts)
    orders = balanced_order(counts, placement.n)
    before = device_shares(counts, np.tile(np.arange(mc.n_experts), (moe_layers, 1)), placement.n)
    after = device_shares(counts, orders, placement.n)
    log.info("expert placement: the busiest device's share of a layer's routed tokens at most "
             "%.2f (%.2f in file order)", after.max(), before.max())  # fmt: skip
    return orders


def in_file_order(stored: np.ndarray, orders: np.ndarray | None) -> np.ndarray:
    """Counts [L, E] of experts stored in `orders` (None: file order) back in file order."""
    if orders is None:
        return stored
    counts = np.empty_like(stored)
    np.put_along_axis(counts, orders, stored, axis=1)
    return counts


def device_shares(counts: np.ndarray, orders: np.ndarray, n: int) -> np.ndarray:
    """[L, n]: each device's share of each layer's routed tokens with experts in `orders`."""
    L, E = counts.shape
    stored = np.take_along_axis(counts, orders, axis=1).reshape(L, n, E // n).sum(-1)
    return stored / np.maximum(stored.sum(-1, keepdims=True), 1)
