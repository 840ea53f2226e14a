"""The sampler with top-k / top-p / min-p on the device: the engine's cut by bisection
(luce_jax/device/sampling.py) against the same filters over a sorted row, and against no
filter, per logits row count. Each is `sample` jitted whole (penalties, filters, the Gumbel
draw, the logprobs) over one random [R, V] batch; the median of timed calls.

    python bench/kernels/sampling_filters.py --rows 1 8 32 --vocab 151936 --out filters.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from luce_jax.device import sampling

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from meta import meta_line, run_meta, write_result  # noqa: E402
from timing import median_call  # noqa: E402


def sorted_filter(logits, sp):
    """The filters over a sorted row (the engine's form before the bisection)."""
    V = logits.shape[-1]
    order = jnp.sort(logits, axis=-1)[:, ::-1]
    k = jnp.where(sp["top_k"] > 0, jnp.minimum(sp["top_k"], V), V)
    kth = jnp.take_along_axis(order, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(order, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(before < sp["top_p"][:, None], axis=-1), 1)
    pth = jnp.take_along_axis(order, (n_keep - 1)[:, None], axis=-1)
    min_logit = order[:, :1] + jnp.log(jnp.maximum(sp["min_p"][:, None], 1e-30))
    cut = jnp.maximum(
        jnp.maximum(kth, pth), jnp.where(sp["min_p"][:, None] > 0, min_logit, -jnp.inf)
    )
    return jnp.where(logits >= cut, logits, -jnp.inf)


def case(R: int, V: int, variant: str) -> tuple[float, np.ndarray]:
    rng = np.random.default_rng(R)
    logits = jnp.asarray(rng.standard_normal((R, V)).astype(np.float32) * 4)
    sp = {
        "temperature": jnp.full((R,), 0.8), "top_p": jnp.full((R,), 0.9),
        "top_k": jnp.full((R,), 40 if variant != "none" else 0, jnp.int32),
        "min_p": jnp.full((R,), 0.05), "presence": jnp.zeros(R), "frequency": jnp.zeros(R),
        "repetition": jnp.ones(R),
    }  # fmt: skip
    counts, pmask = jnp.zeros((R, V), jnp.int32), jnp.zeros((R, V), bool)
    seeds, steps = jnp.arange(R, dtype=jnp.uint32), jnp.zeros(R, jnp.int32)
    filtered = variant != "none"
    with mock.patch.object(sampling, "_filter", sorted_filter if variant == "sorted" else
                           sampling._filter):  # fmt: skip
        fn = jax.jit(lambda *a: sampling.sample(*a, filtered=filtered)[0])
        tokens = fn(logits, counts, pmask, sp, seeds, steps)
        return median_call(fn, logits, counts, pmask, sp, seeds, steps, reps=30), np.asarray(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out")
    a = ap.parse_args()
    meta = run_meta()
    rows = []
    for R in a.rows:
        t = {}
        for variant in ("none", "sorted", "bisection"):
            t[variant], tok = case(R, a.vocab, variant)
            if variant == "sorted":
                want = tok
            if variant == "bisection":
                same = int((tok == want).sum())
        rows.append({"R": R, **{f"{k}_us": round(v * 1e6, 1) for k, v in t.items()},
                     "same_tokens": f"{same}/{R}"})  # fmt: skip
    md = "\n".join(
        [f"Sampling with top-k 40, top-p 0.9 and min-p 0.05 on every row, V {a.vocab}, us a call\n",
         "| R | no filter | sorted | bisection | same tokens |", "| --- | --- | --- | --- | --- |"]
        + [f"| {r['R']} | {r['none_us']} | {r['sorted_us']} | {r['bisection_us']} | "
           f"{r['same_tokens']} |" for r in rows]
        + ["", meta_line(meta)]
    )  # fmt: skip
    write_result({"meta": meta, "rows": rows}, md, a.out)


if __name__ == "__main__":
    main()
