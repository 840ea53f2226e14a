"""Draft-model proposals: a small model with its own paged KV, slots mirrored 1:1 (Proposer).

The draft runs on a second Runner and KVPool of the same design as the target's. Slot s of
the draft holds the same sequence as slot s of the target, fed lazily: each `propose` call
first runs one batched catch-up step that feeds every slot the tokens its draft cache lacks
(prompt chunks while the target prefills, then the one or two tokens the last verify
emitted), then K - 1 batched decode steps for the slots that speculate. Proposals are the
draft's greedy tokens, so they are deterministic and the target's verification is exact
(see runner._step_fn).

Rollback: the draft fed its own proposals past the sequence; when the target's verdict
arrives (`extend`) the draft keeps only the fed tokens that match what was accepted, by
shortening its fed length. Blocks stay claimed (the reservation covers the whole sequence).
"""

from __future__ import annotations

import logging

from .batch import Row, pick_bucket
from .kv_pool import KVPool
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)


class DraftProposer:
    """Proposer over a draft Runner.

    Args:
      runner: a warmed runner.Runner of the draft model (max_proposals 0).
      num_blocks: blocks of its pool (sink included), as the runner's KV was built with.
      block_size, max_slots, max_blocks_per_seq: as the target engine's.
      token_buckets: the draft runner's warmed token buckets; rows_for: T -> row bucket.
      chunk: prompt tokens one slot feeds per catch-up step.
    """

    def __init__(
        self, runner, num_blocks, block_size, max_slots, max_blocks_per_seq, token_buckets,
        rows_for, chunk,
    ):  # fmt: skip
        self.runner = runner
        self.pool = KVPool(num_blocks, block_size, max_slots, max_blocks_per_seq)
        self.token_buckets, self.rows_for, self.chunk = token_buckets, rows_for, chunk
        self.seq: dict[int, list[int]] = {}  # slot -> prompt + accepted output
        self.fed: dict[int, int] = {}  # tokens of seq in the draft cache
        self.ahead: dict[int, list[int]] = {}  # proposals fed past seq, pending the verdict

    def start(self, slot: int, prompt: list[int], max_len: int) -> None:
        self.drop(slot)
        if not self.pool.reserve(slot, max_len):  # no room: the slot just never speculates
            log.debug("draft pool full; slot %d will not speculate", slot)
            return
        self.seq[slot], self.fed[slot], self.ahead[slot] = list(prompt), 0, []

    def drop(self, slot: int) -> None:
        self.pool.release(slot)
        for d in (self.seq, self.fed, self.ahead):
            d.pop(slot, None)

    def extend(self, slot: int, tokens: list[int]) -> None:
        if slot not in self.seq:
            return
        ahead = self.ahead[slot]
        if ahead:  # the cache holds seq + ahead: keep the fed proposals the verdict kept
            keep = 0
            while keep < min(len(ahead), len(tokens)) and ahead[keep] == tokens[keep]:
                keep += 1
            self.fed[slot] = len(self.seq[slot]) + keep
            self.ahead[slot] = []
        self.seq[slot].extend(tokens)

    def available(self, want: dict[int, int]) -> dict[int, int]:
        """Slots whose catch-up fits one step can take all they want; others none yet."""
        return {
            s: k if s in self.seq and len(self.seq[s]) - self.fed[s] <= self.chunk else 0
            for s, k in want.items()
        }

    def propose(self, want: dict[int, int]) -> dict[int, list[int]]:
        props: dict[int, list[int]] = {}
        budget = self.token_buckets[-1]
        rows = []
        # Speculating slots first: their catch-up is a token or two; then prompt chunks.
        order = sorted(self.seq, key=lambda s: want.get(s, 0) == 0)
        for s in order:
            pending = len(self.seq[s]) - self.fed[s]
            n = min(pending, self.chunk, budget)
            if n <= 0 or len(rows) == self.runner.max_slots:
                continue
            sample = n == pending and want.get(s, 0) > 0
            rows.append(
                Row(s, tuple(self.seq[s][self.fed[s] : self.fed[s] + n]), self.fed[s], sample)
            )
            budget -= n
        out = self._run(rows)
        for r in rows:
            self.fed[r.slot] += len(r.tokens)
            if r.sample:
                props[r.slot] = [out[r.slot]]
        for depth in range(2, max(want.values(), default=0) + 1):
            rows = [
                Row(s, (p[-1],), self.fed[s], True) for s, p in props.items() if want[s] >= depth
            ]
            if not rows:
                break
            out = self._run(rows)
            for r in rows:
                self.fed[r.slot] += 1
                self.ahead[r.slot].append(r.tokens[0])
                props[r.slot].append(out[r.slot])
        return props

    def _run(self, rows: list[Row]) -> dict[int, int]:
        """One greedy draft step; returns slot -> sampled token for rows that sample."""
        if not rows:
            return {}
        for r in rows:
            self.pool.ensure(r.slot, r.start + len(r.tokens))
        t = pick_bucket(sum(len(r.tokens) for r in rows), self.token_buckets)
        sampling = [GREEDY if r.sample else None for r in rows]
        zeros = [0] * len(rows)
        res = self.runner.run(
            rows, self.pool.block_array, t, self.rows_for(t), sampling, zeros, zeros
        )
        return {r.slot: int(res["tokens"][i]) for i, r in enumerate(rows) if r.sample}
