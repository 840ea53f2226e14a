"""The engine loop: a background thread that owns the scheduler and the engine.

Other threads talk to it only through `submit` and `cancel`, which enqueue commands; the loop
applies them between steps, so the scheduler and engine are never touched concurrently.

Each iteration:
  1. Apply pending submits and cancels (a cancel retires the slot before the next plan).
  2. If there is work, run one scheduler step (admit, plan, dispatch the next step, collect
     the previous one, route, retire; scheduler.py).
  3. If idle (no request and no step in flight), sleep until a command arrives (or the
     coalesce window ends).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from ..sampling_params import SamplingParams
from .request import Event, Request
from .scheduler import Closed, QueueFull, Scheduler

log = logging.getLogger(__name__)
RETRIES = 3  # loop iterations failing in a row before queued requests are failed too


class EngineLoop:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        # Submits not yet applied by the engine thread; counted with the scheduler's queue so
        # that admission sees every request it has let in (`waiting`).
        self._pending = 0
        self._pending_lock = threading.Lock()
        self.closed: str | None = None  # why submits are refused (close())
        self._thread = threading.Thread(target=self._run, name="luce-engine", daemon=True)
        self.step_listeners: list = []  # callables(seconds) told each step's duration
        self._failures = 0  # iterations failed in a row

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """The engine thread has not ended (stop() waits at most its timeout for it)."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    def waiting(self) -> int:
        """Requests submitted and not yet admitted: queued, or not yet seen by the loop."""
        return self._pending + len(self.scheduler.queue)

    def submit(
        self, prompt: list[int], sampling: SamplingParams, on_event, max_waiting: int | None = None
    ) -> Request:
        """Queue a request; `on_event(Event)` is called on the engine thread. Thread-safe.

        Raises:
          Closed: close() was called; nothing was submitted.
          QueueFull: `max_waiting` requests are already waiting; nothing was submitted. The
            check and the count are one step under a lock, so callers racing each other (a
            burst of HTTP requests) cannot overfill the queue between check and submit.
        """
        with self._pending_lock:
            if self.closed is not None:
                raise Closed(self.closed)
            if max_waiting is not None and self.waiting() >= max_waiting:
                raise QueueFull(f"queue is full ({max_waiting} requests waiting)")
            self._pending += 1
        req = Request(list(prompt), sampling, on_event)
        self._commands.put(("submit", req))
        return req

    def close(self, error: str) -> None:
        """Refuse new requests (Closed) and finish every request in flight with `error`, so
        their clients hear at once rather than when generation would have ended. Thread-safe;
        for a server shutting down."""
        with self._pending_lock:
            self.closed = error
        self._commands.put(("fail_all", error))

    def cancel(self, req: Request) -> None:
        """Thread-safe; the slot and its blocks are free before the next step."""
        self._commands.put(("cancel", req))

    def _apply(self, block: bool, timeout: float | None) -> None:
        try:
            cmd = self._commands.get(block=block, timeout=timeout)
        except queue.Empty:
            return
        while True:
            kind, req = cmd
            if kind == "submit":
                try:
                    self.scheduler.add(req)
                except QueueFull as e:
                    req.phase = "failed"
                    req.emit(Event(finish_reason="error", error=str(e)))
                finally:
                    with self._pending_lock:
                        self._pending -= 1
            elif kind == "cancel":
                self.scheduler.cancel(req)
            elif kind == "fail_all":
                self.scheduler.fail_all(req)  # req is the error message here
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        sched = self.scheduler
        while not self._stop.is_set():
            self._apply(block=sched.idle, timeout=None if sched.idle else 0)
            if self._stop.is_set():
                break
            t0 = time.perf_counter()
            try:
                worked = sched.step()
            except Exception as e:  # a bug, not a StepFailed: see _recover
                self._failures += 1
                self._recover(e)
                continue
            self._failures = 0
            if worked:
                dt = time.perf_counter() - t0
                for fn in self.step_listeners:
                    fn(dt)
            elif not sched.idle:
                time.sleep(0.001)  # waiting out the admission coalesce window

    def _recover(self, e: Exception) -> None:
        """After an exception escaped a scheduler step: the requests that held a slot fail
        with an error (the server answers 500); those still queued never ran and stay queued,
        unless iterations keep failing (RETRIES in a row), when they fail as retryable (503)
        so that no client waits on a loop that cannot recover. The loop goes on either way."""
        sched = self.scheduler
        log.exception("engine loop iteration failed (%d in a row)", self._failures)
        error = f"internal error in the engine loop: {type(e).__name__}: {e}"
        for req in list(sched.running.values()):
            try:
                sched.fail(req, error)
            except Exception:
                log.exception("failing request %s", req.id)
        if self._failures >= RETRIES:
            for req in list(sched.queue):
                sched.fail(req, error + " (not started; retry)", retryable=True)
