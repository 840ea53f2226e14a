"""The last steps the engine thread ran, and what the engine holds now, for the server's web
page (`GET /debug/steps`, server/web.py). No jax.

The engine thread appends one small tuple per step (a bounded deque: its append is atomic, so
the thread takes no lock and does no more work than that); a reader copies the deque. The
engine's state is read the same way, from any thread: counts and per-slot numbers that may be
a step apart from each other, which is what a live view needs.
"""

from __future__ import annotations

import time
from collections import deque

# (unix seconds, step seconds, token bucket, decode rows, prompt rows, prompt tokens,
#  proposals verified, proposals kept)
FIELDS = ("t", "seconds", "tokens", "decode", "prompts", "prompt_tokens", "proposed",
          "accepted")  # fmt: skip


class StepLog:
    """A ring of the last `size` steps (FIELDS)."""

    def __init__(self, size: int = 240):
        if size <= 0:
            raise ValueError(f"size={size}: must be positive")
        self._steps: deque = deque(maxlen=size)

    def add(self, scheduler, seconds: float) -> None:
        """The engine thread, after a scheduler step that worked: its plan, bucket and time."""
        plan, engine = scheduler.last_plan, scheduler.engine
        spec = engine.spec.last if engine.spec is not None else {}
        proposed = sum(p for p, _ in spec.values())
        accepted = sum(a for _, a in spec.values())
        prompts = plan.prefills if plan is not None else ()
        self._steps.append((time.time(), seconds, engine.last_bucket[0],
                            len(plan.decode) if plan is not None else 0, len(prompts),
                            sum(n for _, n in prompts), proposed, accepted))  # fmt: skip

    def steps(self) -> list[dict]:
        return [dict(zip(FIELDS, s, strict=True)) for s in list(self._steps)]


def engine_view(handle) -> dict:
    """What an engine holds now (an engine_handle.EngineHandle): each live slot's request
    (prompt progress, tokens so far), the KV pool's blocks, the queue, speculation totals."""
    sched, engine = handle.scheduler, handle.engine
    for _ in range(3):  # the engine thread may change `running` while it is copied
        try:
            running = list(sched.running.items())
            break
        except RuntimeError:
            continue
    else:
        running = []
    sl = engine.slots
    slots = []
    for slot, req in running:
        prompt = len(req.prompt)
        done = min(int(sl.prefilled[slot]), prompt)
        slots.append({"slot": int(slot), "request": req.id, "prompt": prompt, "prefilled": done,
                      "generated": len(req.output_ids),
                      "phase": "decode" if done >= prompt else "prompt"})  # fmt: skip
    pool = engine.pool
    return {
        "slots": sorted(slots, key=lambda s: s["slot"]),
        "max_slots": handle.config.max_concurrency,
        "kv": {
            "used": pool.used,
            "cached": pool.cached,
            "free": pool.available,
            "total": pool.capacity,
            "block_size": handle.config.kv_block_size,
        },  # fmt: skip
        "queue": handle.waiting(),
        "spec": handle.spec_stats(),
    }
