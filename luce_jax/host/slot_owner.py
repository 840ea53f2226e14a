"""What a request brings to the slot it takes, and the owners of per-slot host state.

Admission reserves the request's KV blocks first (all or nothing); then every owner in the
engine's list starts the slot, in order, and retirement releases it in each, in reverse
order (host/engine.py). An owner holds only its own state of the slot: the SlotTable its
prompt and progress, SlotOutputs the tokens collected, the grammars its matcher, speculation
its proposer's and policy's records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class Admission:
    """A request as its slot's owners see it when it is admitted."""

    prompt: list[int]
    sampling: SamplingParams
    cached: int  # leading prompt tokens whose KV the prefix cache already holds
    need: int  # the most tokens the slot can reach: prompt + max_tokens


class SlotOwner(Protocol):
    def start(self, slot: int, req: Admission) -> None:
        """Take up `slot` for a request just admitted to it."""
        ...

    def release(self, slot: int) -> None:
        """Forget `slot`: its request finished, failed or was cancelled."""
        ...


class SlotOutputs:
    """Per slot: the tokens collected for its request (for the prefix cache, which keeps a
    finished sequence's output blocks too), and how many accepted proposals its next row
    feeds again (families rolled back by feeding again: models/family.py)."""

    def __init__(self, n: int):
        self.tokens: dict[int, list[int]] = {}
        self.lag = np.zeros(n, np.int32)

    def start(self, slot: int, req: Admission) -> None:
        self.tokens[slot] = []
        self.lag[slot] = 0

    def release(self, slot: int) -> None:
        self.tokens.pop(slot, None)
        self.lag[slot] = 0
