"""Paged attention on the GPU: the Pallas kernel against the XLA reference, one layer.

Qwen3-8B attention shape (H 32, K 8, D 128, bf16 KV, 16-token blocks). Decode steps of R rows
at a context length each, and a mixed step (a 256-token prompt chunk plus decode rows). For
each: max abs difference to the float32 jnp reference (where it fits), time per call of both
implementations, and the KV bytes the step must read over that time against the copy bandwidth
measured in the same run.

    python bench/attention_kernel.py --out attention.json
"""

from __future__ import annotations

import argparse
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from luce_jax.models.attention import paged_attention_xla
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

from meta import meta_line, run_meta, write_result
from roofline import copy_bandwidth

log = logging.getLogger("attention_kernel")
H, K, D, P = 32, 8, 128, 16


def step(segs, seed=0):
    """Device arrays for a packed step: segs = [(rows, kv length)], tables in shuffled blocks."""
    rng = np.random.default_rng(seed)
    MB = max(-(-kv // P) for _, kv in segs)
    NB = 1 + sum(-(-kv // P) for _, kv in segs)
    perm = rng.permutation(np.arange(1, NB))
    tables = np.zeros((len(segs), MB), np.int32)
    seg_ids, positions, cu, at = [], [], [0], 0
    for s, (q, kv) in enumerate(segs):
        n = -(-kv // P)
        tables[s, :n] = perm[at : at + n]
        at += n
        seg_ids += [s] * q
        positions += list(range(kv - q, kv))
        cu.append(cu[-1] + q)
    T = 1 << max(3, (cu[-1] - 1).bit_length())  # the engine's power-of-two token bucket
    pad = T - cu[-1]
    key = jax.random.key(seed)
    k = jax.random.normal(key, (NB, P, K, D), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), (NB, P, K, D), jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 2), (T, H, D), jnp.bfloat16)
    args = (
        q,
        k,
        v,
        jnp.asarray(seg_ids + [0] * pad, jnp.int32),
        jnp.asarray(positions + [0] * pad, jnp.int32),
        jnp.asarray(tables),
        jnp.asarray([kv for _, kv in segs], jnp.int32),
    )
    kv_bytes = sum(kv for _, kv in segs) * K * D * 2 * 2
    return args, jnp.asarray(cu, jnp.int32), cu[-1], kv_bytes


def timed(f, args, n=20) -> float:
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n


def run_case(name, segs, bw, check_ref, split_tokens=1024) -> dict:
    args, cu, real, kv_bytes = step(segs)
    scale = D**-0.5
    fp = jax.jit(
        lambda *a: paged_attention(*a, scale=scale, cu_q_lens=cu, split_tokens=split_tokens)
    )
    fx = jax.jit(lambda *a: paged_attention_xla(*a, scale=scale))
    out_p, out_x = fp(*args), fx(*args)
    row = {
        "case": f"{name}, split {split_tokens}",
        "T": int(args[0].shape[0]),
        "kv_MB": kv_bytes / 1e6,
    }
    row["max_diff_vs_xla"] = float(
        jnp.max(jnp.abs(out_p[:real].astype(jnp.float32) - out_x[:real].astype(jnp.float32)))
    )
    if check_ref:
        ref = jax.jit(lambda *a: paged_attention_reference(*a, scale=scale))(*args)
        row["max_diff_vs_f32_ref"] = float(
            jnp.max(jnp.abs(out_p[:real].astype(jnp.float32) - ref[:real].astype(jnp.float32)))
        )
    tp, tx = timed(fp, args), timed(fx, args)
    row.update(
        pallas_us=tp * 1e6,
        xla_us=tx * 1e6,
        speedup=tx / tp,
        pallas_GB_s=kv_bytes / tp / 1e9,
        of_copy_bw=kv_bytes / tp / bw,
    )
    log.info("%s", row)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--split-tokens", type=int, nargs="+", default=[1024])
    ap.add_argument("--no-mixed", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth()
    rows = []
    for ctx in a.ctx:
        for r in a.rows:
            for sp in a.split_tokens:
                rows.append(run_case(f"decode {r}x{ctx}", [(1, ctx)] * r, bw, r * ctx <= 65536, sp))
    if not a.no_mixed:
        mixed = [(256, 4096)] + [(1, 4096)] * 8
        for sp in a.split_tokens:
            rows.append(run_case("prefill 256 @4096 + 8 decode @4096", mixed, bw, True, sp))
    meta = run_meta()
    lines = [
        f"Paged attention, one layer of Qwen3-8B shape (H {H}, K {K}, D {D}, P {P}, bf16 KV); "
        f"copy bandwidth {bw / 1e9:.0f} GB/s.",
        "",
        "| case | T | KV MB | Pallas us | XLA us | speedup | Pallas KV GB/s | of copy BW | "
        "max diff vs XLA | vs f32 ref |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ref = f"{r['max_diff_vs_f32_ref']:.3g}" if "max_diff_vs_f32_ref" in r else "-"
        lines.append(
            f"| {r['case']} | {r['T']} | {r['kv_MB']:.1f} | {r['pallas_us']:.0f} | "
            f"{r['xla_us']:.0f} | {r['speedup']:.1f}x | {r['pallas_GB_s']:.0f} | "
            f"{r['of_copy_bw']:.0%} | {r['max_diff_vs_xla']:.3g} | {ref} |"
        )
    md = "\n".join(lines) + "\n\n" + meta_line(meta) + "\n"
    res = {"bench": "attention_kernel", **meta, "copy_GB_s": bw / 1e9, "rows": rows}
    write_result(res, md, a.out)


if __name__ == "__main__":
    main()
