"""Speculation in the engine: per step, which decoding slots verify which proposals (no jax).

The engine asks `choose` once per step, before it builds rows, and reports each verify row's
outcome to `record`:
  1. Cap each decoding slot's proposals by K and by its remaining max_tokens, so a verify
     row never writes KV past the slot's reservation or emits past max_tokens.
  2. Ask the proposer how many it can offer (prompt lookup: the continuation it found; draft
     model: K once the draft has caught up with the slot's sequence; draft head: K, kept on
     the device by the slot's last step).
  3. Let SpecPolicy pick counts per slot for the best expected tokens per second over the
     token buckets, then fetch that many proposals (a draft model runs its steps here).
  4. After the step, `record` feeds acceptance back to the policy, the accepted tokens to
     the proposer (which rolls back anything it assumed past them), and the counters;
     `step_done` tells the policy what the step really cost, and the gate (gate.py, policy
     auto with proposals on the device) what it served. While the gate has speculation off,
     every slot's cap is 0 and nothing proposes.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .gate import SpecGate
from .policy import SpecPolicy


class Speculator:
    """A Proposer, a SpecPolicy and the counters /metrics and the trace read.

    Args:
      proposer: ngram.NgramProposer or on_device.OnDeviceProposer.
      policy: SpecPolicy over the engine's token buckets.
      mode: EngineConfig.spec_mode (reported in metrics).
      gate: a gate.SpecGate that turns speculation off while it measures slower, or None.
    """

    def __init__(self, proposer, policy: SpecPolicy, mode: str, gate: SpecGate | None = None):
        self.proposer, self.policy, self.mode, self.gate = proposer, policy, mode, gate
        self.k = policy.k
        self.proposed = 0  # proposals verified, all steps
        self.accepted = 0  # of those, kept
        self.verify_rows = 0  # rows that verified at least one proposal
        self.accept_lengths: Counter[int] = Counter()  # kept proposals per verify row
        self.last: dict[int, tuple[int, int]] = {}  # slot -> (proposed, accepted), last step
        self.proposing = False  # the last step verified proposals

    def start(self, slot: int, req) -> None:
        """A request admitted to `slot` (host/slot_owner.Admission)."""
        self.proposer.start(slot, req.prompt, req.need)
        self.policy.start(slot)

    def release(self, slot: int) -> None:
        self.proposer.drop(slot)
        self.policy.drop(slot)

    def choose(self, caps: dict[int, int], other_tokens: int) -> dict[int, list[int]]:
        """Proposals to verify per decoding slot this step.

        Args:
          caps: decoding slot -> most proposals it may take (K, or fewer near max_tokens).
          other_tokens: prompt tokens the step carries besides the decode rows.
        Returns:
          slot -> proposed tokens (empty: an ordinary decode row).
        """
        self.last = {}
        self.proposing = False
        if not caps:
            self.policy.skip()
            return {}
        if self.gate is not None and not self.gate.on:
            caps = dict.fromkeys(caps, 0)
        available = self.proposer.available(caps)
        counts = self.policy.plan(available, other_tokens)
        self.proposing = any(counts.values())
        props = self.proposer.propose(counts)
        return {s: list(props.get(s, ()))[: counts[s]] for s in caps}

    def rows(self, dec: np.ndarray, left: np.ndarray, prompt_tokens: int) -> tuple:
        """Proposals for a step's decode rows.

        Args:
          dec: int32 [n] the decoding slots, in row order; left: int [n] tokens each may
            still emit past its next one; prompt_tokens: tokens the step carries besides.
        Returns:
          (n_draft int32 [n], the proposals per row as lists, or None where the device holds
          them: the rows then carry markers, step_format.marker_rows).
        """
        if not len(dec):
            self.choose({}, prompt_tokens)  # keeps the policy's plans and steps in step
            return np.zeros(0, np.int32), None
        caps = np.maximum(np.minimum(left, self.k), 0).astype(np.int32)  # np.clip is slower
        if self.counts_only:  # every cap taken as far as the bucket allows: no dicts
            return self.counts(dec, caps, prompt_tokens), None
        chosen = self.choose(dict(zip(dec.tolist(), caps.tolist(), strict=True)), prompt_tokens)
        props = [chosen[s] for s in dec.tolist()]
        return np.fromiter(map(len, props), np.int32, len(dec)), props

    @property
    def counts_only(self) -> bool:
        """Whether `counts` may stand for `choose`: the device holds the proposals and the
        plan takes every cap (policy always)."""
        return getattr(self.proposer, "on_device", False) and self.policy.always

    def counts(self, slots: np.ndarray, caps: np.ndarray, other_tokens: int) -> np.ndarray:
        """`choose` for proposals held on the device under the always plan, on arrays: caps
        int32 [n] of the decoding rows' slots (non-empty) -> proposals each verifies, int32 [n]
        (the rows carry markers, not tokens)."""
        assert self.counts_only and len(caps), "device proposals, always, some rows"
        self.last = {}
        if self.gate is not None and not self.gate.on:
            caps = np.zeros_like(caps)
        rates = None
        if self.policy.fit and caps.any():  # the rows' estimates, only where a depth is chosen
            rates = np.fromiter(map(self.policy.rate, slots.tolist()), np.float64, len(slots))
        counts = self.policy.take_all(caps, len(caps) + other_tokens, rates)
        self.proposing = bool(counts.any())
        return counts

    def wants_proposals(self, new_decoders: bool) -> bool:
        """Whether the next step may verify proposals, so that this one should make them (a
        draft head runs in the step before): it verified some, a probe is due, or slots
        start decoding (new_decoders), whose estimates are the prior's; never while the gate
        keeps speculation off, unless it turns it on within two steps."""
        if self.gate is not None and not self.gate.on_soon:
            return False
        return new_decoders or self.proposing or self.policy.probe_due()

    def record(self, slot: int, proposed: int, accepted: int, tokens: list[int]) -> None:
        """A row's outcome: the tokens it emitted, in order (proposed 0: a decode row, or the
        first token when a prompt completes)."""
        self.proposer.extend(slot, tokens)
        if proposed:
            self.policy.observe(slot, proposed, accepted)
            self.proposed += proposed
            self.accepted += accepted
            self.verify_rows += 1
            self.accept_lengths[accepted] += 1
            self.last[slot] = (proposed, accepted)

    def step_done(self, seconds: float, tokens: int, rows: int) -> None:
        """The oldest unobserved step's measured seconds (host/engine.py: from its dispatch to
        its results, or with overlapped steps from the results before it), and the tokens its
        `rows` sampled rows emitted."""
        self.policy.observe_step(seconds)
        if self.gate is not None:
            self.gate.observe(tokens, rows, seconds)

    def stats(self) -> dict:
        """Totals for /metrics: proposed, accepted, verify rows, accept-length counts."""
        return {
            "mode": self.mode,
            "max_proposals": self.k,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "verify_rows": self.verify_rows,
            "accept_lengths": dict(self.accept_lengths),
            "active": self.gate.on if self.gate is not None else True,
        }
