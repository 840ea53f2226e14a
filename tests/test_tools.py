"""Chat tool calls: request validation, the forced-call grammar, and the parser that turns
<tool_call> blocks into OpenAI tool_calls, whole and streamed."""

import dataclasses
import json

import pytest

from server.protocol import APIError
from server.tools import LLAMA3, CallStream, chat_tools, parse, syntax_of

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
REPLY = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_tool_call_blocks_become_tool_calls_and_the_rest_content():
    content, calls = parse(REPLY, {"get_weather", "get_time"})
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not offered
        '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {}}',  # cut by max_tokens
        "plain text",
    ],
)
def test_anything_that_is_not_a_whole_known_call_stays_content(text):
    assert parse(text, {"get_weather", "get_time"}) == (text, [])


@pytest.mark.parametrize("piece", [1, 3, 7, 1000])
def test_streamed_pieces_give_the_same_calls_and_content(piece):
    names = {"get_weather", "get_time"}
    s, text, calls = CallStream(names), "", []
    for i in range(0, len(REPLY), piece):
        t, c = s.feed(REPLY[i : i + piece])
        text, calls = text + t, calls + c
    rest, last = s.flush()
    text, calls = text + rest, calls + last
    content, whole = parse(REPLY, names)
    assert text.strip() == content
    assert [c["function"] for c in calls] == [c["function"] for c in whole]
    assert "<tool" not in text  # never a part of a call streamed as content


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TIME, TIME]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [TIME], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [TIME], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)  # fmt: skip
def test_bad_tools_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        chat_tools(body)
    assert e.value.status == 400 and e.value.param == param


def test_forced_calls_are_one_call_of_the_allowed_tools():
    t = chat_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    schema, before, after = t.forced()
    assert (before, after) == ("<tool_call>\n", "\n</tool_call>")
    names = [o["properties"]["name"]["const"] for o in json.loads(schema)["anyOf"]]
    assert names == ["get_weather", "get_time"]
    named = chat_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    assert json.loads(named.forced()[0])["properties"]["name"] == {"const": "get_time"}
    assert chat_tools({"tools": [WEATHER]}).forced() is None  # auto: parsed, not forced
    assert chat_tools({"tools": [WEATHER], "tool_choice": "none"}).mode == "none"


def test_the_syntax_is_read_off_the_chat_template(fixtures_dir):
    read = lambda name: (fixtures_dir / "chat_templates" / name).read_text()  # noqa: E731
    assert syntax_of(read("Qwen-Qwen3-0.6B.jinja")) == "hermes"
    assert syntax_of(read("meta-llama-Llama-3.1-8B-Instruct.jinja")) == LLAMA3
    assert syntax_of(None) == "hermes"


LLAMA_REPLY = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_a_llama_json_reply_is_one_call_whole_or_streamed(piece):
    names = {"get_weather"}
    content, (call,) = parse(LLAMA_REPLY, names, LLAMA3)
    assert content is None and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    s, text, calls = CallStream(names, LLAMA3), "", []
    for i in range(0, len(LLAMA_REPLY), piece):
        t, c = s.feed(LLAMA_REPLY[i : i + piece])
        text, calls = text + t, calls + c
    t, c = s.flush()
    assert text + t == "" and [x["function"] for x in calls + c] == [call["function"]]


def test_a_plain_llama_reply_streams_as_content():
    s = CallStream({"get_weather"}, LLAMA3)
    assert s.feed("  ") == ("", [])  # may still become a call
    assert s.feed("It is sunny.") == ("  It is sunny.", [])
    assert s.feed(" {x}") == (" {x}", []) and s.flush() == ("", [])
    assert parse("It is sunny.", {"get_weather"}, LLAMA3) == ("It is sunny.", [])


def test_forced_llama_calls_are_bare_json_with_parameters():
    t = chat_tools({"tools": [WEATHER], "tool_choice": "required"})
    schema, before, after = dataclasses.replace(t, syntax=LLAMA3).forced()
    assert (before, after) == ("", "") and "parameters" in json.loads(schema)["required"]
