"""Where a decode step's time goes: a JAX profiler trace of engine steps, by model part.

C requests are prefilled, then `--steps` engine steps (plan, lowering, the compiled step,
sampling, bookkeeping) run under jax.profiler. Device kernel time is attributed to the named
scopes of models/dense.py and device/runner.py (embed, qkv, kv_write, attention, attn_out, mlp,
lm_head, sampling) through the compiled HLO's op metadata; the rest of the step's wall time
is host time and device idle (planning, transfers, dispatch, waiting for sampled tokens).
With --prefill the traced steps are prefill steps (chunks of --chunk tokens of C prompts).

    python bench/engine/profile_step.py --model qwen3-8b-bf16.gguf --concurrency 1 8 --out prof.json
    python bench/engine/profile_step.py --model m.gguf --prefill --chunk 512 --ctx 8192 --steps 8

With --spec-mode the policy proposes K for every decoding slot in every step (flat step times),
so each traced step verifies and proposes; the draft's kernels count as part `draft` (the
draft model's, in the forward pass and the sampling program) or `draft_head`. With
--no-proposals the speculating engine's gate stays off: its steps verify nothing, and what
they cost beyond `off`'s is what speculation costs a step that does not use it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import logging
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from engine_decode import CallClock  # noqa: E402

from meta import run_meta, write_result  # noqa: E402

log = logging.getLogger("profile_step")

SCOPES = ("draft", "draft_head", "embed", "qkv", "kv_write", "compressor", "indexer",
          "attention", "attn_out", "mlp", "hyper_connection", "lm_head", "sampling")  # fmt: skip
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> the model part whose named scope appears in its op_name. A
    name in several programs keeps its first program's part: the forward pass's, which comes
    first in the text (a kernel is matched by name alone, and the sampling program reuses
    names such as `input_reduce_fusion`: the DeepSeek V4 profile counted 732 of its forward
    kernels as sampling's)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            parts = m.group(2).split("/")
            out.setdefault(m.group(1), next((p for p in parts if p in SCOPES), "other"))
    return out


def _variants(name: str) -> list[str]:
    """GPU kernel names sanitize HLO names ('fusion.3' runs as 'fusion_3' or 'loop_fusion_3')."""
    v = [name]
    m = re.match(r"^(.*)_(\d+)$", name)
    if m:
        v.append(f"{m.group(1)}.{m.group(2)}")
    return v


def device_time(trace: dict, cats: dict[str, str]) -> tuple[dict, dict, float, float, list, dict]:
    """(ms per category, (ms, launches) per (kernel, category), busy ms, span ms, gaps, kernels
    per category) over the trace's device events; the span runs from the first one's start to the
    last one's end, so span - busy is the time the device waited (for launches, transfers or
    the host), gaps lists the 8 longest waits as (ms, kernel before, kernel after), and the
    kernels count the events.

    GPU: events on the device process's stream threads (other lines of that process repeat
    them per module or op). CPU: events whose name is an HLO instruction of the step.
    """
    ev = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname, tname = {}, {}
    for e in ev:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pname[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e.get("tid"))] = e["args"]["name"]
    gpu = {p for p, n in pname.items() if "GPU" in n or "gpu" in n}
    streams = {k for k, n in tname.items() if k[0] in gpu and "Stream" in n}
    by_cat, by_kernel, spans, counts = defaultdict(float), defaultdict(float), [], defaultdict(int)
    launches = defaultdict(int)
    for e in ev:
        if e.get("ph") != "X":
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0)) / 1e3
        if gpu:
            if streams and (e["pid"], e.get("tid")) not in streams:
                continue
            if not streams and e["pid"] not in gpu:
                continue
            # The kernel's name first: under XLA's command buffers (CUDA graphs) hlo_op names
            # the whole graph ("command_buffer_1"), not the fusion.
            names = _variants(name) + _variants((e.get("args") or {}).get("hlo_op", ""))
            cat = next((cats[v] for v in names if v in cats), None)
            if cat is None:
                cat = "transfer" if "memcpy" in name.lower() else "unattributed"
        else:
            cat = cats.get(name)
            if cat is None:
                continue
        by_cat[cat] += dur
        counts[cat] += 1
        by_kernel[(name, cat)] += dur
        launches[(name, cat)] += 1
        spans.append((float(e["ts"]) / 1e3, float(e["ts"]) / 1e3 + dur, name))
    busy, end, last, gaps = 0.0, -1e30, "", []
    for a, b, name in sorted(spans):  # union of intervals: overlapping kernels count once
        if b > end:
            if a > end > -1e30:
                gaps.append((a - end, last, name))
            busy += b - max(a, end)
            end, last = b, name
    span = max(b for _, b, _ in spans) - min(a for a, _, _ in spans) if spans else 0.0
    by_kernel = {k: (v, launches[k]) for k, v in by_kernel.items()}
    return dict(by_cat), by_kernel, busy, span, sorted(gaps, reverse=True)[:8], dict(counts)


def profile(engine, tok, C: int, ctx: int, steps: int, warm: int, save_dir=None, prefill=False):
    """The report of `steps` traced engine steps at concurrency C: decode steps after C prompts
    of ctx tokens are prefilled, or (prefill) steps while those prompts are being prefilled
    (ctx must outlast warm + steps chunks)."""
    import jax

    from luce_jax.host.request import Request
    from luce_jax.host.scheduler import Scheduler
    from luce_jax.sampling_params import SamplingParams

    mc, runner = engine.runner.cfg, engine.runner
    sched = Scheduler(engine, tok)
    sp = SamplingParams(max_tokens=steps + warm + 64, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    reqs = [Request(rng.integers(0, mc.vocab_size, ctx).tolist(), sp) for _ in range(C)]
    for r in reqs:
        sched.add(r)
    while not prefill and not all(sched.decoding(r) for r in reqs):
        assert not any(r.done for r in reqs), [(r.finish_reason, r.error) for r in reqs]
        sched.step()
    for _ in range(warm):
        sched.step()
    sampling = runner.sample_programs._exec  # the sampling programs, one per row width
    with tempfile.TemporaryDirectory() as d, CallClock(runner) as clock:
        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0  # tracing every Python call would inflate host time
        with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=opts):
            t = time.perf_counter()
            for _ in range(steps):
                sched.step()
            wall = (time.perf_counter() - t) * 1e3
        (path,) = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    assert not prefill or not any(sched.decoding(r) for r in reqs), "ctx too short for --prefill"
    for r in reqs:
        sched.cancel(r)
    sched.step()
    raw = {
        "C": C,
        "ctx": ctx,
        "steps": steps,
        "wall_ms": wall,
        "buckets": sorted(clock.buckets),  # which the traced steps ran
        "hlo": "\n".join(
            [
                *(runner.programs._exec[k].as_text() for k in sorted(clock.buckets)),
                *(e.as_text() for e in sampling.values()),
            ]
        ),  # fmt: skip
        "trace": trace,
    }
    if save_dir:
        raw = {**raw, "trace": _device_only(trace)}
        os.makedirs(save_dir, exist_ok=True)
        with gzip.open(os.path.join(save_dir, f"profile_raw_C{C}.json.gz"), "wt") as f:
            json.dump(raw, f)
    return analyze(raw)


def _device_only(trace: dict) -> dict:
    """The trace without host events when it has a GPU process (they are most of its size)."""
    ev = trace["traceEvents"]
    gpu = {
        e["pid"]
        for e in ev
        if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"]["name"]
    }
    if not gpu:
        return trace
    return {**trace, "traceEvents": [e for e in ev if e.get("ph") == "M" or e.get("pid") in gpu]}


def analyze(raw: dict) -> dict:
    """The report of one profiled concurrency from its raw trace and HLO text."""
    by_cat, by_kernel, busy, _, gaps, counts = device_time(raw["trace"], hlo_categories(raw["hlo"]))
    kernels = sum(counts.values())
    steps = raw["steps"]
    step_ms = raw["wall_ms"] / steps
    parts = {k: v / steps for k, v in by_cat.items()}
    parts["host + idle"] = max(step_ms - busy / steps, 0.0)
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:24]
    return {
        "C": raw["C"],
        "ctx": raw["ctx"],
        "buckets": [tuple(b) for b in raw["buckets"]],
        "step_ms": step_ms,
        "device_busy_ms": busy / steps,
        # Each step is one CUDA graph (XLA's command buffers), prepared on the host in time that
        # grows with its kernels; the device waits for it in the longest gaps.
        "kernels_per_step": kernels / steps,
        "kernels_per_part": {k: v / steps for k, v in counts.items()},
        "longest_waits_ms": [(round(g, 3), a[:40], b[:40]) for g, a, b in gaps[:4]],
        "parts_ms": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [(n, cat, v / steps, c / steps) for (n, cat), (v, c) in top],
    }


def markdown(results: list[dict], title: str) -> str:
    lines = [title, ""]
    for r in results:
        lines += [
            f"C={r['C']}: step {r['step_ms']:.2f} ms, device busy {r['device_busy_ms']:.2f} ms, "
            f"{r.get('kernels_per_step', 0):.0f} kernels a step, buckets {r['buckets']}; "
            f"longest device waits (ms, before, after): {r.get('longest_waits_ms', [])}",
            "",
            "| part | ms per step | share of step | kernels per step |",
            "| --- | --- | --- | --- |",
        ]
        per_part = r.get("kernels_per_part", {})
        for k, v in r["parts_ms"].items():
            n = f"{per_part[k]:.0f}" if k in per_part else ""
            lines.append(f"| {k} | {v:.3f} | {v / r['step_ms']:.1%} | {n} |")
        lines += [
            "",
            "| kernel | part | ms per step | launches per step |",
            "| --- | --- | --- | --- |",
        ]
        for n, c, v, *k in r["top_kernels_ms"][:16]:  # records before launches: 3 fields
            lines.append(f"| `{n[:70]}` | {c} | {v:.3f} | {f'{k[0]:.0f}' if k else ''} |")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--dtype", default="auto", help="EngineConfig.dtype (quantized: keep packed)")
    ap.add_argument("--quant-activations", default="auto", help="EngineConfig.quant_activations")
    ap.add_argument(
        "--cache-type", default="auto", help="KV cache type (K and V): bf16, q8_0, q4_0"
    )
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--prefill", action="store_true", help="trace prefill steps of ctx prompts")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk and token budget")
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument("--spec-mode", default="off", help="EngineConfig.spec_mode")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument(
        "--no-proposals", action="store_true", help="with --spec-mode: steps with its gate off"
    )
    ap.add_argument("--title", default="decode step profile")
    ap.add_argument("--out", default=None, help="JSON path; .md beside it")
    ap.add_argument("--save-raw", default=None, help="folder for each C's trace and HLO text")
    ap.add_argument("--from-raw", nargs="+", default=None, help="report from saved raw files")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if a.from_raw:
        results = []
        for path in a.from_raw:
            with gzip.open(path, "rt") as f:
                results.append(analyze(json.load(f)))
        return write(results, a)
    from luce_jax.build import load_engine
    from luce_jax.config import EngineConfig

    cmax = max(a.concurrency)
    max_ctx = a.ctx + a.steps + a.warm + 128
    cfg = EngineConfig(
        **({"model": a.model} if a.model else {}),
        dtype=a.dtype,
        quant_activations=a.quant_activations,
        cache_type_k=a.cache_type,
        cache_type_v=a.cache_type,
        max_concurrency=cmax,
        max_ctx=max_ctx,
        kv_pool_tokens=cmax * (-(-max_ctx // 16) + 1) * 16,
        prefill_chunk=a.chunk,
        prefill_token_budget=a.chunk,
        max_concurrent_prefills=cmax,
        compile_cache_dir=a.compile_cache_dir,
        spec_mode=a.spec_mode,
        draft_tokens=a.draft_tokens,
    )
    tok, engine = load_engine(cfg)
    if engine.spec is not None:  # propose K every step, whatever acceptance random text gets
        from luce_jax.speculation.policy import SpecPolicy

        engine.spec.policy = SpecPolicy(
            a.draft_tokens, dict.fromkeys(engine.token_buckets, 1.0), min_gain=0.0
        )
        engine.spec.policy.observe_step = lambda seconds: None
        if a.no_proposals:  # what speculation costs a step that verifies nothing
            engine.spec.gate = _GateOff()
    results = [
        profile(engine, tok, C, a.ctx, a.steps, a.warm, a.save_raw, a.prefill)
        for C in a.concurrency
    ]
    write(results, a)


class _GateOff:
    """A speculation gate (luce_jax/speculation/gate.py's interface) that stays off."""

    on = on_soon = False

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        pass


def write(results: list[dict], a) -> None:
    res = {"bench": "profile_step", **run_meta(), "results": results}
    md = markdown(results, a.title) + f"Command: `{res['command']}`\n"
    write_result(res, md, a.out)


if __name__ == "__main__":
    main()
