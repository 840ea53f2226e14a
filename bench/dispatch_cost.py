"""Host time to launch a jitted program by its number of array arguments.

A step passes the model's weights (a few hundred arrays) and its KV caches (two per attention
layer, donated) to one jitted function; JAX and PjRt handle each argument on every call. This
times the call's return (the launch, not the run) of a chain of small matmuls over N weight
arrays that also updates M cache arrays, donated or not.

    python bench/dispatch_cost.py --cases 1:0 50:0 300:0 300:72 1:72
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["1:0", "50:0", "300:0", "300:72", "1:72"],
                    help="weights:caches")  # fmt: skip
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
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
