"""Whether speculation runs at all, from the throughput measured with it and without (no jax).

A cost model predicts a step's time from warmup's timings, and where the host, not the device,
bounds the step (a small model, or the H200 at low concurrency) those timings say little: on the
embedded pair the adaptive policy ran prompt lookup at 0.71 to 1.38x of `off`, where verifying K
proposals on every step ran at 1.11 to 1.67x, and the draft head at 0.86 to 0.99x whichever
policy (bench/results/speculative_ngram_device_embedded_h200.md). So `auto` measures:

1. Run the regime believed best (speculating at first) for a window of steps, then the other
   for a short trial window, and compare their served rates: tokens emitted per sampled row
   (per row, so a load that changes between windows weighs less) over the window's median
   step time. The median, because a pause of the host (a garbage collection) of a few ms in
   a trial of 16 steps of 2 ms moved a mean by a quarter: the first gate, on means, kept the
   draft head on at 0.74x to 0.85x of `off` (bench/results/
   history/2026-12-03_speculative_gated_mean_embedded_h200.md).
2. Keep a moving average of log(rate speculating / rate not) over the trials; the better side
   is the regime from then on.
3. Each trial that agrees with the standing choice doubles the next window (up to
   `max_window`), so a clear winner pays ever rarer trials; a trial that disagrees resets it.
   The trial window is `trial` steps, so with windows of `window` steps a regime that loses
   x% costs about x * trial / (window + trial) percent, and less as windows grow: with the
   defaults, speculation that serves 40% slower costs 1.4% over 4000 steps (tested).
4. The first step after a switch is not counted: it was dispatched under the regime before.
5. A chosen window is rated on its last `trial` steps, next to the trial, and both run at one
   load: the log ratio, the choice and the window are kept per load level (sampled rows a
   step on a log2 scale: 1, 2, 3-5, 6-11, 12-22, 23-45 ...; a step moves the level only once
   its rows are 0.75 from it in log2, so a load at a border does not flap). When the load
   moves, the new level's choice runs for what is left of its window (a level never measured
   takes the nearest measured level's, and a trial soon), and a trial under way is dropped.
   Why levels: at C32 on a random 8B file a single average kept prompt lookup on, as trials
   at C1 to C16 had found faster, where it served 0.95x of `off`
   (bench/results/history/2026-12-03_speculative_gated_qwen3-8b-bf16_h200.md); the gate after it,
   which restarted its average whenever the load moved, decided afresh within each wave of
   concurrent requests (their ends thin the rows out), on trials that straddled the moves:
   it ended with the draft model off at C16 and C32 on the embedded pair
   (bench/results/speculative_head_lookup_embedded_h200.md). Simulated waves
   (tests/test_spec_gate.py): the faster regime runs 98% and 96% of each level's steps,
   where the gate before ran it 82% and 62%.

Steps without a sampled row (prefill only) teach nothing and are skipped.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


def level(rows: float) -> int:
    """A load level: round(log2(sampled rows a step))."""
    return round(math.log2(max(rows, 1.0)))


class SpecGate:
    """Alternates measured windows with speculation on and off; `on` says which runs now.

    Args:
      trial: steps of a trial window (the regime not chosen).
      window: steps of the chosen regime before the first trial after a switch.
      max_window: the longest window, reached after agreeing trials.
      smoothing: weight of the newest trial in a level's average log ratio.
    """

    def __init__(self, trial: int = 16, window: int = 128, max_window: int = 2048,
                 smoothing: float = 0.5):  # fmt: skip
        if not 0 < trial <= window <= max_window or not 0 < smoothing <= 1:
            raise ValueError(f"need 0 < trial <= window <= max_window, smoothing in (0, 1]: "
                             f"{trial}, {window}, {max_window}, {smoothing}")  # fmt: skip
        self.trial, self.window, self.max_window, self.smoothing = (
            trial,
            window,
            max_window,
            smoothing,
        )
        self.best = True  # the chosen regime at the current level: speculating
        self.on = True  # the regime running now
        self.level: int | None = None  # the current load level (set by the first step)
        self.ratios: dict[int, float] = {}  # level -> average log(rate on / rate off)
        self._agree: dict[int, int] = {}  # level -> trials in a row that agreed with it
        self._lefts: dict[int, int] = {}  # level -> steps left of its window, while away
        self.trials = 0
        self._left = trial  # the first window is short: a first trial comes early
        self._skip = 0  # steps still to leave uncounted
        # the window's last `trial` steps (tokens, rows, seconds): a chosen window is rated on
        # the steps next to the trial, under the load the trial runs at
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=trial)
        self._before: float | None = None  # the chosen regime's rate just before the trial

    @property
    def log_ratio(self) -> float | None:
        """The current level's average log(rate on / rate off), None before its first trial."""
        return self.ratios.get(self.level)

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        """One collected step: `tokens` emitted by its `rows` sampled rows in `seconds`."""
        if rows <= 0:
            return
        if self.level is None:
            self.level = level(rows)
        elif abs(math.log2(rows) - self.level) > 0.75:  # a margin: no flapping at a border
            self._moved(level(rows))
        if self._skip:
            self._skip -= 1
            return
        self._recent.append((tokens, rows, seconds))
        self._left -= 1
        if self._left > 0:
            return
        if len(self._recent) < self.trial:  # the load moved within the window: rate it later
            self._left = self.trial - len(self._recent)
            return
        t, n, secs = zip(*self._recent, strict=True)
        rate = sum(t) / sum(n) / max(statistics.median(secs), 1e-12)
        self._recent.clear()
        if self.on == self.best:  # a window of the chosen regime ends: a trial follows
            self._before = rate
            self._switch(not self.best, self.trial)
            return
        r = math.log(rate / self._before) if self._before and rate > 0 else 0.0
        if not self.on:  # the trial ran without speculation
            r = -r
        self.trials += 1
        old = self.ratios.get(self.level)
        self.ratios[self.level] = avg = r if old is None else old + self.smoothing * (r - old)
        best = avg >= 0
        agree = self._agree.get(self.level, 0) + 1 if (r >= 0) == self.best == best else 0
        self._agree[self.level] = agree
        self.best = best
        self._switch(best, min(self.window << min(agree, 8), self.max_window))

    def _moved(self, now: int) -> None:
        """The load moved to level `now`: the level's verdict runs from here for what is left
        of its window (a level without one takes the nearest level's, and a trial after
        `trial` steps), the old level's window waits for its return, and a trial under way
        decides nothing."""
        if self.on == self.best:
            self._lefts[self.level] = self._left
        self.level = now
        self._recent.clear()
        near = min(self.ratios, key=lambda x: abs(x - now), default=None)
        self.best = self.ratios[near] >= 0 if near is not None else True
        self._switch(self.best, self._lefts.pop(now, self.trial))

    @property
    def on_soon(self) -> bool:
        """Speculating now, or possibly within the next two plans (so the step before makes
        proposals for them)."""
        return self.on or self._left + self._skip <= 2

    def _switch(self, on: bool, steps: int) -> None:
        self._skip = int(on != self.on)
        self.on, self._left = on, steps
