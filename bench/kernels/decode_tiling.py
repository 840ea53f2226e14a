"""Tilings of the quantized matmul at decode sizes: experts mode (a MoE step's (token, expert)
pairs) and the vector path (one live row), per projection of a model shape.

Each variant is timed as the layers of a step run it: one executable of LAYERS dependent calls,
each on other weights (experts mode: other experts of one stack; vector path: its own buffer),
so L2 does not serve them. The first variant of each kind is the engine's tiling; every other's
output is checked against it.

    python bench/kernels/decode_tiling.py --experts 64:256:4:0 64:512:4:0 128:256:4:0 \
        --vectors 64:256:4:2112 32:256:4:2112 --tokens 1 8 --out tiling.json

Experts variants are block_n:values_per_step:warps:splits (splits 0: one loop step a program,
the engine's); vector variants block_n:values_per_step:warps:vector_programs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from luce_jax.loading.quants import keep_quantized
from pallas_kernels.ggml_blocks import FORMATS
from pallas_kernels.quant_matmul import quant_matmul

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from make_model import random_rows  # noqa: E402
from meta import run_meta, write_partial, write_result  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402
from timing import per_call  # noqa: E402

log = logging.getLogger("decode_tiling")
LAYERS = 8
# (name, qtype, experts (0: a plain weight), N, K) of Qwen3-30B-A3B's Q4_K_M mix: the experts'
# gate | up and down (Q6_K in half the layers, Q4_K in the others), q | k, v, output, head
CASES = [("gate/up", "q4_k", 128, 1536, 2048), ("down", "q6_k", 128, 2048, 768),
         ("down", "q4_k", 128, 2048, 768), ("q|k", "q4_k", 0, 4608, 2048),
         ("v", "q6_k", 0, 512, 2048), ("out", "q4_k", 0, 2048, 4096),
         ("head", "q6_k", 0, 151936, 2048)]  # fmt: skip
K_USED = 8  # experts a token


def experts_kw(v: str) -> dict:
    bn, vps, warps, splits = (int(t) for t in v.split(":"))
    return dict(block_n=bn, values_per_step=vps, num_warps=warps, expert_splits=splits or None)


def vector_kw(v: str) -> dict:
    bn, vps, warps, programs = (int(t) for t in v.split(":"))
    return dict(block_n=bn, values_per_step=vps, num_warps=warps, vector_programs=programs)


def run_case(case, tokens: int, variants: list[str], bw: float, rows: list, flush) -> None:
    name, qtype, E, N, K = case
    rng = np.random.default_rng(0)
    fmt = FORMATS[qtype]
    raw = random_rows(max(E, 1) * N, K, fmt.qtype, rng)
    x = jax.random.normal(jax.random.key(0), (tokens, K), jnp.bfloat16)
    if E:
        w = keep_quantized(raw.reshape(E, N, -1), fmt.qtype, (E, N, K), jnp.bfloat16)
        # each layer's tokens choose K_USED experts each, at random
        pick = [np.concatenate([rng.choice(E, K_USED, replace=False) for _ in range(tokens)])
                for _ in range(LAYERS)]  # fmt: skip
        ws = [(w, jnp.asarray(p, jnp.int32)) for p in pick]
        down = name == "down"
        x_in, fan = (
            (jnp.repeat(x, K_USED, axis=0), 1) if down else (x, K_USED)
        )  # down: a row a pair
        moved = np.mean([len(set(p)) for p in pick]) * w.nbytes / E

        def make(v):
            kw = experts_kw(v)
            return lambda x, we: quant_matmul(x, we[0], experts=we[1], fan_out=fan,
                                              splits=True, **kw)  # fmt: skip

        mode, x = "experts", x_in
    else:
        ws = [keep_quantized(raw, fmt.qtype, (N, K), jnp.bfloat16)] + [
            keep_quantized(random_rows(N, K, fmt.qtype, rng), fmt.qtype, (N, K), jnp.bfloat16)
            for _ in range(LAYERS - 1)
        ]
        moved = ws[0].nbytes
        live = jnp.int32(tokens)

        def make(v):
            kw = vector_kw(v)
            return lambda x, w: quant_matmul(x, w, live, splits=True, **kw)

        mode = "vector"
    ref = None
    for v in variants:
        base = dict(case=name, qtype=qtype, mode=mode, tokens=tokens, N=N, K=K, variant=v)
        try:
            fn = make(v)
            got = jax.jit(fn)(x, ws[0]).sum(0).astype(jnp.float32)
            ref = got if ref is None else ref
            err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            t = per_call(lambda x, w, fn=fn: fn(x, w)[0], x, ws, LAYERS)  # split 0: [M, N]
        except Exception as e:  # a tiling Triton cannot build is recorded, not fatal
            rows.append(dict(base, error=str(e).splitlines()[0][:200]))
            log.warning("%s", rows[-1])
            flush()
            continue
        rows.append(dict(base, us=t * 1e6, rel_diff=err, of_copy_bw=moved / t / bw))
        log.info("%s %s T%d %s: %.1f us (%.0f%% of copy BW)", name, qtype, tokens, v, t * 1e6,
                 100 * moved / t / bw)  # fmt: skip
        flush()


def markdown(res) -> str:
    out = [f"# {res['title']}", "", f"{res['meta']}", "",
           "| case | type | T | variant | us | of copy BW | rel diff to the first |",
           "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in res["rows"]:
        if "error" in r:
            out.append(f"| {r['case']} | {r['qtype']} | {r['tokens']} | {r['variant']} | "
                       f"failed: {r['error'][:80]} | | |")  # fmt: skip
            continue
        out.append(f"| {r['case']} | {r['qtype']} | {r['tokens']} | {r['variant']} | "
                   f"{r['us']:.1f} | {r['of_copy_bw']:.0%} | {r['rel_diff']:.1e} |")  # fmt: skip
    return "\n".join(out) + f"\n\nCommand: `{res['command']}`\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--experts", nargs="+", default=["64:256:4:0"])
    ap.add_argument("--vectors", nargs="+", default=["64:256:4:2112"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--cases", type=int, nargs="+", default=None, help="indices into CASES")
    ap.add_argument("--title", default="quantized matmul tilings at decode sizes")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth()
    meta = run_meta()
    line = f"{meta.get('device')}, {meta.get('date')}, commit {meta.get('commit')}"
    res = {"bench": "decode_tiling", **meta, "title": a.title, "rows": [], "meta": line}

    def flush():  # what is measured so far, should the run be cut short
        write_partial(res, a.out)

    for i in a.cases if a.cases is not None else range(len(CASES)):
        case = CASES[i]
        for tokens in a.tokens if case[2] else [1]:
            run_case(case, tokens, a.experts if case[2] else a.vectors, bw, res["rows"], flush)
    write_result(res, markdown(res), a.out)


if __name__ == "__main__":
    main()
