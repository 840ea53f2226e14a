"""Several devices as one: a 1-D mesh and where each array of a step lives on it.

Tensor parallelism here is GSPMD's: the params and the KV caches are placed with
`NamedSharding`s, every step program is compiled for those placements, and XLA partitions the
model's ops and inserts the collectives (over NCCL on GPUs). The model code does not change.
Placement rules, by a param's name (loading/params.py's keys):

- column-parallel (the output axis split): the fused q/k/v and gate/up projections, their
  biases, the shared expert's gate/up and the lm_head (split by vocabulary);
- row-parallel (the input axis split; one reduction per layer follows): the attention output
  and down projections;
- experts: with expert parallelism the stacked experts' axis E, else their FFN width as a
  column / row pair;
- KV caches of four axes [NB, P, K, D] (and a quantized cache's data and scales): the KV-head
  axis K; the block tables are the host's and do not change;
- everything else (norms, the router, the embedding table, the sampler's and the families'
  per-slot state): replicated.

An axis that does not divide by the mesh size stays whole (KV heads fewer than devices are
replicated). A QuantWeight keeps its blocks whole: it is split by output rows only (its `head`
[..., hK, N] on its last axis, `body` [..., N, bytes] on its second last), and a row-parallel
one is replicated; a Gated DeltaNet layer's w_out, stored with its inputs a whole block at a
time in device order, is split by its blocks (`delta_spec`). Arrays of one device (mesh None)
are placed as before.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..models import fused_layout

log = logging.getLogger(__name__)

AXIS = "tensor"

COLUMN = frozenset({"wqkv", "bqkv", "w_gu", "w_gu_shexp", "lm_head"})
ROW = frozenset({"wo", "w_down", "w_down_shexp"})
EXPERTS = {"w_gu_exps": COLUMN, "w_down_exps": ROW}  # without expert parallelism: as these


def delta_spec(name: str, w):
    """The PartitionSpec tree of Gated DeltaNet param `name` (fused_layout.DELTA) split by head:
    a float array along its DELTA axis; a QuantWeight by output rows (w_in) or by input blocks
    (w_out: head [hK, d] on its first axis, body [d, bytes] on its last); a tuple part by part."""
    from pallas_kernels.quant_weight import QuantWeight

    def along(a, axis):
        return P(*[None] * (axis % len(a.shape)), AXIS)

    def one(w):
        if isinstance(w, QuantWeight):
            rows = name == "w_in"
            return QuantWeight(along(w.head, -1 if rows else -2),
                               along(w.body, -2 if rows else -1), w.qtype, w.dtype)  # fmt: skip
        return along(w, fused_layout.DELTA[name])

    return tuple(map(one, w)) if isinstance(w, tuple) else one(w)


def make_mesh(devices: Sequence[int] | None, tensor_parallel: int) -> Mesh | None:
    """The 1-D mesh of `tensor_parallel` local devices (`devices`: their indices, default the
    first ones), or None for one device and no choice of it. With several processes
    (device/distributed.py), every device of every process, in process order."""
    if jax.process_count() > 1:
        if devices is not None or tensor_parallel != jax.device_count():
            raise ValueError(
                f"tensor_parallel={tensor_parallel}, devices={devices}: several processes split "
                f"the model over all their {jax.device_count()} devices (devices unset)"
            )
        return Mesh(np.array(jax.devices()), (AXIS,))
    if tensor_parallel == 1 and devices is None:
        return None
    local = jax.local_devices()
    if devices is None and tensor_parallel > len(local):
        raise ValueError(
            f"tensor_parallel={tensor_parallel}: this process has {len(local)} local devices"
        )
    picked = list(devices) if devices is not None else list(range(tensor_parallel))
    if len(picked) != tensor_parallel:
        raise ValueError(f"devices {picked}: tensor_parallel={tensor_parallel} needs as many")
    bad = [i for i in picked if not 0 <= i < len(local)]
    if bad:
        raise ValueError(f"devices {bad}: this process has {len(local)} local devices")
    return Mesh(np.array([local[i] for i in picked]), (AXIS,))


class Placement:
    """Where a step's arrays live on `mesh`.

    Args:
      expert_parallel: split the stacked experts over their axis E (else their FFN width).
      split_experts: split the stacked experts at all. A Pallas kernel is not partitioned by
        XLA: given a split weight it would gather it whole onto every device each step, so
        experts split by width stay whole where the grouped-expert kernels run. (Split by E
        they run per device, as the quantized matmul kernels run on each device's rows:
        device/sharded_kernels.py.)
      cfg: the model's config, where its Gated DeltaNet layers may split their heads
        (models/fused_layout.py's delta_split: their params, and the slot state's conv
        channels and ssm heads, split by head); None: they stay whole.
    """

    def __init__(self, mesh: Mesh, expert_parallel: bool, split_experts: bool = True,
                 cfg=None):  # fmt: skip
        self.mesh, self.expert_parallel, self.split_experts = mesh, expert_parallel, split_experts
        self.n = mesh.devices.size
        self.delta = cfg if cfg is not None and fused_layout.delta_shards(cfg, self.n) > 1 else None
        self.replicated = NamedSharding(mesh, P())

    def split(self, shape: tuple, axis: int) -> NamedSharding:
        """Split along `axis` if it divides by the mesh size, else replicated."""
        axis %= len(shape)
        if shape[axis] % self.n:
            return self.replicated
        spec = [None] * len(shape)
        spec[axis] = AXIS
        return NamedSharding(self.mesh, P(*spec))

    def _param(self, name: str, field: str | None, shape: tuple) -> NamedSharding:
        """The sharding of one param leaf: `name` its key, `field` "head" / "body" for a
        QuantWeight's arrays (None for a float array [in, out] or [E, in, out])."""
        if name in EXPERTS and not self.split_experts:
            return self.replicated
        if name in EXPERTS and self.expert_parallel and len(shape) == 3:
            return self.split(shape, 0)
        role = EXPERTS.get(name) or (COLUMN if name in COLUMN else ROW if name in ROW else None)
        if role is None or len(shape) == 0:
            return self.replicated
        if field is not None:  # output rows only: a split along K could cut a block
            return self.split(shape, -1 if field == "head" else -2) if role is COLUMN else (
                self.replicated)  # fmt: skip
        if len(shape) == 1:  # a bias [out]
            return self.split(shape, 0) if role is COLUMN else self.replicated
        return self.split(shape, -1 if role is COLUMN else -2)

    def params(self, params):
        """A sharding per leaf of a params pytree (arrays or ShapeDtypeStructs)."""

        def one(path, x):
            keys = [getattr(k, "key", None) for k in path]  # dict keys (a QuantWeight's: None)
            name = next((k for k in reversed(keys) if isinstance(k, str)), "")
            field = getattr(path[-1], "name", None) if path else None
            field = field if field in ("head", "body") else None
            return self._param(name, field, tuple(x.shape))

        return self._delta_params(params, jax.tree_util.tree_map_with_path(one, params))

    def _delta_params(self, params, shardings):
        """shardings with each Gated DeltaNet layer's split params split by head."""
        if self.delta is None:
            return shardings
        if isinstance(params, list):
            return [self._delta_params(p, s) for p, s in zip(params, shardings, strict=True)]
        if not isinstance(params, dict):
            return shardings
        out = {k: self._delta_params(params[k], s) for k, s in shardings.items()}
        if fused_layout.delta_split(params, self.delta, self.n):
            for name in fused_layout.DELTA:
                out[name] = jax.tree.map(lambda p: NamedSharding(self.mesh, p),
                                         delta_spec(name, params[name]),
                                         is_leaf=lambda p: isinstance(p, P))  # fmt: skip
        return out

    def slot_state(self, state: dict):
        """The per-slot state's shardings: replicated, but a Gated DeltaNet model's conv
        history [Lr, S, Kc-1, C] and ssm states [Lr, S, Hv, Dk, Dv] split by channel and head
        where its layers split (the channels and heads in fused_layout's order)."""
        out = self.replicate(state)
        if self.delta is not None and "model" in state:
            model = state["model"]
            # conv and pend by channel (pend: Lr arrays [S_max, K, W], by W), ssm by head
            split = {"conv": -1, "ssm": 2, "pend": -1}
            parts = {k: jax.tree.map(lambda x, a=a: self.split(x.shape, a), model[k])
                     for k, a in split.items() if k in model}  # fmt: skip
            out["model"] = {**out["model"], **parts}
        return out

    def caches(self, caches):
        """KV caches: four-axis leaves split by KV head (axis 2); others replicated."""
        return jax.tree.map(
            lambda x: self.split(x.shape, 2) if len(x.shape) == 4 else self.replicated, caches
        )

    def device_bytes(self, params) -> int:
        """Bytes of a params pytree (arrays or ShapeDtypeStructs) on each device: a split
        leaf's shard, a replicated leaf whole."""
        shardings = self.params(params)
        return sum(
            math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
            for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True)
        )

    def replicate(self, tree):
        return jax.tree.map(lambda _: self.replicated, tree)

    def abstract(self, tree, shardings):
        """ShapeDtypeStructs of `tree` carrying `shardings` (what a program is lowered with)."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
        )

    def put(self, tree, shardings):
        """`tree` on the mesh: each device receives only its shard of a split array (with
        several processes, from this process's host copy: each sends its devices' shards).
        Arrays already placed so stay as they are."""
        if jax.process_count() > 1:
            return jax.tree.map(self._from_host, tree, shardings)
        return jax.device_put(tree, shardings)

    @property
    def loading_device(self):
        """Where the loader unpacks and fuses tensors before load_onto sends their shards: the
        host's CPU device, so that no accelerator of the mesh ever holds a split weight whole
        (the default device where no CPU backend is initialized)."""
        try:
            return jax.local_devices(backend="cpu")[0]
        except RuntimeError:
            return jax.local_devices()[0]

    def load_onto(self, tree):
        """A subtree of params (a layer's dict, or the top level without the layers: leaves are
        placed by their keys) on the mesh, as the loader makes it."""
        return self.put(tree, self.params(tree))

    @staticmethod
    def _from_host(x, sharding):
        """A global array of x's values (the same on every process), each process putting
        its own devices' shards (jax.device_put would compare the copies first)."""
        if isinstance(x, jax.Array) and x.sharding == sharding:  # placed while loading
            return x
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

    def host_input(self, x: np.ndarray):
        """A step's host array as a program argument: replicated (with several processes,
        each holding the same values, a global array of their copies)."""
        if jax.process_count() == 1:
            return x
        return self._from_host(x, self.replicated)

    def local(self, x):
        """This process's copy of replicated outputs (a pytree or None)."""
        return jax.tree.map(
            lambda a: a if a.is_fully_addressable else a.addressable_shards[0].data, x
        )

    @property
    def first_local_device(self):
        """This process's first device of the mesh (whose memory sizes the KV pool)."""
        return next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())

    def allocator(self, allocate, params):
        """allocate () -> (kv caches, slot state, draft caches) made on the mesh, and the
        shardings ((kv, state, draft kv), params) the step programs keep them in."""
        kv, state, dkv = jax.eval_shape(allocate)
        held = (self.caches(kv), self.slot_state(state), self.replicate(dkv))
        return jax.jit(allocate, out_shardings=held), (held, self.params(params))

    def place(self, params, shardings):
        """params on the mesh, or abstract ones carrying their shardings (what a program is
        compiled for before the weights load)."""
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            return self.abstract(params, shardings)
        return self.put(params, shardings)

    def abstract_split(self, shape: tuple, dtype, axis: int) -> jax.ShapeDtypeStruct:
        """An abstract program argument split along `axis` (where it divides)."""
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self.split(shape, axis))

    def on_parts(self, fn, x):
        """Inside a program: fn on each device's part of x [R, n, ...] (split along axis 1),
        its outputs ([R, n, ...] each) left split so."""
        spec = P(None, AXIS)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=spec, out_specs=spec,
                             check_vma=False)(x)  # fmt: skip

    def constrain(self, tree, shardings):
        """Inside a program: outputs kept where their inputs were (donated buffers are reused
        and the next step's program takes them as they are). shardings None: replicated; an
        int: split along that axis (each leaf, where it divides)."""
        if tree is None:
            return None
        if shardings is None:
            shardings = self.replicate(tree)
        elif isinstance(shardings, int):
            shardings = jax.tree.map(lambda x: self.split(x.shape, shardings), tree)
        return jax.lax.with_sharding_constraint(tree, shardings)


class OneDevice:
    """Placement's interface for one device (no mesh): arrays stay where JAX puts them."""

    replicated = None
    n = 1

    def allocator(self, allocate, params):
        return allocate, ((None, None, None), None)

    def place(self, params, shardings):
        return params

    def abstract(self, tree, shardings):
        return tree

    def constrain(self, tree, shardings):
        return tree

    def abstract_split(self, shape: tuple, dtype, axis: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    def host_input(self, x):
        return x

    def local(self, x):
        return x

    def put(self, x, sharding):
        return jax.numpy.asarray(x)


def abstract_arg(placement: Placement | OneDevice, shape: tuple, dtype) -> jax.ShapeDtypeStruct:
    """An abstract program argument: replicated on a mesh."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=placement.replicated)
