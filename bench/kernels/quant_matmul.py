"""Quantized-weight matmuls on the GPU: the Pallas kernel against XLA's bf16 dot and XLA's
dequantize-then-dot, per GGML type.

For Qwen3-8B's projection shapes and decode and prefill row counts: max relative difference to
the float32 reference, time per call inside one executable of LAYERS dependent calls cycling
over distinct weight buffers (as the layers of a step run, so L2 does not serve them), and GB/s
of the bytes a call must move (weights as stored, rows in and out) against the copy bandwidth
measured in the same run. Weights are random valid blocks (make_model.random_rows).

    python bench/kernels/quant_matmul.py --types q8_0 q4_k --variants 128:256:4:3 --out qmm.json

`--live L`: also time each variant told that only the first L rows are real (a decode step of
L tokens in a bigger bucket), which takes the kernel's vector path for L <= vector_rows.
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
from pallas_kernels.dequantize import dequantized_matmul
from pallas_kernels.ggml_blocks import FORMATS
from pallas_kernels.quant_matmul import quant_matmul, quant_matmul_reference, quant_matmul_xla
from pallas_kernels.quant_weight import dequantize_weight

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from make_model import random_rows  # noqa: E402
from meta import meta_line, run_meta, write_result  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402
from timing import per_call  # noqa: E402

log = logging.getLogger("quant_matmul")
LAYERS = 8
# (name, K, N): Qwen3-8B's fused gate/up, down, attention output and fused qkv projections.
# (name, K, N) of Qwen3-8B; the head (vocabulary 151936) is the largest matmul of a decode
# step, Q6_K in a Q4_K_M file (315 us of a 4.4 ms C1 step on the H200,
# results/history/2026-12-02_profile_qwen3-8b-q4_k_m_c1_9345aba.md)
SHAPES = [("gate/up", 4096, 24576), ("down", 12288, 4096), ("attn_out", 4096, 4096),
          ("qkv", 4096, 6144), ("head", 4096, 151936)]  # fmt: skip


def parse_variant(v: str) -> dict:
    """block_n:values_per_step:warps:stages[:min_programs[:block_m[:int8]]] (int8 1: the dots
    on x's int8 rows and int8 codes, int8_x and int8_dots: at prefill sizes, llama.cpp's
    MMQ route, int8 tensor cores with a scale a group)."""
    bn, vps, warps, stages, *more = (int(t) for t in v.split(":"))
    kw = dict(block_n=bn, values_per_step=vps, num_warps=warps, num_stages=stages)
    names = ("min_programs", "block_m")
    kw |= {n: m for n, m in zip(names, more[:2], strict=False)}
    if len(more) > 2 and more[2]:
        kw |= {"int8_x": True, "int8_dots": True}
    return kw


def parse_vector(v: str) -> dict:
    """block_n:values_per_step:warps:stages:vector_programs[:unit[:int8[:prefetch[:dots]]]] of
    the vector path (unit 1: codes as the floats 1 + q / 128 four bytes at a time, ggml_asm.py;
    int8 1: x as int8 and codes dotted with it by dp4a; 0, the default: a code at a time in
    float32; prefetch 1: weight loads a loop step ahead; dots 1: with int8, a call of more live
    rows than the vector path takes dots x's int8 rows with int8 codes, int8_dots)."""
    bn, vps, warps, stages, vp, *flags = (int(t) for t in v.split(":"))
    flags += [0] * (4 - len(flags))
    return dict(block_n=bn, values_per_step=vps, num_warps=warps, num_stages=stages,
                vector_programs=vp, unit_codes=bool(flags[0]), int8_x=bool(flags[1]),
                prefetch=bool(flags[2]), int8_dots=bool(flags[3]))  # fmt: skip


def parse_dequant(v: str) -> dict:
    """block_n:values_per_program:warps[:transpose 0/1] of pallas_kernels/dequantize.py."""
    bn, vpp, warps, *t = (int(x) for x in v.split(":"))
    return dict(block_n=bn, values_per_program=vpp, num_warps=warps, transpose=bool(t and t[0]))


def xla_reduce(x, w):
    """Row 0 of x @ W^T as XLA's multiply-and-reduce with W dequantized inside the fusion (no
    dot, no bf16 copy of W if XLA fuses the decoding into the reduction); other rows zero."""
    y = jnp.sum(dequantize_weight(w, jnp.float32) * x[0].astype(jnp.float32)[None, :], axis=1)
    return jnp.zeros((x.shape[0], y.shape[0]), jnp.bfloat16).at[0].set(y.astype(jnp.bfloat16))


def xla_split(x, w, n: int):
    """XLA's dequantize-then-dot a chunk of n outputs at a time (static slices, outputs
    concatenated), so that each chunk's bf16 copy may stay in L2 for its dot. The barrier keeps
    XLA from computing only the chunk that the timing chain reads (it simplifies a slice of a
    concatenation to one operand)."""
    parts = [quant_matmul_xla(x, w.take(slice(a, a + n)), out_dtype=jnp.bfloat16)
             for a in range(0, w.shape[0], n)]  # fmt: skip
    return jax.lax.optimization_barrier(jnp.concatenate(parts, axis=-1))


def run_case(
    qtype,
    name,
    K,
    N,
    M,
    bw,
    variants,
    xla: bool,
    lives=(),
    vectors=(),
    rows=None,
    flush=lambda: None,
    splits=(),
    dequants=(),
) -> list[dict]:
    """Times each variant at one type, shape and row count; appends a row per variant to
    `rows` and calls flush() after each (a run cut short keeps what it measured)."""
    rng = np.random.default_rng(0)
    fmt = FORMATS[qtype]
    x = jax.random.normal(jax.random.key(0), (M, K), jnp.bfloat16)
    quant = [keep_quantized(random_rows(N, K, fmt.qtype, rng), fmt.qtype, (N, K), jnp.bfloat16)
             for _ in range(LAYERS)]  # fmt: skip  # a buffer per call (timing.per_call)
    # random, not constant: a bf16 product on zeros ran 13% fast on an H200 (device METHOD.md)
    dense = [jax.random.normal(jax.random.key(i + 1), (K, N), jnp.bfloat16)
             for i in range(LAYERS)]  # fmt: skip
    ref = quant_matmul_reference(x, quant[0])
    io = M * K * 2 + M * N * 2
    qbytes = quant[0].nbytes + io
    base = dict(qtype=qtype, case=name, M=M, K=K, N=N)
    t_bf16 = per_call(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32), x, dense,
                      LAYERS)  # fmt: skip
    fns = [(v, functools.partial(quant_matmul, out_dtype=jnp.bfloat16, **parse_variant(v)))
           for v in variants]  # fmt: skip
    fns += [(f"dequant {v}", functools.partial(dequantized_matmul, **parse_dequant(v)))
            for v in dequants]  # fmt: skip
    for n in lives:
        live = jnp.int32(n)
        fns += [(f"{v} live {n}", functools.partial(quant_matmul, live=live,
                 out_dtype=jnp.bfloat16, **parse_variant(v))) for v in variants]  # fmt: skip
        # the vector path itself, for every K and up to n rows; with the dots flag, the dots
        # branch on int8 rows (the vector path's default 2 rows, so n > 2 takes the dots). At
        # n <= 2 the kernel is compiled as the engine's is (vector_rows 2 and the dots branch)
        for v in vectors:
            kw = parse_vector(v)
            rows_v = 2 if kw["int8_dots"] or n <= 2 else n
            fns.append((f"{'dots' if kw['int8_dots'] else 'vector'} {v} live {n}",
                        functools.partial(quant_matmul, live=live, out_dtype=jnp.bfloat16,
                                          vector_rows=rows_v, **kw)))  # fmt: skip
    if lives and xla:  # one row as XLA's fused multiply-reduce over the dequantized weight
        fns.append(("xla-reduce live 1", xla_reduce))
    if xla:
        fns.append(("xla", functools.partial(quant_matmul_xla, out_dtype=jnp.bfloat16)))
        fns += [(f"xla-split {n}", functools.partial(xla_split, n=n)) for n in splits if n < N]
    rows = [] if rows is None else rows
    for v, fn in fns:
        try:
            got = jax.jit(fn)(x, quant[0]).astype(jnp.float32)
            n = int(v.split(" live ")[1]) if " live " in v else M  # rows past live: unspecified
            err = float(jnp.linalg.norm(got[:n] - ref[:n]) / jnp.linalg.norm(ref[:n]))
            t = per_call(fn, x, quant, LAYERS)
        except Exception as e:  # a variant Triton cannot build is recorded, not fatal
            log.warning("%s %s M=%d %s failed: %s", qtype, name, M, v, str(e).splitlines()[0][:200])
            rows.append(dict(base, variant=v, error=str(e).splitlines()[0][:200]))
            flush()
            continue
        row = dict(
            base, variant=v, rel_err=err, us=t * 1e6, bf16_us=t_bf16 * 1e6, speedup=t_bf16 / t,
            GB_s=qbytes / t / 1e9, of_copy_bw=qbytes / t / bw,
            bf16_of_copy_bw=(K * N * 2 + io) / t_bf16 / bw,
        )  # fmt: skip
        log.info("%s", row)
        rows.append(row)
        flush()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_k"], choices=list(FORMATS))
    ap.add_argument(
        "--variants",
        nargs="*",
        default=["128:256:4:3"],
        help="Pallas tilings block_n:values_per_step:warps:stages[:programs[:block_m[:int8]]]",
    )
    ap.add_argument(
        "--vector-variants",
        nargs="*",
        default=[],
        help="with --live: the vector path at block_n:values_per_step:warps:stages:programs",
    )
    ap.add_argument(
        "--dequant",
        nargs="*",
        default=[],
        help="also dequantize.py's kernel then XLA's dot, at "
        "block_n:values_per_program:warps[:transpose 0/1] (1: W^T [K, N] and a plain dot)",
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    ap.add_argument("--shapes", type=int, nargs="+", default=None, help="indices into SHAPES")
    ap.add_argument("--no-xla", action="store_true", help="skip XLA's dequantize-then-dot")
    ap.add_argument("--live", type=int, nargs="*", default=[], help="also with these live rows")
    ap.add_argument(
        "--xla-splits", type=int, nargs="*", default=[], help="also XLA's path n outputs at a time"
    )
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth()
    shapes = [SHAPES[i] for i in a.shapes] if a.shapes is not None else SHAPES
    meta = run_meta()
    rows: list[dict] = []

    def flush():
        report(rows, bw, meta, a.out)

    for t in a.types:
        for s in shapes:
            for M in a.rows:
                run_case(t, *s, M, bw, a.variants, not a.no_xla,
                         [n for n in a.live if n < M], a.vector_variants, rows,
                         flush, a.xla_splits, a.dequant)  # fmt: skip
    flush()


def report(rows, bw, meta, out):
    lines = [
        f"GGML-quantized weights (Pallas kernel, dequantized in registers; `xla`: XLA "
        f"dequantizes to bf16 then dots) against bf16 weights (XLA dot); copy bandwidth "
        f"{bw / 1e9:.0f} GB/s. Time per call inside one executable of {LAYERS} dependent calls, "
        f"each on its own weight buffer. Variant: "
        "block_n:values_per_step:warps:stages[:min_programs].",
        "",
        "| type | case | M | variant | us | bf16 us | speedup | GB/s (of copy BW) | bf16 of "
        "copy BW | rel. error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        head = f"| {r['qtype']} | {r['case']} K {r['K']} N {r['N']} | {r['M']} | {r['variant']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error']} |")
            continue
        lines.append(
            f"{head} {r['us']:.1f} | {r['bf16_us']:.1f} | {r['speedup']:.2f}x | "
            f"{r['GB_s']:.0f} ({r['of_copy_bw']:.0%}) | {r['bf16_of_copy_bw']:.0%} | "
            f"{r['rel_err']:.1e} |"
        )
    lines += ["", meta_line(meta)]
    res = {"bench": "quant_matmul", **meta, "copy_GB_s": bw / 1e9, "rows": rows}
    write_result(res, "\n".join(lines) + "\n", out)


if __name__ == "__main__":
    main()
