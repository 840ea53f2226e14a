"""SamplingParams: per-request generation options (no jax: the server builds these)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # OpenAI's maximum; device/sampling.TOP_LOGPROBS computes this many


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation options (OpenAI / vLLM semantics)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    cache_prompt: bool = True  # may reuse a cached prompt prefix (llama.cpp's server's option)
    # Structured output: the output is JSON matching this JSON schema (a dict or its JSON text;
    # {"type": "object"} for any JSON object), enforced token by token (host/grammar.py).
    json_schema: str | dict | None = None
    # Literal text the output must have before and after that JSON (a forced tool call wraps
    # its JSON in <tool_call> tags); only with json_schema.
    json_prefix: str = ""
    json_suffix: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "must be an integer >= 1")
        if not 0 <= self.temperature <= 2:  # OpenAI's range, as the HTTP API takes it
            bad("temperature", "must be in [0, 2]")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                bad(name, "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", "must be in (0, 10]")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", "must be an integer in [0, max_tokens]")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (alternatives per token)")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if (self.json_prefix or self.json_suffix) and self.json_schema is None:
            bad("json_prefix", "needs json_schema")
        if self.json_schema is not None:
            try:
                schema = (
                    json.loads(self.json_schema)
                    if isinstance(self.json_schema, str)
                    else self.json_schema
                )
            except ValueError:
                bad("json_schema", "must be a JSON object (a dict or its JSON text)")
            if not isinstance(schema, dict):
                bad("json_schema", "must be a JSON object (a dict or its JSON text)")
            # JSON text: hashable and the compiled grammars' cache key; keys keep their order,
            # which is the order the output's properties take
            object.__setattr__(self, "json_schema", json.dumps(schema))

    def replace(self, **kw) -> SamplingParams:
        return dataclasses.replace(self, **kw)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
