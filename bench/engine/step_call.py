"""Host time of a decode step's call, by token bucket: is a small-bucket step bound by the host?

Each step is one CUDA graph (XLA's command buffer) that the call updates for the step's new
buffers before launching it. Drives the real scheduler at C concurrent sequences with the
engine's smallest token bucket forced to each given size, and reports per bucket: the engine's
wall step, the host seconds inside the compiled step's call, and that call again on the last
step's inputs with the device idle and back to back (the device step when the host keeps up).

    python bench/engine/step_call.py --model m.gguf --dtype quantized --phases 1:8 1:1 1:8 1:1

A phase C:B runs C sequences with B as the smallest bucket (B must be one of the engine's).
Phases alternate so that the host's drift within a run shows. XLA's own update time per step
is in its log: `TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3` prints
"Updated command buffer in N us; num_commands=..." for every update.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from engine_decode import CallClock  # noqa: E402

from meta import run_meta, write_result  # noqa: E402

log = logging.getLogger("step_call")


def phase(engine, tok, C: int, smallest: int, ctx: int, steps: int) -> dict:
    import jax

    from luce_jax.host.request import Request
    from luce_jax.host.scheduler import Scheduler
    from luce_jax.sampling_params import SamplingParams

    full = list(engine.token_buckets)
    if smallest not in full:
        raise ValueError(f"--phases bucket {smallest} is not one of the engine's {full}")
    engine.token_buckets = full[full.index(smallest) :]
    runner, sched = engine.runner, Scheduler(engine, tok)
    sp = SamplingParams(max_tokens=steps + 64, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    reqs = [Request(rng.integers(0, 1000, ctx).tolist(), sp) for _ in range(C)]
    for r in reqs:
        sched.add(r)
    while not all(sched.decoding(r) for r in reqs):
        sched.step()
    for _ in range(8):
        sched.step()
    # Re-running the last step rewrites the same KV slots with the same values.
    with CallClock(runner) as clock:
        t = time.perf_counter()
        for _ in range(steps):
            sched.step()
        step = (time.perf_counter() - t) / steps
        step_in_call = clock.seconds / steps
        idle, busy = [], []
        for _ in range(16):
            jax.block_until_ready(runner.kv)
            s0 = clock.seconds
            out = runner.launch(*clock.launch)
            idle.append(clock.seconds - s0)
        jax.block_until_ready(out.packed)
        t = time.perf_counter()
        for _ in range(16):
            s0 = clock.seconds
            out = runner.launch(*clock.launch)
            busy.append(clock.seconds - s0)
        jax.block_until_ready(out.packed)
        back_to_back = (time.perf_counter() - t) / 16
        used = set(clock.buckets)
    for r in reqs:
        sched.cancel(r)
    sched.step()
    engine.token_buckets = full
    ms = {"step_ms": step, "in_call_ms": step_in_call, "idle_call_ms": float(np.median(idle)),
          "busy_call_ms": float(np.median(busy)), "back_to_back_ms": back_to_back}  # fmt: skip
    row = {"C": C, "smallest_bucket": smallest, "buckets": sorted(used)}
    row |= {k: v * 1e3 for k, v in ms.items()}
    log.info("%s", row)
    return row


def markdown(res) -> str:
    out = [f"# {res['title']}", "", f"{res['device']}, {res['date']}, commit {res['commit']}", "",
           "| C | smallest bucket | buckets run | step ms | in call ms | call, device idle | "
           "call, back to back | back-to-back step ms |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in res["rows"]:
        out.append(f"| {r['C']} | {r['smallest_bucket']} | {r['buckets']} | {r['step_ms']:.2f} | "
                   f"{r['in_call_ms']:.2f} | {r['idle_call_ms']:.2f} | {r['busy_call_ms']:.2f} | "
                   f"{r['back_to_back_ms']:.2f} |")  # fmt: skip
    return "\n".join(out) + f"\n\nCommand: `{res['command']}`\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="quantized", help="EngineConfig.dtype")
    ap.add_argument("--quant-activations", default="auto", help="EngineConfig.quant_activations")
    ap.add_argument("--phases", nargs="+", default=["1:8", "1:1", "1:8", "1:1"], help="C:bucket")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument("--title", default="host time of a decode step's call, by token bucket")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from luce_jax.build import load_engine
    from luce_jax.config import EngineConfig

    phases = [tuple(int(t) for t in p.split(":")) for p in a.phases]
    cmax = max(c for c, _ in phases)
    max_ctx = a.ctx + a.steps + 128
    cfg = EngineConfig(model=a.model, dtype=a.dtype, quant_activations=a.quant_activations,
                       max_concurrency=cmax, max_ctx=max_ctx,
                       kv_pool_tokens=cmax * (-(-max_ctx // 16) + 1) * 16, prefill_chunk=256,
                       prefill_token_budget=256, max_concurrent_prefills=cmax,
                       compile_cache_dir=a.compile_cache_dir)  # fmt: skip
    tok, engine = load_engine(cfg)
    res = {"bench": "step_call", **run_meta(), "title": a.title, "rows": []}
    for C, smallest in phases:
        res["rows"].append(phase(engine, tok, C, smallest, a.ctx, a.steps))
    write_result(res, markdown(res), a.out)


if __name__ == "__main__":
    main()
