"""The web page (`GET /`): chat with the model and watch the engine batch, with no build step
and nothing loaded from elsewhere (server/web/*), and the JSON it polls (`GET /debug/steps`:
the last steps the engine ran and what it holds now, host/step_log.py). No jax here.

Both are served where the page is on (ServerState.web_ui: by default on a loopback bind only,
since the page shows every request's prompt to whoever opens it)."""

from __future__ import annotations

import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from luce_jax.host.step_log import engine_view

FILES = Path(__file__).resolve().parent / "web"
MEDIA = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
WINDOW_S = 60.0  # the page's plots cover the last minute


async def page(request: Request) -> Response:
    return FileResponse(FILES / "index.html", media_type=MEDIA["index.html"])


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in MEDIA or name == "index.html":
        return JSONResponse({"error": {"message": f"no such file: /web/{name}"}}, 404)
    return FileResponse(FILES / name, media_type=MEDIA[name])


async def steps(request: Request) -> Response:
    """The step log, the engine's slots, KV pool, queue and speculation totals, the tokens
    generated so far and the last minute's times to first token."""
    state = request.app.state.luce
    if state.engine is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})
    now = time.time()
    m = state.metrics
    return JSONResponse({
        "model": state.model_name,
        "now": now,
        "steps": state.step_log.steps(),
        "generated_tokens": m.registry.get_sample_value("luce_generation_tokens_total") or 0,
        "ttft": [[t, s] for t, s in list(m.recent_ttft) if now - t <= WINDOW_S],
        **engine_view(state.engine),
    })  # fmt: skip


ROUTES = [
    Route("/", page, methods=["GET"]),
    Route("/web/{name}", asset, methods=["GET"]),
    Route("/debug/steps", steps, methods=["GET"]),
]
