"""A SeqEngine with no model: deterministic tokens, a real KVPool and SlotTable, plan checks,
and steps collected one behind their dispatch (overlap) as the real engine's."""

import time
from collections import deque

from luce_jax.host.kv_pool import KVPool
from luce_jax.host.seq_engine import AdmitResult, StepFailed, StepLimits, StepResult, TokenOut
from luce_jax.host.slots import SlotTable
from luce_jax.step_format import GroupShape


class FakeEngine:
    def __init__(
        self,
        slots=4,
        blocks=32,
        block_size=4,
        max_context=64,
        chunk=8,
        budget=16,
        max_prefills=2,
        fail_on=None,
        fail_collect_on=None,
        delay=0.0,
        overlap=True,
    ):
        self.slot_count, self.max_context, self.block_size = slots, max_context, block_size
        self.slots = SlotTable(slots)
        self.pool = KVPool([GroupShape(blocks + 1, block_size, -(-max_context // block_size))])
        self.chunk, self.budget, self.max_prefills = chunk, budget, max_prefills
        self.plans = []
        self.fail_on = fail_on  # callable(plan) -> bool: raise in dispatch
        self.fail_collect_on = fail_collect_on  # callable(plan) -> bool: the step fails later
        self.delay = delay  # seconds each step takes
        self.overlap = overlap
        self._launched = deque()  # (plan, [(slot, token, epoch)])

    @property
    def in_flight(self):
        return len(self._launched)

    def admit(self, request_id, prompt, sampling):
        need = len(prompt) + sampling.max_tokens
        if need > self.max_context or not self.pool.fits_ever(need):
            return AdmitResult("failed", error="too long")
        slot = self.slots.lowest_free()
        if slot is None or not self.pool.reserve(slot, need):
            return AdmitResult("busy")
        self.slots.claim(slot, prompt, sampling)
        return AdmitResult("admitted", slot)

    def step_limits(self, n_decode):
        return StepLimits(self.max_prefills, self.chunk, self.budget - n_decode)

    def dispatch(self, plan):
        self.plans.append(plan)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on and self.fail_on(plan):
            raise RuntimeError("injected failure")
        sl, out = self.slots, []
        for slot in plan.decode:
            assert sl.can_decode(slot), "decode before prefill finished, or past max_tokens"
            self.pool.ensure(slot, int(sl.kv_len([slot])[0]) + 1)
            sl.generated[slot] += 1
            out.append((slot, 100 + int(sl.generated[slot])))
        for slot, n in plan.prefills:
            assert 0 < n <= sl.prefill_left(slot)
            sl.prefilled[slot] += n
            self.pool.ensure(slot, int(sl.prefilled[slot]))
            if sl.decoding(slot):
                sl.generated[slot] = 1
                out.append((slot, 101))
        rows = [(s, t, int(sl.epoch[s])) for s, t in out]
        rows += [(s, None, int(sl.epoch[s])) for s, _ in plan.prefills if not sl.decoding(s)]
        self._launched.append((plan, rows))

    def collect(self):
        plan, rows = self._launched.popleft()
        live = [(s, t) for s, t, e in rows if self.slots.epoch[s] == e]
        if self.fail_collect_on and self.fail_collect_on(plan):
            raise StepFailed([s for s, _ in live], RuntimeError("injected device failure"))
        return StepResult({s: [TokenOut(t)] for s, t in live if t is not None})

    def live_slots(self):
        return {s for s in range(self.slot_count) if self.slots.live(s)}

    def retire(self, slot):
        if self.slots.live(slot):
            self.slots.release(slot)
        self.pool.release(slot)
