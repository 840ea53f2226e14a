"""What real clients met: /tokenize of chat messages, the slow-reader clock, a failing engine
loop, the API key, OpenAI's shapes for models and errors, and tools without xgrammar. Against
the fake engine (tests/fake_engine.py), through the app as a client sees it."""

import asyncio
import sys

import pytest
from starlette.testclient import TestClient

from luce_jax.host.scheduler import Scheduler
from luce_jax.sampling_params import SamplingParams
from server.app import ServerState, create_app
from server.bridge import Stream

from fake_engine import FakeEngine
from test_app_faults import Handle, app_for


@pytest.fixture
def handle():
    h = Handle(FakeEngine())
    yield h
    h.loop.stop()


def test_tokenize_renders_chat_messages_as_a_chat_request_does(handle):
    c = app_for(handle)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    r = c.post("/tokenize", json={"messages": msgs})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == list(b"hiyo") and r.json()["count"] == 4
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = c.post("/tokenize", json={"messages": msgs, "tools": tools})
    assert r.status_code == 200 and r.json()["count"] == 4
    r = c.post("/tokenize", json={"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_request_that_waits_longer_than_the_stall_limit_is_not_a_slow_reader():
    """Time in the queue or in a long prefill, its reader polling, is no stall: only output the
    server holds and the client does not take counts."""
    h = Handle(FakeEngine(delay=0.05))

    async def main():
        s = Stream(h.loop, [1, 2, 3], SamplingParams(max_tokens=6), stall_s=0.1)
        events = []
        while not events or not events[-1].final:
            try:
                events.append(await s.get(timeout=0.02))  # a poll that times out, as SSE's
            except TimeoutError:
                pass
        return s, events

    h.sched.step = _slowed(h.sched.step, first=0.4)  # the first step: longer than stall_s
    try:
        s, events = asyncio.run(main())
    finally:
        h.loop.stop()
    assert not s.slow_reader and events[-1].finish_reason == "length"
    assert sum(len(e.token_ids) for e in events) == 6


def _slowed(step, first):
    import time

    calls = []

    def slow(*a, **k):
        if not calls:
            time.sleep(first)
        calls.append(1)
        return step(*a, **k)

    return slow


def test_a_slow_reader_gets_an_error_not_a_cancelled_finish_reason():
    """finish_reason "cancelled" is not OpenAI's: a request the server ends early is an
    error (an error event on a stream, a 500 otherwise)."""
    eng = FakeEngine(slots=2, blocks=400, max_context=1000)
    h = Handle(eng)
    state = ServerState(model_name="fake")
    state.engine = h
    from server import generation

    real = generation.Stream

    def stalling(*a, **k):  # every event counts as left unread
        return real(*a, **{**k, "stall_s": 0.0})

    generation.Stream = stalling
    try:
        c = TestClient(create_app(state))
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 900})
        assert r.status_code == 500 and "unread" in r.json()["error"]["message"]
        body = {"prompt": "x", "max_tokens": 900, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: {")]
        assert '"error"' in lines[-1] and "cancelled" not in "".join(lines[:-1])
    finally:
        generation.Stream = real
        h.loop.stop()


class Broken(Exception):
    pass


def test_an_engine_loop_exception_fails_its_requests_with_500_and_serving_goes_on():
    """A bug escaping Scheduler.step (not a StepFailed): requests that held a slot get a 500,
    requests still queued are not harmed, and the next request is served."""
    eng = FakeEngine(slots=1, delay=0.02)
    h = Handle(eng, max_queue=8)
    step, armed = h.sched.step, []

    def breaking(*a, **k):
        if armed and h.sched.running:
            armed.clear()
            raise Broken("a bug")
        return step(*a, **k)

    h.sched.step = breaking
    c = app_for(h)
    from concurrent.futures import ThreadPoolExecutor

    try:
        armed.append(1)
        with ThreadPoolExecutor(3) as ex:
            rs = list(ex.map(lambda i: c.post("/v1/completions",
                                                json={"prompt": f"p{i}", "max_tokens": 4}),
                             range(3)))  # fmt: skip
        codes = sorted(r.status_code for r in rs)
        assert codes == [200, 200, 500], [r.text for r in rs]
        err = next(r for r in rs if r.status_code == 500).json()["error"]
        assert "Broken" in err["message"] and err["type"] == "server_error"
        assert c.post("/v1/completions", json={"prompt": "z", "max_tokens": 2}).status_code == 200
        assert eng.pool.available == eng.pool.capacity and not h.sched.running
    finally:
        h.loop.stop()


def test_a_loop_that_keeps_failing_fails_queued_requests_with_503():
    from luce_jax.host.loop import RETRIES

    h = Handle(FakeEngine(slots=1), max_queue=8)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise Broken("always")

    h.sched.step = broken
    try:
        r = app_for(h).post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert "retry" in r.json()["error"]["message"] and len(calls) >= RETRIES
    finally:
        h.loop.stop()


@pytest.fixture
def keyed(handle):
    state = ServerState(model_name="fake", api_key="s3cret")
    state.engine = handle
    return state


def test_an_api_key_guards_the_api_and_leaves_health_open(keyed):
    c = TestClient(create_app(keyed))
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = c.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/models/fake"):
        assert c.get(path).status_code == 401
    assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
    assert c.post("/detokenize", json={"tokens": [65]}).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    assert c.post("/v1/completions", json=body, headers=auth).status_code == 200
    assert c.get("/health").status_code == 200
    assert c.get("/metrics").status_code == 401  # the test client is not a loopback client
    assert c.get("/metrics", headers=auth).status_code == 200
    local = TestClient(create_app(keyed), client=("127.0.0.1", 5000))
    assert local.get("/metrics").status_code == 200


def test_models_retrieve_and_an_unknown_model_id():
    import openai

    state = ServerState(model_name="org/fake-1")
    h = Handle(FakeEngine())
    state.engine = h
    try:
        http = TestClient(create_app(state), base_url="http://testserver")
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        m = client.models.retrieve("org/fake-1")
        assert m.id == "org/fake-1" and m.object == "model"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")
    finally:
        h.loop.stop()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": {}}, "tools"),
        ({"max_tokens": 3, "max_completion_tokens": 3}, "max_completion_tokens"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema"),
    ],
)  # fmt: skip
def test_conflicting_or_empty_fields_are_a_400_naming_the_field(handle, body, param):
    msgs = [{"role": "user", "content": "hi"}]
    r = app_for(handle).post("/v1/chat/completions", json={"messages": msgs, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_tools_are_accepted_without_xgrammar_unless_a_grammar_forces_a_call(handle, monkeypatch):
    """Agent frameworks send tools on every request: auto and none need no grammar, so the
    plain install (no structured extra) takes them; required and a named function say what
    to install."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar raises ImportError
    c = app_for(handle)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "hi"}]
    for choice in ("auto", "none", None):
        body = {"messages": msgs, "tools": [tool], "max_tokens": 2}
        if choice:
            body["tool_choice"] = choice
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named):
        body = {"messages": msgs, "tools": [tool], "tool_choice": choice}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "structured" in r.json()["error"]["message"]


def test_a_loading_server_asks_health_pollers_to_retry():
    c = TestClient(create_app(ServerState(model_name="fake")))
    r = c.get("/health")
    assert r.status_code == 503 and r.headers["retry-after"]


def test_scheduler_fail_retires_a_running_request():
    eng = FakeEngine()
    sched = Scheduler(eng)
    from luce_jax.host.request import Request

    got = []
    req = Request([1, 2], SamplingParams(max_tokens=3), got.append)
    sched.add(req)
    sched.step()
    sched.fail(req, "boom")
    assert req.phase == "failed" and got[-1].error == "boom" and not sched.running
