"""Grouped expert matmuls on the GPU: the Pallas kernel against jax.lax.ragged_dot.

Rows are routed uniformly at random to k of E experts and grouped by expert, as models/moe.py
does. For each case and Pallas tiling: max abs difference between the two, time per call inside
one executable of 48 dependent calls over distinct weight buffers (as the layers of a step run),
TFLOP/s, and GB/s of the bytes a call must
move (the weights of every expert with rows, the rows in and out) against the copy bandwidth
measured in the same run.

    python bench/kernels/moe_kernel.py --variants 16:128:128:4:3 64:128:64:4:2 --out moe_kernel.json

`--type q4_k` (any pallas_kernels.ggml_blocks.FORMATS type) times quantized experts kept in their
blocks (random valid blocks, make_model.random_rows), against ragged_dot over the same experts
dequantized to bf16 inside the step (what the XLA path does with them). With quantized experts
the variants `rows` and `rows:int8` time what a decode step runs instead of the grouped kernel
(models/moe.by_rows): each row alone against its expert's blocks, quant_matmul's experts mode,
with float32 or int8 activations, to place the per-pair path's threshold.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from luce_jax.loading.quants import keep_quantized
from luce_jax.models.moe import grouped_matmul_xla
from pallas_kernels.ggml_blocks import FORMATS
from pallas_kernels.moe_grouping import grouped_matmul
from pallas_kernels.quant_matmul import quant_matmul

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from make_model import random_rows  # noqa: E402
from meta import meta_line, run_meta, write_result  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402
from timing import per_call  # noqa: E402

log = logging.getLogger("moe_kernel")
LAYERS = 48
# (name, tokens, experts used, K, N, E, swiglu): DESIGN §9's ragged_dot figure, then the
# Qwen3-30B-A3B gate/up (d 2048 -> 2 x 768, fused SwiGLU) and down projections.
CASES = [
    ("DESIGN 9: T 4096, K 2048, N 768, E 64", 4096, 1, 2048, 768, 64, False),
    ("30B-A3B gate/up, 1 token", 1, 8, 2048, 768, 128, True),
    ("30B-A3B gate/up, 8 tokens", 8, 8, 2048, 768, 128, True),
    ("30B-A3B gate/up, 32 tokens", 32, 8, 2048, 768, 128, True),
    ("30B-A3B gate/up, 64 tokens", 64, 8, 2048, 768, 128, True),
    ("30B-A3B gate/up, 512 tokens", 512, 8, 2048, 768, 128, True),
    ("30B-A3B down, 8 tokens", 8, 8, 768, 2048, 128, False),
    ("30B-A3B down, 32 tokens", 32, 8, 768, 2048, 128, False),
    ("30B-A3B down, 512 tokens", 512, 8, 768, 2048, 128, False),
]


def timed(fn, x, ws, sizes) -> float:
    """Seconds per call of fn(x, w, sizes) in one executable of LAYERS dependent calls."""
    return per_call(lambda x, w: fn(x, w, sizes), x, ws, LAYERS)


def rows_fn(experts, swiglu: bool, int8_x: bool):
    """models/moe.ffn_rows' call as grouped_matmul's signature: row m times expert experts[m]
    (the rows' experts in grouped order), SwiGLU after the matmul."""

    def f(x, w, sizes):
        del sizes
        y = quant_matmul(x, w, experts=experts, int8_x=int8_x)
        if swiglu:
            gate, up = jnp.split(y, 2, axis=-1)
            y = jax.nn.silu(gate) * up
        return y.astype(jnp.bfloat16)

    return f


def tokamax_fn(impl: str | None, swiglu: bool):
    """tokamax.ragged_dot (an optional package: Pallas Mosaic GPU kernels for Hopper, or its
    Triton or XLA implementation) with grouped_matmul's signature, SwiGLU after it."""
    import tokamax
    from absl import flags

    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags, which would parse our argv
        flags.FLAGS(sys.argv[:1])

    def f(x, w, sizes):
        y = tokamax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32,
                               implementation=impl)  # fmt: skip
        if swiglu:
            gate, up = jnp.split(y, 2, axis=-1)
            y = jax.nn.silu(gate) * up
        return y.astype(jnp.bfloat16)

    return f


def parse_variant(v: str) -> dict:
    bm, bn, bk, warps, stages = (int(p) for p in v.split(":"))
    return dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


def expert_weights(E, K, Nw, qtype):
    """LAYERS distinct expert stacks (a buffer per timed call): bf16 [E, K, Nw], or
    QuantWeight [E, Nw, K]."""
    if qtype == "bf16":
        return [(jax.random.normal(jax.random.key(1 + i), (E, K, Nw), jnp.float32) * 0.05)
                .astype(jnp.bfloat16) for i in range(LAYERS)]  # fmt: skip
    t = FORMATS[qtype].qtype
    return [keep_quantized(random_rows(E * Nw, K, t, np.random.default_rng(i)), t, (E, Nw, K),
                           jnp.bfloat16) for i in range(LAYERS)]  # fmt: skip


def run_case(name, tokens, k, K, N, E, swiglu, bw, variants, qtype="bf16") -> list[dict]:
    r = np.random.default_rng(0)
    experts = np.stack([r.choice(E, k, replace=False) for _ in range(tokens)]).reshape(-1)
    sizes = jnp.asarray(np.bincount(experts, minlength=E), jnp.int32)
    M = tokens * k
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
    Nw = 2 * N if swiglu else N
    ws = expert_weights(E, K, Nw, qtype)
    used = int(np.count_nonzero(np.asarray(sizes)))
    per_expert = K * Nw * 2 if qtype == "bf16" else ws[0].nbytes // E
    nbytes = used * per_expert + M * K * 2 + M * N * 2
    flops = 2 * M * K * Nw
    fx = functools.partial(grouped_matmul_xla, swiglu=swiglu, out_dtype=jnp.bfloat16)
    ox = jax.jit(fx)(x, ws[0], sizes).astype(jnp.float32)
    tx = timed(fx, x, ws, sizes)
    rows = []
    for v in variants:
        try:
            if v.startswith("tokamax"):
                fp = tokamax_fn(v.partition(":")[2] or None, swiglu)
            elif v.startswith("rows"):
                fp = rows_fn(jnp.asarray(np.sort(experts), jnp.int32), swiglu, v == "rows:int8")
            else:
                fp = functools.partial(
                    grouped_matmul, swiglu=swiglu, out_dtype=jnp.bfloat16, **parse_variant(v)
                )
            op = jax.jit(fp)(x, ws[0], sizes).astype(jnp.float32)
            diff = float(jnp.max(jnp.abs(ox - op)))
            tp = timed(fp, x, ws, sizes)
        except Exception as e:  # a variant Triton cannot build is recorded, not fatal
            log.warning("%s %s failed: %s", name, v, str(e).splitlines()[0][:200])
            rows.append(dict(case=name, variant=v, error=str(e).splitlines()[0][:200]))
            continue
        row = dict(
            case=name, type=qtype, variant=v, M=M, K=K, N=N, E=E, experts_with_rows=used,
            swiglu=swiglu,
            max_diff=diff, xla_us=tx * 1e6, pallas_us=tp * 1e6, speedup=tx / tp,
            xla_TFLOP_s=flops / tx / 1e12, pallas_TFLOP_s=flops / tp / 1e12,
            xla_GB_s=nbytes / tx / 1e9, pallas_GB_s=nbytes / tp / 1e9,
            pallas_of_copy_bw=nbytes / tp / bw,
        )  # fmt: skip
        log.info("%s", row)
        rows.append(row)
    del ws
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["16:128:128:4:3"],
        help="Pallas tilings block_m:block_n:block_k:num_warps:num_stages (block_m is a cap), "
        "rows / rows:int8 (quantized experts a row at a time), or tokamax[:mosaic|triton|xla] "
        "(tokamax.ragged_dot, bf16 experts; the package and its needs installed)",
    )
    ap.add_argument("--cases", type=int, nargs="+", default=None, help="indices into CASES")
    ap.add_argument("--type", default="bf16", choices=["bf16", *FORMATS], help="expert weights")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth()
    cases = [CASES[i] for i in a.cases] if a.cases is not None else CASES
    rows = [r for c in cases for r in run_case(*c, bw, a.variants, a.type)]
    meta = run_meta()
    lines = [
        f"Grouped expert matmuls, {a.type} experts, random uniform routing; copy bandwidth "
        f"{bw / 1e9:.0f} "
        f"GB/s. Time per call inside one executable of {LAYERS} dependent calls, each on "
        f"its own weight buffer. Variant: block_m:block_n:block_k:warps:stages.",
        "",
        "| case | variant | M | experts with rows | ragged_dot us | Pallas us | speedup | "
        "ragged_dot TFLOP/s | Pallas TFLOP/s | Pallas GB/s | of copy BW | max diff |",
        "| --- " * 12 + "|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['variant']} | failed: {r['error']} |")
            continue
        lines.append(
            f"| {r['case']} | {r['variant']} | {r['M']} | {r['experts_with_rows']} | "
            f"{r['xla_us']:.0f} | "
            f"{r['pallas_us']:.0f} | {r['speedup']:.2f}x | {r['xla_TFLOP_s']:.1f} | "
            f"{r['pallas_TFLOP_s']:.1f} | {r['pallas_GB_s']:.0f} | {r['pallas_of_copy_bw']:.0%} | "
            f"{r['max_diff']:.3g} |"
        )
    md = "\n".join(lines) + "\n\n" + meta_line(meta) + "\n"
    write_result({"bench": "moe_kernel", **meta, "copy_GB_s": bw / 1e9, "rows": rows}, md, a.out)


if __name__ == "__main__":
    main()
