"""Runs of every bucket on all-padding steps at start-up (device/runner.py's programs): first
runs that build CUDA graphs before any request, and step timings for the speculation policy.
Shapes: T tokens, S rows."""

from __future__ import annotations

import jax
import numpy as np

from ..step_format import lower, padding_inputs
from .programs import best_of_3


def idle_batch(runner, T: int, S: int) -> dict[str, np.ndarray]:
    """An all-padding step of bucket (T, S) for `runner` (a device/runner.Runner): it writes
    only the sink block."""
    first, *groups = (np.zeros((1, g.max_blocks), np.int32) for g in runner.spaces)
    b = lower([], first, runner.block_size, T, S, runner.logit_width(T, S),
              tuple(zip(groups, runner.spaces[1:], strict=True)))  # fmt: skip
    b.update(padding_inputs(S))
    return b


def first_runs(runner, pairs: list[tuple[int, int]]) -> None:
    """Run each bucket once on an all-padding step (it writes only the sink block).

    On the GPU a step program's first run builds its CUDA graph and loads its kernels: the
    first cold 8k-token request took 392 ms against 335 after, a 4k prompt's first 234
    against 190-205 (bench/results/history/2026-12-03_prefix_warm_ttft_708373c_h200.md,
    history/2026-12-02_ttft4k_budgets_qwen3-8b-q4_k_m.md). Here start-up pays it, not a request.
    A bucket that cannot run (out of memory, say) fails start-up here, not its first
    request: a failed run may have consumed the donated caches, so serving on would fail
    every step after it.
    """
    for t, s in pairs:
        runner.fetch(runner.launch(idle_batch(runner, t, s), t, s))
    jax.block_until_ready((runner.kv, runner.state, runner.draft_kv))


def time_steps(runner, pairs: list[tuple[int, int]]) -> None:
    """Time each bucket on an all-padding step (which reads every weight, as a real step
    does) for the speculation policy. Only speculation needs it: four steps per bucket
    were 12 s of a 17 s start of the embedded model on 2 CPU cores."""
    for t, s in pairs:
        b = idle_batch(runner, t, s)
        runner.step_time[(t, s)] = best_of_3(
            lambda t=t, s=s, b=b: runner.fetch(runner.launch(b, t, s))
        )
    if runner.ahead:  # what proposing (the head, or the draft's decodes) adds to a step
        t, s = pairs[0]
        b = {**idle_batch(runner, t, s), "propose": True}
        proposing = best_of_3(lambda: runner.fetch(runner.launch(b, t, s)))
        runner.propose_time = max(proposing - runner.step_time[(t, s)], 0.0)
    jax.block_until_ready((runner.kv, runner.state, runner.draft_kv))
