"""Where a prefix-cached request's time to first token goes, in process (no HTTP).

Cold requests (8k-token prompts never seen), then one shared prefix and warm requests that
extend it by a 200-token tail, with max_tokens 1 (and 64 for three warm ones): tokenization
time, time from submit to the first token's event, the cached tokens, and for one warm and
one cold request the device's busy time by model part and its top kernels
(bench/engine/profile_step.py's attribution), the device's span from its first kernel to its
last, and its longest waits, and the host's timeline (admit, plan, dispatch, launches, fetch,
collect) from submit.

    python bench/serving/warm_ttft.py --model qwen3-8b-bf16.gguf --slots 32 --ctx 8656
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from prefix import system_prefix, text_of

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("", "engine")]
from profile_step import device_time, hlo_categories  # noqa: E402

log = logging.getLogger("warm_ttft")


def main():
    import threading

    import jax

    from luce_jax import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=8656)
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk and token budget")
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument(
        "--cuda-graph-max-tokens", type=int, default=0, help="the engine flag of that name"
    )
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    llm = LLM(a.model, max_ctx=a.ctx, max_concurrency=a.slots, prefill_chunk=a.chunk,
              prefill_token_budget=a.chunk, max_concurrent_prefills=a.slots,
              compile_cache_dir=a.compile_cache_dir,
              cuda_graph_max_tokens=a.cuda_graph_max_tokens)  # fmt: skip
    tok = llm.tokenizer

    def count(s):
        return len(tok.encode(s, add_special=False))

    timeline: list[tuple[str, float, float]] = []  # (phase, start, end) while timing

    def timed(obj, name: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if timing.is_set():
                    timeline.append((name, t, time.perf_counter()))

        setattr(obj, name, wrapper)

    timing = threading.Event()
    sched, engine = llm.loop.scheduler, llm.engine
    for obj, names in ((sched, ("plan",)), (engine, ("admit", "dispatch", "collect")),
                       (engine.runner, ("launch_forward", "launch_sample", "fetch"))):  # fmt: skip
        for name in names:
            timed(obj, name)

    def first_token(ids: list[int], max_tokens: int) -> tuple[float, int]:
        """Seconds from submit to the first token's event, and the cached prompt tokens."""
        first, seen = threading.Event(), {}

        def on_event(ev):
            seen.setdefault("t", time.perf_counter())
            first.set()

        timeline.clear()
        t = seen["submit"] = time.perf_counter()
        req = llm.loop.submit(ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                  ignore_eos=True), on_event)  # fmt: skip
        first.wait()
        seconds = seen["t"] - t
        if timing.is_set():
            log.info("  host timeline from submit (ms): %s", " ".join(
                f"{n} {1e3 * (a - t):.1f}-{1e3 * (b - t):.1f}" for n, a, b in timeline
                if a < seen["t"]))  # fmt: skip
        while not req.done:  # let it finish: the next request starts on an idle engine
            time.sleep(0.002)
        return seconds, req.cached_tokens

    def one(prompt: str, label: str, trace: bool = False, max_tokens: int = 1,
            phases: bool = False) -> None:  # fmt: skip
        t0 = time.perf_counter()
        ids = tok.encode(prompt)
        t1 = time.perf_counter()
        d = tempfile.mkdtemp()
        if phases:
            timing.set()
        if trace:
            opts = jax.profiler.ProfileOptions()
            opts.python_tracer_level = 0
            with jax.profiler.trace(d, create_perfetto_trace=True, profiler_options=opts):
                ttft, cached = first_token(ids, max_tokens)
        else:
            ttft, cached = first_token(ids, max_tokens)
        timing.clear()
        log.info("%s, max_tokens %d: %d tokens, %d cached; encode %.1f ms, first token %.1f ms",
                 label, max_tokens, len(ids), cached, 1e3 * (t1 - t0), 1e3 * ttft)  # fmt: skip
        if trace:
            (path,) = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
            with gzip.open(path) as f:
                tr = json.load(f)
            hlo = "\n".join(e.as_text() for e in llm.engine.runner.programs._exec.values())
            by_cat, by_kernel, busy, span, gaps, _ = device_time(tr, hlo_categories(hlo))
            parts = {k: round(v, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])}
            top = sorted(((k, v) for k, (v, _) in by_kernel.items()), key=lambda kv: -kv[1])[:8]
            log.info("  device busy %.2f ms of a %.2f ms span: %s", busy, span, parts)
            log.info("  top kernels (ms): %s", [(n[:40], c, round(v, 2)) for (n, c), v in top])
            log.info("  longest device waits (ms, before, after): %s",
                     [(round(g, 3), a[:32], b[:32]) for g, a, b in gaps])  # fmt: skip

    prefix = system_prefix(a.prefix_tokens, 1, count)
    for i in range(2):
        one(system_prefix(a.prefix_tokens, 100 + i, count) + text_of(200, 50 + i, count), "cold")
    one(prefix, "prefix")
    for i in range(3):
        one(prefix + text_of(200, 10 + i, count), "warm")
    # the first token of a request that goes on decoding (the server's case) against one that
    # ends at it: the first is collected after the next step is dispatched
    for i in range(3):
        one(prefix + text_of(200, 20 + i, count), "warm", max_tokens=64, phases=True)
    one(prefix + text_of(200, 99, count), "warm, traced", trace=True)
    one(system_prefix(a.prefix_tokens, 200, count) + text_of(200, 98, count), "cold, traced",
        trace=True)  # fmt: skip
    # Greedy tokens of a warm and a cold request, as a digest: runs under different XLA flags
    # (or commits) must print the same one.
    pair = [prefix + text_of(200, 97, count), system_prefix(a.prefix_tokens, 300, count)]
    outs = llm.generate(pair, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    digest = hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()[:16]
    log.info("greedy tokens digest (a warm and a cold request, 32 each): %s", digest)
    llm.close()


if __name__ == "__main__":
    main()
