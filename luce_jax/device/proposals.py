"""Proposals kept on the device: per-slot state, its update in the sampling program, and the
offset by which a row lowered behind its slot's state moves (a draft head's proposals:
device/head_proposer.py; a draft model's: device/draft_model.py; prompt lookup's:
device/ngram_lookup.py).

Per slot the state holds `props` [S_max, K], the proposals for the slot's next verify row (a
draft head's, a draft model's or the lookup's), and `acc` [S_max], the proposals the slot's
last sampled row kept. The forward pass reads both (sampling.feed resolves proposal markers,
sampling.catch_up moves rows by `offsets`); the sampling program rewrites them after
verification. Shapes: S rows, R logits rows, S_max slots, K proposals, V vocabulary, MB blocks
per sequence, P block size."""

from __future__ import annotations

import jax
import jax.numpy as jnp

KEYS = ("acc", "props")  # the state's entries, beside the sampler's in the runner's state


def of(state: dict) -> dict:
    """This state's entries out of the runner's state (a forward pass reads them)."""
    return {k: state[k] for k in KEYS}


def init(max_slots: int, k: int) -> dict:
    """Zeroed state: acc [S_max], props [S_max, K]."""
    return {
        "acc": jnp.zeros((max_slots,), jnp.int32),
        "props": jnp.zeros((max_slots, k), jnp.int32),
    }


def row_reads(batch: dict) -> tuple:
    """What a proposer with caches on the pool's block ids (a draft model, the lookup) reads
    from the forward pass: the logits rows' positions int32 [R] and the rows' block tables
    [S, MB]."""
    return batch["positions"][batch["logit_rows"]], batch["block_tables"]


def row_read_shapes(R: int, S: int, MB: int) -> tuple:
    """Abstract `row_reads`, to compile a sampling program with."""
    return (jax.ShapeDtypeStruct((R,), jnp.int32), jax.ShapeDtypeStruct((S, MB), jnp.int32))


def last_emitted(packed, lpos, batch: dict) -> tuple:
    """Per row, the token it emitted last, the position after it (where that token goes) and
    the proposals it kept, each [S]; lpos: `row_reads`' positions, packed: sample_rows'."""
    R, S = lpos.shape[0], batch["slots"].shape[0]
    accepted = packed[2 * R : 2 * R + S]
    last = jnp.minimum(batch["logit_start"] + accepted, R - 1)  # [S] logits row
    return packed[last], lpos[last] + 1, accepted


def offsets(acc, batch: dict):
    """int32 [S]: how far each row the host marked `behind` really starts past where it was
    lowered (its slot's last row's kept proposals); 0 for every other row."""
    return acc[jnp.clip(batch["slots"], 0, acc.shape[0] - 1)] * (batch["behind"] > 0)


def update(state: dict, packed, batch: dict, R: int, props=None) -> dict:
    """The state after a sampling program: each sampled row's kept count, and its next
    proposals props [S, K] (None: the slots keep older ones, which only cost a rejection if a
    step verifies them). Rows that sample nothing (and padding) write nothing.

    Args: state: acc and props; packed: sampling.sample_rows' output; batch: the sampling
      program's rows; R: logits rows.
    """
    at = jnp.where(batch["sample_mask"] > 0, batch["slots"], state["acc"].shape[0])
    out = {"acc": state["acc"].at[at].set(packed[2 * R :], mode="drop"), "props": state["props"]}
    if props is not None:
        out["props"] = state["props"].at[at].set(props, mode="drop")
    return out
