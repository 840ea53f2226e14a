"""One generation's response: collected JSON or an SSE stream, in completion or chat shape."""

from __future__ import annotations

import json
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from luce_jax.host.scheduler import Closed, QueueFull

from . import protocol as P
from . import tools as T
from .bridge import Stream

log = logging.getLogger(__name__)


def error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Generation:
    """Reads one Stream (for the app's ServerState), keeping text, tokens and logprobs."""

    def __init__(self, state, stream: Stream, tokenizer, n_logprobs):
        self.state, self.stream, self.tok, self.n_lp = state, stream, tokenizer, n_logprobs
        self.text, self.tokens, self.logprobs = "", [], []
        self.finish_reason, self.error, self.retryable = None, None, False

    def absorb(self, ev) -> None:
        self.text += ev.text
        self.tokens.extend(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        if ev.final:
            self.finish_reason, self.error = ev.finish_reason, ev.error
            self.retryable = ev.retryable
            if ev.finish_reason == "cancelled":  # not an OpenAI finish_reason: an error
                self.finish_reason = "error"
                self.error = (
                    "cancelled: the client left its output unread too long"
                    if self.stream.slow_reader
                    else "cancelled by the server"
                )

    def usage(self) -> dict:
        s = self.stream
        return P.usage(s.prompt_tokens, len(self.tokens), s.req.cached_tokens)

    def token_str(self, tid: int) -> str:
        return self.tok.token_bytes[tid].decode("utf-8", errors="replace")

    def chat_logprobs(self, lps, ids) -> dict | None:
        if self.n_lp is None:
            return None
        out = []
        for (lp, top), tid in zip(lps, ids, strict=True):
            if tid in self.tok.eog_ids:  # ends the turn; no part of the message, as in OpenAI's
                continue
            s = self.token_str(tid)
            out.append(
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {
                            "token": self.token_str(i),
                            "logprob": v,
                            "bytes": list(self.token_str(i).encode()),
                        }
                        for i, v in top[: self.n_lp]
                    ],
                }
            )
        return {"content": out}

    def completion_logprobs(self, lps, ids, offset: int) -> dict | None:
        if self.n_lp is None:
            return None
        toks = [self.token_str(t) for t in ids]
        offsets, o = [], offset
        for s in toks:
            offsets.append(o)
            o += len(s)
        return {
            "tokens": toks,
            "token_logprobs": [lp for lp, _ in lps],
            "top_logprobs": [{self.token_str(i): v for i, v in top[: self.n_lp]} for _, top in lps],
            "text_offset": offsets,
        }

    def raise_if_failed(self) -> None:
        if self.finish_reason == "error":
            if self.stream.closed_by_server or self.retryable:
                raise shutting_down(self.error)
            raise P.APIError(500, self.error or "generation failed", type_="server_error")


def shutting_down(message: str) -> P.APIError:
    return P.APIError(503, message, type_="service_unavailable", headers={"Retry-After": "5"})


async def collect(request: Request, gen: Generation, poll_s: float = 0.5) -> None:
    """Wait for a non-streamed generation; a client that goes away cancels it. The connection
    is checked every poll_s whether or not tokens are arriving: checked only when none came
    for a second, a request kept its slot to max_tokens after its client left."""
    last_poll = time.monotonic()
    while gen.finish_reason is None:
        try:
            gen.absorb(await gen.stream.get(timeout=poll_s))
        except TimeoutError:
            pass
        if time.monotonic() - last_poll >= poll_s:
            last_poll = time.monotonic()
            if await request.is_disconnected():
                gen.stream.cancel()
                return


async def sse(gen: Generation, chunk, include_usage: bool, usage_chunk, first=None):
    """SSE body: `first` (if any), a chunk per event, usage when asked, then [DONE]."""
    try:
        if first is not None:
            yield f"data: {json.dumps(first)}\n\n"
        while gen.finish_reason is None:
            try:
                ev = await gen.stream.get(timeout=gen.state.keepalive_s)
            except TimeoutError:
                yield ": keep-alive\n\n"  # a long prefill: keep proxies and clients patient
                continue
            gen.absorb(ev)
            if gen.finish_reason == "error":
                err = {"error": {"message": gen.error, "type": "server_error", "code": 500}}
                yield f"data: {json.dumps(err)}\n\n"
                break
            if ev.text or ev.token_ids or ev.final:
                data = f"data: {json.dumps(chunk(gen, ev))}\n\n"
                marks = gen.stream.marks
                if ev.token_ids and "chunk" not in marks:
                    marks["chunk"] = time.perf_counter()
                    log.debug("request %s, first token ms: %s", gen.stream.req.id,
                              gen.stream.timeline())  # fmt: skip
                yield data
        if include_usage:
            yield f"data: {json.dumps(usage_chunk(gen))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        gen.stream.cancel()  # no-op when finished; a disconnect lands here


async def respond(
    request: Request,
    state,
    engine,
    ids: list[int],
    sp,
    stream: bool,
    include_usage: bool,
    chat: bool,
    tools: T.Tools | None = None,
) -> Response:
    """Submit `ids` and answer in OpenAI's completion (chat=False) or chat shape; with `tools`
    (offered to the model), the calls in the reply (tools.py's syntaxes) become `tool_calls`.

    A full queue is decided here, before any response starts: 429 with Retry-After for
    streaming and non-streaming requests alike."""
    try:
        s = Stream(engine.loop, ids, sp, state.metrics, max_waiting=engine.config.max_queue)
        s.marks.update(getattr(request.state, "marks", {}))
    except QueueFull:
        raise P.APIError(
            429,
            "the request queue is full; retry later",
            type_="rate_limit",
            headers={"Retry-After": "1"},
        ) from None
    except Closed as e:
        raise shutting_down(str(e)) from None
    state.streams.add(s)
    gen = Generation(state, s, engine.tokenizer, sp.logprobs)
    rid, created = P.new_id("chatcmpl" if chat else "cmpl"), P.now()

    def envelope(obj, choices, usage=None):
        out = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": state.model_name,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    def choice(text, finish, lps, tids, offset, calls=()):
        if chat:
            delta = {"content": text} if text else {}
            if calls:
                delta["tool_calls"] = calls
            return {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": gen.chat_logprobs(lps, tids),
            }
        return {
            "index": 0,
            "text": text,
            "finish_reason": finish,
            "logprobs": gen.completion_logprobs(lps, tids, offset),
        }

    if stream:
        obj = "chat.completion.chunk" if chat else "text_completion"
        first = None
        if chat:
            first = envelope(
                obj,
                [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )

        calls = T.CallStream(tools.names, tools.syntax) if chat and tools is not None else None

        def chunk(g, ev):
            offset = len(g.text) - len(ev.text)
            text, finish, new = ev.text, g.finish_reason, []
            if calls is not None:
                text, new = calls.feed(ev.text)
                if ev.final:
                    rest, last = calls.flush()
                    text, new = text + rest, new + last
                    finish = "tool_calls" if calls.calls and finish == "stop" else finish
                first = calls.calls - len(new)  # index of the first new call
                if not tools.parallel:  # the first call only
                    new = new[: max(0, 1 - first)]
                new = [{"index": first + k, **c} for k, c in enumerate(new)]
            lps, tids = list(ev.logprobs), list(ev.token_ids)
            return envelope(obj, [choice(text, finish, lps, tids, offset, new)])

        def usage_chunk(g):
            return envelope(obj, [], g.usage())

        return StreamingResponse(
            sse(gen, chunk, include_usage, usage_chunk, first), media_type="text/event-stream"
        )
    await collect(request, gen)
    try:
        gen.raise_if_failed()
    except P.APIError as e:
        return error_response(e)
    usage = gen.usage()
    if chat:
        message, finish = {"role": "assistant", "content": gen.text}, gen.finish_reason
        if tools is not None:
            content, calls = T.parse(gen.text, tools.names, tools.syntax)
            if calls:
                calls = calls if tools.parallel else calls[:1]
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        final = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": gen.chat_logprobs(gen.logprobs, gen.tokens),
        }
        return JSONResponse(envelope("chat.completion", [final], usage))
    final = choice(gen.text, gen.finish_reason, gen.logprobs, gen.tokens, 0)
    return JSONResponse(envelope("text_completion", [final], usage))
