"""The Starlette app: OpenAI-compatible endpoints over the engine loop. No jax here."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from luce_jax.host.step_log import StepLog

from . import protocol as P
from . import tools as T
from .auth import APIKey
from .generation import error_response, respond
from .metrics import Metrics
from .web import ROUTES as WEB_ROUTES

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What handlers share. `engine` is None until the model is loaded and compiled."""

    model_name: str
    engine: object = None  # engine_handle.EngineHandle
    keepalive_s: float = 5.0
    max_request_bytes: int = 4 << 20  # larger bodies get 413 before they are read whole
    default_max_tokens: int | None = None  # a chat request's cap when it sets none
    api_key: str | None = None  # --api-key: Bearer token of /v1/*, /tokenize, /detokenize
    web_ui: bool = False  # the web page at / and the /debug/steps it polls (server/web.py)
    metrics: Metrics = field(init=False)
    step_log: StepLog = field(init=False, default_factory=StepLog)  # the engine thread's steps
    # generations being answered (a shutdown ends them at once: serve.py)
    streams: weakref.WeakSet = field(init=False, default_factory=weakref.WeakSet)

    def __post_init__(self):
        self.metrics = Metrics(self)


def _engine_endpoint(handler):
    """Wrap `handler(request, state, engine, body)`: the engine must be ready, the body a JSON
    object naming this server's model (or none); any APIError becomes its JSON response."""

    async def endpoint(request: Request) -> Response:
        state: ServerState = request.app.state.luce
        request.state.marks = {"received": time.perf_counter()}  # bridge.MARKS
        try:
            if state.engine is None:
                raise P.APIError(
                    503,
                    "the model is loading",
                    type_="service_unavailable",
                    headers={"Retry-After": "5"},
                )
            body = P.parse_json(await read_body(request, state.max_request_bytes))
            request.state.marks["parsed"] = time.perf_counter()
            model = body.get("model")
            if model is not None and model != state.model_name:
                raise P.APIError(
                    404,
                    f"model {model!r} not found; this server serves {state.model_name!r}",
                    "model",
                    code="model_not_found",
                )
            return await handler(request, state, state.engine, body)
        except P.APIError as e:
            return error_response(e)
        except ClientDisconnect:  # gone while its body arrived: nothing was submitted
            return Response(status_code=499)  # nginx's "client closed request"; never sent

    return endpoint


# A body over the limit is still read, and dropped, up to this many times the limit, so that a
# client that sends its whole body before reading (urllib, httpx) reads the 413 instead of a
# reset connection; past that the connection is closed.
DRAIN_FACTOR = 4


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 once it is known to pass `limit` bytes (from its
    Content-Length, else while it arrives): a huge body is never held whole."""
    too_big = P.APIError(
        413,
        f"request body is over {limit} bytes (--max-request-bytes)",
        headers={"Connection": "close"},
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > DRAIN_FACTOR * limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DRAIN_FACTOR * limit:
            raise too_big
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise too_big
    return b"".join(chunks)


@functools.lru_cache(maxsize=4)
def _longest_token(tokenizer) -> int:
    """Bytes of the vocabulary's longest token: once per tokenizer, not per request."""
    return max(map(len, tokenizer.token_bytes)) or 1


def check_length_bound(engine, text: str, field: str) -> None:
    """Refuse a prompt that cannot fit the context before tokenizing it: no token stands for
    more than the vocabulary's longest token's bytes, so bytes / that is a lower bound on its
    tokens (a 50 MB prompt took 67 s to tokenize before the context check refused it)."""
    longest = _longest_token(engine.tokenizer)
    at_least = len(text.encode("utf-8", "surrogatepass")) // longest
    if at_least >= engine.config.max_ctx:
        raise P.bad(
            field,
            f"the prompt has at least {at_least} tokens; the context is {engine.config.max_ctx}",
        )


def _chat_prompt(engine, body: dict, tools: T.Tools | None) -> str:
    """Render `messages` (and `chat_template_kwargs`, and the tools offered) with the model's
    chat template."""
    messages = P.chat_messages(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise P.bad("chat_template_kwargs", "must be an object")
    if tools is not None:
        kwargs = {**kwargs, "tools": tools.tools}
    try:
        return engine.tokenizer.apply_chat_template(messages, True, **kwargs)
    except Exception as e:  # a template's raise_exception, or no template at all
        raise P.bad("messages", f"chat template failed: {e}") from None


def _offered_tools(engine, body: dict) -> T.Tools | None:
    """The request's tools as the template offers them to the model (None: no tools, or
    tool_choice none), in the tool-call syntax its chat template teaches."""
    tools = T.chat_tools(body)
    if tools is None or tools.mode == "none":
        return None
    return dataclasses.replace(tools, syntax=T.syntax_of(engine.tokenizer.chat_template))


@_engine_endpoint
async def completions(request: Request, state: ServerState, engine, body: dict) -> Response:
    prompt = P.completion_prompt(body, engine.vocab_size)
    if isinstance(prompt, str):
        check_length_bound(engine, prompt, "prompt")
    ids = (
        await run_in_threadpool(engine.tokenizer.encode, prompt)
        if isinstance(prompt, str)
        else prompt
    )
    request.state.marks["tokenized"] = time.perf_counter()
    sp = P.sampling_from(
        body,
        len(ids),
        engine.config.max_ctx,
        engine.vocab_size,
        logprobs=P.completion_logprobs(body),
    )
    stream, include_usage = P.stream_flags(body)
    return await respond(request, state, engine, ids, sp, stream, include_usage, chat=False)


@_engine_endpoint
async def chat_completions(request: Request, state: ServerState, engine, body: dict) -> Response:
    P.check_fields(body, P.CHAT_FIELDS)
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise P.bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    tools = _offered_tools(engine, body)
    text = await run_in_threadpool(_chat_prompt, engine, body, tools)
    check_length_bound(engine, text, "messages")
    ids = await run_in_threadpool(engine.tokenizer.encode, text, False)
    request.state.marks["tokenized"] = time.perf_counter()
    mt_key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    sp = P.sampling_from(
        body,
        len(ids),
        engine.config.max_ctx,
        engine.vocab_size,
        max_tokens_key=mt_key,
        default_max=state.default_max_tokens,
        logprobs=P.chat_logprobs(body),
    )
    forced = tools.forced() if tools is not None else None
    if forced is not None:  # required / a named function: the grammar makes the call
        if sp.json_schema is not None:
            raise P.bad("response_format", "cannot be combined with a required tool_choice")
        sp = sp.replace(json_schema=forced[0], json_prefix=forced[1], json_suffix=forced[2])
    stream, include_usage = P.stream_flags(body)
    return await respond(
        request, state, engine, ids, sp, stream, include_usage, chat=True, tools=tools
    )


def _model_card(state: ServerState) -> dict:
    max_len = state.engine.config.max_ctx if state.engine is not None else None
    return {
        "id": state.model_name,
        "object": "model",
        "created": P.now(),
        "owned_by": "luce_jax",
        "max_model_len": max_len,
    }


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.luce)]})


async def model(request: Request) -> Response:
    """GET /v1/models/{id}: the served model's card, or a 404 naming the id."""
    state: ServerState = request.app.state.luce
    name = request.path_params["model_id"]
    if name != state.model_name:
        return error_response(
            P.APIError(
                404,
                f"model {name!r} not found; this server serves {state.model_name!r}",
                "model",
                code="model_not_found",
            )  # fmt: skip
        )
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.luce
    if state.engine is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(
        request.app.state.luce.metrics.render(),
        media_type="text/plain; version=0.0.4; charset=utf-8",
    )


@_engine_endpoint
async def tokenize(request: Request, state: ServerState, engine, body: dict) -> Response:
    # rendering and tokenizing run off the event loop: a long text never stalls other requests
    if "messages" in body:  # rendered as a chat request would be, tools offered included
        text = await run_in_threadpool(_chat_prompt, engine, body, _offered_tools(engine, body))
        ids = await run_in_threadpool(engine.tokenizer.encode, text, False)
    elif isinstance(body.get("prompt"), str):
        add_special = body.get("add_special_tokens", True) is not False
        ids = await run_in_threadpool(engine.tokenizer.encode, body["prompt"], add_special)
    else:
        raise P.bad("prompt", "must be a string (or pass messages)")
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.config.max_ctx})


@_engine_endpoint
async def detokenize(request: Request, state: ServerState, engine, body: dict) -> Response:
    ids = P.token_ids(body.get("tokens"), "tokens", engine.vocab_size)
    return JSONResponse({"prompt": engine.tokenizer.decode(ids)})


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (an unknown path: 404, a wrong method: 405) in the OpenAI error
    shape every other error has, naming the method and path as OpenAI's "Invalid URL" does."""
    message = f"{exc.detail}: {request.method} {request.url.path}"
    return error_response(P.APIError(exc.status_code, message, headers=exc.headers))


def create_app(state: ServerState) -> Starlette:
    app = Starlette(
        exception_handlers={HTTPException: http_error},
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            *(WEB_ROUTES if state.web_ui else []),
        ],
    )
    app.state.luce = state
    if state.api_key:
        app.add_middleware(APIKey, key=state.api_key)
    return app
