"""A real uvicorn server started by `python -m luce_jax.serve`, driven by the openai client."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, timeout: float = 300.0) -> None:
    """Poll url/health until it answers 200; the server process must stay up meanwhile."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:  # its output is read only once it has ended
            out = proc.stdout.read().decode()[-3000:] if proc.stdout else ""
            raise AssertionError(f"the server exited: {out}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("server did not become healthy")


SERVER = {}  # the module's server process (the shutdown test, last in this file, stops it)


@pytest.fixture(scope="module")
def base_url(tiny_gguf, compile_cache):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "luce_jax.serve",
        "--model",
        tiny_gguf,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--cache-type-k",
        "f32",
        "--cache-type-v",
        "f32",
        "--max-ctx",
        "1024",
        "--max-concurrency",
        "8",
        "--kv-pool-tokens",
        "8192",
        "--prefill-token-budget",
        "64",
        "--prefill-chunk",
        "64",
        "--model-name",
        "tiny",
        "--compile-cache-dir",
        compile_cache,
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    SERVER["proc"] = proc
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    saw_loading = False
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 503:
                saw_loading = True
            if r.status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        raise AssertionError("server did not become healthy")
    assert saw_loading, "/health never answered 503 while loading"
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)


def metrics(base_url) -> dict:
    text = httpx.get(base_url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
            out[key] = s.value
    return out


def test_completions_and_chat_streaming_and_not(client):
    out = client.completions.create(model="tiny", prompt="the cat", **GREEDY)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="the cat",
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], **GREEDY
    )
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, **GREEDY
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content


POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"type": "string", "maxLength": 6},
    },
    "required": ["x", "tag"],
    "additionalProperties": False,
}


def test_response_format_json_schema_streaming_and_not(client):
    """The output of a response_format request parses and matches its schema, streamed or not,
    through the official client, on chat and completions."""
    import jsonschema

    rf = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT}}
    kw = dict(model="tiny", temperature=0, max_tokens=40, response_format=rf)
    msgs = [{"role": "user", "content": "a point"}]
    chat = client.chat.completions.create(messages=msgs, **kw)
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), POINT)
    stream = client.chat.completions.create(messages=msgs, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        chat.choices[0].message.content
    )
    out = client.completions.create(
        model="tiny",
        prompt="data = ",
        temperature=0,
        max_tokens=40,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert out.choices[0].text.startswith("{")
    if out.choices[0].finish_reason == "stop":  # a free-form object may run to max_tokens
        assert isinstance(json.loads(out.choices[0].text), dict)


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "add two small numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
       "properties": {}, "additionalProperties": False}}}  # fmt: skip


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["req", "named"]
)
def test_forced_tool_calls_streaming_and_not_and_a_second_turn(client, choice):
    """required / a named tool: the reply is a call whose arguments parse and match the tool's
    parameters, streamed or not; the tool's result in a second turn renders and runs."""
    import jsonschema

    msgs = [{"role": "user", "content": "what is 2 + 3?"}]
    kw = dict(model="tiny", temperature=0, max_tokens=120, tools=[ADD, NOW], tool_choice=choice)
    out = client.chat.completions.create(messages=msgs, **kw)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if choice != "required":
        assert call.function.name == "add"
    params = {"add": ADD, "now": NOW}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    chunks = list(client.chat.completions.create(messages=msgs, stream=True, **kw))
    deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, call.function.name, call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    turn2 = msgs + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    again = client.chat.completions.create(model="tiny", messages=turn2, temperature=0,
                                           max_tokens=4, tools=[ADD, NOW])  # fmt: skip
    assert again.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_auto_tools_leave_a_plain_reply_as_content(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], **GREEDY)
    plain = client.chat.completions.create(**kw)
    auto = client.chat.completions.create(tools=[ADD], **kw)
    # the tiny test template does not render tools, so the prompt and the reply are the same;
    # a reply without <tool_call> blocks stays content
    assert auto.choices[0].message.content == plain.choices[0].message.content
    assert not auto.choices[0].message.tool_calls
    assert auto.choices[0].finish_reason == plain.choices[0].finish_reason


def test_logprobs(client):
    out = client.completions.create(model="tiny", prompt="abc", logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 12 and all(len(t) <= 3 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and len(content[0].top_logprobs) == 2


def test_eight_concurrent_streams_equal_their_alone_text(base_url, client):
    prompts = [f"req {i} " * (i + 1) for i in range(8)]
    alone = [
        client.completions.create(model="tiny", prompt=p, **GREEDY).choices[0].text for p in prompts
    ]

    async def one(ac, p):
        text = ""
        async for c in await ac.completions.create(model="tiny", prompt=p, stream=True, **GREEDY):
            text += c.choices[0].text
        return text

    async def main():
        ac = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(main()) == alone


def test_disconnect_frees_slot_and_blocks(base_url):
    body = {
        "model": "tiny",
        "prompt": "a long one",
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    cancelled = 'luce_requests_total{"finish_reason": "cancelled"}'
    before = metrics(base_url).get(cancelled, 0)
    with (
        httpx.Client(timeout=30) as h,
        h.stream("POST", base_url + "/v1/completions", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data:"):
                m = metrics(base_url)
                assert m["luce_requests_running"] == 1 and m["luce_kv_blocks_used"] > 0
                break  # closing the line iterator drops the connection
    deadline = time.time() + 5
    while time.time() < deadline:
        m = metrics(base_url)
        if m["luce_requests_running"] == 0 and m["luce_kv_blocks_used"] == 0:
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"slot not freed after disconnect: {m}")
    assert m[cancelled] == before + 1
    assert m["luce_generation_tokens_total"] < 4000


def test_a_reader_that_stops_reading_does_not_slow_others(base_url, client):
    ref = client.completions.create(model="tiny", prompt="others", **GREEDY).choices[0].text
    t0 = time.time()
    client.completions.create(model="tiny", prompt="others", **GREEDY)
    alone_s = time.time() - t0
    body = {
        "model": "tiny",
        "prompt": "stalled",
        "max_tokens": 480,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as h,
        h.stream("POST", base_url + "/v1/completions", json=body) as r,
    ):
        next(r.iter_lines())  # read one line, then read no more
        t0 = time.time()
        outs = [
            client.completions.create(model="tiny", prompt="others", **GREEDY) for _ in range(3)
        ]
        took = (time.time() - t0) / 3
    assert all(o.choices[0].text == ref for o in outs)
    assert took < 10 * alone_s + 1.0, (took, alone_s)


BAD = [
    # (path, body or raw bytes, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 1.5}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "seed": "s"}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x " * 2100}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                    ],
                },
            ]
        },
        400,
        "messages[1].tool_calls[0].function.arguments",
    ),  # fmt: skip
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": 3}},
        },
        400,
        "response_format.json_schema",
    ),
    (
        "/v1/completions",
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "object", "minProperties": "x"}},
            },
        },
        400,
        "response_format.json_schema.schema",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
]


@pytest.mark.parametrize(
    "path, body, status, param", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)]
)
def test_bad_request_gets_a_clear_error_and_the_server_keeps_serving(
    base_url, path, body, status, param
):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(base_url + path, headers={"content-type": "application/json"}, timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["param"] == param
    ok = httpx.post(
        base_url + "/v1/completions", json={"prompt": "fine", "max_tokens": 2}, timeout=30
    )
    assert ok.status_code == 200


def test_metrics_parse_and_move(base_url, client):
    before = metrics(base_url)
    client.completions.create(model="tiny", prompt="count me", **GREEDY)
    after = metrics(base_url)
    assert after["luce_generation_tokens_total"] - before["luce_generation_tokens_total"] == 12
    assert after["luce_prompt_tokens_total"] > before["luce_prompt_tokens_total"]
    assert (
        after["luce_time_to_first_token_seconds_count"]
        > before["luce_time_to_first_token_seconds_count"]
    )
    assert after["luce_step_seconds_count"] > before["luce_step_seconds_count"]
    assert after["luce_compiles"] == before["luce_compiles"]  # nothing compiled while serving
    assert after["luce_kv_blocks_used"] == 0 and after["luce_requests_running"] == 0


def test_a_repeated_prompt_reports_its_cached_tokens_in_usage_and_metrics(base_url, client):
    """The second request with the same prompt reuses its full KV blocks (16 tokens each,
    never the last prompt token), and says so in usage.prompt_tokens_details.cached_tokens,
    streamed or not, as the metrics do."""
    text = "def cached_prefix_probe(x):\n" + "    x = x * 3 + 1  # step\n" * 12
    before = metrics(base_url)
    first = client.completions.create(model="tiny", prompt=text, **GREEDY)
    n = first.usage.prompt_tokens
    assert n > 64 and first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="tiny", prompt=text, **GREEDY)
    cached = (n - 1) // 16 * 16
    assert second.usage.prompt_tokens_details.cached_tokens == cached
    assert second.choices[0].text == first.choices[0].text
    chunks = list(
        client.completions.create(
            model="tiny", prompt=text, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    after = metrics(base_url)
    d = {k: after[k] - before[k] for k in after if k in before}
    assert d["luce_prefix_cache_queries_tokens_total"] == 3 * n
    assert d["luce_prefix_cache_hits_tokens_total"] == 2 * cached
    assert after["luce_kv_blocks_cached"] >= n // 16
    assert after["luce_kv_blocks_used"] == 0  # cached blocks no request holds are not used
    # llama.cpp's server's per-request switch: cache_prompt false computes the whole prompt
    off = client.completions.create(
        model="tiny",
        prompt=text,
        **{**GREEDY, "extra_body": {"ignore_eos": True, "cache_prompt": False}},
    )
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert off.choices[0].text == first.choices[0].text
    r = httpx.post(
        client.base_url.join("completions").__str__(),
        json={"model": "tiny", "prompt": "x", "cache_prompt": "yes"},
    )
    assert r.status_code == 400 and "cache_prompt" in r.json()["error"]["message"]


def test_models_tokenize_detokenize(base_url, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    ids = httpx.post(base_url + "/tokenize", json={"prompt": "hello world"}).json()["tokens"]
    assert (
        httpx.post(base_url + "/detokenize", json={"tokens": ids}).json()["prompt"] == "hello world"
    )


def test_max_tokens_is_clamped_to_the_context_left(client):
    out = client.completions.create(
        model="tiny",
        prompt="x " * 490,  # 980 tokens
        max_tokens=10_000,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.prompt_tokens + out.usage.completion_tokens == 1024
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--dtype", "int3"], "--dtype"),
        (["--kv-block-size", "12"], "--kv-block-size"),
        (["--port", "70000"], "--port"),
        (["--cuda-graph-max-tokens", "-1"], "--cuda-graph-max-tokens"),
    ],
)
def test_cli_rejects_bad_flags(tiny_gguf, args, needle):
    r = subprocess.run(
        [sys.executable, "-m", "luce_jax.serve", "--model", tiny_gguf, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and needle in r.stderr


def test_cli_help_lists_every_flag():
    r = subprocess.run(
        [sys.executable, "-m", "luce_jax.serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    for flag in (
        "--model",
        "--host",
        "--port",
        "--model-name",
        "--max-concurrency",
        "--kv-pool-tokens",
        "--kv-block-size",
        "--max-ctx",
        "--cache-type-k",
        "--cache-type-v",
        "--prefill-chunk",
        "--prefill-token-budget",
        "--max-concurrent-prefills",
        "--admission-coalesce-ms",
        "--max-queue",
        "--chat-template-file",
        "--compile-cache-dir",
        "--dtype",
        "--quant-backend",
        "--log-level",
    ):
        assert flag in r.stdout
    assert "(default: None)" not in r.stdout  # the help text says what no value means


def test_missing_model_file_exits_nonzero():
    r = subprocess.run(
        [sys.executable, "-m", "luce_jax.serve", "--model", "/nope.gguf"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "no such file" in r.stderr


def test_server_package_imports_no_jax():
    code = "import sys, server.app, luce_jax.serve; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_health_polls_and_the_no_tpu_note_stay_out_of_the_log():
    import logging

    from luce_jax.serve import quiet_logs

    quiet_logs()
    assert logging.getLogger("jax._src.xla_bridge").getEffectiveLevel() == logging.WARNING
    access = logging.getLogger("uvicorn.access")

    def line(path):
        fmt = '%s - "%s %s HTTP/%s" %d'
        args = ("127.0.0.1:5", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, fmt, args, None)

    assert not access.filter(line("/health")) and not access.filter(line("/metrics"))
    assert access.filter(line("/v1/models"))
    assert logging.getLogger("jax").getEffectiveLevel() == logging.INFO  # also at debug


@pytest.mark.parametrize("kind", ["half", "random", "empty", "100 bytes", "template"])
def test_a_bad_model_or_template_file_exits_2_naming_the_flag(tmp_path, capsys, kind):
    """Checked while parsing flags, before anything binds the port: status 2 and one line."""
    from luce_jax.config import DEFAULT_MODEL
    from luce_jax.serve import parse_config

    good = DEFAULT_MODEL.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"half": good[: len(good) // 2], "random": os.urandom(4096), "empty": b"",
                     "100 bytes": good[:100], "template": good}[kind])  # fmt: skip
    argv = ["--model", str(bad)]
    if kind == "template":
        argv += ["--chat-template-file", str(tmp_path / "none.jinja")]
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    flag = "--chat-template-file" if kind == "template" else "--model"
    assert e.value.code == 2 and f"error: {flag}" in err and "Traceback" not in err


def test_a_body_over_the_limit_is_a_413_a_client_writing_it_whole_can_read(base_url):
    """urllib and httpx (the openai client) send their whole body before reading: the server
    reads past the limit (up to DRAIN_FACTOR times it) so they see the 413, not a reset."""
    import urllib.error
    import urllib.request

    import openai

    big = json.dumps({"model": "tiny", "prompt": "x" * (10 << 20), "max_tokens": 1}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=big,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413 and b"max-request-bytes" in e.value.read()
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="x" * (10 << 20), max_tokens=1)
    assert e.value.status_code == 413


def test_the_served_model_can_be_retrieved_by_id(base_url):
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("tiny").id == "tiny"


def test_sigint_with_a_stream_in_flight_exits_within_5_s(base_url):
    """Ctrl-C: the stream in flight gets an error event and the server exits within 5 s, not
    when the generation would have ended. Keep this test last: it stops the module's server."""
    proc = SERVER["proc"]
    body = {"model": "tiny", "prompt": "the", "max_tokens": 1000, "min_tokens": 1000,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        next(x for x in lines if x.startswith("data: "))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest = list(lines)
    proc.wait(10)
    assert time.monotonic() - t0 < 5
    assert any("shutting down" in x for x in rest)
