"""Host milliseconds per engine step by part (dispatch, lowering, launches, collect, routing).

Offline, the real engine loop (LLM.generate): each part's function is wrapped with a timer,
and the totals are divided by the steps of 3 timed generations (after an untimed one). Parts
nest (dispatch holds lower and the launches; the step holds everything), so shares do not add
up. On a GPU `fetch` is the wait for the device; with steps overlapped it is short where the
host bounds the step.

    python bench/engine/host_parts.py --spec-mode head --concurrency 1 --out host_parts.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import time

log = logging.getLogger("host_parts")

PROMPTS = ["def fib(n):", "import os\n", "class A:", "def add(a, b):", "for i in range(10):",
           "x = [", "# sort a list\n", "def main():"]  # fmt: skip


def measure(mode: str, c: int, max_tokens: int, compile_cache_dir: str | None) -> dict:
    import luce_jax.host.engine as engine_mod
    import luce_jax.host.request as request_mod
    from luce_jax import LLM, SamplingParams
    from luce_jax.loading import tokenizer as tokenizer_mod

    kw = dict(max_concurrency=16, max_ctx=512, spec_mode=mode, compile_cache_dir=compile_cache_dir)
    if mode != "off":
        kw["draft_tokens"] = 4
    llm = LLM(**kw)
    eng = llm.engine
    total, calls = collections.Counter(), collections.Counter()

    def wrap(obj, name, label=None):
        f, label = getattr(obj, name), label or name

        def timed(*a, **k):
            t0 = time.perf_counter()
            r = f(*a, **k)
            total[label] += time.perf_counter() - t0
            calls[label] += 1
            return r

        setattr(obj, name, timed)

    wrap(engine_mod, "lower")
    for obj, names in ((eng, ("dispatch", "collect", "_proposals", "_behind")),
                       (eng.slots, ("row_inputs",)), (eng.pool, ("ensure",)),
                       (eng.runner, ("launch_forward", "launch_sample", "fetch")),
                       (llm.scheduler, ("plan", "_route", "step", "_admit"))):  # fmt: skip
        for name in names:
            wrap(obj, name)
    wrap(request_mod.OutputProcessor, "push", "detokenize and stop checks")
    wrap(tokenizer_mod.IncrementalDecoder, "push", "incremental decode")
    if eng.spec is not None:
        for name in ("record", "step_done", "counts", "wants_proposals"):
            wrap(eng.spec, name)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, seed=0)
    prompts = (PROMPTS * 4)[:c]
    llm.generate(prompts, sp)
    total.clear()
    calls.clear()
    s0, t0, tokens = llm.scheduler.steps, time.perf_counter(), 0
    for _ in range(3):
        tokens += sum(len(o.token_ids) for o in llm.generate(prompts, sp))
    wall = time.perf_counter() - t0
    n = llm.scheduler.steps - s0
    llm.close()
    return dict(mode=mode, c=c, steps=n, tokens=tokens, wall_ms_per_step=wall / n * 1e3,
                tok_s=tokens / wall,
                parts_ms_per_step={k: round(v / n * 1e3, 4) for k, v in sorted(total.items())},
                calls_per_step={k: round(v / n, 2) for k, v in calls.items()})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--spec-mode", default="off")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument("--out", default=None, help="a JSON line is appended here")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    res = measure(a.spec_mode, a.concurrency, a.max_tokens, a.compile_cache_dir)
    log.info("%s", json.dumps(res))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
