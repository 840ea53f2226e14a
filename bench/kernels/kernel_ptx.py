"""What a Pallas kernel compiles to for the H200, without a GPU: loads, registers, instructions.

Lowers a kernel for the cuda platform on the CPU (as tests/test_triton_lowering.py does),
compiles the Triton module that Pallas built for sm_90a with the `triton` package's own
compiler (a Triton newer than jaxlib's reads it), and reads the cubin with the cuobjdump and
nvdisasm that package bundles. Per kernel: global loads by width (PTX), shared memory bytes,
registers, local memory (spills), SASS instructions by opcode and the I2F conversions among
them (the H200 issues those at an eighth of its FMA rate). No timing: a count to compare
variants by between GPU runs, never a speed claim. The `triton` package is not the Triton the
device's jaxlib builds with, and a layout change can compile differently there: Q6_K's groups in
pairs counted 39 loads against 61 here and ran 2.3x slower on the H200
(bench/results/history/2026-12-02_q6_k_pairs_h200.md). `--vector` or `--dots` keeps one path of
quant_matmul's branch.

    python bench/kernels/kernel_ptx.py quant_matmul --types q8_0 q4_k --live 1
    python bench/kernels/kernel_ptx.py quant_matmul --types q4_k --live 1 --vector --unit-codes
    python bench/kernels/kernel_ptx.py paged_attention --kv-types bf16 q8_0 q4_0
    python bench/kernels/kernel_ptx.py paged_attention --kv-types bf16 --rows 512 --split-masks
    python bench/kernels/kernel_ptx.py moe --types q4_k q6_k --k 2048 --n 1536 --experts 128 \
        --topk 8 --md moe_ptx.md

`moe` is the MoE decode path's account: per type, the dense GEMV of one live row (quant_matmul's
vector path on an [n, k] weight) beside the experts-mode call of one token's `--topk` pairs (a
stack of `--experts` [n, k] weights, each pair's row read once through fan_out) and the fused
router (moe_router.py over [k, experts]); per kernel its registers, spills, SASS instructions
and those per byte of weights one program's loop step decodes (--values-per-step values of
BN = 64 weight rows), as a markdown table (`--md`).

Needs `triton` (xgrammar's dependency pulls it into the test extra).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.pallas.triton import pallas_call_registration as registration

from pallas_kernels import kv_cache
from pallas_kernels.ggml_blocks import FORMATS
from pallas_kernels.moe_router import moe_router
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.quant_matmul import quant_matmul
from pallas_kernels.quant_weight import QuantWeight


def triton_modules(f, *args) -> list[str]:
    """The Triton modules (MLIR text) Pallas builds while lowering f(*args) for cuda."""
    seen, build = [], registration.lowering.lower_jaxpr_to_triton_module

    def keep(*a, **k):
        result = build(*a, **k)
        seen.append(str(result.module))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = keep
    try:
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = build
    return seen


def compiled(ttir: str, num_warps: int, num_stages: int) -> dict:
    """PTX statistics, the cubin's resource usage and its SASS opcode counts, one module.

    Registers and local memory (where spills go) come from cuobjdump on the cubin Triton built
    (its own ptxas run: a separate ptxas call can refuse a newer Triton's PTX version), and
    the opcode counts from nvdisasm, both bundled with the `triton` package.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said aloud
    tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ttir")
        with open(src, "w") as f:
            f.write(ttir)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})  # fmt: skip
        ptx, cubin = k.asm["ptx"], os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        run = lambda *c: subprocess.run(c, capture_output=True, text=True, check=True).stdout  # noqa: E731
        usage = run(os.path.join(tools, "cuobjdump"), "-res-usage", cubin)
        sass = run(os.path.join(tools, "nvdisasm"), "-c", cubin)
    ops = collections.Counter(
        m.split(".")[0]
        for m in re.findall(
            r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M
        )
    )
    return {
        "global_loads": dict(collections.Counter(re.findall(r"(ld\.global[.\w]*)", ptx))),
        "shared_bytes": k.metadata.shared,
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        # per thread: a spilled register lives in the stack frame (STACK), other local arrays
        # in LOCAL
        "spill_bytes": sum(
            int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("STACK", "LOCAL")
        ),
        "ptx_lines": ptx.count("\n"),
        "sass": sum(ops.values()),
        "sass_ops": dict(ops.most_common(12)),
        "I2F": sum(v for o, v in ops.items() if o.startswith("I2F")),  # a 16th of the FMA rate
        "MMA": {o: v for o, v in ops.items() if "MMA" in o},  # tensor-core instructions
    }


VECTOR_PATHS = ("vectors",)  # quant_matmul's, bound to a row count


def _name(f) -> str:
    """A branch's function name, through a functools.partial (quant_matmul binds its paths)."""
    return getattr(getattr(f, "func", f), "__name__", "")


def one_path(cond, vector: bool):
    """A lax.cond that traces one path of quant_matmul's chain of conds (1 row, ...,
    vector_rows rows, dots): the widest vector path, or the dots; other conds stay."""

    def one_branch(pred, true, false, *ops):
        if _name(true) not in VECTOR_PATHS:
            return cond(pred, true, false, *ops)
        widest = _name(false) == "dots"
        return (true if vector and widest else false)(*ops)

    return one_branch


def quant_cases(a):
    for q in a.types:
        f = FORMATS[q]
        w = QuantWeight.from_rows(jnp.zeros((a.n, a.k // f.block * f.type_size), jnp.uint8), q)
        x = jnp.zeros((a.rows, a.k), jnp.bfloat16)
        live = None if a.live is None else jnp.int32(a.live)
        kw = dict(interpret=False, num_warps=a.warps, num_stages=a.stages,
                  values_per_step=a.values_per_step, block_n=a.block_n,
                  vector_rows=a.vector_rows, unit_codes=a.unit_codes,
                  int8_x=a.int8_x, int8_dots=a.int8_dots)  # fmt: skip
        yield q, (lambda x, w=w, n=live, kw=kw: quant_matmul(x, w, n, **kw)), (x,)


def moe_cases(a):
    """(name, f, args, weight bytes one program's loop step decodes) of the MoE decode kernels."""
    BN = 64
    for q in a.types:
        f = FORMATS[q]
        step_bytes = BN * max(1, a.values_per_step // f.block) * f.type_size
        row_bytes = a.k // f.block * f.type_size
        kw = dict(interpret=False, num_warps=a.warps, num_stages=a.stages, int8_x=a.int8_x)
        w = QuantWeight.from_rows(jnp.zeros((a.n, row_bytes), jnp.uint8), q)
        x = jnp.zeros((8, a.k), jnp.bfloat16)
        gemv = lambda x, w=w, kw=kw: quant_matmul(x, w, jnp.int32(1), **kw)  # noqa: E731
        yield f"{q} dense GEMV (1 live row)", gemv, (x,), step_bytes
        ws = QuantWeight.from_rows(jnp.zeros((a.experts, a.n, row_bytes), jnp.uint8), q)
        ex = jnp.zeros((a.topk,), jnp.int32)
        yield (f"{q} experts ({a.topk} pairs of a token)",
               lambda x, ex, w=ws, kw=kw: quant_matmul(x, w, experts=ex, fan_out=a.topk,
                                                       splits=True, **kw),
               (x[:1], ex), step_bytes)  # fmt: skip
    router = jnp.zeros((a.k, a.experts), jnp.float32)
    yield (f"router ({a.experts} experts, top {a.topk})",
           lambda x, r: moe_router(x, r, k=a.topk, interpret=False),
           (jnp.zeros((8, a.k), jnp.float32), router), a.k * a.experts * 4)  # fmt: skip


def moe_table(a) -> str:
    lines = [
        f"MoE decode kernels compiled for sm_90a on the CPU (Triton {_triton_version()}), "
        f"k={a.k}, n={a.n}, {a.experts} experts, top {a.topk}, int8_x={a.int8_x}; a count to "
        "compare variants by, never a speed claim",
        "",
        "| kernel | registers | spill bytes | SASS | SASS per weight byte of a loop step | I2F |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, f, args, nbytes in moe_cases(a):
        for ttir in triton_modules(f, *args):
            c = compiled(ttir, a.warps, a.stages)
            fn = re.search(r"tt\.func (?:public )?@(\w+)", ttir)
            kernel = f"{name}: `{fn.group(1) if fn else '?'}`"
            lines.append(f"| {kernel} | {c['registers']} | {c['spill_bytes']} | {c['sass']} | "
                         f"{c['sass'] / nbytes:.2f} | {c['I2F']} |")  # fmt: skip
            print(lines[-1])
            sys.stdout.flush()
    return "\n".join([*lines, "", "Command: `python " + " ".join(sys.argv) + "`", ""])


def _triton_version() -> str:
    import triton

    return triton.__version__


def attention_cases(a):
    H, K, D, P, ctx = 32, 8, 128, 16, 4096
    MB = ctx // P
    for t in a.kv_types:
        k = jnp.zeros((1 + MB * a.rows, P, K, D), jnp.bfloat16)
        k = k if t == "bf16" else kv_cache.quantize(k, t)
        T = a.rows
        args = (
            jnp.zeros((T, H, D), jnp.bfloat16), k, k, jnp.zeros((T,), jnp.int32),
            jnp.full((T,), ctx - 1, jnp.int32), jnp.zeros((T, MB), jnp.int32),
            jnp.full((T,), ctx, jnp.int32),
        )  # fmt: skip
        cu = jnp.arange(T + 1, dtype=jnp.int32)
        kw = dict(scale=0.1, cu_q_lens=cu, interpret=False, num_warps=a.warps,
                  num_stages=a.stages, block_qg=a.block_qg, block_k=a.block_k,
                  split_masks=a.split_masks)  # fmt: skip
        yield t, (lambda *x, kw=kw: paged_attention(*x, **kw)), args


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("kernel", choices=["quant_matmul", "paged_attention", "moe"])
    ap.add_argument("--experts", type=int, default=128, help="moe's E")
    ap.add_argument("--topk", type=int, default=8, help="moe's experts per token")
    ap.add_argument("--md", default=None, help="moe's table, written here")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_k"], choices=list(FORMATS))
    ap.add_argument("--kv-types", nargs="+", default=["bf16", "q8_0", "q4_0"])
    ap.add_argument("--rows", type=int, default=8, help="M (quant_matmul) or decode rows")
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=24576)
    ap.add_argument("--live", type=int, default=None, help="quant_matmul's live rows")
    ap.add_argument("--values-per-step", type=int, default=256, help="quant_matmul's")
    ap.add_argument("--block-n", type=int, default=64, help="quant_matmul's")
    ap.add_argument("--unit-codes", action="store_true", help="quant_matmul's ggml_asm.py codes")
    ap.add_argument("--int8-x", action="store_true", help="quant_matmul's dp4a over int8 x")
    ap.add_argument("--int8-dots", action="store_true", help="quant_matmul's int8 dots branch")
    ap.add_argument(
        "--vector-rows",
        type=int,
        default=2,
        help="quant_matmul's: the vector path is compiled for 1 .. this many rows",
    )
    ap.add_argument("--block-qg", type=int, default=64, help="paged_attention's")
    ap.add_argument("--block-k", type=int, default=64, help="paged_attention's")
    ap.add_argument("--split-masks", action="store_true", help="paged_attention's")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    path = ap.add_mutually_exclusive_group()
    path.add_argument("--vector", action="store_true", help="quant_matmul's vector path only")
    path.add_argument("--dots", action="store_true", help="quant_matmul's dots path only")
    a = ap.parse_args()
    # --vector-rows 1 with --vector: the one-row path
    if a.vector or a.dots:
        jax.lax.cond = one_path(jax.lax.cond, vector=a.vector)
    if a.kernel == "moe":
        text = moe_table(a)
        if a.md:
            with open(a.md, "w") as fh:
                fh.write(text)
        return
    cases = quant_cases(a) if a.kernel == "quant_matmul" else attention_cases(a)
    for name, f, args in cases:
        for i, ttir in enumerate(triton_modules(f, *args)):
            print(name, i, compiled(ttir, a.warps, a.stages))
            sys.stdout.flush()


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
