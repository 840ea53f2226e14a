"""Whether speculation runs at all, from the throughput measured with it and without (no jax).

A cost model predicts a step's time from warmup's timings, and where the host, not the device,
bounds the step (a small model, or the H200 at low concurrency) those timings say little: on the
embedded pair the adaptive policy ran prompt lookup at 0.71 to 1.38x of `off`, where verifying K
proposals on every step ran at 1.11 to 1.67x, and the draft head at 0.86 to 0.99x whichever
policy (bench/results/2026-12-03_speculative_ngram_device_embedded_h200.md). So `auto` measures:

1. Run the regime believed best (speculating at first) for a window of steps, then the other
   for a short trial window, and compare their served rates: tokens emitted per sampled row
   (per row, so a load that changes between windows weighs less) over the window's median
   step time. The median, because a pause of the host (a garbage collection) of a few ms in
   a trial of 16 steps of 2 ms moved a mean by a quarter: the first gate, on means, kept the
   draft head on at 0.74x to 0.85x of `off` (bench/results/
   2026-12-03_speculative_gated_mean_embedded_h200.md).
2. Keep a moving average of log(rate speculating / rate not) over the trials; the better side
   is the regime from then on.
3. Each trial that agrees with the standing choice doubles the next window (up to
   `max_window`), so a clear winner pays ever rarer trials; a trial that disagrees resets it.
   The trial window is `trial` steps, so with windows of `window` steps a regime that loses
   x% costs about x * trial / (window + trial) percent, and less as windows grow: with the
   defaults, speculation that serves 40% slower costs 1.4% over 4000 steps (tested).
4. The first step after a switch is not counted: it was dispatched under the regime before.
5. A chosen window is rated on its last `trial` steps, next to the trial. When the load (the
   sampled rows a step) moves by more than half or a third from the last trial's, the window
   ends `trial` steps later (rated on those) and the average restarts: at C32 on a random 8B
   file the gate kept prompt lookup on, as its trials at C1 to C16 had found faster, where it
   served 0.95x of `off`
   (bench/results/2026-12-03_speculative_gated_qwen3-8b-bf16_h200.md).

Steps without a sampled row (prefill only) teach nothing and are skipped.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class SpecGate:
    """Alternates measured windows with speculation on and off; `on` says which runs now.

    Args:
      trial: steps of a trial window (the regime not chosen).
      window: steps of the chosen regime before the first trial after a switch.
      max_window: the longest window, reached after agreeing trials.
      smoothing: weight of the newest trial in the average log ratio.
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
        self.best = True  # the chosen regime: speculating
        self.on = True  # the regime running now
        self.log_ratio: float | None = None  # average log(rate on / rate off)
        self.trials = 0
        self._agree = 0  # trials in a row that agreed with the choice
        self._left = trial  # the first window is short: a first trial comes early
        self._skip = 0  # steps still to leave uncounted
        # the window's last `trial` steps (tokens, rows, seconds): a chosen window is rated on
        # the steps next to the trial, under the load the trial runs at
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=trial)
        self._before: float | None = None  # the chosen regime's rate just before the trial
        self._trial_rows = 0.0  # the mean sampled rows of the last trial's steps

    def observe(self, tokens: int, rows: int, seconds: float) -> None:
        """One collected step: `tokens` emitted by its `rows` sampled rows in `seconds`."""
        if rows <= 0:
            return
        if self._skip:
            self._skip -= 1
            return
        self._recent.append((tokens, rows, seconds))
        self._left -= 1
        full = len(self._recent) == self.trial
        rows_now = sum(r for _, r, _ in self._recent) / len(self._recent)
        if full and self.on == self.best and self._trial_rows and self._left > 0:
            if not 2 / 3 <= rows_now / self._trial_rows <= 3 / 2:  # the load moved: measure anew
                # the window ends after `trial` steps at the new load, then a trial
                self.log_ratio, self._agree, self._left, self._trial_rows = None, 0, self.trial, 0
                self._recent.clear()
                return
        if self._left > 0:
            return
        t, n, secs = zip(*self._recent, strict=True)
        rate = sum(t) / sum(n) / max(statistics.median(secs), 1e-12)
        self._recent.clear()
        if self.on == self.best:  # a window of the chosen regime ends: a trial follows
            self._before = rate
            self._switch(not self.best, self.trial)
            return
        self._trial_rows = sum(n) / len(n)
        r = math.log(rate / self._before) if self._before and rate > 0 else 0.0
        if not self.on:  # the trial ran without speculation
            r = -r
        self.trials += 1
        self.log_ratio = r if self.log_ratio is None else (
            self.log_ratio + self.smoothing * (r - self.log_ratio)
        )  # fmt: skip
        best = self.log_ratio >= 0
        self._agree = self._agree + 1 if (r >= 0) == self.best and best == self.best else 0
        self.best = best
        n = min(self.window << min(self._agree, 8), self.max_window)
        self._switch(self.best, n)

    @property
    def on_soon(self) -> bool:
        """Speculating now, or possibly within the next two plans (so the step before makes
        proposals for them)."""
        return self.on or self._left + self._skip <= 2

    def _switch(self, on: bool, steps: int) -> None:
        self._skip = int(on != self.on)
        self.on, self._left = on, steps
