"""Where start-up time goes: named phases and the compile cache's hits, as one log line."""

from __future__ import annotations

import time
from contextlib import contextmanager

CACHE_HIT, CACHE_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


class StartupClock:
    """Times named phases of start-up and counts JAX's persistent compile cache hits and misses
    while it listens (`with clock:`), so a slow start says which part was slow and whether the
    cache served every bucket.

    Usage:
        with StartupClock() as clock:
            with clock.phase("weights"):
                ...
        log.info("%s", clock.summary())
    """

    def __init__(self):
        self.t0 = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.notes: dict[str, str] = {}
        self.cache_hits = self.cache_misses = 0
        self.total = None

    def _event(self, event: str, **_) -> None:
        if event == CACHE_HIT:
            self.cache_hits += 1
        elif event == CACHE_MISS:
            self.cache_misses += 1

    def __enter__(self) -> StartupClock:
        import jax.monitoring

        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_listener(self._event)
        self.total = time.perf_counter() - self.t0

    @contextmanager
    def phase(self, name: str, note: str | None = None):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t
            if note:
                self.notes[name] = note

    def summary(self) -> str:
        """One line: the total, each phase's seconds (and note), the cache's hits and misses."""
        total = self.total if self.total is not None else time.perf_counter() - self.t0
        parts = [f"{k} {v:.1f} s" + (f" ({self.notes[k]})" if k in self.notes else "")
                 for k, v in self.phases.items()]  # fmt: skip
        other = total - sum(self.phases.values())
        return (
            f"ready in {total:.1f} s: " + ", ".join(parts) + f", other {other:.1f} s; "
            f"compile cache {self.cache_hits} hits, {self.cache_misses} misses"
        )
