"""Paged attention on the GPU: the Pallas kernel against the XLA reference, one layer.

Qwen3-8B attention shape (H 32, K 8, D 128, 16-token blocks), bf16, q8_0 or q4_0 KV. Decode
steps of R rows at a context length each, a mixed step (a 256-token prompt chunk plus decode
rows), and with --prefill / --warm-prefix prompt chunks after a cached prefix (reported also in
TFLOP/s of causal attention; --no-xla skips XLA's path, whose gathers do not fit at 2048
rows). For each: max abs difference to the float32 jnp reference (where it fits), time per
call of both implementations (one per kernel tiling variant), and the KV bytes the step must
read over that time against the copy bandwidth measured in the same run. Times are per call inside
one executable of 36 dependent calls, as the layers of a step run.

    python bench/kernels/attention_kernel.py --variants 64:1024:4 128:512:8 --out attention.json
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from luce_jax.models.attention import paged_attention_xla
from pallas_kernels import kv_cache
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from meta import meta_line, run_meta, write_result  # noqa: E402
from roofline import copy_bandwidth  # noqa: E402

log = logging.getLogger("attention_kernel")
H, K, D, P = 32, 8, 128, 16


KV_TYPES = ("bf16", *kv_cache.QUANT_TYPES)


def step(segs, kv_type="bf16", seed=0):
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
    if kv_type != "bf16":
        k, v = kv_cache.quantize(k, kv_type), kv_cache.quantize(v, kv_type)
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
    per_value = kv_cache.bytes_per_value("bfloat16" if kv_type == "bf16" else kv_type)
    kv_bytes = sum(kv for _, kv in segs) * K * D * 2 * per_value
    return args, jnp.asarray(cu, jnp.int32), cu[-1], kv_bytes


LAYERS = 36  # calls per timed executable, as in a Qwen3-8B step


def timed(attn, args, n=5) -> float:
    """Seconds per attention call inside one executable of LAYERS dependent calls.

    Timing single jitted calls would mostly time Python dispatch (tens of microseconds); in the
    engine every layer's attention runs inside one step executable, as here.
    """

    def layers(q, *rest):
        def one(_, q):
            return q + attn(q, *rest) * 0  # dependent calls: no overlap, no common subexpression

        return jax.lax.fori_loop(0, LAYERS, one, q)

    f = jax.jit(layers)
    jax.block_until_ready(f(*args))
    t = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / n / LAYERS


def max_diff(a, b, real) -> float:
    return float(jnp.max(jnp.abs(a[:real].astype(jnp.float32) - b[:real].astype(jnp.float32))))


def attention_flops(segs) -> float:
    """Multiply-adds x 2 of q.k and p.v over the keys each new row sees (causal)."""
    n = sum(q * (kv - q + 1) + q * (q - 1) // 2 for q, kv in segs)  # kv - q + 1 + i, i < q
    return 4.0 * n * H * D


def run_case(name, segs, bw, check_ref, kv_type, variants, xla=True) -> list[dict]:
    """One step shape: the XLA path once (unless not xla: then differences are taken against
    the first variant), the kernel once per (block_k, split, warps, block_qg) variant."""
    args, cu, real, kv_bytes = step(segs, kv_type)
    scale = D**-0.5
    fx = functools.partial(paged_attention_xla, scale=scale)
    out_x, tx = (jax.jit(fx)(*args), timed(fx, args)) if xla else (None, float("nan"))
    ref = (
        jax.jit(lambda *a: paged_attention_reference(*a, scale=scale))(*args) if check_ref else None
    )
    rows = []
    for bk, split, warps, bqg, masks, pieces in variants:
        row = {"case": name, "kv": kv_type, "block_k": bk, "split": split, "warps": warps}
        # a split "nC": C splits per query block, each an equal share of its keys
        tokens, splits = (256, int(split[1:])) if str(split).startswith("n") else (split, None)
        row.update(block_qg=bqg, split_masks=bool(masks), pieces=pieces, T=int(args[0].shape[0]),
                   kv_MB=kv_bytes / 1e6, xla_us=tx * 1e6)  # fmt: skip
        kw = dict(scale=scale, cu_q_lens=cu, block_k=bk, split_tokens=tokens, num_warps=warps,
                  block_qg=bqg, split_masks=bool(masks), splits=splits,
                  pieces=pieces or None)  # fmt: skip
        try:
            fp = functools.partial(paged_attention, **kw)
            out_p = jax.jit(fp)(*args)
            out_x = out_p if out_x is None else out_x  # no XLA: against the first variant
            row["max_diff_vs_xla"] = max_diff(out_p, out_x, real)
            if ref is not None:
                row["max_diff_vs_f32_ref"] = max_diff(out_p, ref, real)
            tp = timed(fp, args)
        except Exception as e:  # a variant Triton cannot build is recorded, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("%s", row)
            rows.append(row)
            continue
        row.update(
            pallas_us=tp * 1e6,
            speedup=tx / tp,
            pallas_GB_s=kv_bytes / tp / 1e9,
            pallas_TFLOP_s=attention_flops(segs) / tp / 1e12,
            of_copy_bw=kv_bytes / tp / bw,
        )
        log.info("%s", row)
        rows.append(row)
    return rows


def variant(s: str) -> tuple:
    """block_k:split:num_warps[:block_qg[:split_masks[:pieces]]] (64, 0 and 0 if left out);
    split is split_tokens, or nC for C splits per query block (paged_attention's `splits`);
    pieces the dots a quantized tile is contracted in (0: the kernel's TILE_PIECES)."""
    bk, split, warps, *rest = s.split(":")
    bqg, masks, pieces = ([int(x) for x in rest] + [64, 0, 0][len(rest) :])[:3]
    if split.startswith("n") and not split[1:].isdigit():
        raise argparse.ArgumentTypeError(f"split {split!r}: tokens, or n and a count")
    return int(bk), split if split.startswith("n") else int(split), int(warps), bqg, masks, pieces


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--kv-types", nargs="+", default=list(KV_TYPES), choices=KV_TYPES)
    ap.add_argument(
        "--variants",
        type=variant,
        nargs="+",
        default=[(64, 1024, 4, 64, 0, 0)],
        help="kernel tilings block_k:split:num_warps[:block_qg[:split_masks 0/1[:pieces]]]; "
        "split: split_tokens, or nC for C splits per query block; pieces: dots a quantized tile "
        "is contracted in (0: the kernel's default)",
    )
    ap.add_argument(
        "--warm-prefix",
        type=int,
        nargs="*",
        default=[],
        help="also a warm prefix-cached request's step: one segment of 200 new rows after "
        "each of these cached lengths (bench/serving/prefix.py's agent loop: 8k)",
    )
    ap.add_argument(
        "--prefill",
        nargs="*",
        default=[],
        metavar="ROWS@CTX",
        help="also prompt chunks: one segment of ROWS new rows ending at CTX keys (e.g. 2048@8192)",
    )
    ap.add_argument(
        "--no-xla",
        action="store_true",
        help="skip XLA's path (large prefill cases); differences against the first variant",
    )
    ap.add_argument("--no-mixed", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth()
    cases = [(f"decode {r}x{ctx}", [(1, ctx)] * r) for ctx in a.ctx for r in a.rows]
    if not a.no_mixed:
        cases.append(("prefill 256 @4096 + 8 decode @4096", [(256, 4096)] + [(1, 4096)] * 8))
    cases += [(f"warm 200 @{n + 200}", [(200, n + 200)]) for n in a.warm_prefix]
    for spec in a.prefill:
        r, ctx = (int(x) for x in spec.split("@"))
        if not 0 < r <= ctx:
            raise ValueError(f"--prefill {spec}: want 0 < ROWS <= CTX")
        cases.append((f"prefill {r} @{ctx}", [(r, ctx)]))
    rows = []
    for kv_type in a.kv_types:
        for name, segs in cases:
            small = sum(kv for _, kv in segs) * (1 + len(segs) // 8) <= 65536 * 2
            small &= sum(q * kv for q, kv in segs) <= 1 << 21  # the f32 reference's gathers
            rows += run_case(name, segs, bw, small, kv_type, a.variants, not a.no_xla)
    meta = run_meta()
    lines = [
        f"Paged attention, one layer of Qwen3-8B shape (H {H}, K {K}, D {D}, P {P}); "
        f"copy bandwidth {bw / 1e9:.0f} GB/s. KV MB counts the cache type's bytes (q8_0 34 and "
        "q4_0 18 bytes per 32 values); the XLA path reads the same cache, dequantizing in XLA.",
        "",
        "| case | KV | block_k:split:warps:block_qg:split_masks[:pieces] | T | KV MB | Pallas us | "
        "XLA us | speedup | Pallas KV GB/s | of copy BW | Pallas TFLOP/s | "
        f"max diff vs {'the first variant' if a.no_xla else 'XLA'} | vs f32 ref |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        tiling = f"{r['block_k']}:{r['split']}:{r['warps']}:{r['block_qg']}:{int(r['split_masks'])}"
        tiling += f":{r['pieces']}" if r.get("pieces") else ""
        head = f"| {r['case']} | {r['kv']} | {tiling} | {r['T']} | {r['kv_MB']:.1f} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:80]} | | | | | | | |")
            continue
        ref = f"{r['max_diff_vs_f32_ref']:.3g}" if "max_diff_vs_f32_ref" in r else "-"
        xla = "- | -" if a.no_xla else f"{r['xla_us']:.0f} | {r['speedup']:.1f}x"
        lines.append(
            f"{head} {r['pallas_us']:.0f} | {xla} | "
            f"{r['pallas_GB_s']:.0f} | {r['of_copy_bw']:.0%} | {r['pallas_TFLOP_s']:.0f} | "
            f"{r['max_diff_vs_xla']:.3g} | {ref} |"
        )
    md = "\n".join(lines) + "\n\n" + meta_line(meta) + "\n"
    res = {"bench": "attention_kernel", **meta, "copy_GB_s": bw / 1e9, "rows": rows}
    write_result(res, md, a.out)


if __name__ == "__main__":
    main()
