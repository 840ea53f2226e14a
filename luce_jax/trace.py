"""Step timeline and compiled-program inspection, for notebooks/inspect_steps.ipynb and debugging.

tracer = StepTracer(llm.engine)          # records every step the scheduler runs
llm.generate(prompts, sp)
tracer.rows()                             # per step: slots, rows, bucket, milliseconds, the
                                          # speculative proposals verified and accepted, and
                                          # for MoE models tokens per expert in each layer
compiled_buckets(llm.engine)              # every compiled (T, S) with XLA's cost analysis
step_jaxpr(llm.engine, 16), step_hlo(llm.engine, 16)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

import jax
import numpy as np


@dataclass(frozen=True)
class StepRecord:
    index: int
    slots: tuple[int, ...]
    decode_rows: int
    prefill_rows: int
    prefill_tokens: int
    token_bucket: int
    row_bucket: int
    ms: float
    proposed: int = 0  # speculative proposals verified in the step
    accepted: int = 0  # of those, kept
    expert_tokens: tuple[tuple[int, ...], ...] | None = None  # MoE: [layer][expert] tokens


class StepTracer:
    """Wraps an engine's `dispatch` and `collect` to record what each step held and its time.

    A step's `ms` runs from its dispatch, or from the collect of the step before it if that
    came later (steps overlap: the next is dispatched while this one runs), to the moment its
    tokens are on the host: about the device time of the step when the host keeps up.
    """

    def __init__(self, engine):
        self.engine = engine
        self.records: list[StepRecord] = []
        self._dispatch, self._collect = engine.dispatch, engine.collect
        engine.dispatch, engine.collect = self._on_dispatch, self._on_collect
        self._pending: deque = deque()  # (plan, bucket, dispatch time, stats) per step in flight
        self._last_collect = 0.0

    def _on_dispatch(self, plan):
        t0 = time.perf_counter()
        self._dispatch(plan)
        stats = self.engine.runner.last_stats  # this step's device arrays, fetched at collect
        self._pending.append((plan, self.engine.last_bucket, t0, stats))

    def _on_collect(self):
        plan, (t_bucket, s_bucket), t0, stats = self._pending.popleft()
        result = self._collect()
        now = time.perf_counter()
        start, self._last_collect = max(t0, self._last_collect), now
        spec = self.engine.spec.last.values() if self.engine.spec is not None else ()
        self.records.append(
            StepRecord(
                index=len(self.records),
                slots=tuple(plan.decode) + tuple(s for s, _ in plan.prefills),
                decode_rows=len(plan.decode),
                prefill_rows=len(plan.prefills),
                prefill_tokens=sum(n for _, n in plan.prefills),
                token_bucket=t_bucket,
                row_bucket=s_bucket,
                ms=(now - start) * 1e3,
                proposed=sum(p for p, _ in spec),
                accepted=sum(a for _, a in spec),
                expert_tokens=_expert_tokens(stats),
            )
        )
        return result

    def rows(self) -> list[dict]:
        return [asdict(r) for r in self.records]

    def detach(self) -> None:
        self.engine.dispatch, self.engine.collect = self._dispatch, self._collect


def _expert_tokens(stats: dict):
    counts = stats.get("expert_counts")
    return None if counts is None else tuple(map(tuple, np.asarray(counts).tolist()))


def _cost(exe) -> dict:
    c = exe.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return {k: c.get(k, 0.0) for k in ("flops", "bytes accessed", "transcendentals")}


def compiled_buckets(engine) -> list[dict]:
    """One row per compiled (T, S) bucket with XLA's estimate of FLOPs and bytes."""
    out = []
    for t, s in engine.bucket_pairs():
        out.append({"tokens": t, "rows": s, **_cost(engine.runner.executable(t, s))})
    return out


def step_jaxpr(engine, t_bucket: int) -> str:
    """The jaxpr of the step for token bucket `t_bucket` (traced abstractly)."""
    fn, args = engine.runner.step_function(t_bucket, engine.rows_for(t_bucket))
    return str(jax.make_jaxpr(fn)(*args))


def step_hlo(engine, t_bucket: int) -> str:
    """XLA's optimized HLO of the compiled step for token bucket `t_bucket`."""
    return engine.runner.executable(t_bucket, engine.rows_for(t_bucket)).as_text()
