"""Draft-model proposals on the host's side, for hybrid targets: a small model with its own
paged KV, slots mirrored 1:1 (Proposer). A dense target runs its draft inside its own step
instead (device/draft_model.py); a hybrid one needs the proposals a verify row kept fed again
to its slot's state, which the host arranges.

The draft runs on a DraftRunner (draft_runner.py) and a KVPool of the same design as the
target's. Slot s of the draft holds the same sequence as slot s of the target, fed lazily: each
`propose` call that wants proposals runs one program that feeds every slot the tokens
its draft cache lacks (prompt chunks, then the one or two tokens the last verify emitted)
and then up to K - 1 batched decode steps on the device, so K proposals cost one host round
trip. Proposals are sampled with the noise the target's rows will use (draft_runner.py), so
the target keeps a proposal only when it is the token it samples itself, and its output is
the one without speculation (see device/sampling.sample_rows).

Rollback: the draft fed its own proposals past the sequence; when the target's verdict
arrives (`extend`) the draft keeps only the fed tokens that match what was accepted, by
shortening its fed length. Blocks stay claimed (the reservation covers the whole sequence).
"""

from __future__ import annotations

import logging

import numpy as np

from ..host.kv_pool import KVPool
from ..step_format import Row, pick_bucket

log = logging.getLogger(__name__)


class DraftProposer:
    """Proposer over a draft Runner.

    Args:
      runner: a warmed draft_runner.DraftRunner of the draft model.
      max_slots: as the target engine's (its pool's shape is the runner's).
      token_buckets: the draft runner's warmed token buckets; rows_for: T -> row bucket.
      chunk: prompt tokens one slot feeds per catch-up step.
      slots: the target engine's SlotTable, whose sampling parameters, seeds and progress the
        proposals are sampled with (None: greedy proposals).
    """

    def __init__(
        self, runner, max_slots, token_buckets, rows_for, chunk, slots=None,
    ):  # fmt: skip
        self.runner, self.slots = runner, slots
        self.pool = KVPool([runner.shape], max_slots)
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
        """Every mirrored slot can take what it wants; one whose backlog exceeds a chunk gets
        fed a chunk instead, and its proposals come in a later step."""
        return {s: k if s in self.seq else 0 for s, k in want.items()}

    def propose(self, want: dict[int, int]) -> dict[int, list[int]]:
        props: dict[int, list[int]] = {}
        if not any(k > 0 for k in want.values()):
            # Nothing to propose: no draft step at all (a step costs about as much host time as
            # the target's). Catch-up waits for the next step that speculates.
            return props
        budget, rows, wants = self.token_buckets[-1], [], []
        # Speculating slots first: their catch-up is a token or two; then prompt chunks.
        for s in sorted(self.seq, key=lambda s: want.get(s, 0) == 0):
            pending = len(self.seq[s]) - self.fed[s]
            n = min(pending, self.chunk, budget)
            if n <= 0 or len(rows) == self.runner.max_slots:
                continue
            k = want.get(s, 0) if n == pending else 0
            start = self.fed[s]
            rows.append(Row(s, tuple(self.seq[s][start : start + n]), start, k > 0))
            wants.append(k)
            # Blocks for the catch-up and for the proposals fed after it (k - 1 of them).
            self.pool.ensure(s, start + n + max(k - 1, 0))
            budget -= n
        if not rows:
            return props
        t = pick_bucket(sum(len(r.tokens) for r in rows), self.token_buckets)
        S, sampling = self.rows_for(t), None
        if self.slots is not None:  # speculation collects every step: `generated` is exact
            ids = np.array([r.slot for r in rows], np.int32)
            starts = np.array([r.start for r in rows], np.int32)
            sampling = self.slots.row_inputs(ids, starts, np.array(wants) > 0, S)
        out = self.runner.propose(rows, self.pool.block_array, t, S, wants,
                                  sampling_rows=sampling)  # fmt: skip
        for i, (r, k) in enumerate(zip(rows, wants, strict=True)):
            self.fed[r.slot] += len(r.tokens)
            if k:
                props[r.slot] = out[i, :k].tolist()
                self.ahead[r.slot] = props[r.slot][:-1]  # fed after the catch-up
                self.fed[r.slot] += k - 1
        return props
