"""Model families: what the runner, the builder and the engine may know of a model.

A family is one module under models/ that registers a `ModelFamily` for the GGUF
architectures it serves. Everything outside models/ (and the loader, which maps a file's
tensors) reads a model only through these capabilities and never names a family: a new family
is a new module, its loader mapping and its tests (docs/architecture.md, "Adding a model
family"). dense.py (llama, qwen2, qwen3, and qwen3moe's experts), hybrid.py (qwen35,
qwen35moe) and deepseek4.py are the three.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..config import ModelConfig

# How a slot goes back to the position before proposals its verify row did not keep:
# "kv_length": shorten its KV length (entries past it are overwritten later);
# "refeed": the slot's state cannot be shortened, so its last step ran before the proposals
# and the accepted ones are fed again (host/engine.py);
# "replay": the slot's state stays before the proposals and its next pass advances it over the
# kept ones on the device, from inputs its verify row stored (models/gated_deltanet.py);
# proposals are then kept on the device, and the host shortens the KV length as for kv_length.
ROLLBACKS = ("kv_length", "refeed", "replay")
# Proposers that run inside the target's step on the device (device/proposals.py); a family
# without one runs speculation's draft model and prompt lookup on the host.
DEVICE_PROPOSERS = frozenset({"head", "draft", "ngram", "mtp", "dflash"})


class Kernels(NamedTuple):
    """The implementations a family's forward pass runs its ops with, chosen once from the
    engine's backends (backends.kernels): hashable, so a step's layer functions take them as a
    static argument. None is XLA's / the jnp reference's op."""

    attention: Callable | None = None  # paged attention (models/attention.py's signature)
    grouped_matmul: Callable | None = None  # MoE experts (moe.grouped_matmul_xla's)
    quant_matmul: Any = None  # models.linear.QuantMatmul: projections over quantized weights
    rope_write: Callable | None = None  # q, k norms, rope and the KV write in one kernel
    gated_delta: Callable | None = None  # the gated delta rule in place (hybrid layers)
    moe_router: Callable | None = None  # MoE routing in one kernel (moe.route's decode buckets)
    # attention with sinks over keys gathered by row (pallas_kernels/sink_attention.py)
    sink_attention: Callable | None = None
    # the hyper-connections' Sinkhorn normalization in one kernel (pallas_kernels/sinkhorn.py)
    sinkhorn: Callable | None = None
    # (routed, lp, h, live, tokens) -> moe.routed's output, run where the experts' weights are
    # (device/sharded_kernels.py: each device its own experts); None: moe.routed here
    experts: Callable | None = None
    # the devices the fused projections are stored shard-major for (models/fused_layout.py)
    shards: int = 1
    # (mixer, lp, h, hist, ssm, li, batch) -> a Gated DeltaNet layer's (out, hist, ssm) run on
    # each device's heads (device/sharded_kernels.py), for layers whose params split by head
    # (fused_layout.delta_split); None: the layer runs whole here
    delta_heads: Callable | None = None


XLA = Kernels()  # every op XLA's or the jnp reference's


def stacked(outputs: dict, hidden: tuple[int, ...]):
    """float32 [len(hidden), T, d]: the residual streams a forward pass kept (by layer id),
    in `hidden`'s order (ModelFamily.forward's "hidden")."""
    import jax.numpy as jnp

    return jnp.stack([outputs[i].astype(jnp.float32) for i in hidden])


@dataclass(frozen=True)
class CacheGroup:
    """Layers whose paged KV shares one block space and one block table per slot.

    kind: "full" (every token's entry kept), "sliding" (the last `window` tokens' entries),
    "compressed" (an entry stands for `tokens_per_entry` tokens). bytes_per_token: what one
    token costs the group's caches (all its layers, K and V). block_size: entries per block
    (0: the engine's kv_block_size). The builder sizes each group's block space from these
    (kv_sizing.kv_spaces); only a full group of per-token entries can share blocks by prefix."""

    kind: str
    layers: int
    bytes_per_token: float
    tokens_per_entry: int = 1
    window: int = 0
    block_size: int = 0

    def __post_init__(self):
        if self.kind not in GROUP_KINDS:
            raise ValueError(f"kind={self.kind!r}: must be one of {GROUP_KINDS}")
        if (self.kind == "sliding") != (self.window > 0):
            raise ValueError(f"window={self.window}: a sliding group has one, no other does")
        if (self.kind == "compressed") != (self.tokens_per_entry > 1):
            raise ValueError(f"tokens_per_entry={self.tokens_per_entry}: > 1 for a compressed "
                             "group, 1 for the others")  # fmt: skip

    @property
    def shareable(self) -> bool:
        return self.kind == "full"


GROUP_KINDS = ("full", "sliding", "compressed")


class ModelFamily(Protocol):
    """What a family declares. Shapes: NB KV blocks, P block size, S_max slots, R logits rows."""

    name: str
    archs: tuple[str, ...]  # GGUF general.architecture values it serves
    rollback: str  # one of ROLLBACKS
    prefix_cacheable: bool  # whether the prefix cache may share its slots' leading blocks
    device_proposers: frozenset  # of DEVICE_PROPOSERS
    rope_scalings: tuple[str, ...]  # rope.scaling.type values its read_config takes

    def read_config(self, arch: str, get: Callable, md: dict, n_layers: int) -> dict:
        """The ModelConfig fields it reads from a file's metadata beyond the shared ones
        (loading/gguf.model_config), its own in `own` (a frozen dataclass of its module's):
        get(key, default) is `{arch}.{key}` (an error that names a key missing without a
        default), md the whole metadata, n_layers the model's blocks."""
        ...

    def layer_params(self, cfg: ModelConfig, i: int, t) -> dict:
        """Layer i's params from the file's tensors, in its fused layouts: t has tensor(name,
        transpose, optional, out_dtype, keep), linear(*names) (one projection, outputs
        concatenated), ffn(prefix) (a dense or experts' FFN) and f32 (loading/params.py)."""
        ...

    def model_params(self, cfg: ModelConfig, t) -> dict:
        """Params beyond the layers and the shared embed, final_norm and lm_head (t as
        layer_params'), under names of its own."""
        ...

    def tensor_shapes(self, cfg: ModelConfig) -> dict[str, tuple]:
        """Shapes of the tensors it adds to the shared attention and FFN ones, by name without
        the blk.N. prefix, numpy order (checked at load)."""
        ...

    def cache_groups(self, cfg: ModelConfig, kv_bytes_per_entry: float) -> list[CacheGroup]:
        """Its paged caches, given one layer's K and V bytes per token entry."""
        ...

    def init_caches(self, cfg: ModelConfig, spaces, k_type, v_type):
        """Zeroed paged caches: for each of its cache groups, in cache_groups' order, the
        block space the pool sized (step_format.GroupShape: NB blocks of P entries). A type:
        a dtype, "q8_0" or "q4_0"."""
        ...

    def init_slot_state(self, cfg: ModelConfig, max_slots: int,
                        proposals: int = 0) -> dict | None:  # fmt: skip
        """Zeroed per-slot model state [.., S_max, ..], zeroed again where a row is fresh;
        None: the family keeps none. proposals: K, where proposals are kept on the device
        (a "replay" family keeps what its verify rows need to follow the kept ones)."""
        ...

    def forward(self, params, caches, slot_state, batch: dict, cfg: ModelConfig,
                kernels: Kernels, hidden: tuple[int, ...] = ()):  # fmt: skip
        """One step over the packed tokens (step_format.lower's batch): (logits float32 [R, V],
        caches, slot_state, stats). stats: device arrays of model statistics (MoE:
        expert_counts), and with `hidden` "hidden": float32 [len(hidden), T, d], every token's
        residual stream before block L for each L in `hidden` (L = n_layers: the last block's
        output before the final norm; llama.cpp's layer-output ids, which a DFlash drafter's
        target_layers name)."""
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


def _registered() -> dict[str, ModelFamily]:
    from . import deepseek4, dense, hybrid  # noqa: F401  (their registrations)

    return _FAMILIES


def architectures() -> tuple[str, ...]:
    """Every GGUF architecture some family serves."""
    return tuple(_registered())


def family_for(arch: str) -> ModelFamily:
    """The family that serves a GGUF architecture."""
    try:
        return _registered()[arch]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {architectures()}"
        ) from None


def family_of(cfg: ModelConfig) -> ModelFamily:
    """The family that serves a model's architecture."""
    return family_for(cfg.arch)
