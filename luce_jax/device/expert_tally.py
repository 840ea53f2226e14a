"""Tokens routed to each expert of each MoE layer, summed over steps on the device
(--record-expert-stats; expert_stats.py writes them)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


class ExpertTally:
    """The forward pass's expert_counts [L_moe, E] of every step, summed where they are: one
    small add a step, queued behind it, and no wait for the device until `counts`."""

    def __init__(self, moe_layers: int, experts: int):
        self.totals = jnp.zeros((moe_layers, experts), jnp.int32)

    def add(self, stats: dict) -> None:
        self.totals = self.totals + stats["expert_counts"]

    def counts(self, placement) -> np.ndarray:
        """The totals on the host ([L_moe, E], in the experts' stored order)."""
        return np.asarray(placement.local(self.totals))
