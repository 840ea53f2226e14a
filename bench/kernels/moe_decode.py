"""The MoE decode FFN on the GPU: the engine's path (the router's dot and its kernel, experts a
pair at a time on each token's one row, GLU int8 rows; dense experts' tiles read once for
their tokens) against the one-kernel router, XLA's routing, the grouped kernel over sorted pairs
(the prefill path) and the grouped ragged_dot over the same experts dequantized, and the
launches each makes.

One MoE layer of a random file (bench/make_model.py's shape, one layer); per row count: the
max difference of the outputs relative to their largest value, whether the experts chosen
agree, the time per call of each path (median of jitted calls over the same inputs), and the
Triton calls and XLA launching ops each lowers to (tests/test_moe_launches.py's count).

    python bench/kernels/moe_decode.py --shape qwen3-30b-a3b --type q4_k --rows 1 8 32 \
        --out moe_decode.md
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from luce_jax.backends import served_quant_matmul
from luce_jax.loading.gguf import GGUFFile, model_config
from luce_jax.loading.params import load_params
from luce_jax.models import moe
from luce_jax.models.linear import Normed, QuantMatmul
from pallas_kernels.expert_rows import expert_rows
from pallas_kernels.int8_rows import glu_int8_rows, norm_int8_rows
from pallas_kernels.moe_grouping import grouped_matmul
from pallas_kernels.moe_router import moe_router

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
import make_model  # noqa: E402
from timing import median_call  # noqa: E402

LAUNCHING = ("reduce", "dot_general", "sort", "scatter", "while", "top_k")


def launches(text: str) -> int:
    """Triton calls and XLA launching ops in a lowered module (callees included once each:
    an upper bound on its kernels)."""
    ops = collections.Counter(re.findall(r"= (?:stablehlo|chlo)\.(\w+)", text))
    return text.count("custom_call @__gpu$xla.gpu.triton(") + sum(ops[o] for o in LAUNCHING)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--type", default="q4_k")
    ap.add_argument("--vocab", default=".bench_data/ggml-vocab-qwen2.gguf")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shape = dict(make_model.SHAPES[a.shape], L=1)
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "layer.gguf")
        make_model.SHAPES["one-layer"] = shape
        make_model.write("one-layer", a.type, a.vocab, path)
        f = GGUFFile(path)
        cfg, params = load_params(f, model_config(f.metadata), "bfloat16", True)
    lp = params["layers"][0]
    fused = QuantMatmul(functools.partial(served_quant_matmul, int8_x=True),
                        norm_int8=norm_int8_rows, glu_int8=glu_int8_rows,
                        expert_rows=expert_rows)  # fmt: skip
    float_qmm = QuantMatmul(functools.partial(served_quant_matmul, int8_x=False),
                            expert_rows=expert_rows)  # fmt: skip
    one_kernel = functools.partial(moe_router, fused_dot=True)
    paths = {
        "engine router, int8": (fused, moe_router),
        "engine router, float": (float_qmm, moe_router),
        "one-kernel router, float": (float_qmm, one_kernel),
        "XLA routing, float": (float_qmm, None),
        "grouped kernel, sorted pairs": ("grouped", moe_router),
        "grouped ragged_dot (reference)": (None, None),
    }
    lines = [
        f"MoE decode FFN, one {a.shape} layer ({a.type} experts), {jax.devices()[0].device_kind}",
        "",
        "| rows | path | us / call | launches | max rel diff | experts agree |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    nw = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, cfg.d_model), jnp.float32)
    for T in a.rows:
        x = jax.random.normal(jax.random.key(T), (max(T, 8), cfg.d_model), jnp.float32)
        live = jnp.int32(T)
        outs, stats = {}, {}
        for name, (qmm, router) in paths.items():

            def f(x, nw, live, qmm=qmm, router=router):
                h = Normed(x, nw, cfg.rms_eps)
                if qmm == "grouped":  # the prefill path's kernel (the bf16 decode path before)
                    return moe.ffn(lp, h, cfg, grouped_matmul, live, None, router)
                return moe.ffn(lp, h, cfg, None, live, qmm, router)

            fn = jax.jit(f)
            outs[name] = jax.device_get(fn(x, nw, live))
            stats[name] = (
                median_call(fn, x, nw, live) * 1e6,
                launches(fn.trace(x, nw, live).lower().as_text()),
            )
        ref_y, ref_p = (np.asarray(v) for v in outs["grouped ragged_dot (reference)"])
        scale = float(np.abs(ref_y[:T]).max()) or 1.0
        for name, (y, p) in outs.items():
            diff = float(np.abs(np.asarray(y)[:T] - ref_y[:T]).max()) / scale
            agree = float((np.asarray(p) == ref_p).mean())
            us, n = stats[name]
            lines.append(f"| {T} | {name} | {us:.0f} | {n} | {diff:.2e} | {agree:.3f} |")
    lines += ["", "Command: `python " + " ".join(sys.argv) + "`"]
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
