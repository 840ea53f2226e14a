"""Offline engine decode throughput at C concurrent sequences, against the HBM roofline.

Drives the real scheduler and StepEngine (no HTTP): C requests with `--ctx`-token prompts are
prefilled, then `--steps` decode steps are timed. The copy bandwidth measured in the same run
gives the roofline: bytes a decode step must move (all weights + every row's KV) / bandwidth.

    python bench/engine/engine_decode.py --model qwen3-8b-bf16.gguf --ctx 1024 --concurrency 1 8 \
        32 \
        --attention-backends xla pallas --cache-types bf16 q8_0 q4_0

For a mixture-of-experts file, `--moe-backends xla pallas` compares the grouped expert matmuls,
the weight bytes count only the experts that C rows touch (roofline.decode_step), and each row
records how many experts the last step's tokens reached per layer (routing on random weights
must spread like real routing for the roofline to hold). With several `--cache-types`, one
engine runs per type and the JSON's top-level `tok_s` maps each type to {C: tok/s}.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from meta import run_meta, write_result  # noqa: E402
from roofline import copy_bandwidth, decode_step, model_bytes  # noqa: E402

log = logging.getLogger("engine_decode")


class CallClock:
    """While in use (`with CallClock(runner) as clock:`), the host seconds spent inside the
    runner's compiled step calls (`seconds`: each step is one CUDA graph, XLA's command buffer,
    which the call updates for the step's new buffers and then launches), the buckets called
    (`buckets`) and the last step's launch arguments (`launch`: Runner.launch_forward's, what
    device_step_time re-launches)."""

    def __init__(self, runner):
        self.runner, self.seconds, self.buckets, self.launch = runner, 0.0, set(), None

    def __enter__(self) -> CallClock:
        runner = self.runner
        self._originals = dict(runner.programs._exec)

        def spy(key, exe):
            def call(*a):
                self.buckets.add(key)
                t = time.perf_counter()
                out = exe(*a)
                self.seconds += time.perf_counter() - t
                return out

            return call

        def capture(b, T, S, _f=runner.launch_forward):
            self.launch = (b, T, S)
            return _f(b, T, S)

        runner.programs._exec = {k: spy(k, v) for k, v in self._originals.items()}
        runner.launch_forward = capture
        return self

    def __exit__(self, *exc) -> None:
        self.runner.programs._exec = self._originals
        del self.runner.launch_forward  # the class's again


def device_step_time(runner, launch_args: tuple, n: int) -> float:
    """Seconds per step of the runner's forward pass and sampling re-launched back to back on
    the last decode step's lowered arrays (launch_args: what Runner.launch_forward was given).
    A launch uploads one buffer and queues the programs, so with the device busy this is the
    device's time; the difference to the engine's step time is host work: planning, lowering,
    collecting. Re-running rewrites the same KV slots with the same values, so the cache stays
    valid.
    """
    import jax

    jax.block_until_ready(runner.launch(*launch_args).packed)
    t = time.perf_counter()
    for _ in range(n):
        out = runner.launch(*launch_args)
    jax.block_until_ready(out.packed)
    return (time.perf_counter() - t) / n


def expert_spread(stats: dict, n_experts: int) -> dict:
    """Experts the last step reached per MoE layer (mean, min) and the busiest expert's tokens."""
    if not n_experts:
        return {}
    counts = np.asarray(stats["expert_counts"])  # [L_moe, E]
    reached = (counts > 0).sum(1)
    return {
        "experts_reached_mean": float(reached.mean()),
        "experts_reached_min": int(reached.min()),
        "expert_tokens_max": int(counts.max()),
    }


def param_bytes(params) -> int:
    import jax

    return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def run(args, backend: str, moe_backend: str, cache_type: str, bw: float) -> dict:
    """One engine's rows at every C (bw: the copy bandwidth in bytes/s, for the roofline)."""
    import jax

    from luce_jax.build import load_engine
    from luce_jax.config import EngineConfig
    from luce_jax.host.request import Request
    from luce_jax.host.scheduler import Scheduler
    from luce_jax.sampling_params import SamplingParams
    from pallas_kernels import kv_cache

    cmax = max(args.concurrency)
    # Early requests decode while later ones prefill, so leave room for those steps too.
    max_new = args.steps + args.warm + -(-cmax * args.ctx // args.budget) + 8
    max_ctx = args.ctx + max_new
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quant_activations=args.quant_activations,
        max_concurrency=cmax,
        max_ctx=max_ctx,
        kv_pool_tokens=cmax * -(-max_ctx // 16) * 16,  # whole blocks per request
        prefill_chunk=args.budget,
        prefill_token_budget=args.budget,
        max_concurrent_prefills=cmax,
        cache_type_k=cache_type,
        cache_type_v=cache_type,
        attention_backend=backend,
        moe_backend=moe_backend,
        compile_cache_dir=args.compile_cache_dir,
    )
    t0 = time.perf_counter()
    tok, engine = load_engine(cfg)
    t_load = time.perf_counter() - t0
    mc = engine.runner.cfg
    warm_compiles_at_load = engine.runner.compiles
    wbytes = param_bytes(engine.runner.params)
    mb = model_bytes(args.model)
    kv_per_token = (
        2
        * mc.n_layers
        * mc.kv_size
        * kv_cache.bytes_per_value(cache_type if cache_type in kv_cache.QUANT_TYPES else "bfloat16")
    )
    log.info(
        "load + warmup %.1f s, %d compiles, weights %.2f GB",
        t_load,
        engine.runner.compiles,
        wbytes / 1e9,
    )
    rows = []
    rng = np.random.default_rng(0)
    for C in args.concurrency:
        sched = Scheduler(engine, tok)
        sp = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
        reqs = [Request(rng.integers(0, mc.vocab_size, args.ctx).tolist(), sp) for _ in range(C)]
        for r in reqs:
            sched.add(r)
        t = time.perf_counter()
        while not all(sched.decoding(r) for r in reqs):
            ended = [(r.finish_reason, r.error) for r in reqs if r.done]
            assert not ended, f"requests ended before the timed steps: {ended}"
            sched.step()
        t_prefill = time.perf_counter() - t
        log.info("C=%d: prefilled %d x %d tokens in %.2f s", C, C, args.ctx, t_prefill)
        for _ in range(args.warm):
            sched.step()
        compiles = engine.runner.compiles
        runner = engine.runner
        with CallClock(runner) as clock:
            t = time.perf_counter()
            for _ in range(args.steps):
                sched.step()
            dt = (time.perf_counter() - t) / args.steps
        assert engine.runner.compiles == compiles, "compiled while decoding"
        dev_dt = device_step_time(runner, clock.launch, args.steps)
        for r in reqs:
            sched.cancel(r)
        ctx_avg = args.ctx + args.warm + args.steps / 2
        weights = wbytes
        if mb.n_experts:  # only the experts C rows reach, with uniform routing
            weights = decode_step(mb, C, 0, held_bits=16).weight_bytes
        step_bytes = weights + C * ctx_avg * kv_per_token
        row = {
            "backend": engine.config.attention_backend,  # resolved, as the server's
            "moe_backend": engine.config.moe_backend if mb.n_experts else None,
            "cache_type": cache_type,
            "C": C,
            "tok_s": C / dt,
            "step_ms": dt * 1e3,
            "device_step_ms": dev_dt * 1e3,
            "host_overhead_ms": (dt - dev_dt) * 1e3,
            # Each step is one CUDA graph (XLA's command buffer) that the call updates for the
            # step's new buffers before launching it, in time that grows with its kernels.
            "in_call_ms": clock.seconds / args.steps * 1e3,
            "prefill_s": t_prefill,
            "load_warmup_s": t_load,
            "warm_compiles": warm_compiles_at_load,
            "bytes_per_step_GB": step_bytes / 1e9,
            "achieved_GB_s": step_bytes / dt / 1e9,
            "roofline_frac": step_bytes / dt / bw,
            "roofline_tok_s": C * bw / step_bytes,
            **expert_spread(runner.last_stats, mb.n_experts),
        }
        log.info("%s", row)
        rows.append(row)
    del engine, runner, sched  # free the pool before the next backend's engine
    dev = jax.devices()[0]
    return {
        "bench": "engine_decode",
        **run_meta(),
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "model": args.model,
        "ctx": args.ctx,
        "steps": args.steps,
        "copy_GB_s": bw / 1e9,
        "weights_GB": wbytes / 1e9,
        "rows": rows,
    }


def _label(r: dict) -> str:
    return (
        r["backend"]
        + (f" / {r['moe_backend']}" if r.get("moe_backend") else "")
        + f", {r['cache_type']} KV"
    )


def tok_s_by_cache_type(rows: list[dict]) -> dict:
    """{cache type: {C: tok/s}} of the first backend (pair) run, the served one by default."""
    first = (rows[0]["backend"], rows[0].get("moe_backend"))
    out: dict = {}
    for r in rows:
        if (r["backend"], r.get("moe_backend")) == first:
            out.setdefault(r["cache_type"], {})[r["C"]] = r["tok_s"]
    return out


def markdown(res: dict, reference: dict | None = None) -> str:
    labels = list(dict.fromkeys(_label(r) for r in res["rows"]))  # in run order
    by = {(_label(r), r["C"]): r for r in res["rows"]}
    vs = labels[0] if len(labels) > 1 else None
    moe = any(r.get("moe_backend") for r in res["rows"])
    lines = [
        f"Engine decode, {res['model']}, {res['ctx']}-token contexts, "
        f"{res['device']}, {res['date']}, commit {res['commit']}; copy bandwidth "
        f"{res['copy_GB_s']:.0f} GB/s.",
        "",
        ("| attention / moe" if moe else "| attention")
        + " | C | tok/s | step ms | device step ms | host in call ms | prefill s | GB/s moved "
        "| of copy BW | roofline tok/s |"
        + (f" vs {vs} |" if vs else "")
        + (" experts reached per layer |" if moe else "")
        + (" plain XLA tok/s |" if reference else ""),
        "| --- " * (10 + bool(vs) + moe + bool(reference)) + "|",
    ]
    for r in res["rows"]:
        ratio = f" {r['tok_s'] / by[(vs, r['C'])]['tok_s']:.2f}x |" if vs else ""
        spread = f" {r['experts_reached_mean']:.1f} |" if moe else ""
        ref = f" {reference.get(r['C'], '-')} |" if reference else ""
        lines.append(
            f"| {_label(r)} | {r['C']} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | "
            f"{r['device_step_ms']:.2f} | {r.get('in_call_ms', 0):.2f} | {r['prefill_s']:.2f} | "
            f"{r['achieved_GB_s']:.0f} | "
            f"{r['roofline_frac']:.0%} | {r['roofline_tok_s']:.0f} |{ratio}{spread}{ref}"
        )
    lines += [
        "",
        "Prefill s: wall time to prefill all C prompts (chunked, mixed with decode rows). The "
        + "plain XLA column is DESIGN §9's figure at 1024-token contexts."
        if reference
        else "",
        f"Command: `{res['command']}`",
    ]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--budget", type=int, default=256, help="prefill token budget per step")
    # auto: what the server resolves (Pallas on a GPU), so results time the served path
    backends = ["auto", "xla", "pallas"]
    ap.add_argument("--attention-backends", nargs="+", default=["auto"], choices=backends)
    ap.add_argument("--moe-backends", nargs="+", default=["auto"], choices=backends)
    ap.add_argument(
        "--cache-types",
        "--cache-type",
        nargs="+",
        default=["bf16"],
        choices=["bf16", "q8_0", "q4_0"],
        help="KV cache types, one engine each (the first is the ratios' baseline)",
    )
    ap.add_argument("--dtype", default="bfloat16", help="EngineConfig.dtype (quantized: packed)")
    ap.add_argument("--quant-activations", default="auto", help="EngineConfig.quant_activations")
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument("--copy-gib", type=float, default=4.0, help="the copy bandwidth's buffer")
    ap.add_argument("--out", default=None, help="write JSON here and markdown beside it")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    bw = copy_bandwidth(a.copy_gib)  # once: every engine's roofline divides by the same
    log.info("copy bandwidth %.0f GB per s", bw / 1e9)
    res = None
    # One engine at a time, in the same process and call (moe backends matter for MoE files only).
    combos = itertools.product(a.attention_backends, a.moe_backends, a.cache_types)
    for backend, moe_backend, cache_type in combos:
        r = run(a, backend, moe_backend, cache_type, bw)
        res = r if res is None else {**res, "rows": res["rows"] + r["rows"]}
        gc.collect()
    res["tok_s"] = tok_s_by_cache_type(res["rows"])  # {cache type: {C: tok/s}}
    reference = {1: 133, 8: 994, 32: 2297} if a.ctx == 1024 and a.cache_types == ["bf16"] else None
    write_result(res, markdown(res, reference), a.out)


if __name__ == "__main__":
    main()
