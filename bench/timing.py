"""Kernel timing as the layers of a step run: dependent calls over distinct weight buffers."""

from __future__ import annotations

import time

import jax


def per_call(fn, x, ws: list, layers: int, n: int = 5) -> float:
    """Seconds per call of fn(x, w) in one executable of `layers` dependent calls cycling over
    `ws`, so each call reads other weights than the last few (len(ws) distinct buffers,
    together far over the 60 MB L2, as the layers of a step do; one buffer reused would be
    served from L2). Each call's input depends on the last one's output, so calls never
    overlap."""

    def chain(x, ws):
        for i in range(layers):
            y = fn(x, ws[i % len(ws)])
            x = x + (y[0, 0] * 0).astype(x.dtype)
        return x

    f = jax.jit(chain)
    jax.block_until_ready(f(x, ws))
    t = time.perf_counter()
    for _ in range(n):
        out = f(x, ws)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n / layers
