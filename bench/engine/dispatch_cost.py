"""Host time to launch a jitted program by its number of array arguments.

A step passes the model's weights (a few hundred arrays) and its KV caches (two per attention
layer, donated) to one jitted function; JAX and PjRt handle each argument on every call. This
times the call's return (the launch, not the run) of a chain of small matmuls over N weight
arrays that also updates M cache arrays, donated or not.

    python bench/engine/dispatch_cost.py --cases 1:0 50:0 300:0 300:72 1:72

`--inputs K` times instead the launch of a chain of K kernels by where its one input comes
from: the same device array every call, two alternating ones, a fresh host (NumPy) array, or
a fresh device array; and alternating device arrays with one call in flight, as the engine
launches.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("dispatch_cost")


def launch_ms(n_weights: int, n_caches: int, donate: bool, calls: int = 30) -> float:
    """Median milliseconds for the jitted call to return (its outputs are then awaited)."""
    ws = [jnp.full((256, 256), i % 7, jnp.bfloat16) for i in range(n_weights)]
    kv = [jnp.zeros((1024, 128), jnp.bfloat16) for _ in range(n_caches)]
    x = np.ones((8, 256), np.float32)

    @functools.partial(jax.jit, donate_argnums=(1,) if donate else ())
    def step(ws, kv, x):
        h = x.astype(jnp.bfloat16)
        for w in ws:
            h = jnp.tanh(h @ w)
        return h.sum(), [c.at[:8].add(h[:, :128]) for c in kv]

    out, kv = step(ws, kv, x)
    out.block_until_ready()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        out, kv = step(ws, kv, x)
        times.append(time.perf_counter() - t)
        out.block_until_ready()
    return 1e3 * statistics.median(times)


def input_us(kernels: int, calls: int = 60) -> dict[str, float]:
    """Median microseconds for the call to return, by where its input comes from."""
    w = jnp.full((64, 64), 0.01, jnp.float32)

    @jax.jit
    def f(w, x):
        for _ in range(kernels):
            x = jax.lax.optimization_barrier(jnp.tanh(x @ w))  # one kernel each
        return x.sum()

    host = np.ones((8, 64), np.float32)
    a, b = jax.device_put(host), jax.device_put(host + 1)
    out = {}
    for label, get in (("same device array", lambda i: a),
                       ("two alternating device arrays", lambda i: (a, b)[i % 2]),
                       ("fresh host array", lambda i: host + i),
                       ("fresh device array", lambda i: jax.device_put(host + i))):  # fmt: skip
        f(w, get(0)).block_until_ready()
        times = []
        for i in range(calls):
            x = jax.block_until_ready(get(i))
            t = time.perf_counter()
            y = f(w, x)
            times.append(time.perf_counter() - t)
            y.block_until_ready()
        out[label] = 1e6 * statistics.median(times)
    times, y = [], f(w, a)
    for i in range(calls):
        t = time.perf_counter()
        nxt = f(w, (a, b)[i % 2])
        times.append(time.perf_counter() - t)
        y.block_until_ready()
        y = nxt
    out["alternating, one call in flight"] = 1e6 * statistics.median(times)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["1:0", "50:0", "300:0", "300:72", "1:72"],
                    help="weights:caches")  # fmt: skip
    ap.add_argument("--inputs", type=int, nargs="*", default=None,
                    help="kernel counts: time launches by where the input comes from")  # fmt: skip
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    if a.inputs:
        for k in a.inputs:
            us = input_us(k)
            rows.append({"kernels": k, "launch_us": us})
            log.info("%d kernels: %s", k, {key: round(v, 1) for key, v in us.items()})
        a.cases = []
    for case in a.cases:
        n, m = (int(v) for v in case.split(":"))
        for donate in (False, True) if m else (False,):
            ms = launch_ms(n, m, donate)
            rows.append({"weights": n, "caches": m, "donated": donate, "launch_ms": ms})
            log.info("%d weights, %d caches, donated %s: launch %.3f ms", n, m, donate, ms)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
