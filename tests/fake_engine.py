"""A SeqEngine with no model: deterministic tokens, a real KVPool, and plan checks."""

import time

from luce_jax.engine import AdmitResult, StepLimits, StepResult, TokenOut
from luce_jax.kv_pool import KVPool


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
        delay=0.0,
    ):
        self.slot_count, self.max_context, self.block_size = slots, max_context, block_size
        self.pool = KVPool(blocks + 1, block_size)
        self.chunk, self.budget, self.max_prefills = chunk, budget, max_prefills
        self.state = {}  # slot -> dict(prompt, prefilled, generated)
        self.plans = []
        self.fail_on = fail_on  # callable(plan) -> bool: raise in step
        self.delay = delay  # seconds each step takes

    def admit(self, request_id, prompt, sampling):
        need = len(prompt) + sampling.max_tokens
        if need > self.max_context or self.pool.blocks_for(need) > self.pool.capacity:
            return AdmitResult("failed", error="too long")
        free = [s for s in range(self.slot_count) if s not in self.state]
        if not free or not self.pool.reserve(free[0], need):
            return AdmitResult("busy")
        self.state[free[0]] = {"prompt": prompt, "prefilled": 0, "generated": 0}
        return AdmitResult("admitted", free[0])

    def step_limits(self, n_decode):
        return StepLimits(self.max_prefills, self.chunk, self.budget - n_decode)

    def step(self, plan):
        self.plans.append(plan)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_on and self.fail_on(plan):
            raise RuntimeError("injected failure")
        res = StepResult()
        for slot, _ in plan.decode:
            st = self.state[slot]
            assert st["prefilled"] == len(st["prompt"]), "decode before prefill finished"
            self.pool.ensure(slot, st["prefilled"] + st["generated"])
            st["generated"] += 1
            res.decoded[slot] = [TokenOut(100 + st["generated"])]
        for slot, n in plan.prefills:
            st = self.state[slot]
            st["prefilled"] += n
            assert st["prefilled"] <= len(st["prompt"])
            self.pool.ensure(slot, st["prefilled"])
            if st["prefilled"] == len(st["prompt"]):
                st["generated"] = 1
                res.completed[slot] = TokenOut(101)
            else:
                res.advanced.add(slot)
        return res

    def retire(self, slot):
        self.state.pop(slot, None)
        self.pool.release(slot)
