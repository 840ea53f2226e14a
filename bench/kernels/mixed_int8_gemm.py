"""Is a mixed int8 x bf16 GEMM on the tensor cores as fast as XLA's bf16 dot at prefill sizes?

The route to quantized prefill steps no slower than bf16 ones (issue 17) needs a GEMM that
decodes the weights in registers and still runs at the bf16 dot's speed. JAX ships a Hopper
kernel of that kind, `hopper_mixed_type_matmul_mgpu` (Mosaic GPU: int8 W loaded to registers,
converted, and fed to wgmma as its A operand). This times it on the 8B's projections against
XLA's bf16 dot and XLA's int8 -> bf16 convert then dot, over a few tilings: plain int8 codes,
no block scales, so it bounds from below what a Q8_0 / Q4_K GEMM built on it would take.

    python bench/kernels/mixed_int8_gemm.py --rows 512 --out mixed.json

us per call from bench/timing.per_call (dependent calls over 4 weight buffers); each shape's
row is written as soon as it is measured (compiling the tilings takes most of the time).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mm

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from timing import per_call  # noqa: E402

SHAPES = {"gate/up": (24576, 4096), "down": (4096, 12288), "qkv": (6144, 4096)}  # (N, K)


def configs():
    D = mm.MatmulDimension
    return [
        dict(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, grid_minor_dim=D.N,
             grid_tile_width=4, wg_dimension=D.N),
        dict(tile_m=128, tile_n=128, tile_k=128, max_concurrent_steps=2, grid_minor_dim=D.M,
             grid_tile_width=8, wg_dimension=D.N),
        dict(tile_m=128, tile_n=64, tile_k=128, max_concurrent_steps=4, grid_minor_dim=D.M,
             grid_tile_width=8, wg_dimension=D.M),
        dict(tile_m=256, tile_n=64, tile_k=64, max_concurrent_steps=4, grid_minor_dim=D.N,
             grid_tile_width=16, wg_dimension=D.M),
    ]  # fmt: skip


def dot(x, w):
    """x [M, K] @ w [N, K]^T in float32."""
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def measure(M: int, name: str, cfgs: list[dict]) -> dict:
    N, K = SHAPES[name]
    kx, kw = jax.random.split(jax.random.key(M + N))
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    wi = [jax.random.randint(jax.random.fold_in(kw, i), (N, K), -127, 127, jnp.int8)
          for i in range(8)]  # fmt: skip
    wb = [w.astype(jnp.bfloat16) for w in wi]
    res = dict(M=M, case=name, N=N, K=K, flops=2 * M * N * K)
    res["bf16_dot_us"] = per_call(dot, x, wb, 8) * 1e6
    res["xla_convert_dot_us"] = per_call(lambda x, w: dot(x, w.astype(x.dtype)), x, wi, 8) * 1e6
    ref = dot(x, wb[0])
    for i, c in enumerate(cfgs):
        cfg = mm.TuningConfig(**c)
        f = lambda x, w, cfg=cfg: mm.mixed_matmul_kernel(  # noqa: E731
            w, x.T, out_dtype=jnp.bfloat16, config=cfg
        ).T.astype(jnp.float32)
        try:
            got = jax.jit(f)(x, wi[0])
            res[f"mixed_{i}_err"] = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            res[f"mixed_{i}_us"] = per_call(f, x, wi, 8) * 1e6
        except Exception as e:  # a tiling the shape or shared memory refuses
            res[f"mixed_{i}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--cases", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--out", default="mixed_int8_gemm.json")
    a = p.parse_args()
    cfgs = configs()
    out = dict(configs=[{k: str(v) for k, v in c.items()} for c in cfgs], rows=[])
    for M in a.rows:
        for name in a.cases:
            res = measure(M, name, cfgs)
            out["rows"].append(res)
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
            best = min((v for k, v in res.items() if k.startswith("mixed_") and k.endswith("_us")),
                       default=None)  # fmt: skip
            print(f"M {M} {name}: bf16 dot {res['bf16_dot_us']:.1f} us, convert+dot "
                  f"{res['xla_convert_dot_us']:.1f}, best mixed {best and round(best, 1)}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
