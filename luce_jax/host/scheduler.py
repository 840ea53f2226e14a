"""Model-agnostic scheduler: FIFO admission, step planning, routing of results, retirement.

Pure Python: it talks to a SeqEngine in slots and token counts only, and plans from the
engine's SlotTable, which counts the progress of every dispatched step.

Each call of `step()`:
  1. Admit from the head of the FIFO queue while the engine grants a slot and a KV
     reservation; the first "busy" stops admission (head-of-line blocking, so a large request
     at the head is never starved by small ones behind it). "failed" fails that request.
  2. Build a StepPlan: every slot that can decode (its prompt dispatched, max_tokens not
     reached by dispatched steps), then prefill slices, oldest request first, within the
     engine's StepLimits.
  3. Dispatch it. If dispatch raises, only the requests in that plan fail; their slots are
     retired and the scheduler goes on.
  4. Collect the previous step (the engine's `overlap`: the device runs step N+1 while the
     host reads step N's tokens), or this one when the engine cannot overlap (speculation)
     or nothing was dispatched. A step that failed on the device fails its live requests.
  5. Route tokens to requests through their OutputProcessor (text deltas, stop strings, EOS,
     max_tokens) and emit events. A speculating slot may return several tokens; they are
     routed in order, and those after the one that finishes the request are dropped.
  6. Retire every finished or cancelled request at once, so its slot and blocks are free for
     the next plan. A request that finished in step N may have had step N+1 computed for it;
     the engine drops that step's tokens for it (its slot's epoch moved on).
"""

from __future__ import annotations

import logging
import time
from collections import deque

from .request import Event, OutputProcessor, Request
from .seq_engine import StepFailed, StepPlan, StepResult, TokenOut

log = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


class Closed(Exception):
    """The engine takes no more requests: the server is shutting down."""


class Scheduler:
    def __init__(self, engine, tokenizer=None, max_queue: int = 256, coalesce_ms: float = 0.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eog = tokenizer.eog_ids if tokenizer is not None else frozenset()
        self.max_queue = max_queue
        self.coalesce_s = coalesce_ms / 1000.0
        self.queue: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request, in admission order
        self.steps = 0  # steps dispatched
        self.last_plan = None  # the plan of the last step()

    # -- requests -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"queue is full ({self.max_queue} requests waiting)")
        req.processor = OutputProcessor(req.sampling, self.tokenizer, self.eog)
        self.queue.append(req)

    def cancel(self, req: Request) -> None:
        """Cancel in any phase; a running request's slot is retired at once."""
        self._end(req, "cancelled")

    def fail(self, req: Request, error: str, retryable: bool = False) -> None:
        """Finish one queued or running request with `error`, retiring its slot."""
        self._end(req, "error", error=error, retryable=retryable)

    def fail_all(self, error: str) -> None:
        """Finish every queued and running request with `error`, retiring their slots."""
        for req in list(self.queue) + list(self.running.values()):
            self._end(req, "error", error=error)

    def _end(self, req: Request, reason: str, **why) -> None:
        """Take `req` out of the queue, or retire its slot, and finish it."""
        if req.done:
            return
        if req.phase == "queued":
            self.queue.remove(req)
        else:
            self._retire(req)
        self._finish(req, reason, **why)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running and not self.engine.in_flight

    def decoding(self, req: Request) -> bool:
        """The request's whole prompt is dispatched; its rows are decode rows."""
        return req.phase == "running" and self.engine.slots.decoding(req.slot)

    # -- one iteration ----------------------------------------------------------------------
    def step(self, now: float | None = None) -> bool:
        """Admit, plan, dispatch, collect and route. Returns False if there was nothing to do."""
        self._admit(time.monotonic() if now is None else now)
        plan = self.plan()
        self.last_plan = plan  # for the step log (host/step_log.py)
        planned = bool(plan.decode or plan.prefills)
        launched = planned and self._dispatch(plan)
        keep = 1 if launched and self.engine.overlap else 0
        collected = self.engine.in_flight > keep
        while self.engine.in_flight > keep:
            self._collect()
        return planned or collected

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
            req.slot, req.phase, req.cached_tokens = res.slot, "running", res.cached_tokens
            self.running[res.slot] = req

    def plan(self) -> StepPlan:
        slots = self.engine.slots
        decode = [s for s in self.running if slots.can_decode(s)]
        limits = self.engine.step_limits(len(decode))
        budget = limits.max_prefill_tokens_total
        prefills = []
        for slot in self.running:  # dicts keep admission order: oldest first
            left = slots.prefill_left(slot)
            if left <= 0 or budget <= 0:
                continue
            if len(prefills) >= limits.max_prefill_seqs:
                break
            n = min(left, limits.max_prefill_tokens_per_seq, budget)
            prefills.append((slot, n))
            budget -= n
        return StepPlan(decode, prefills)

    def _dispatch(self, plan: StepPlan) -> bool:
        try:
            self.engine.dispatch(plan)
        except Exception as e:  # a failed step fails only its own requests
            slots = plan.decode + [s for s, _ in plan.prefills]
            log.exception("engine step failed; failing %d requests", len(slots))
            self._fail(slots, f"engine step failed: {e}")
            return False
        self.steps += 1
        return True

    def _collect(self) -> None:
        try:
            result = self.engine.collect()
        except StepFailed as e:
            log.error("engine step failed on the device: %s; failing %d requests", e, len(e.slots))
            self._fail(e.slots, f"engine step failed: {e}")
            return
        self._route(result)

    def _fail(self, slots: list[int], error: str) -> None:
        for slot in slots:
            req = self.running.get(slot)
            if req is not None:
                self._retire(req)
                self._finish(req, "error", error=error)

    def _route(self, result: StepResult) -> None:
        for slot, toks in result.tokens.items():
            req = self.running[slot]  # the engine drops slots retired since the dispatch
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            self._deliver(req, toks)

    def _deliver(self, req: Request, toks: list[TokenOut]) -> None:
        """Route a step's tokens for one request (speculation may bring several) in one event;
        the first token that finishes it ends the request, and the event is its last."""
        texts, ids, reason = [], [], None
        for tok in toks:
            text, reason = req.processor.push(tok.token)
            texts.append(text)
            ids.append(tok.token)
            if reason is not None:
                break
        lp = ()
        if req.sampling.logprobs is not None:
            lp = tuple((t.logprob, t.top) for t in toks[: len(ids)])
        out = dict(text="".join(texts), token_ids=tuple(ids), logprobs=lp)
        if reason is None:
            req.emit(Event(**out))
            return
        self._retire(req)
        self._finish(req, reason, **out)

    def _retire(self, req: Request) -> None:
        if req.slot >= 0 and self.running.get(req.slot) is req:
            del self.running[req.slot]
            self.engine.retire(req.slot)

    def _finish(
        self, req: Request, reason: str, text="", token_ids=(), logprobs=(), error=None,
        retryable=False,
    ):  # fmt: skip
        req.finish_reason, req.error = reason, error
        req.phase = {"cancelled": "cancelled", "error": "failed"}.get(reason, "finished")
        req.emit(
            Event(
                text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                error=error, retryable=retryable,
            )
        )  # fmt: skip
