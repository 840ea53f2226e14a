"""A small model's params packed into one buffer per dtype, so a program takes two arguments
for them, not one per tensor.

A program's launch costs about 4 us per argument on the H200 (bench/engine/dispatch_cost.py): the
embedded draft model's 34 tensors, passed to both programs of a step, added about 0.3 ms to a
decode step the host already bounds. Inside the program each tensor is a static slice of its
dtype's buffer, reshaped; XLA fuses such slices into the ops that read them (the draft's
matmuls are Triton fusions), so the device pays nothing measurable. Meant for small models
only: a slice that a library call (cuBLAS) reads is copied first.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Layout:
    """Where each leaf of a params pytree lives: (dtype name, offset, shape) per leaf, in
    tree order, and the tree's structure. Hashable: a static argument."""

    treedef: object
    leaves: tuple[tuple[str, int, tuple[int, ...]], ...]


def pack(params) -> tuple[dict[str, jax.Array], Layout]:
    """({dtype name: 1-D buffer}, Layout) of a params pytree of arrays."""
    leaves, treedef = jax.tree.flatten(params)
    parts: dict[str, list] = {}
    where, size = [], {}
    for x in leaves:
        name = jnp.dtype(x.dtype).name
        where.append((name, size.get(name, 0), tuple(x.shape)))
        size[name] = size.get(name, 0) + int(np.prod(x.shape))
        parts.setdefault(name, []).append(jnp.ravel(x))
    bufs = {name: jnp.concatenate(p) for name, p in parts.items()}
    return bufs, Layout(treedef, tuple(where))


def unpack(bufs: dict, layout: Layout):
    """The params pytree back from pack's buffers (traced: static slices and reshapes)."""
    leaves = [
        jax.lax.slice(bufs[name], (off,), (off + int(np.prod(shape)),)).reshape(shape)
        for name, off, shape in layout.leaves
    ]
    return jax.tree.unflatten(layout.treedef, leaves)
