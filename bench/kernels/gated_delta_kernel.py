"""The gated delta kernel at Qwen3.5-27B's linear-layer sizes: decode rows and prompt chunks.

Each case is one layer's call of pallas_kernels/gated_delta.gated_delta_in_place on a state
array of 48 layers x 32 slots (float32, 4.8 GB), timed as `layers` dependent calls on distinct
layers of it (the layer index traced, as in a step), for each variant chunk:block_v:num_warps.
Also, per case, the step's former path: the bucket's rows of the state gathered out, the
kernel on them (block_v 128: a whole [Dk, Dv] state a program, as before the column split),
scattered back.
Reported: microseconds a call, the live slots' state bytes read and written, and that as a
share of the copy bandwidth measured in the same run.

    python bench/kernels/gated_delta_kernel.py --variants 16:32:4 0:32:4 --out gd.json
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta import gated_delta_in_place

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from meta import meta_line, run_meta, write_result  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402

Hk, Hv, D, LAYERS, SLOTS = 16, 48, 128, 48, 32


def variant(s: str) -> tuple[int, int, int]:
    """chunk:block_v:num_warps."""
    chunk, bv, warps = (int(x) for x in s.split(":"))
    return chunk, bv, warps


def case_inputs(lens: list[int], T: int, seed: int = 0):
    r = np.random.default_rng(seed)
    S = max(8, len(lens))  # padded to a bucket of rows, as a step is
    cu = np.zeros(S + 1, np.int32)
    np.cumsum(lens + [0] * (S - len(lens)), out=cu[1:])
    slots = np.full(S, -1, np.int32)
    slots[: len(lens)] = r.permutation(SLOTS)[: len(lens)]

    def unit(a):
        return a / np.linalg.norm(a, axis=-1, keepdims=True)

    x = dict(
        q=jnp.asarray(unit(r.standard_normal((T, Hk, D))) * D**-0.5, jnp.float32),
        k=jnp.asarray(unit(r.standard_normal((T, Hk, D))), jnp.float32),
        v=jnp.asarray(r.standard_normal((T, Hv, D)), jnp.float32),
        g=-jnp.asarray(r.uniform(0.01, 1.0, (T, Hv)), jnp.float32),
        beta=jnp.asarray(r.uniform(0.0, 1.0, (T, Hv)), jnp.float32),
    )
    return x, jnp.asarray(cu), jnp.asarray(slots), jnp.zeros((S,), jnp.int32)


def gathered(x, state, li, slots, fresh, cu, *, chunk, block_v, num_warps):
    """The former path: rows gathered out of the state, the kernel, rows scattered back."""
    read = jnp.maximum(slots, 0)
    write = jnp.where(slots < 0, state.shape[1], slots)
    h0 = jnp.where(((fresh == 0) & (slots >= 0))[:, None, None, None], state[li, read], 0.0)
    S = slots.shape[0]
    o, hs = gated_delta_in_place(
        x["q"], x["k"], x["v"], x["g"], x["beta"], h0[None], jnp.int32(0),
        jnp.arange(S, dtype=jnp.int32), jnp.zeros((S,), jnp.int32), cu,
        chunk=chunk, block_v=block_v, num_warps=num_warps,
    )  # fmt: skip
    return o, state.at[li, write].set(hs[0], mode="drop")


def time_case(name, lens, T, variants, bw, layers):
    x, cu, slots, fresh = case_inputs(lens, T)
    live = len(lens)
    moved = 2 * live * Hv * D * D * 4  # the live slots' states, read and written
    rows = []
    forms = [("in place", v) for v in variants] + [("gathered", (variants[0][0], 128, 4))]
    for form, (chunk, bv, warps) in forms:
        kw = dict(chunk=chunk, block_v=bv, num_warps=warps)
        run = functools.partial(gathered if form == "gathered" else _in_place, **kw)

        def chain(state, acc, run=run):
            def body(li, c):
                st, acc = c
                o, st = run(x, st, li, slots, fresh, cu)
                return st, acc + o[0, 0, 0]

            return jax.lax.fori_loop(0, layers, body, (state, acc))

        try:
            t = seconds(jax.jit(chain, donate_argnums=0), layers)
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported
            rows.append(dict(case=name, form=form, chunk=chunk, block_v=bv, warps=warps,
                             error=str(e)[:200]))  # fmt: skip
            continue
        rows.append(dict(case=name, form=form, chunk=chunk, block_v=bv, warps=warps, T=T,
                         live=live, us=t * 1e6, GBs=moved / t / 1e9,
                         of_copy_bw=moved / t / bw))  # fmt: skip
        logging.info("%s", rows[-1])
    return rows


def seconds(f, layers: int, rounds: int = 7) -> float:
    """Median seconds per layer call of f(state, acc) -> (state, acc), `layers` calls a run
    (the state donated from run to run, as the step donates it), after a warm-up."""
    state = jnp.zeros((LAYERS, SLOTS, Hv, D, D), jnp.float32)
    acc = jnp.float32(0)
    for _ in range(3):
        state, acc = f(state, acc)
    jax.block_until_ready(acc)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(5):
            state, acc = f(state, acc)
        jax.block_until_ready(acc)
        times.append((time.perf_counter() - t) / 5 / layers)
    return statistics.median(times)


def _in_place(x, state, li, slots, fresh, cu, **kw):
    return gated_delta_in_place(x["q"], x["k"], x["v"], x["g"], x["beta"], state, li, slots,
                                fresh, cu, **kw)  # fmt: skip


def report(rows: list[dict], bw: float, out: str | None) -> None:
    lines = [
        f"Gated delta rule, one linear layer of Qwen3.5-27B shape (Hk {Hk}, Hv {Hv}, Dk = Dv = "
        f"{D}), state array {LAYERS} layers x {SLOTS} slots; copy bandwidth {bw / 1e9:.0f} GB/s. "
        "State MB: the live slots' states read and written.",
        "",
        "| case | form | chunk:block_v:warps | us | state MB | GB/s | of copy BW |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        v = f"{r['chunk']}:{r['block_v']}:{r['warps']}"
        if "error" in r:
            lines.append(f"| {r['case']} | {r['form']} | {v} | failed: {r['error'][:80]} | | | |")
            continue
        mb = 2 * r["live"] * Hv * D * D * 4 / 1e6
        lines.append(f"| {r['case']} | {r['form']} | {v} | {r['us']:.1f} | {mb:.1f} | "
                     f"{r['GBs']:.0f} | {r['of_copy_bw']:.0%} |")  # fmt: skip
    meta = run_meta()
    lines += ["", meta_line(meta)]
    write_result(dict(bench="gated_delta_kernel", **meta, rows=rows), "\n".join(lines), out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variants", type=variant, nargs="+", default=[(16, 32, 4)])
    ap.add_argument("--decode", type=int, nargs="+", default=[1, 8], help="live decode rows")
    ap.add_argument("--prefill", type=int, nargs="*", default=[256, 512], help="chunk tokens")
    ap.add_argument("--layers", type=int, default=8, help="dependent calls a timed run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth()
    rows = []
    cases = [(f"decode {n} rows", [1] * n, max(8, n)) for n in a.decode]
    cases += [(f"prompt chunk {n}", [n], n) for n in a.prefill]
    for name, lens, T in cases:
        rows += time_case(name, lens, T, a.variants, bw, a.layers)
        report(rows, bw, a.out)  # after each case: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
