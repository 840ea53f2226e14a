"""Server behaviour under faults, against a fake engine: failed steps, full queue, slow reader."""

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from starlette.testclient import TestClient

from luce_jax.config import EngineConfig
from luce_jax.host.loop import EngineLoop
from luce_jax.host.request import Event
from luce_jax.host.scheduler import QueueFull, Scheduler
from luce_jax.sampling_params import SamplingParams
from server.app import ServerState, create_app
from server.bridge import Stream

from fake_engine import FakeEngine


class ByteTokenizer:
    vocab_size = 256
    chat_template = None
    eog_ids = frozenset()
    token_bytes = [bytes([i]) for i in range(256)]

    def encode(self, text, add_special=True):
        return list(text.encode("latin-1", errors="replace"))

    def decode(self, ids, skip_special=True):
        return bytes(ids).decode("latin-1")

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        return "".join(m["content"] for m in messages)


class Handle:
    def __init__(self, engine, spec=None, max_queue=4, start=True):
        self.config = EngineConfig(max_ctx=64, max_queue=max_queue)
        self.tokenizer = ByteTokenizer()
        self.vocab_size = 256
        self.engine = engine
        self.sched = Scheduler(engine, self.tokenizer, max_queue=max_queue)
        self.loop = EngineLoop(self.sched)
        if start:
            self.loop.start()
        self._spec = spec

    def running(self):
        return len(self.sched.running)

    def waiting(self):
        return self.loop.waiting()

    def blocks_used(self):
        return self.engine.pool.used

    def blocks_free(self):
        return self.engine.pool.available

    def compiles(self):
        return 0

    def prefix_stats(self):
        return {"queries": 0, "hits": 0, "blocks": 0}

    def spec_stats(self):
        return self._spec


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


def test_the_queue_limit_counts_submits_the_engine_thread_has_not_applied():
    loop = EngineLoop(Scheduler(FakeEngine(), ByteTokenizer()))  # not started: nothing applied
    sp = SamplingParams(max_tokens=2)
    for _ in range(2):
        loop.submit([1, 2], sp, lambda ev: None, max_waiting=2)
    assert loop.waiting() == 2
    with pytest.raises(QueueFull):
        loop.submit([1], sp, lambda ev: None, max_waiting=2)
    assert loop.waiting() == 2  # the refused request counts for nothing


@pytest.mark.parametrize("stream", [False, True])
def test_full_queue_answers_429_with_retry_after_streaming_or_not(stream):
    """Requests the engine thread has not yet taken count: a full queue is 429 before any
    response starts, never a 500 or an error event inside a 200 stream."""
    h = Handle(FakeEngine(), start=False)
    for _ in range(4):
        h.loop.submit([1], SamplingParams(max_tokens=2), lambda ev: None)
    body = {"prompt": "x", "max_tokens": 2, "stream": stream}
    r = app_for(h).post("/v1/completions", json=body)
    assert r.status_code == 429 and r.headers["retry-after"]
    assert r.json()["error"]["type"] == "rate_limit"


def test_a_burst_over_the_queue_gets_answers_or_429_never_500():
    h = Handle(FakeEngine(slots=2, delay=0.02), max_queue=2)
    c = app_for(h)

    def post(i):
        return c.post("/v1/completions", json={"prompt": f"x{i}", "max_tokens": 3}).status_code

    try:
        with ThreadPoolExecutor(24) as ex:
            codes = list(ex.map(post, range(24)))
    finally:
        h.loop.stop()
    assert set(codes) <= {200, 429} and 200 in codes and 429 in codes


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


def test_unknown_paths_and_methods_answer_in_the_openai_error_shape():
    c = TestClient(create_app(ServerState(model_name="fake")))
    r = c.get("/v1/nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "GET /v1/nope" in err["message"]
    r = c.get("/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert "GET /v1/completions" in r.json()["error"]["message"]


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
        while eng.live_slots() and time.time() < deadline:
            time.sleep(0.01)
        assert not eng.live_slots() and eng.pool.available == eng.pool.capacity
    finally:
        h.loop.stop()


def test_metrics_report_speculation_totals_and_acceptance_lengths():
    from prometheus_client.parser import text_string_to_metric_families

    def families(handle):
        try:
            text = app_for(handle).get("/metrics").text
        finally:
            handle.loop.stop()
        return {
            s.name + str(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    assert not any("spec" in k for k in families(Handle(FakeEngine())))  # off: no families
    st = {
        "mode": "ngram",
        "max_proposals": 3,
        "proposed": 40,
        "accepted": 24,
        "verify_rows": 12,
        "accept_lengths": {0: 2, 1: 3, 3: 7},
        "active": False,
    }
    m = families(Handle(FakeEngine(), spec=st))
    mode = "('mode', 'ngram')"
    assert m[f"luce_spec_proposed_tokens_total[{mode}]"] == 40
    assert m[f"luce_spec_accepted_tokens_total[{mode}]"] == 24
    assert m[f"luce_spec_verify_rows_total[{mode}]"] == 12
    le = {
        n: m[f"luce_spec_acceptance_length_bucket[('le', '{n}'), {mode}]"]
        for n in ("0", "1", "2", "3", "+Inf")
    }
    assert le == {"0": 2, "1": 5, "2": 5, "3": 12, "+Inf": 12}
    assert m[f"luce_spec_acceptance_length_sum[{mode}]"] == 3 + 21
    assert m[f"luce_spec_active[{mode}]"] == 0  # the gate has it off


@pytest.fixture
def served():
    """A client of the app over a running fake engine."""
    h = Handle(FakeEngine())
    try:
        yield app_for(h)
    finally:
        h.loop.stop()


@pytest.mark.parametrize(
    "path, raw, field",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
         "messages[0].content"),
        ("/tokenize", '{"prompt": "\\udfff"}', "prompt"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_a_400_naming_the_field(served, path, raw, field):
    r = served.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


@pytest.mark.parametrize("depth", [100, 5000])
def test_deeply_nested_json_is_a_400(served, depth):
    raw = '{"prompt": "x", "extra": ' + "[" * depth + "]" * depth + "}"
    r = served.post("/v1/completions", content=raw)
    assert r.status_code == 400 and "nested deeper" in r.json()["error"]["message"]


class Disconnecting:
    """A request whose client has gone: is_disconnected() is True."""

    async def is_disconnected(self):
        return True


def test_a_non_streamed_request_whose_client_leaves_is_cancelled_while_tokens_flow():
    """Tokens keep arriving (the stream never times out), yet the dropped client is seen
    within the poll interval and the generation is cancelled, not run to max_tokens."""
    from server.generation import Generation, collect

    class Flowing:
        cancelled = False
        produced = 0

        async def get(self, timeout):
            await asyncio.sleep(0.01)
            self.produced += 1
            return Event(text="a", token_ids=[97])

        def cancel(self):
            self.cancelled = True

    stream = Flowing()
    gen = Generation(None, stream, ByteTokenizer(), None)
    asyncio.run(asyncio.wait_for(collect(Disconnecting(), gen, poll_s=0.05), timeout=5))
    assert stream.cancelled and stream.produced < 50


def test_closing_the_engine_ends_requests_in_flight_and_refuses_new_ones():
    """What a shutdown does (serve.py's Server.handle_exit): a stream in flight gets an error
    event at once instead of running to max_tokens, a non-streamed one a 503, new ones 503."""
    h = Handle(FakeEngine(delay=0.02))
    c = app_for(h)
    body = {"prompt": "x", "max_tokens": 60, "stream": True}
    try:
        t0 = time.monotonic()
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: ") and not lines:
                    h.loop.close("the server is shutting down")
                lines.append(line)
        assert time.monotonic() - t0 < 60 * 0.02  # well before max_tokens
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert events[-1]["error"]["message"] == "the server is shutting down"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"]
    finally:
        h.loop.stop()


def test_a_non_streamed_request_in_flight_at_shutdown_gets_503():
    h = Handle(FakeEngine(delay=0.05))
    c = app_for(h)
    try:
        threading.Timer(0.2, h.loop.close, ("the server is shutting down",)).start()
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 60})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    finally:
        h.loop.stop()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413(declared):
    h = Handle(FakeEngine(), start=False)
    state = ServerState(model_name="fake", max_request_bytes=1000)
    state.engine = h
    c = TestClient(create_app(state))
    raw = json.dumps({"prompt": "x" * 2000}).encode()
    content = raw if declared else iter([raw[:500], raw[500:]])
    r = c.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(served):
    """64-token context, 1-byte tokens: 100 kB is at least 100k tokens, refused unread."""
    r = served.post("/v1/completions", json={"prompt": "y" * 100_000, "max_tokens": 2})
    assert r.status_code == 400 and "at least 100000 tokens" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"


def test_tokenizing_a_long_text_does_not_stall_other_requests():
    class SlowTokenizer(ByteTokenizer):
        def encode(self, text, add_special=True):
            time.sleep(1.0)
            return super().encode(text, add_special)

    h = Handle(FakeEngine())
    h.tokenizer = SlowTokenizer()
    state = ServerState(model_name="fake")
    state.engine = h
    try:
        with TestClient(create_app(state)) as c:  # one event loop for every request
            slow = threading.Thread(
                target=c.post, args=("/tokenize",), kwargs={"json": {"prompt": "x"}}
            )
            slow.start()
            time.sleep(0.2)
            t0 = time.monotonic()
            assert c.get("/health").status_code == 200
            assert time.monotonic() - t0 < 0.5
            slow.join()
    finally:
        h.loop.stop()


class EogTokenizer(ByteTokenizer):
    eog_ids = frozenset({103})  # the fake engine's third token ends the turn


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_leave_out_the_token_that_ends_the_turn(stream):
    """The end-of-turn token adds nothing to the message, so it has no logprobs entry (it had
    one with an empty token string)."""
    h = Handle(FakeEngine(), start=False)
    h.tokenizer = EogTokenizer()
    h.sched = Scheduler(h.engine, h.tokenizer, max_queue=4)
    h.loop = EngineLoop(h.sched)
    h.loop.start()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "logprobs": True,
            "stream": stream}  # fmt: skip
    try:
        r = app_for(h).post("/v1/chat/completions", json=body)
    finally:
        h.loop.stop()
    assert r.status_code == 200
    if stream:
        events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
        content = [e for ev in events for c in ev["choices"] if c.get("logprobs")
                   for e in c["logprobs"]["content"]]  # fmt: skip
        finish = events[-1]["choices"][0]["finish_reason"]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
        finish = r.json()["choices"][0]["finish_reason"]
    assert finish == "stop"
    assert [e["token"] for e in content] == ["e", "f"]  # tokens 101, 102; 103 ended the turn


@pytest.mark.parametrize("default_max, expect", [(None, 64 - 2), (5, 5)])
def test_a_chat_without_max_tokens_gets_the_servers_default(default_max, expect):
    """--default-max-tokens caps a chat that sets no max_tokens; without it the reply may run
    to the end of the context, as OpenAI's does."""
    h = Handle(FakeEngine(blocks=100))
    state = ServerState(model_name="fake", default_max_tokens=default_max)
    state.engine = h
    body = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        r = TestClient(create_app(state)).post("/v1/chat/completions", json=body)
    finally:
        h.loop.stop()
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == expect
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_the_embedded_model_caps_chats_and_a_bad_default_exits_2(capsys):
    from luce_jax.serve import EMBEDDED_CHAT_MAX_TOKENS, parse_config

    assert parse_config([])[0].default_max_tokens == EMBEDDED_CHAT_MAX_TOKENS
    assert parse_config(["--default-max-tokens", "9"])[0].default_max_tokens == 9
    with pytest.raises(SystemExit) as e:
        parse_config(["--default-max-tokens", "0"])
    assert e.value.code == 2 and "--default-max-tokens" in capsys.readouterr().err


def test_a_client_gone_while_its_body_arrives_is_not_an_application_error():
    """The 10k soak's only server-side errors: a client that left while the server read its
    body raised ClientDisconnect out of the endpoint, a traceback in the log per client.
    Now the request ends quietly, before anything is submitted."""
    h = Handle(FakeEngine(), start=False)
    state = ServerState(model_name="fake")
    state.engine = h
    app = create_app(state)
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "raw_path": b"/v1/completions", "headers": [(b"content-type", b"application/json")],
             "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": "", "app": app}  # fmt: skip
    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect before the fix
    assert sent[0]["status"] == 499 and h.sched.idle and not h.loop.waiting()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_debug_log_shows_where_a_first_token_spent_its_time(path, caplog):
    """At debug level a streamed request logs its first token's way, a step at a time (the body
    parsed, the prompt tokenized, submitted, emitted by the engine thread, read by the event
    loop, written as a chunk), so a slow time to first token can be located on the server."""
    import logging
    import re

    from server.bridge import MARKS

    h = Handle(FakeEngine(slots=2))
    try:
        body = {"max_tokens": 3, "stream": True}
        body.update({"prompt": "hello"} if "chat" not in path else {})
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {})
        with caplog.at_level(logging.DEBUG, logger="server.generation"):
            r = app_for(h).post(path, json=body)
        assert r.status_code == 200 and "[DONE]" in r.text
    finally:
        h.loop.stop()
    lines = [m.getMessage() for m in caplog.records if "first token ms" in m.getMessage()]
    assert len(lines) == 1  # one line a request, at its first token only
    steps = re.findall(r"-> (\w+) ([\d.]+)", lines[0])
    assert lines[0].split("first token ms: ")[1].startswith("received ->")
    assert [k for k, _ in steps] == list(MARKS[1:])
    assert all(float(v) >= 0 for _, v in steps)
