"""How many proposals each decoding slot verifies this step, or none (pure Python, no jax).

The policy maximizes expected emitted tokens per second of step time:

1. Each slot keeps an estimate a of the probability that one proposal is accepted (an
   exponential moving average of accepted / proposed, starting from a prior). With k
   proposals a slot emits 1 + a + a^2 + ... + a^k tokens in expectation: the j-th proposal
   counts only if all before it were kept, and the correction or bonus token always comes.
2. For a fixed number of verify tokens, the best split gives them out in order of marginal
   gain a_i^j, highest first; per slot these gains fall with j, so taking them greedily is
   optimal. A proposal whose gain is under `min_gain` is never made: tokens inside a bucket
   cost no step time, but each verify row still costs logits, sampling and host work.
3. The step's cost is the measured step time of its token bucket (decode rows, verify tokens
   and prompt tokens together). The policy tries each bucket from the one the step needs
   without speculation up to the largest, fills it greedily, and keeps the one with the most
   expected tokens per second. At high concurrency a bigger bucket costs more than the
   accepted tokens return, so speculation turns itself down; a slot whose estimate is low
   gets no proposals, because its gains never pay for the tokens.
   A draft model adds proposal_fixed + cap * proposal_time to a step that proposes up to cap
   tokens per slot (one draft program: a catch-up step, then cap - 1 decode steps), so the
   policy also tries each cap 1..K; a step with no proposals pays none of it.
4. A slot that got no proposals for `probe_every` steps gets one, if that fits the chosen
   bucket, so its estimate can recover when its text becomes predictable. Every other
   idle slot is probed in the same step, so probes share one draft program and stay in
   step; with a draft model the interval grows by (draft cost / step time), so probing
   costs about the same share of time whatever a proposal costs. Acceptance comes in
   stretches (code, quotes), so a slot that just stopped is probed sooner: after
   `probe_soon` steps, doubled by every verify in a row that kept nothing, up to the full
   interval; a kept proposal starts it over. Text that stays unpredictable thus costs a few
   early probes, then the full interval's share. Where proposals cost no more with depth
   (on the device, prompt lookup) a probe verifies as many as fit the bucket.
5. Step times come from warmup, on all-padding batches; a real step also pays host work
   (lowering, proposing, routing more tokens) that those miss and that grows with
   speculation. `observe_step` learns it online: a moving average of measured minus
   predicted seconds, kept apart for steps with and without proposals, added to the cost of
   each kind. Where speculating steps cost more than their accepted tokens return, the
   policy stops proposing (probes keep the estimate current).

With `always` (EngineConfig.spec_policy) none of this applies: every decoding slot verifies K
proposals, or what it has, while they fit the largest bucket. With `fit` as well (the gated
plan of spec_policy auto), every slot verifies up to one common depth c <= K: the c whose
expected tokens (1. above, from the slots' estimates) per second of its bucket's step time are
highest, so that at high concurrency the verify rows stay in a cheaper bucket when the deepest
proposals return less than the bigger bucket costs (on the random Qwen3-8B file at C32, K = 4
put 160 verify tokens in bucket 256, 9.9 ms a step at warmup, where K = 3 fits bucket 128,
8.5 ms, and keeps all but 2% of the expected tokens).

Shapes: none; slots are ints, times are seconds per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class _SlotStats:
    rate: float  # estimated per-proposal acceptance probability
    idle: int = 0  # steps since it last verified a proposal
    misses: int = 0  # verifies in a row that kept nothing


class SpecPolicy:
    """Per-step proposal counts from acceptance estimates and the step-time table.

    Args:
      max_proposals: K, the most proposals one slot verifies in a step.
      step_time: seconds of one step per token bucket (measured at warmup); its keys are the
        token buckets, ascending.
      prior: acceptance estimate of a new slot; smoothing: weight of the newest observation.
      probe_every: steps without proposals after which a slot gets one.
      probe_soon: the first probe's wait after a slot stops, doubled per verify in a row that
        kept nothing, up to the full interval (0: always the full interval).
      min_gain: smallest probability of acceptance worth a proposal (see the module note).
      proposal_time: seconds one more proposal depth costs (a draft model's decode step; 0
        for prompt lookup, whose proposals cost no device time); proposal_fixed: seconds any
        proposing step costs besides (the draft program's launch and host round trip).
      always: verify K proposals (or what a slot has) for every decoding slot while they fit
        the largest bucket, whatever the estimates (EngineConfig.spec_policy "always").
      fit: with always, the depth every slot verifies up to is the one with the most expected
        tokens per second of step time (take_all, given the slots' estimates).
    """

    def __init__(
        self,
        max_proposals: int,
        step_time: dict[int, float],
        prior: float = 0.5,
        smoothing: float = 0.3,
        probe_every: int = 16,
        probe_soon: int = 2,
        min_gain: float = 0.1,
        proposal_time: float = 0.0,
        proposal_fixed: float = 0.0,
        always: bool = False,
        fit: bool = False,
    ):
        if max_proposals < 1:
            raise ValueError(f"max_proposals must be >= 1: {max_proposals}")
        if not step_time or any(t <= 0 for t in step_time.values()):
            raise ValueError(f"step_time needs a positive time per bucket: {step_time}")
        if not 0 <= prior <= 1 or not 0 < smoothing <= 1:
            raise ValueError(f"prior in [0, 1] and smoothing in (0, 1]: {prior}, {smoothing}")
        self.k = max_proposals
        self.buckets = sorted(step_time)
        self.step_time = dict(step_time)
        self.prior, self.smoothing, self.probe_every = prior, smoothing, probe_every
        self.probe_soon = probe_soon
        self.min_gain = min_gain
        self.proposal_time, self.proposal_fixed = proposal_time, proposal_fixed
        self.always = always
        self.fit = fit and always
        draft = proposal_fixed + proposal_time
        self.probe_interval = round(probe_every * (1 + draft / min(step_time.values())))
        self._slots: dict[int, _SlotStats] = {}
        self.overhead = {False: 0.0, True: 0.0}  # learned seconds beyond the prediction
        # per step dispatched and not yet observed, in order: (predicted seconds, proposing?),
        # or None for a step without decode rows (nothing planned; with overlapped steps the
        # next plan comes before this step's observation)
        self._pending: deque[tuple[float, bool] | None] = deque()

    def start(self, slot: int) -> None:
        self._slots[slot] = _SlotStats(self.prior)

    def drop(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def rate(self, slot: int) -> float:
        return self._slots[slot].rate

    def observe(self, slot: int, proposed: int, accepted: int) -> None:
        """Record a verify result: `accepted` leading proposals of `proposed` were kept.

        Proposals after the first rejection were never tested, so the observation is the
        accepted ones plus the one rejection: accepted / (accepted + 1), or 1 if all were kept.
        """
        if proposed <= 0:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} of {proposed} proposals")
        s = self._slots[slot]
        tried = accepted + (accepted < proposed)
        s.rate += self.smoothing * (accepted / tried - s.rate)
        s.misses = 0 if accepted else s.misses + 1

    def expected_tokens(self, slot: int, k: int) -> float:
        """Tokens a slot emits in expectation when it verifies k proposals."""
        a = self._slots[slot].rate
        return 1.0 + sum(a**j for j in range(1, k + 1))

    def plan(self, available: dict[int, int], other_tokens: int = 0) -> dict[int, int]:
        """Proposals to verify per decoding slot this step.

        Args:
          available: decoding slot -> proposals its proposer can offer (<= K are used).
          other_tokens: prompt tokens the step carries besides the decode rows.
        Returns:
          slot -> proposals to verify (0: an ordinary decode row).
        """
        base = len(available) + other_tokens
        if self.always:
            return self._all(available, base)
        gains = sorted(
            (
                (g, j, s)
                for s, n in available.items()
                for j in range(1, min(n, self.k) + 1)
                if (g := self._slots[s].rate ** j) >= self.min_gain
            ),
            key=lambda g: -g[0],
        )  # a slot's gains fall with j, so its j-th comes after its (j-1)-th
        caps = range(1, self.k + 1) if self.proposal_time + self.proposal_fixed else [self.k]
        b0 = next((b for b in self.buckets if b >= base), self.buckets[-1])
        best, best_rate = [], len(available) / (self._predict(b0, 0) + self.overhead[False])
        for cap in caps:
            capped = [g for g in gains if g[1] <= cap]
            for b in self.buckets:
                if b < base:
                    continue
                extra = min(b - base, len(capped))
                cost = self._predict(b, cap if extra else 0) + self.overhead[extra > 0]
                rate = (len(available) + sum(g for g, _, _ in capped[:extra])) / cost
                if rate > best_rate + 1e-12:
                    best, best_rate = capped[:extra], rate
                if extra == len(capped):
                    break  # bigger buckets only cost more
        out = dict.fromkeys(available, 0)
        for _, _, s in best:
            out[s] += 1
        self._probe(out, available, base + len(best))
        for s in available:
            st = self._slots[s]
            st.idle = 0 if out[s] else st.idle + 1
        self._planned(base, out)
        return out

    def _all(self, available: dict[int, int], base: int) -> dict[int, int]:
        """The `always` plan: up to K per slot, in slot order, within the largest bucket."""
        room, out = self.buckets[-1] - base, {}
        for s, n in available.items():
            out[s] = max(min(n, self.k, room), 0)
            room -= out[s]
        self._planned(base, out)
        return out

    def take_all(self, caps: np.ndarray, base: int, rates: np.ndarray | None = None) -> np.ndarray:
        """`_all` on arrays, for proposals that need no host work (caps int32 [n], in row
        order): up to K per row within the largest bucket, and the plan noted. With `fit`
        and the rows' estimates (rates float [n]), up to the best common depth instead."""
        want = np.minimum(caps, self.k)
        if self.fit and rates is not None and want.any():
            want = np.minimum(want, self._best_depth(want, base, rates))
        room = self.buckets[-1] - base - (np.cumsum(want) - want)  # left before each row
        out = np.maximum(np.minimum(want, room), 0).astype(np.int32)
        self._note(base + int(out.sum()), int(out.max(initial=0)))
        return out

    def _best_depth(self, want: np.ndarray, base: int, rates: np.ndarray) -> int:
        """The depth c in 1..K whose plan (min(want, c) per row) has the most expected tokens
        per predicted second; the smallest such c on ties."""
        rows = np.arange(len(want))
        # expected[i, j]: tokens row i emits verifying j proposals, 1 + a + ... + a^j
        expected = np.cumsum(np.asarray(rates)[:, None] ** np.arange(self.k + 1), axis=1)
        best, best_rate = self.k, -1.0
        for c in range(1, self.k + 1):
            w = np.minimum(want, c)
            used = base + int(w.sum())
            bucket = next((b for b in self.buckets if b >= used), self.buckets[-1])
            rate = float(expected[rows, w].sum()) / self._predict(bucket, c)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = c, rate
        return best

    def _planned(self, base: int, out: dict[int, int]) -> None:
        self._note(base + sum(out.values()), max(out.values(), default=0))

    def _note(self, used: int, cap: int) -> None:
        """Note the predicted seconds of the step a plan makes (`used` tokens, up to `cap`
        proposals a row), for observe_step."""
        bucket = next((b for b in self.buckets if b >= used), self.buckets[-1])
        self._pending.append((self._predict(bucket, cap), cap > 0))

    def forget_last(self) -> None:
        """The step the last plan (or skip) was for was never launched."""
        if self._pending:
            self._pending.pop()

    def skip(self) -> None:
        """A step was dispatched without a plan (no decode rows): its observation teaches
        nothing."""
        self._pending.append(None)

    def _predict(self, bucket: int, cap: int) -> float:
        """Warmup-measured seconds of a step in `bucket` proposing up to `cap` per slot."""
        draft = self.proposal_fixed + cap * self.proposal_time if cap else 0.0
        return self.step_time[bucket] + draft

    def observe_step(self, seconds: float) -> None:
        """The measured duration of the oldest step not yet observed."""
        if not self._pending:
            return
        item = self._pending.popleft()
        if item is None:
            return
        predicted, proposing = item
        o = self.overhead
        o[proposing] += self.smoothing * (seconds - predicted - o[proposing])

    def _interval(self, s: _SlotStats) -> int:
        """Steps without proposals after which slot stats s are probed."""
        if not self.probe_soon:
            return self.probe_interval
        return min(self.probe_interval, self.probe_soon << min(s.misses, 16))

    def probe_due(self) -> bool:
        """Whether some idle slot will be probed within the next two plans."""
        return any(s.idle + 2 >= self._interval(s) for s in self._slots.values())

    def _probe(self, out: dict[int, int], available: dict[int, int], used: int) -> None:
        """When a slot is due, proposals for every idle slot, while the step stays in its
        bucket: one each, or as many as fit when depth costs nothing."""
        idle = [s for s, n in available.items() if out[s] == 0 and n > 0]
        if not any(self._slots[s].idle + 1 >= self._interval(self._slots[s]) for s in idle):
            return
        room = next((b for b in self.buckets if b >= used), used) - used
        for s in idle:
            n = min(available[s], self.k, room) if not self.proposal_time else min(1, room)
            if n <= 0:
                break
            out[s], room = n, room - n
