"""The bridge between asyncio handlers and the engine thread: one bounded stream per request.

The engine thread never waits on a client: it hands each event to the event loop with
call_soon_threadsafe. A stream whose reader falls more than `max_buffer` bytes behind, or
leaves its events unread for `stall_s` seconds, is cancelled, so it cannot pin a slot. Only
time in which events wait unread counts as a stall: a request waiting in the queue or in a
long prefill, its reader waiting on it, is never a slow reader.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

from luce_jax.host.request import Event

log = logging.getLogger(__name__)

MAX_BUFFER = 1 << 20  # bytes of text a reader may fall behind
# A request's way to its first token, in order (perf_counter seconds in Stream.marks): the app
# received it, parsed its body, tokenized its prompt; it was submitted; the engine thread
# emitted its first token; the event loop read it; the SSE chunk was formed.
MARKS = ("received", "parsed", "tokenized", "submitted", "engine", "loop", "chunk")
STALL_S = 30.0  # seconds a reader may leave queued events unread


class Stream:
    """One request's events, written by the engine thread, read by one asyncio task."""

    def __init__(
        self,
        engine_loop,
        prompt: list[int],
        sampling,
        metrics=None,
        max_buffer=MAX_BUFFER,
        stall_s=STALL_S,
        max_waiting: int | None = None,
    ):
        self._engine = engine_loop
        self._aloop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._lock = threading.Lock()
        self._buffered = 0
        self._unread_since: float | None = None  # since when events wait unread (None: none)
        self._max_buffer, self._stall_s = max_buffer, stall_s
        self.slow_reader = False
        self.finished = False
        self.arrival = time.monotonic()
        self.marks: dict[str, float] = {}  # MARKS, as each happens (the app's are copied in)
        self.prompt_tokens = len(prompt)
        self._metrics = metrics
        self._last_token: float | None = None
        self.marks["submitted"] = time.perf_counter()  # before the engine thread can emit
        # Raises QueueFull before anything is counted or sent (the caller answers 429).
        self.req = engine_loop.submit(prompt, sampling, self._on_event, max_waiting)
        if metrics is not None:
            metrics.prompt_tokens.inc(len(prompt))

    @staticmethod
    def _size(ev) -> int:
        return len(ev.text.encode("utf-8")) + 16 * len(ev.token_ids) + 1

    def _observe(self, ev) -> None:
        """Latency metrics at the time the engine produced the event (not when it was read)."""
        m, t = self._metrics, time.monotonic()
        if ev.token_ids:
            if self._last_token is None:
                m.ttft.observe(t - self.arrival)
                m.recent_ttft.append((time.time(), t - self.arrival))
            else:
                m.itl.observe(t - self._last_token)
            self._last_token = t
            m.generation_tokens.inc(len(ev.token_ids))
        if ev.final:
            m.requests.labels(ev.finish_reason).inc()
            m.e2e.observe(t - self.arrival)

    @property
    def closed_by_server(self) -> bool:
        """The engine was closed (shutdown) while this request ran."""
        return self._engine.closed is not None

    def _on_event(self, ev) -> None:  # engine thread
        if ev.token_ids and "engine" not in self.marks:
            self.marks["engine"] = time.perf_counter()
        if self._metrics is not None:
            self._observe(ev)
        now = time.monotonic()
        with self._lock:
            if self._unread_since is None:
                self._unread_since = now
            self._buffered += self._size(ev)
            too_slow = self._buffered > self._max_buffer or now - self._unread_since > self._stall_s
        if too_slow and not ev.final and not self.slow_reader:
            self.slow_reader = True
            log.warning("request %s: reader too slow, cancelling", self.req.id)
            self._engine.cancel(self.req)
        self._aloop.call_soon_threadsafe(self._queue.put_nowait, ev)

    async def get(self, timeout: float | None = None):
        """Next event; raises TimeoutError if none comes within `timeout` seconds."""
        ev = await asyncio.wait_for(self._queue.get(), timeout)
        if ev.token_ids and "loop" not in self.marks:
            self.marks["loop"] = time.perf_counter()
        with self._lock:
            self._buffered -= self._size(ev)
            # the reader took an event: what still waits has waited from now on
            self._unread_since = time.monotonic() if self._buffered > 0 else None
        if ev.final:
            self.finished = True
        return ev

    def timeline(self) -> str:
        """The milliseconds between consecutive MARKS that happened, e.g. "received ->
        parsed 0.21, -> tokenized 1.30, ...", for a debug log of the first token's way."""
        at = [(k, self.marks[k]) for k in MARKS if k in self.marks]
        steps = [f"-> {k} {(t - p) * 1e3:.2f}" for (_, p), (k, t) in itertools.pairwise(at)]
        return " ".join([at[0][0], *steps]) if at else ""

    def abort(self, error: str) -> None:
        """End the stream for its reader now with `error` (the server is shutting down), and
        cancel the request; the engine's own final event, if it comes, is never read."""
        if not self.finished:
            self._aloop.call_soon_threadsafe(
                self._queue.put_nowait, Event(finish_reason="error", error=error)
            )
            self._engine.cancel(self.req)

    def cancel(self) -> None:
        """Cancel the request (client gone); its slot is free before the next step."""
        if not self.finished:
            self.finished = True
            self._engine.cancel(self.req)
