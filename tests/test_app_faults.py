"""Server behaviour under faults, against a fake engine: failed steps, full queue, slow reader."""

import asyncio
import time

import pytest
from starlette.testclient import TestClient

from luce_jax.config import EngineConfig
from luce_jax.loop import EngineLoop
from luce_jax.sampling_params import SamplingParams
from luce_jax.scheduler import Scheduler
from server.app import ServerState, create_app
from server.bridge import Stream

from fake_engine import FakeEngine


class ByteTokenizer:
    vocab_size = 256
    eog_ids = frozenset()
    token_bytes = [bytes([i]) for i in range(256)]

    def encode(self, text, add_special=True):
        return list(text.encode("latin-1", errors="replace"))

    def decode(self, ids, skip_special=True):
        return bytes(ids).decode("latin-1")

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        return "".join(m["content"] for m in messages)


class Handle:
    def __init__(self, engine, waiting=None):
        self.config = EngineConfig(max_ctx=64, max_queue=4)
        self.tokenizer = ByteTokenizer()
        self.vocab_size = 256
        self.engine = engine
        self.sched = Scheduler(engine, self.tokenizer)
        self.loop = EngineLoop(self.sched).start()
        self._waiting = waiting

    def running(self):
        return len(self.sched.running)

    def waiting(self):
        return self._waiting if self._waiting is not None else len(self.sched.queue)

    def blocks_used(self):
        return self.engine.pool.used

    def blocks_free(self):
        return self.engine.pool.available

    def compiles(self):
        return 0


def app_for(handle):
    state = ServerState(model_name="fake")
    state.engine = handle
    return TestClient(create_app(state))


def test_failed_step_fails_only_its_request_and_the_server_goes_on():
    eng = FakeEngine(slots=4, blocks=100, fail_on=lambda p: any(n == 7 for _, n in p.prefills))
    h = Handle(eng)
    try:
        c = app_for(h)
        r = c.post("/v1/completions", json={"prompt": "sevenxx", "max_tokens": 3})
        assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "fine", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert eng.pool.available == eng.pool.capacity
    finally:
        h.loop.stop()


def test_full_queue_answers_429_with_retry_after():
    h = Handle(FakeEngine(), waiting=4)
    try:
        r = app_for(h).post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "rate_limit"
    finally:
        h.loop.stop()


def test_sse_sends_keepalive_comments_while_waiting():
    eng = FakeEngine(delay=0.15)
    h = Handle(eng)
    try:
        state = ServerState(model_name="fake", keepalive_s=0.05)
        state.engine = h
        c = TestClient(create_app(state))
        body = {"prompt": "slow", "max_tokens": 2, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = list(r.iter_lines())
        lines = [x for x in lines if x]
        assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
    finally:
        h.loop.stop()


def test_loading_server_answers_503():
    c = TestClient(create_app(ServerState(model_name="fake")))
    assert c.get("/health").status_code == 503
    r = c.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 503 and r.headers["retry-after"]


@pytest.mark.parametrize("limit", ["bytes", "stall"])
def test_a_reader_too_far_behind_is_cancelled(limit):
    eng = FakeEngine(slots=2, blocks=400, max_context=1000)
    h = Handle(eng)

    async def main():
        kw = {"max_buffer": 64} if limit == "bytes" else {"stall_s": 0.0}
        s = Stream(h.loop, [1, 2, 3], SamplingParams(max_tokens=900), **kw)
        await asyncio.sleep(0.3)  # never read
        events = []
        while not events or not events[-1].final:
            events.append(await s.get(timeout=5))
        return s, events

    try:
        s, events = asyncio.run(main())
        assert s.slow_reader and events[-1].finish_reason == "cancelled"
        assert sum(len(e.token_ids) for e in events) < 900
        deadline = time.time() + 2
        while eng.state and time.time() < deadline:
            time.sleep(0.01)
        assert not eng.state and eng.pool.available == eng.pool.capacity
    finally:
        h.loop.stop()
