"""Model-agnostic scheduler: FIFO admission, step planning, routing of results, retirement.

Pure Python: it talks to a SeqEngine in slots and token counts only.

Each call of `step()`:
  1. Admit from the head of the FIFO queue while the engine grants a slot and a KV
     reservation; the first "busy" stops admission (head-of-line blocking, so a large request
     at the head is never starved by small ones behind it). "failed" fails that request.
  2. Build a StepPlan: every decoding slot once with its last token, then prefill slices,
     oldest request first, within the engine's StepLimits.
  3. Run `engine.step(plan)`. If it raises, only the requests in that plan fail; their slots
     are retired and the scheduler goes on.
  4. Route tokens to requests through their OutputProcessor (text deltas, stop strings, EOS,
     max_tokens) and emit events. A speculating slot may return several tokens; they are
     routed in order, and those after the one that finishes the request are dropped.
  5. Retire every finished or cancelled request before returning, so its slot and blocks are
     free for the next plan.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from .engine import StepPlan, StepResult, TokenOut
from .request import Event, OutputProcessor, Request

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, engine, tokenizer=None, max_queue: int = 256, coalesce_ms: float = 0.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eog = tokenizer.eog_ids if tokenizer is not None else frozenset()
        self.max_queue = max_queue
        self.coalesce_s = coalesce_ms / 1000.0
        self.queue: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request, in admission order
        self.steps = 0

    # -- requests -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"queue is full ({self.max_queue} requests waiting)")
        req.processor = OutputProcessor(req.sampling, self.tokenizer, self.eog)
        self.queue.append(req)

    def cancel(self, req: Request) -> None:
        """Cancel in any phase; a running request's slot is retired at once."""
        if req.done:
            return
        if req.phase == "queued":
            self.queue.remove(req)
        else:
            self._retire(req)
        self._finish(req, "cancelled")

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    # -- one iteration ----------------------------------------------------------------------
    def step(self, now: float | None = None) -> bool:
        """Admit, plan, run one engine step and route its results. Returns False if idle."""
        self._admit(time.monotonic() if now is None else now)
        plan = self.plan()
        if not plan.decode and not plan.prefills:
            return False
        in_plan = [self.running[s] for s, _ in plan.decode] + [
            self.running[s] for s, _ in plan.prefills
        ]
        try:
            result = self.engine.step(plan)
        except Exception as e:  # a failed step fails only its own requests
            log.exception("engine step failed; failing %d requests", len(in_plan))
            for req in in_plan:
                self._retire(req)
                self._finish(req, "error", error=f"engine step failed: {e}")
            return True
        self.steps += 1
        for slot, n in plan.prefills:
            if slot not in result.errors:
                self.running[slot].prefilled += n
        self._route(result)
        return True

    def _admit(self, now: float) -> None:
        if self.coalesce_s and not self.running and self.queue:
            if now - self.queue[0].arrival < self.coalesce_s:
                return  # let a burst arriving at an idle server start together
        while self.queue:
            req = self.queue[0]
            res = self.engine.admit(req.id, req.prompt, req.sampling)
            if res.status == "busy":
                return
            self.queue.popleft()
            if res.status == "failed":
                self._finish(req, "error", error=res.error)
                continue
            req.slot, req.phase = res.slot, "prefill"
            self.running[res.slot] = req

    def plan(self) -> StepPlan:
        decode = [
            (slot, r.output_ids[-1]) for slot, r in self.running.items() if r.phase == "decode"
        ]
        limits = self.engine.step_limits(len(decode))
        budget = limits.max_prefill_tokens_total
        prefills = []
        for slot, r in self.running.items():  # dicts keep admission order: oldest first
            if r.phase != "prefill" or budget <= 0:
                continue
            if len(prefills) >= limits.max_prefill_seqs:
                break
            left = len(r.prompt) - r.prefilled
            n = min(left, limits.max_prefill_tokens_per_seq, budget)
            prefills.append((slot, n))
            budget -= n
        return StepPlan(decode, prefills)

    def _route(self, result: StepResult) -> None:
        for slot, msg in result.errors.items():
            req = self.running[slot]
            self._retire(req)
            self._finish(req, "error", error=msg)
        for slot, tok in result.completed.items():
            req = self.running.get(slot)
            if req is not None:
                req.phase = "decode"
                req.first_token_time = time.monotonic()
                self._deliver(req, tok)
        for slot, toks in result.decoded.items():
            for tok in toks:  # speculation may bring several; stop at the first that ends it
                req = self.running.get(slot)
                if req is None or not self._deliver(req, tok):
                    break

    def _deliver(self, req: Request, tok: TokenOut) -> bool:
        """Route one token; False once the request is finished (and retired)."""
        req.output_ids.append(tok.token)
        text, reason = req.processor.push(tok.token)
        lp = ((tok.logprob, tok.top),) if req.sampling.logprobs is not None else ()
        if reason is None:
            req.emit(Event(text=text, token_ids=(tok.token,), logprobs=lp))
            return True
        self._retire(req)
        self._finish(req, reason, text=text, token_ids=(tok.token,), logprobs=lp)
        return False

    def _retire(self, req: Request) -> None:
        if req.slot >= 0 and self.running.get(req.slot) is req:
            del self.running[req.slot]
            self.engine.retire(req.slot)

    def _finish(self, req: Request, reason: str, text="", token_ids=(), logprobs=(), error=None):
        req.finish_reason, req.error = reason, error
        req.phase = {"cancelled": "cancelled", "error": "failed"}.get(reason, "finished")
        req.emit(
            Event(
                text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason, error=error
            )
        )
