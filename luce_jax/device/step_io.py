"""A step's inputs and outputs between host and device: the one upload, the launched records.

A step sends one int32 buffer: the forward pass's row arrays (step_format.step_layout), then the
sampling's (sample_layout), then the bits of the float32 sampling parameters. The forward pass
takes it in its launch and returns the sampling's part, on the device, for the sampling
program. On the H200's host each array copied in a launch added 60 to 130 us to it, and there
were three (bench/results/host_launch_embedded_h200.md). Shapes: T tokens, S rows,
R logits rows, K proposals, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..step_format import FLOAT_FIELDS, layout_size, pack, sample_layout, unpack


@dataclass(frozen=True)
class Forward:
    """A dispatched forward pass whose sampling is not launched yet."""

    logits: jax.Array  # float32 [R, V]
    row_tokens: jax.Array  # int32 [R, K + 1] (sampling.mark_fed's)
    R: int
    S: int
    sample_in: jax.Array  # int32 [sample_size(R, S)]: the sampling's ints, then float bits
    # what proposing reads in the sampling program: the proposer's feed reads, else None
    reads: object = None


@dataclass(frozen=True)
class Launched:
    """A launched step's device outputs, being copied to the host."""

    packed: jax.Array  # int32 [2R + S] (sampling.sample_rows)
    top: tuple | None  # (top ids, top logprobs) [R, 20] when a row asked for logprobs
    R: int


def sample_size(R: int, S: int) -> int:
    """int32 words of a sampling program's inputs: its ints, then its float bits."""
    return layout_size(sample_layout(S, R)) + len(FLOAT_FIELDS) * S


def upload(b: dict[str, np.ndarray], step_layout, R: int, S: int) -> np.ndarray:
    """The one int32 buffer a step sends: b's arrays per step_layout, then per sample_layout,
    then the bits of b["floats"] (float32 [6, S])."""
    floats = np.ascontiguousarray(b["floats"], np.float32).view(np.int32).ravel()
    return pack(b, step_layout + sample_layout(S, R), tail=floats)


def sample_inputs(sample_in, R: int, S: int) -> tuple[dict, jax.Array]:
    """The sampling's row arrays and floats [6, S] from its part of the upload (traced)."""
    layout = sample_layout(S, R)
    n = layout_size(layout)
    floats = jax.lax.bitcast_convert_type(sample_in[n:], jnp.float32).reshape(-1, S)
    return unpack(sample_in[:n], layout), floats


def outputs(launched: Launched) -> dict[str, np.ndarray]:
    """Wait for a launched step's outputs.

    Returns:
      per logits row: tokens, logprob, and top_ids / top_logprobs [R, 20] when a row asked
      for logprobs; per row: accepted (proposals kept).
    """
    R = launched.R
    packed = np.asarray(launched.packed)
    out = {
        "tokens": packed[:R],
        "logprob": packed[R : 2 * R].view(np.float32),
        "accepted": packed[2 * R :],
    }
    if launched.top is not None:
        out["top_ids"], out["top_logprobs"] = map(np.asarray, launched.top)
    return out
