"""Kernel timing as the layers of a step run: dependent calls over distinct weight buffers."""

from __future__ import annotations

import statistics
import time

import jax


def per_call(fn, x, ws: list, layers: int, rounds: int = 7, round_s: float = 0.005,
             warmup_s: float = 0.05) -> float:  # fmt: skip
    """Median seconds per call of fn(x, w) in one executable of `layers` dependent calls, each
    on its own weight buffer of `ws` (together far over the 60 MB L2, as the layers of a step
    are; one buffer reused would be served from L2). Each call's input depends on the last
    one's output, so calls never overlap. One buffer per call, not a cycle over fewer: XLA
    computes a weight-only part of fn (dequantize.py's kernel, XLA's dequantizing ops) once
    per distinct buffer, and with 2 buffers for 8 calls such a variant timed a quarter of its
    dequantizing (bench/results/history/2026-12-02_quant_matmul_mmq_prefill_h200.md).

    The executable first runs for `warmup_s` (the GPU's clocks rise from idle; five runs of a
    0.4 ms chain had timed one kernel and grid 7 to 25% apart on the H200,
    bench/results/history/2026-12-01_quant_matmul_vector_splits_h200.md), then `rounds` rounds of
    about `round_s` each are timed and the median round is returned."""

    if len(ws) < layers:
        raise ValueError(f"{len(ws)} weight buffers for {layers} calls: give one per call")

    def chain(x, ws):
        for i in range(layers):
            y = fn(x, ws[i])
            x = x + (y[0, 0] * 0).astype(x.dtype)
        return x

    f = jax.jit(chain)
    jax.block_until_ready(f(x, ws))
    t0, runs = time.perf_counter(), 0
    while runs == 0 or time.perf_counter() - t0 < warmup_s:
        jax.block_until_ready(f(x, ws))
        runs += 1
    reps = max(1, round(round_s / ((time.perf_counter() - t0) / runs)))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            out = f(x, ws)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / reps / layers)
    return statistics.median(times)


def median_call(fn, *args, reps: int = 50) -> float:
    """Median seconds of one fn(*args) (jitted, its results awaited each call), after a first
    call that compiles it."""
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return statistics.median(out)
