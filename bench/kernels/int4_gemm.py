"""Does XLA fuse a 4-bit weight's group-scale decoding into its GEMM at prefill sizes?

A quantized prefill step today writes each weight in bf16 (pallas_kernels/dequantize.py) and
then takes XLA's dot: at least 5.4 ms a step on the 8B for the write alone, which is why a 4k
prompt's TTFT is 1.4x the bf16 model's (issue 17). XLA's GPU backend can fuse a producer of
convert and multiply into its Triton GEMM's operand, so a weight held as int4 codes and group
scales might never be written in bf16. Q4_K's dequantization splits that way:

    W[n, k] = d*sc[n, g] * q[n, k] - dmin*m[n, g]      (g = k // 32, q in 0..15)
    x @ W^T = x @ (A * q)^T - xs @ B^T                   (A = d*sc, B = dmin*m, xs[m, g] = sum of
                                                          x over group g)

so the GEMM's operand is convert(q) * broadcast(A) and the offsets are a product of K / 32
columns. This times, per Qwen3-8B projection and M rows:
- `bf16`: XLA's dot on bf16 W (the model dequantized at load);
- `u4`: q as uint4 [N, K] (XLA packs two a byte), A [N, K / 32] bf16, plus the offsets' product;
- `s4`: q - 8 as int4 with A only (Q4_0's form);
- `s8`: int8 codes with A (Q8_0's form);
- `q4_k`, `q8_0`: the same on a file's blocks as the engine holds them (QuantWeight), no copy of
  the codes: Q4_K's bytes read as uint4 and x's columns put in their nibble order, Q8_0's read
  as int8 (checked against quant_matmul_reference);
and reports whether the compiled step has a Triton GEMM fusion (the decode inside the GEMM)
and how many fusions it runs.

    python bench/kernels/int4_gemm.py --rows 512 --out int4.json

us per call from bench/timing.per_call (dependent calls over 4 weight buffers).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from luce_jax.loading.quants import keep_quantized
from luce_jax.models.block_gemm import GROUP, PRODUCTS, scaled
from luce_jax.models.block_gemm import dot_t as dot
from pallas_kernels.ggml_blocks import FORMATS
from pallas_kernels.quant_matmul import quant_matmul_reference

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from make_model import random_rows  # noqa: E402
from timing import per_call  # noqa: E402

SHAPES = {"gate/up": (24576, 4096), "down": (4096, 12288), "qkv": (6144, 4096)}  # (N, K)


def u4_product(x, w):
    """x @ (A * q - B)^T with w = (q uint4 [N, K], A, B [N, K / 32])."""
    q, a, b = w
    M, K = x.shape
    xs = jnp.sum(x.astype(jnp.float32).reshape(M, K // GROUP, GROUP), axis=-1)  # [M, K / 32]
    return dot(x, scaled(q, a, x.dtype)) - dot(xs, b.astype(jnp.float32))


def signed_product(x, w):
    """x @ (A * q)^T with w = (q int4 or int8 [N, K], A [N, K / 32])."""
    q, a = w
    return dot(x, scaled(q, a, x.dtype))


VARIANTS = {"u4": u4_product, "s4": signed_product, "s8": signed_product}
BLOCKS = PRODUCTS  # on a file's blocks (QuantWeight): luce_jax/models/block_gemm.py


def weights(kind: str, N: int, K: int, key) -> tuple:
    """Random codes and scales of a variant, and the same weight dequantized in float32."""
    kq, ka, kb = jax.random.split(key, 3)
    a = jax.random.uniform(ka, (N, K // GROUP), jnp.float32, 0.001, 0.01).astype(jnp.bfloat16)
    if kind == "u4":
        q = jax.random.randint(kq, (N, K), 0, 16, jnp.int32)
        b = jax.random.uniform(kb, (N, K // GROUP), jnp.float32, 0.0, 0.05).astype(jnp.bfloat16)
        w = (q.astype(jnp.uint4), a, b)
        ref = scaled(q, a, jnp.float32) - jnp.repeat(b.astype(jnp.float32), GROUP, axis=1)
        return w, ref
    lo, hi, dt = (-8, 8, jnp.int4) if kind == "s4" else (-127, 128, jnp.int8)
    q = jax.random.randint(kq, (N, K), lo, hi, jnp.int32)
    return (q.astype(dt), a), scaled(q, a, jnp.float32)


def fusions(fn, x, w) -> dict:
    """The compiled call's fusions: how many, and whether one is a Triton GEMM (XLA fused the
    operand's decoding into the matmul) or a cuBLAS call remains."""
    text = jax.jit(fn).lower(x, w).compile().as_text()
    return dict(
        fusions=len(re.findall(r"^\s*\S+ = \S+ fusion\(", text, re.M)),
        triton_gemm="__triton_gemm" in text or "triton_gemm" in text,
        cublas="__cublas" in text,  # $gemm or cuBLASLt's $lt$matmul
    )


def measure(M: int, name: str, kinds=tuple(VARIANTS), shapes=SHAPES, layers: int = 8,
            blocks=tuple(BLOCKS)) -> dict:  # fmt: skip
    N, K = shapes[name]
    key = jax.random.key(M + N)
    x = jax.random.normal(jax.random.fold_in(key, 99), (M, K), jnp.bfloat16)
    res = dict(M=M, case=name, N=N, K=K, flops=2 * M * N * K)
    dense = [jax.random.normal(jax.random.fold_in(key, i), (N, K), jnp.bfloat16)
             for i in range(layers)]  # fmt: skip
    res["bf16_us"] = per_call(dot, x, dense, layers) * 1e6
    for kind in kinds:
        ws = [weights(kind, N, K, jax.random.fold_in(key, 10 + i)) for i in range(layers)]
        fn = VARIANTS[kind]
        got = jax.jit(fn)(x, ws[0][0])
        ref = dot(x.astype(jnp.float32), ws[0][1])
        res[f"{kind}_rel_err"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        res[f"{kind}_us"] = per_call(fn, x, [w for w, _ in ws], layers) * 1e6
        res[f"{kind}_compiled"] = fusions(fn, x, ws[0][0])
    rng = np.random.default_rng(M + N)
    for qtype in blocks:
        fmt = FORMATS[qtype]
        ws = [keep_quantized(random_rows(N, K, fmt.qtype, rng), fmt.qtype, (N, K), jnp.bfloat16)
              for _ in range(layers)]  # fmt: skip
        fn = BLOCKS[qtype]
        got = jax.jit(fn)(x, ws[0])
        ref = quant_matmul_reference(x, ws[0])
        res[f"{qtype}_rel_err"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        res[f"{qtype}_us"] = per_call(fn, x, ws, layers) * 1e6
        res[f"{qtype}_compiled"] = fusions(fn, x, ws[0])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[512])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--kinds", nargs="*", default=list(VARIANTS))
    ap.add_argument("--out", default="int4_gemm.json")
    a = ap.parse_args()
    rows = []
    for M in a.rows:
        for name in a.shapes:
            r = measure(M, name, tuple(a.kinds))
            rows.append(r)
            kinds = [*a.kinds, *BLOCKS]
            cols = " | ".join(f"{k} {r[f'{k}_us']:.1f} us ({r[f'{k}_compiled']})" for k in kinds)
            print(f"| {M} | {name} | bf16 {r['bf16_us']:.1f} us | {cols} |", flush=True)
            meta = dict(bench="int4_gemm", device=jax.devices()[0].device_kind, jax=jax.__version__)
            json.dump(dict(meta, rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
