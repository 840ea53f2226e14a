"""OpenAI request validation -> (prompt, SamplingParams), and response bodies. No jax here."""

from __future__ import annotations

import json
import time
import uuid

from luce_jax.host.grammar import check_schema
from luce_jax.sampling_params import SamplingParams

MAX_LOGPROBS = 20
MAX_STOP = 16


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers=None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


# Accepted fields. OpenAI's own fields we do not support are rejected by name; anything
# else unknown is rejected too (as OpenAI does: "Unrecognized request argument").
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "user",
    "logit_bias",
    # vLLM / llama.cpp extensions
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "cache_prompt",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix", "response_format"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
}


MAX_NESTING = 64  # JSON levels a request body may have (chat content parts need 6; schemas more)


def parse_json(raw: bytes) -> dict:
    """The request body as a dict: valid JSON, an object, at most MAX_NESTING levels deep, and
    every string valid Unicode (JSON's \\ud800 escapes decode to lone surrogates, which no
    tokenizer can encode); otherwise a 400 naming the first bad field."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"request body is nested deeper than {MAX_NESTING} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_values(body, "", 1)
    return body


def _check_values(v, path: str, depth: int) -> None:
    if depth > MAX_NESTING:
        raise APIError(400, f"{path}: nested deeper than {MAX_NESTING} levels", path)
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise bad(path or "body", "is not valid Unicode (a lone UTF-16 surrogate)") from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_values(k, path or "body", depth)
            _check_values(x, f"{path}.{k}" if path else k, depth + 1)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _check_values(x, f"{path}[{i}]", depth + 1)


def check_fields(body: dict, allowed: set[str]) -> None:
    for key in body:
        if key not in allowed:
            raise bad(key, "unrecognized request argument")


def _num(body, name, default, lo, hi, integer=False):
    v = body.get(name, default)
    if v is None:
        return default
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (integer and not isinstance(v, int))
    ):
        raise bad(name, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not lo <= v <= hi:
        raise bad(name, f"must be in [{lo}, {hi}], got {v!r}")
    return v


def token_ids(value, param: str, vocab_size: int) -> list[int]:
    """A list of ints in [0, vocab_size), or a 400 naming `param`."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value
    ):
        raise bad(param, f"must be a list of token ids in [0, {vocab_size})")
    return value


def _bool(body, name, default=False):
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {v!r}")
    return v


def _stop(body) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP:
        raise bad("stop", f"at most {MAX_STOP} stop strings")
    if any(not s for s in stop):
        raise bad("stop", "stop strings must be non-empty")
    return tuple(stop)


def sampling_from(
    body: dict,
    prompt_len: int,
    max_ctx: int,
    vocab_size: int,
    max_tokens_key: str = "max_tokens",
    default_max: int | None = 16,
    logprobs: int | None = None,
) -> SamplingParams:
    """Validate the shared sampling fields; max_tokens is clamped to the context left."""
    if prompt_len >= max_ctx:
        raise bad(
            "prompt" if "prompt" in body else "messages",
            f"the prompt has {prompt_len} tokens; the context is {max_ctx}",
        )
    left = max_ctx - prompt_len
    mt = _num(body, max_tokens_key, None, 1, 2**31, integer=True)
    mt = left if mt is None and default_max is None else min(mt or default_max, left)
    n = _num(body, "n", 1, 1, 1_000_000, integer=True)
    if n != 1:
        raise bad("n", "only n=1 is supported")
    if body.get("logit_bias"):
        raise bad("logit_bias", "is not supported")
    ids = token_ids(body.get("stop_token_ids", []), "stop_token_ids", vocab_size)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed", f"must be an integer, got {seed!r}")
    min_tokens = _num(body, "min_tokens", 0, 0, 2**31, integer=True)
    if min_tokens > mt:
        raise bad("min_tokens", f"must be <= max_tokens ({mt})")
    return SamplingParams(
        max_tokens=mt,
        temperature=_num(body, "temperature", 1.0, 0, 2),
        top_p=_num(body, "top_p", 1.0, 1e-9, 1),
        top_k=_num(body, "top_k", 0, -1, 2**31, integer=True) % (2**31),  # -1 = off (vLLM)
        min_p=_num(body, "min_p", 0.0, 0, 1),
        presence_penalty=_num(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2, 2),
        repetition_penalty=_num(body, "repetition_penalty", 1.0, 1e-6, 10),
        seed=None if seed is None else seed & 0xFFFFFFFF,
        stop=_stop(body),
        stop_token_ids=tuple(ids),
        ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=min_tokens,
        logprobs=logprobs,
        cache_prompt=_bool(body, "cache_prompt", True),
        json_schema=response_schema(body),
    )


def response_schema(body: dict) -> str | None:
    """The JSON schema `response_format` asks the output to match, as JSON text: None for
    text, {"type": "object"} for json_object, json_schema.schema for json_schema (OpenAI's
    forms); a schema xgrammar cannot compile is a 400."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("response_format", "must be an object with type text, json_object or json_schema")
    if rf["type"] == "text":
        return None
    where = "response_format"
    if rf["type"] == "json_object":
        schema = {"type": "object"}
    else:
        where = "response_format.json_schema.schema"
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise bad("response_format.json_schema", "must be an object with a schema object")
        if "name" in js and not isinstance(js["name"], str):
            raise bad("response_format.json_schema.name", "must be a string")
        schema = js["schema"]
    text = json.dumps(schema)
    try:
        check_schema(text)
    except ValueError as e:
        raise bad(where, str(e)) from None
    return text


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise bad("stream_options", "must be an object with include_usage")
    if not stream:
        raise bad("stream_options", "is only allowed with stream=true")
    return stream, _bool(opts, "include_usage")


def completion_prompt(body: dict, vocab_size: int) -> str | list[int]:
    """The prompt of /v1/completions: a string, or a list of token ids (or one of either)."""
    check_fields(body, COMPLETION_FIELDS)
    for name, ok in (("echo", False), ("best_of", 1), ("suffix", None)):
        if body.get(name, ok) not in (ok, None):
            raise bad(name, "is not supported")
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad("prompt", "must not be empty")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < vocab_size for t in p):
            raise bad("prompt", f"token ids must be in [0, {vocab_size})")
        return p
    raise bad("prompt", "must be a non-empty string or list of token ids (one prompt)")


def completion_logprobs(body: dict) -> int | None:
    lp = body.get("logprobs")
    if lp is None:
        return None
    return _num(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "user",
            "assistant",
            "developer",
            "tool",
        ):
            raise bad(where, "must be an object with role system, user, assistant or tool")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                for c in content
            ):
                raise bad(f"{where}.content", "only text content parts are supported")
            content = "".join(c["text"] for c in content)
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):  # a reply that only called tools
                raise bad(f"{where}.tool_calls", "must be a list")
            content = ""
        if not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        role = "system" if m["role"] == "developer" else m["role"]
        extra = {k: v for k, v in m.items() if k not in ("content", "role")}
        if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list):
            extra["tool_calls"] = [_rendered_call(c, f"{where}.tool_calls[{j}]")
                                   for j, c in enumerate(m["tool_calls"])]  # fmt: skip
        out.append({**extra, "role": role, "content": content})
    return out


def _rendered_call(call, where: str) -> dict:
    """An assistant message's tool call as chat templates take it: OpenAI sends arguments as
    JSON text, templates expect the object (Llama 3.1's writes `arguments | tojson`)."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad(f"{where}.function", "must be an object with a name")
    args = f.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad(f"{where}.function.arguments", "must be a JSON object or its text") from None
    if not isinstance(args, dict):
        raise bad(f"{where}.function.arguments", "must be a JSON object or its text")
    return {**call, "function": {**f, "arguments": args}}


def chat_logprobs(body: dict) -> int | None:
    want = _bool(body, "logprobs")
    top = _num(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if top is not None and not want:
        raise bad("top_logprobs", "requires logprobs=true")
    return (top or 0) if want else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
