"""The Starlette app: OpenAI-compatible endpoints over the engine loop. No jax here."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import protocol as P
from .bridge import Stream
from .metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What handlers share. `engine` is None until the model is loaded and compiled."""

    model_name: str
    engine: object = None  # serve.EngineHandle
    keepalive_s: float = 5.0
    metrics: Metrics = field(init=False)

    def __post_init__(self):
        self.metrics = Metrics(self)


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _ready(state: ServerState):
    if state.engine is None:
        raise P.APIError(
            503, "the model is loading", type_="service_unavailable", headers={"Retry-After": "5"}
        )
    return state.engine


def _check_model(state: ServerState, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise P.APIError(
            404,
            f"model {model!r} not found; this server serves {state.model_name!r}",
            "model",
            code="model_not_found",
        )


def _admit_check(engine) -> None:
    if engine.waiting() >= engine.config.max_queue:
        raise P.APIError(
            429,
            "the request queue is full; retry later",
            type_="rate_limit",
            headers={"Retry-After": "1"},
        )


class Generation:
    """Reads one Stream, keeping text, tokens, logprobs and latency metrics."""

    def __init__(self, state: ServerState, stream: Stream, tokenizer, n_logprobs):
        self.state, self.stream, self.tok, self.n_lp = state, stream, tokenizer, n_logprobs
        self.text, self.tokens, self.logprobs = "", [], []
        self.finish_reason, self.error = None, None

    def absorb(self, ev) -> None:
        self.text += ev.text
        self.tokens.extend(ev.token_ids)
        self.logprobs.extend(ev.logprobs)
        if ev.final:
            self.finish_reason = "stop" if ev.finish_reason == "stop" else ev.finish_reason
            self.error = ev.error

    def token_str(self, tid: int) -> str:
        return self.tok.token_bytes[tid].decode("utf-8", errors="replace")

    def chat_logprobs(self, lps, ids) -> dict | None:
        if self.n_lp is None:
            return None
        out = []
        for (lp, top), tid in zip(lps, ids, strict=True):
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
            raise P.APIError(500, self.error or "generation failed", type_="server_error")


async def _collect(request: Request, gen: Generation) -> None:
    """Wait for a non-streamed generation; a client that goes away cancels it."""
    while gen.finish_reason is None:
        try:
            gen.absorb(await gen.stream.get(timeout=1.0))
        except TimeoutError:
            if await request.is_disconnected():
                gen.stream.cancel()
                return


async def _sse(gen: Generation, chunk, include_usage: bool, usage_chunk, first=None):
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
            n_before = len(gen.tokens)
            gen.absorb(ev)
            if gen.finish_reason == "error":
                err = {"error": {"message": gen.error, "type": "server_error", "code": 500}}
                yield f"data: {json.dumps(err)}\n\n"
                break
            if ev.text or ev.token_ids or ev.final:
                yield f"data: {json.dumps(chunk(gen, ev, n_before))}\n\n"
        if include_usage:
            yield f"data: {json.dumps(usage_chunk(gen))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        gen.stream.cancel()  # no-op when finished; a disconnect lands here


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.luce
    try:
        engine = _ready(state)
        body = P.parse_json(await request.body())
        _check_model(state, body)
        prompt = P.completion_prompt(body, engine.vocab_size)
        ids = (
            await run_in_threadpool(engine.tokenizer.encode, prompt)
            if isinstance(prompt, str)
            else prompt
        )
        sp = P.sampling_from(
            body,
            len(ids),
            engine.config.max_ctx,
            engine.vocab_size,
            logprobs=P.completion_logprobs(body),
        )
        stream, include_usage = P.stream_flags(body)
        _admit_check(engine)
    except P.APIError as e:
        return _error(e)
    gen = Generation(
        state, Stream(engine.loop, ids, sp, state.metrics), engine.tokenizer, sp.logprobs
    )
    rid, created = P.new_id("cmpl"), P.now()

    def choice(text, finish, lps, ids_, offset):
        return {
            "index": 0,
            "text": text,
            "finish_reason": finish,
            "logprobs": gen.completion_logprobs(lps, ids_, offset),
        }

    def body_(choices, usage=None):
        out = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    if stream:

        def chunk(g, ev, n_before):
            offset = len(g.text) - len(ev.text)
            return body_(
                [choice(ev.text, g.finish_reason, list(ev.logprobs), list(ev.token_ids), offset)]
            )

        return StreamingResponse(
            _sse(
                gen,
                chunk,
                include_usage,
                lambda g: body_([], P.usage(g.stream.prompt_tokens, len(g.tokens))),
            ),
            media_type="text/event-stream",
        )
    await _collect(request, gen)
    try:
        gen.raise_if_failed()
    except P.APIError as e:
        return _error(e)
    return JSONResponse(
        body_(
            [choice(gen.text, gen.finish_reason, gen.logprobs, gen.tokens, 0)],
            P.usage(len(ids), len(gen.tokens)),
        )
    )


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.luce
    try:
        engine = _ready(state)
        body = P.parse_json(await request.body())
        _check_model(state, body)
        messages = P.chat_messages(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise P.bad("chat_template_kwargs", "must be an object")
        try:
            text = engine.tokenizer.apply_chat_template(messages, True, **kwargs)
        except Exception as e:  # a template's raise_exception, or no template at all
            raise P.bad("messages", f"chat template failed: {e}") from None
        ids = await run_in_threadpool(engine.tokenizer.encode, text, False)
        mt_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        sp = P.sampling_from(
            body,
            len(ids),
            engine.config.max_ctx,
            engine.vocab_size,
            max_tokens_key=mt_key,
            default_max=None,
            logprobs=P.chat_logprobs(body),
        )
        stream, include_usage = P.stream_flags(body)
        _admit_check(engine)
    except P.APIError as e:
        return _error(e)
    gen = Generation(
        state, Stream(engine.loop, ids, sp, state.metrics), engine.tokenizer, sp.logprobs
    )
    rid, created = P.new_id("chatcmpl"), P.now()

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

    if stream:
        first = envelope(
            "chat.completion.chunk",
            [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        )

        def chunk(g, ev, n_before):
            delta = {"content": ev.text} if ev.text else {}
            return envelope(
                "chat.completion.chunk",
                [
                    {
                        "index": 0,
                        "delta": delta,
                        "finish_reason": g.finish_reason,
                        "logprobs": g.chat_logprobs(list(ev.logprobs), list(ev.token_ids)),
                    }
                ],
            )

        return StreamingResponse(
            _sse(
                gen,
                chunk,
                include_usage,
                lambda g: envelope(
                    "chat.completion.chunk", [], P.usage(g.stream.prompt_tokens, len(g.tokens))
                ),
                first=first,
            ),
            media_type="text/event-stream",
        )
    await _collect(request, gen)
    try:
        gen.raise_if_failed()
    except P.APIError as e:
        return _error(e)
    msg = {"role": "assistant", "content": gen.text}
    return JSONResponse(
        envelope(
            "chat.completion",
            [
                {
                    "index": 0,
                    "message": msg,
                    "finish_reason": gen.finish_reason,
                    "logprobs": gen.chat_logprobs(gen.logprobs, gen.tokens),
                }
            ],
            P.usage(len(ids), len(gen.tokens)),
        )
    )


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.luce
    max_len = state.engine.config.max_ctx if state.engine is not None else None
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": P.now(),
                    "owned_by": "luce_jax",
                    "max_model_len": max_len,
                }
            ],
        }
    )


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.luce
    if state.engine is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(
        request.app.state.luce.metrics.render(),
        media_type="text/plain; version=0.0.4; charset=utf-8",
    )


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.luce
    try:
        engine = _ready(state)
        body = P.parse_json(await request.body())
        _check_model(state, body)
        if "messages" in body:
            text = engine.tokenizer.apply_chat_template(
                P.chat_messages({"messages": body["messages"]}), True
            )
            ids = engine.tokenizer.encode(text, False)
        elif isinstance(body.get("prompt"), str):
            ids = engine.tokenizer.encode(
                body["prompt"], body.get("add_special_tokens", True) is not False
            )
        else:
            raise P.bad("prompt", "must be a string (or pass messages)")
    except P.APIError as e:
        return _error(e)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.config.max_ctx})


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.luce
    try:
        engine = _ready(state)
        body = P.parse_json(await request.body())
        _check_model(state, body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < engine.vocab_size
            for t in ids
        ):
            raise P.bad("tokens", f"must be a list of token ids in [0, {engine.vocab_size})")
    except P.APIError as e:
        return _error(e)
    return JSONResponse({"prompt": engine.tokenizer.decode(ids)})


def create_app(state: ServerState) -> Starlette:
    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
        ]
    )
    app.state.luce = state
    return app
