"""Quantized-weight matmuls on the GPU: the Pallas Q8_0 kernel against XLA's bf16 dot.

For Qwen3-8B's projection shapes and decode and prefill row counts: max relative difference to
the float32 reference, time per call inside one executable of LAYERS dependent calls cycling
over distinct weight buffers (as the layers of a step run, so L2 does not serve them), and GB/s
of the bytes a call must move (weights as stored, rows in and out) against the copy bandwidth
measured in the same run.

    python bench/quant_matmul.py --variants 128:4:4:3 64:4:4:3 --out quant_matmul.json
"""

from __future__ import annotations

import argparse
import functools
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.quant_matmul import quant_matmul, quant_matmul_reference, quantize_q8_0

from meta import meta_line, run_meta, write_result
from roofline import copy_bandwidth
from timing import per_call

log = logging.getLogger("quant_matmul")
LAYERS = 8
# (name, K, N): Qwen3-8B's fused gate/up, down, attention output and fused qkv projections.
SHAPES = [("gate/up", 4096, 24576), ("down", 12288, 4096), ("attn_out", 4096, 4096),
          ("qkv", 4096, 6144)]  # fmt: skip


def timed(fn, x, ws) -> float:
    """Seconds per call of fn(x, w) in one executable of LAYERS dependent calls."""
    return per_call(fn, x, ws, LAYERS, n=10)


def parse_variant(v: str) -> dict:
    """block_n:groups:warps:stages[:tile] (tile: quant_matmul's per_group=False)."""
    bn, groups, warps, stages, *mode = v.split(":")
    return dict(block_n=int(bn), groups=int(groups), num_warps=int(warps),
                num_stages=int(stages), per_group=mode != ["tile"])  # fmt: skip


def run_case(name, K, N, M, bw, variants, n_weights) -> list[dict]:
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
    dense = [
        (jax.random.normal(jax.random.key(1 + i), (K, N), jnp.float32) * 0.05).astype(jnp.bfloat16)
        for i in range(n_weights)
    ]
    quant = [quantize_q8_0(w.astype(jnp.float32)) for w in dense]
    ref = quant_matmul_reference(x, quant[0])
    io = M * K * 2 + M * N * 2
    t_bf16 = timed(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), x, dense)
    rows = []
    for v in variants:
        fn = functools.partial(quant_matmul, out_dtype=jnp.bfloat16, **parse_variant(v))
        try:
            got = jax.jit(fn)(x, quant[0]).astype(jnp.float32)
            err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            t = timed(fn, x, quant)
        except Exception as e:  # a variant Triton cannot build is recorded, not fatal
            log.warning("%s M=%d %s failed: %s", name, M, v, str(e).splitlines()[0][:200])
            rows.append(dict(case=name, M=M, variant=v, error=str(e).splitlines()[0][:200]))
            continue
        qbytes = quant[0].nbytes + io
        row = dict(
            case=name, M=M, K=K, N=N, variant=v, rel_err=err, q8_0_us=t * 1e6,
            bf16_us=t_bf16 * 1e6, speedup=t_bf16 / t, q8_0_GB_s=qbytes / t / 1e9,
            q8_0_of_copy_bw=qbytes / t / bw, bf16_of_copy_bw=(K * N * 2 + io) / t_bf16 / bw,
        )  # fmt: skip
        log.info("%s", row)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["128:4:4:3"],
        help="Pallas tilings block_n:groups:num_warps:num_stages[:tile]",
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    ap.add_argument("--shapes", type=int, nargs="+", default=None, help="indices into SHAPES")
    ap.add_argument("--weights", type=int, default=4, help="distinct weight buffers cycled")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth()
    shapes = [SHAPES[i] for i in a.shapes] if a.shapes is not None else SHAPES
    rows = [r for s in shapes for M in a.rows for r in run_case(*s, M, bw, a.variants, a.weights)]
    meta = run_meta()
    lines = [
        f"Q8_0 weights (Pallas, dequantized in registers) against bf16 weights (XLA dot); copy "
        f"bandwidth {bw / 1e9:.0f} GB/s. Time per call inside one executable of {LAYERS} "
        f"dependent calls cycling over {a.weights} weight buffers. Variant: "
        "block_n:groups:warps:stages[:tile] (tile: one dot per chunk of scaled values).",
        "",
        "| case | M | variant | Q8_0 us | bf16 us | speedup | Q8_0 GB/s (of copy BW) | bf16 "
        "of copy BW | rel. error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['M']} | {r['variant']} | failed: {r['error']} |")
            continue
        lines.append(
            f"| {r['case']} K {r['K']} N {r['N']} | {r['M']} | {r['variant']} | "
            f"{r['q8_0_us']:.1f} | {r['bf16_us']:.1f} | {r['speedup']:.2f}x | "
            f"{r['q8_0_GB_s']:.0f} ({r['q8_0_of_copy_bw']:.0%}) | {r['bf16_of_copy_bw']:.0%} | "
            f"{r['rel_err']:.1e} |"
        )
    lines += ["", meta_line(meta)]
    res = {"bench": "quant_matmul", **meta, "copy_GB_s": bw / 1e9, "rows": rows}
    write_result(res, "\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    main()
