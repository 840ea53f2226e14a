"""DeepSeek V4's KV compressors over a packed step: every m tokens of a sequence close into one
compressed entry, a per-channel softmax-weighted sum of their projected rows.

HCA (m = 128): entry i = sum over block i's tokens j of softmax_j(z_j) * c_j, per channel.
CSA (m = 4, `overlap`): each token projects twice as wide, [ca | cb] and [za | zb]; entry i
weighs block i-1's (ca, za) halves together with block i's (cb, zb) over 2m sources, block -1
counting for nothing. z_j already holds the position bias ape[j mod m] (blocks align to
position 0). The caller norms an entry and ropes it at position i * m
(transformers' DeepseekV4HCACompressor / CSACompressor, llama.cpp's
build_{hca,overlap}_compressed_kv_from_state).

A step packs rows of several sequences, each a run of consecutive positions. The rows a
closing token needs from before its run come from its slot's ring, which holds a sequence's
last R positions (row q mod R): R = m for HCA (the open block), 2m for CSA (the open block and
the one before it), as llama.cpp's compressor state. After the step each run's last R rows
replace those positions in the ring, so a prompt split over steps at any point closes the same
entries as one pass.

Shapes: T step rows, W row width (d, or 2d with overlap), d entry width, S slots, R ring rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ring_rows(m: int, overlap: bool) -> int:
    """R: the positions a slot's ring keeps."""
    return 2 * m if overlap else m


def compress(c, z, ring_c, ring_z, slot, pos, start, end, *, m: int, overlap: bool):
    """The entries a step's rows close, and the rings after the step.

    Args:
      c, z: [T, W] float32 rows of this step (z with its position bias added);
      ring_c, ring_z: [S, R, W] float32, every slot's ring (ring_rows);
      slot: [T] int32, each row's slot (-1: padding, which neither reads nor writes);
      pos: [T] int32 positions; start, end: [T] int32, the first position of the row's run in
        this step and one past its last.
    Returns:
      (entries [T, d] float32: entry pos // m, unnormed, where (pos + 1) % m == 0, else
       unspecified; ring_c, ring_z after the step).
    """
    T, W = c.shape
    S, R, _ = ring_c.shape
    d = W // 2 if overlap else W
    real = slot >= 0
    s = jnp.maximum(slot, 0)
    block = pos // m
    # source positions: block i's m tokens, after CSA's m of block i - 1
    r = jnp.arange(m)
    cur = block[:, None] * m + r[None, :]  # [T, m]
    srcs = jnp.concatenate([cur - m, cur], axis=1) if overlap else cur
    here = srcs >= start[:, None]  # in this step's run: row t - (pos - q); else the ring
    row = jnp.where(here, jnp.arange(T)[:, None] - (pos[:, None] - srcs), 0)
    ring_at = s[:, None] * R + jnp.mod(srcs, R)
    # two gathers and a select, not one gather from [ring; rows]: that concatenation copied
    # every slot's ring, each step and layer
    row = jnp.clip(row, 0, T - 1)
    here = here[:, :, None]
    gc = jnp.where(here, c[row], ring_c.reshape(S * R, W)[ring_at])  # [T, n_src, W]
    gz = jnp.where(here, z[row], ring_z.reshape(S * R, W)[ring_at])
    if overlap:  # block i - 1's first halves, block i's second halves; block -1 weighs nothing
        gc = jnp.concatenate([gc[:, :m, :d], gc[:, m:, d:]], axis=1)
        gz = jnp.concatenate([gz[:, :m, :d], gz[:, m:, d:]], axis=1)
        none = (srcs < 0)[:, :, None]
        gc, gz = jnp.where(none, 0.0, gc), jnp.where(none, -jnp.inf, gz)
    entries = jnp.sum(jax.nn.softmax(gz, axis=1) * gc, axis=1)
    # The rings' writes read a zero made from the entries, so they follow every read of the
    # rings and XLA updates them in place: without the dependency it copied each ring twice
    # (an optimization barrier was expanded before copy insertion and ordered nothing).
    e = entries[0, 0]
    zero = jnp.where(jnp.isfinite(e), e, 0.0) * 0.0
    c, z = c + zero, z + zero
    # each run's last R positions go to its slot's ring (no two rows write one ring row)
    keep = real & (pos >= end - R)
    at = jnp.where(keep, s * R + jnp.mod(pos, R), S * R)  # S * R: dropped
    ring_c = ring_c.reshape(S * R, W).at[at].set(c, mode="drop").reshape(S, R, W)
    ring_z = ring_z.reshape(S * R, W).at[at].set(z, mode="drop").reshape(S, R, W)
    return entries, ring_c, ring_z


def closes(pos, m: int):
    """[T] bool: the rows whose position closes an entry."""
    return jnp.mod(pos + 1, m) == 0
