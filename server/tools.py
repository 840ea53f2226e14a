"""Chat tool calls: the request's tools and tool_choice, the grammar that forces a call, and the
parser that turns the model's `<tool_call>` blocks into OpenAI `tool_calls`, whole or streamed.

Two call syntaxes, chosen from the chat template (`syntax_of`): the Hermes / Qwen one that the
Qwen2.5, Qwen3 and Qwen3.5 templates teach (`<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>`, any number of calls among text), and Llama 3.1's JSON reply (the whole reply
is `{"name": ..., "parameters": {...}}`, one call).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from luce_jax.host.grammar import INSTALL_HINT, check_schema

from .protocol import bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES, LLAMA3 = "hermes", "llama3_json"
PYTHON_TAG = "<|python_tag|>"
BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Tools:
    """A chat request's tools (OpenAI shape, validated) and how they may be used.

    mode: none (tools are not offered), auto (the model may call; its calls are parsed),
    required (it must call one of them) or named (it must call `name`).
    """

    tools: list[dict]
    mode: str
    name: str | None = None
    parallel: bool = True
    syntax: str = HERMES  # HERMES or LLAMA3 (syntax_of the model's chat template)

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def forced(self) -> tuple[str, str, str] | None:
        """(JSON schema of one call, text before it, text after it) for required / named; the
        grammar makes the reply exactly one such call."""
        if self.mode not in ("required", "named"):
            return None
        key = "parameters" if self.syntax == LLAMA3 else "arguments"
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    key: t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for t in self.tools
            if self.mode == "required" or t["function"]["name"] == self.name
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        if self.syntax == LLAMA3:
            return json.dumps(schema), "", ""
        return json.dumps(schema), OPEN + "\n", "\n" + CLOSE


def syntax_of(template: str | None) -> str:
    """The tool-call syntax a chat template teaches: Hermes <tool_call> blocks unless it asks
    for Llama 3.1's {"name", "parameters"} reply."""
    if template and OPEN not in template and '"parameters"' in template:
        return LLAMA3
    return HERMES


def chat_tools(body: dict) -> Tools | None:
    """The validated `tools`, `tool_choice` and `parallel_tool_calls` of a chat request (None
    when it has no tools); every error is a 400 naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be a boolean, got {parallel!r}")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", f"must be a list of function tools, got {tools!r}")
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools")
        return None
    seen = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad(where, 'must be an object with type "function"')
        f = t.get("function")
        if not isinstance(f, dict):
            raise bad(f"{where}.function", "must be an object")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad(f"{where}.function.name", "must be 1 to 64 letters, digits, _ or -")
        if name in seen:
            raise bad(f"{where}.function.name", f"{name!r} is defined twice")
        seen.add(name)
        if not isinstance(f.get("description", ""), str):
            raise bad(f"{where}.function.description", "must be a string")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"{where}.function.parameters", "must be a JSON schema object")
    if choice is None or choice in ("none", "auto", "required"):
        return _grammar_checked(Tools(tools, choice or "auto", None, parallel))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in seen:
        raise bad(
            "tool_choice",
            'must be "none", "auto", "required" or {"type": "function", "function": {"name"}} '
            "naming one of the tools",
        )
    return _grammar_checked(Tools(tools, "named", name, parallel))


def _grammar_checked(tools: Tools) -> Tools:
    """`tools`, once each function's parameters compile to a grammar (xgrammar, the structured
    extra). A grammar forces the call only under required or a named function; under auto and
    none a plain install, without xgrammar, takes them unchecked (agent frameworks send tools
    with every request)."""
    forced = tools.mode in ("required", "named")
    for i, t in enumerate(tools.tools):
        params = t["function"].get("parameters")
        if params is None or (tools.mode == "named" and t["function"]["name"] != tools.name):
            continue
        try:
            check_schema(json.dumps(params))
        except ValueError as e:
            if str(e) == INSTALL_HINT and not forced:
                return tools
            raise bad(f"tools[{i}].function.parameters", str(e)) from None
    return tools


def call_from(block: str, names: set[str]) -> dict | None:
    """An OpenAI tool call from the JSON inside one <tool_call> block, or None if it is not
    one (not JSON, no known name, arguments not an object)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args)},
    }


def parse(text: str, names: set[str], syntax: str = HERMES) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole reply: calls from the blocks that parse, content the
    text outside them (stripped; None if empty once calls were found). Llama 3.1: the whole
    reply is one call or content."""
    if syntax == LLAMA3:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        call = call_from(body, names) if body.startswith("{") else None
        return (None, [call]) if call else (text, [])
    calls, content, last = [], [], 0
    for m in BLOCK.finditer(text):
        call = call_from(m.group(1), names)
        if call is None:
            continue
        calls.append(call)
        content.append(text[last : m.start()])
        last = m.end()
    content.append(text[last:])
    rest = "".join(content)
    if not calls:
        return text, []
    return (rest.strip() or None), calls


class CallStream:
    """Incremental `parse` for streamed replies: text is passed on except what may be part of a
    tool call, which is held until its block closes and then sent as one whole call."""

    def __init__(self, names: set[str], syntax: str = HERMES):
        self.names, self.syntax, self.buf, self.calls = names, syntax, "", 0
        self.plain = False  # Llama 3.1: the reply is known not to be a call

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, completed calls) after `text` arrives."""
        self.buf += text
        if self.syntax == LLAMA3:  # a reply that may be a call is held whole
            head = self.buf.lstrip()
            if not self.plain and (not head or head.startswith("{") or PYTHON_TAG.startswith(
                    head[: len(PYTHON_TAG)])):  # fmt: skip
                return "", []
            self.plain, out, self.buf = True, self.buf, ""
            return out, []
        out, calls = [], []
        while True:
            i = self.buf.find(OPEN)
            if i < 0:  # hold back a tail that could start "<tool_call>"
                keep = next(
                    (k for k in range(min(len(OPEN) - 1, len(self.buf)), 0, -1)
                     if OPEN.startswith(self.buf[-k:])),
                    0,
                )  # fmt: skip
                out.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            j = self.buf.find(CLOSE, i)
            if j < 0:
                out.append(self.buf[:i])
                self.buf = self.buf[i:]
                break
            m = BLOCK.match(self.buf, i)
            call = call_from(m.group(1), self.names) if m else None
            end = j + len(CLOSE)
            out.append(self.buf[:i] if call is not None else self.buf[:end])
            if call is not None:
                calls.append(call)
            self.buf = self.buf[end:]
        self.calls += len(calls)
        text_out = "".join(out)
        if self.calls and not text_out.strip():  # whitespace around calls is not content
            text_out = ""
        return text_out, calls

    def flush(self) -> tuple[str, list[dict]]:
        """(text, calls) held back when the reply ends: a Llama 3.1 call, or what is left (an
        unclosed block stays text)."""
        out, self.buf = self.buf, ""
        if self.syntax == LLAMA3 and not self.plain:
            content, calls = parse(out, self.names, LLAMA3)
            self.calls += len(calls)
            return ("" if calls else out), calls
        return (out if not self.calls or out.strip() else ""), []
