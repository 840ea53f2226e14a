"""Model families: what the runner, the builder and the engine may know of a model.

A family is one module under models/ that registers a `ModelFamily` for the GGUF
architectures it serves. Everything outside models/ (and the loader, which maps a file's
tensors) reads a model only through these capabilities and never names a family: a new family
is a new module, its loader mapping and its tests (docs/architecture.md, "Adding a model
family"). dense.py (llama, qwen2, qwen3, and qwen3moe's experts) and hybrid.py (qwen35,
qwen35moe) are the first two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..config import ModelConfig

# How a slot goes back to the position before proposals its verify row did not keep:
# "kv_length": shorten its KV length (entries past it are overwritten later);
# "refeed": the slot's state cannot be shortened, so its last step ran before the proposals
# and the accepted ones are fed again (host/engine.py).
ROLLBACKS = ("kv_length", "refeed")
# Proposers that run inside the target's step on the device (device/proposals.py); a family
# without one runs speculation's draft model and prompt lookup on the host.
DEVICE_PROPOSERS = frozenset({"head", "draft", "ngram"})


class Kernels(NamedTuple):
    """The implementations a family's forward pass runs its ops with, chosen once from the
    engine's backends (backends.kernels): hashable, so a step's layer functions take them as a
    static argument. None is XLA's / the jnp reference's op."""

    attention: Callable | None = None  # paged attention (models/attention.py's signature)
    grouped_matmul: Callable | None = None  # MoE experts (moe.grouped_matmul_xla's)
    quant_matmul: Any = None  # models.linear.QuantMatmul: projections over quantized weights
    rope_write: Callable | None = None  # q, k norms, rope and the KV write in one kernel
    gated_delta: Callable | None = None  # the gated delta rule in place (hybrid layers)


XLA = Kernels()  # every op XLA's or the jnp reference's


@dataclass(frozen=True)
class CacheGroup:
    """Layers whose paged KV shares one block space and one block table per slot.

    kind: "full" (every token's entry kept), "sliding" (the last `window` tokens' entries),
    "compressed" (an entry stands for `tokens_per_entry` tokens). bytes_per_token: what one
    token costs the group's caches (all its layers, K and V)."""

    kind: str
    layers: int
    bytes_per_token: float
    tokens_per_entry: int = 1
    window: int = 0


class ModelFamily(Protocol):
    """What a family declares. Shapes: NB KV blocks, P block size, S_max slots, R logits rows."""

    name: str
    archs: tuple[str, ...]  # GGUF general.architecture values it serves
    rollback: str  # one of ROLLBACKS
    prefix_cacheable: bool  # whether the prefix cache may share its slots' leading blocks
    device_proposers: frozenset  # of DEVICE_PROPOSERS

    def cache_groups(self, cfg: ModelConfig, kv_bytes_per_entry: float) -> list[CacheGroup]:
        """Its paged caches, given one layer's K and V bytes per token entry."""
        ...

    def init_caches(self, cfg: ModelConfig, num_blocks: int, block_size: int, k_type, v_type):
        """Zeroed paged caches of NB blocks of P tokens (a type: a dtype, "q8_0" or "q4_0")."""
        ...

    def init_slot_state(self, cfg: ModelConfig, max_slots: int) -> dict | None:
        """Zeroed per-slot model state [.., S_max, ..], zeroed again where a row is fresh;
        None: the family keeps none."""
        ...

    def forward(self, params, caches, slot_state, batch: dict, cfg: ModelConfig,
                kernels: Kernels, hidden: bool = False):  # fmt: skip
        """One step over the packed tokens (step_format.lower's batch): (logits float32 [R, V],
        caches, slot_state, stats). stats: device arrays of model statistics (MoE:
        expert_counts), and with `hidden` the logits rows' last hidden states."""
        ...


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Serve `family.archs` with `family`; an architecture has one family."""
    if family.rollback not in ROLLBACKS:
        raise ValueError(f"rollback={family.rollback!r}: must be one of {ROLLBACKS}")
    if not family.device_proposers <= DEVICE_PROPOSERS:
        raise ValueError(f"device_proposers={set(family.device_proposers)!r}")
    for arch in family.archs:
        held = _FAMILIES.get(arch)
        if held is not None and held.name != family.name:
            raise ValueError(f"architecture {arch!r} is served by family {held.name!r}")
        _FAMILIES[arch] = family
    return family


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family that serves a model's architecture."""
    from . import dense, hybrid  # noqa: F401  (their registrations)

    try:
        return _FAMILIES[cfg.arch]
    except KeyError:
        raise ValueError(f"architecture {cfg.arch!r}: no model family serves it") from None
