"""`python -m luce_jax.serve`: flags -> EngineConfig -> engine thread -> OpenAI-compatible server.

The HTTP server starts at once (GET /health answers 503 while the model loads and compiles);
the engine is built in a background thread and handed to the app when ready.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
import threading
from pathlib import Path

from . import __version__
from .config import (
    ATTENTION_BACKENDS,
    CACHE_TYPES,
    DEFAULT_MODEL,
    DTYPES,
    MOE_BACKENDS,
    QUANT_ACTIVATIONS,
    QUANT_BACKENDS,
    SPEC_MODES,
    SPEC_POLICIES,
    EngineConfig,
)

log = logging.getLogger("luce_jax.serve")

HELP = {
    "model": "GGUF model file (default: the embedded model trained on the Python stdlib)",
    "model_name": "name served in /v1/models and expected in requests (none: the file stem)",
    "dtype": f"weights: {', '.join(DTYPES)} (a float type dequantizes at load; quantized keeps "
    "GGUF blocks on the device; auto keeps them only when dequantized weights would not fit)",
    "max_concurrency": "sequence slots: requests decoding at once",
    "max_ctx": "longest prompt + output per request, in tokens",
    "kv_pool_tokens": "KV cache size in tokens; 0 = what free device memory holds",
    "kv_block_size": "tokens per KV block (a power of two)",
    "cache_type_k": f"K cache element type: {', '.join(CACHE_TYPES)}",
    "cache_type_v": f"V cache element type: {', '.join(CACHE_TYPES)}",
    "attention_backend": (
        f"paged attention: {', '.join(ATTENTION_BACKENDS)} (auto: pallas on GPU, xla on CPU)"
    ),
    "moe_backend": (
        f"MoE grouped expert matmuls: {', '.join(MOE_BACKENDS)} (auto: pallas on GPU, xla on CPU)"
    ),
    "quant_backend": (
        f"matmuls with quantized weights: {', '.join(QUANT_BACKENDS)} (auto: pallas on GPU, xla "
        "on CPU)"
    ),
    "quant_activations": (
        f"{', '.join(QUANT_ACTIVATIONS)}: what the quantized kernel's decode calls dot the codes "
        "with (int8: activations rounded per 32 values, as llama.cpp; auto: int8)"
    ),
    "prefill_chunk": "prompt tokens one sequence appends per step",
    "prefill_token_budget": "tokens per step, decode rows included",
    "max_concurrent_prefills": "prompts advanced in one step",
    "admission_coalesce_ms": "after idle, wait this long so a burst of requests starts together",
    "max_queue": "waiting requests before new ones get 429",
    "cuda_graph_max_tokens": "steps of more tokens than this run without CUDA graphs (0: every "
    "step uses them)",
    "prefix_cache": "on: requests reuse the KV blocks of a prompt prefix an earlier request "
    "computed (whole blocks; off: every prompt is computed in full)",
    "chat_template_file": "Jinja chat template overriding the GGUF's",
    "compile_cache_dir": "JAX persistent compilation cache ('' to disable; the default "
    "follows LUCE_COMPILE_CACHE_DIR)",
    "spec_mode": f"speculative decoding: {', '.join(SPEC_MODES)} (draft: a draft model proposes; "
    "ngram: prompt lookup; head: a draft head on the model's hidden states, inside its step; "
    "dflash: a DFlash block drafter on its hidden states, inside its step; "
    "mtp: the model file's own MTP block, on its hidden states, inside its step)",
    "draft": "draft GGUF for --spec-mode draft (same vocabulary), draft head GGUF for "
    "--spec-mode head, or DFlash drafter GGUF for --spec-mode dflash (default: the embedded "
    "model's)",
    "draft_tokens": "most proposals one sequence verifies per step (K)",
    "spec_policy": f"{', '.join(SPEC_POLICIES)}: how many proposals a step verifies (always: K "
    "a sequence; adaptive: by acceptance and step cost; auto: with proposals on the device, "
    "always while measured faster than none, else adaptive)",
    "head_lookup": "with --spec-mode head, a sequence whose last 3 tokens occurred before "
    "verifies prompt lookup's proposals instead of the head's",
    "spec_synthetic_accept": "benchmarks only (with --benchmark): every verify row keeps "
    "exactly min(N, K) proposals, whatever they are (-1: off)",
    "benchmark": "allow benchmark-only settings that serve other tokens than the model's",
    "seed": "seed for requests that do not give one",
    "tensor_parallel": "devices the model is split over (its heads, FFN width and vocabulary; "
    "docs/parallelism.md)",
    "expert_parallel": "MoE models: the experts split over the devices with N = "
    "--tensor-parallel, over their FFN width with 1 (0: auto, = --tensor-parallel)",
    "devices": "local device indices to run on, comma-separated (default: the first "
    "--tensor-parallel ones)",
    "coordinator": "several hosts: host:port where process 0 coordinates (jax.distributed)",
    "num_processes": "several hosts: processes in all (--tensor-parallel = all their devices)",
    "process_id": "several hosts: this process's index; 0 serves HTTP, the others follow it",
    "record_expert_stats": "MoE models: write the tokens routed to each expert of each layer "
    "to this JSON file when the server stops",
    "expert_placement": "a --record-expert-stats file: experts placed over the devices so "
    "each device's take an even share of the routed tokens (expert parallelism)",
}


class Parser(argparse.ArgumentParser):
    """argparse, but an invalid value is one line naming the flag and pointing at --help, not
    the 30-line usage first."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, except None: the help text says what no value means."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def on_off(value: str) -> bool:
    """A boolean flag's value: on or off."""
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{value!r}: must be on or off")
    return value == "on"


def web_ui_on(args) -> bool:
    """--web-ui as asked, else on for a loopback --host only (the page shows every prompt)."""
    from server.auth import loopback

    return loopback(args.host) if args.web_ui is None else args.web_ui


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="python -m luce_jax.serve",
        description=__doc__,
        formatter_class=DefaultsFormatter,
    )
    ap.add_argument("--version", action="version", version=f"luce_jax {__version__}")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument(
        "--api-key",
        default=os.environ.get("LUCE_API_KEY") or None,
        help="Bearer token every /v1/*, /tokenize and /detokenize request must send (default: "
        "$LUCE_API_KEY; none: no authentication); /health stays open, /metrics is open to "
        "loopback clients",
    )
    ap.add_argument("--port", type=int, default=8000, help="port to listen on")
    ap.add_argument(
        "--web-ui",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the chat and engine page at / and the /debug/steps it reads (default: on where "
        "--host is a loopback address; elsewhere it must be asked for, as it shows prompts)",
    )
    ap.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 << 20,
        help="larger request bodies are refused with 413",
    )
    ap.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="max_tokens of a chat request that sets none (default: up to the context left, as "
        "OpenAI and vLLM do; 256 with the embedded model, which does not end chat turns)",
    )
    ap.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging level",
    )
    for f in dataclasses.fields(EngineConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = {int: int, float: float, bool: on_off}.get(type(default), str)
        extra = {}
        if kind is on_off:  # argparse passes a string default through `type` too
            default, extra = ("on" if default else "off"), {"metavar": "on|off"}
        ap.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=default,
            help=HELP.get(f.name, f.name),
            **extra,
        )
    return ap


# The embedded 15M-parameter model was trained on code, not chats: it rarely ends a turn, and a
# chat with no max_tokens ran to the end of its 2048-token context (about a minute on 2 CPU
# cores). Real models keep OpenAI's default (the context left).
EMBEDDED_CHAT_MAX_TOKENS = 256


def parse_config(argv=None) -> tuple[argparse.Namespace, EngineConfig]:
    """Parse flags; an invalid value ends the process with a message and status 2."""
    ap = build_parser()
    args = ap.parse_args(argv)
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    kw["compile_cache_dir"] = kw["compile_cache_dir"] or None
    kw["model"] = kw["model"] or str(DEFAULT_MODEL)
    embedded = Path(kw["model"]).resolve() == Path(DEFAULT_MODEL).resolve()
    if args.default_max_tokens is None and embedded:
        args.default_max_tokens = EMBEDDED_CHAT_MAX_TOKENS
    if kw["model_name"] is None:
        kw["model_name"] = Path(kw["model"]).stem
    if kw["devices"] is not None:
        try:
            kw["devices"] = tuple(int(i) for i in kw["devices"].split(","))
        except ValueError:
            ap.error(f"--devices {kw['devices']}: must be device indices, as 0,1")
    if not 0 < args.port < 65536:
        ap.error(f"--port {args.port}: must be in 1..65535")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        ap.error(f"--default-max-tokens {args.default_max_tokens}: must be positive")
    if args.max_request_bytes < 1:
        ap.error(f"--max-request-bytes {args.max_request_bytes}: must be positive")
    if args.api_key is not None and not args.api_key.strip():
        ap.error("--api-key: must not be empty")
    try:
        config = EngineConfig(**kw)
    except ValueError as e:
        name = str(e).split("=", 1)[0]
        ap.error(f"--{name.replace('_', '-')}: {e}")
    try:  # before anything listens: a bad file ends here, not in a traceback after start-up
        check_model_file(config.model)
    except ValueError as e:
        ap.error(f"--model: {e}")
    return args, config


def check_model_file(path: str) -> None:
    """Raise ValueError unless `path` is a complete GGUF of a supported architecture and
    tokenizer."""
    from .loading.gguf import model_config, open_gguf
    from .loading.tokenizer import GGUFVocab, check_supported

    md = open_gguf(path).metadata
    check_supported(GGUFVocab.from_metadata(md))
    model_config(md)


POLLED = ("/health", "/metrics")  # paths a load balancer or a scraper polls


class _DropHealthChecks(logging.Filter):
    """Drops uvicorn's access-log lines of GET /health and /metrics: load balancers, clients
    waiting for the server and Prometheus poll them every few seconds."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and args[1] == "GET" and str(args[2]).startswith(POLLED))


def quiet_logs() -> None:
    """Silence what says nothing to a user: JAX's note that it found no TPU (INFO), its
    internals at --log-level debug (hundreds of lines of tracing and compile-cache notes),
    polling access lines, and XLA's C++ warnings (GPU autotuning's "Delay kernel timed out";
    set TF_CPP_MIN_LOG_LEVEL to see them)."""
    logging.getLogger("jax").setLevel(logging.INFO)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _DropHealthChecks) for f in access.filters):
        access.addFilter(_DropHealthChecks())
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # read when jax's backend starts


SHUTDOWN_S = 5  # the longest a connection may hold up exit after SIGINT / SIGTERM
SHUTTING_DOWN = "the server is shutting down"


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that, on SIGINT / SIGTERM, first closes the engine: new requests
        get 503, and requests in flight end at once (an error event on a stream, 503
        otherwise), so exit does not wait for generations to run out."""

        def __init__(self, state, config):
            super().__init__(config)
            self.state = state

        def handle_exit(self, sig, frame):
            if self.state.engine is not None and self.state.engine.loop.closed is None:
                log.info("shutting down: closing the engine to requests")
                self.state.engine.loop.close(SHUTTING_DOWN)
            for stream in list(self.state.streams):  # now, not when the step in flight ends
                stream.abort(SHUTTING_DOWN)
            super().handle_exit(sig, frame)

    return Server


def main(argv=None) -> int:
    import uvicorn

    from server.app import ServerState, create_app
    from server.auth import loopback

    from .engine_handle import start_engine

    args, config = parse_config(argv)
    Server = _server_class()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_logs()
    if config.process_id > 0:  # no server here: this process runs the steps process 0 plans
        from .engine_handle import follow

        follow(config)
        return 0
    if args.api_key is None and not loopback(args.host):
        log.warning("listening on %s with no --api-key: anyone who can reach it can use it",
                    args.host)  # fmt: skip
    state = ServerState(
        model_name=config.model_name,
        max_request_bytes=args.max_request_bytes,
        default_max_tokens=args.default_max_tokens,
        api_key=args.api_key,
        web_ui=web_ui_on(args),
    )
    server = Server(
        state,
        uvicorn.Config(
            create_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=SHUTDOWN_S,
        ),
    )
    failed = []

    def load():
        try:
            handle = start_engine(config)
            handle.loop.step_listeners.append(state.metrics.step.observe)
            if state.web_ui:
                handle.loop.step_listeners.append(
                    functools.partial(state.step_log.add, handle.scheduler)
                )
            state.engine = handle
            url = f"http://{args.host}:{args.port}"
            log.info("ready: serving %s on %s%s", config.model_name, url,
                     f" (chat and engine page: {url}/)" if state.web_ui else "")  # fmt: skip
        except Exception as e:
            log.exception("failed to load %s", config.model)
            failed.append(e)
            server.should_exit = True

    loader = threading.Thread(target=load, name="luce-load", daemon=True)
    loader.start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it has stopped
        pass
    code = 1 if failed else 0
    if state.engine is not None:
        state.engine.loop.stop(timeout=1.0)
        if not state.engine.loop.running:  # followers stop; the expert stats are written
            state.engine.finish()
    if loader.is_alive() or (state.engine is not None and state.engine.loop.running):
        # Loading and compiling cannot be interrupted, nor can a step on the device (a long
        # CPU prefill): exit now rather than when they end, as a user pressing Ctrl-C expects
        log.info("exiting with %s still running", "loading" if loader.is_alive() else "a step")
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
