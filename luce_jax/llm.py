"""LLM: the offline Python API (load a GGUF, warm up, generate through the engine loop)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .config import DEFAULT_MODEL, EngineConfig
from .engine_handle import start_engine
from .host.request import Event
from .host.scheduler import QueueFull
from .sampling_params import SamplingParams


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class LLM:
    """Load a model and generate with continuous batching.

    >>> llm = LLM()  # the embedded default model; or LLM(model="model.gguf", ...)
    >>> llm.generate(["def fib(n):"], SamplingParams(max_tokens=32, temperature=0))[0].text

    Keyword arguments are EngineConfig fields (the CLI flags in snake_case).
    """

    def __init__(self, model: str | None = None, **kwargs):
        handle = start_engine(EngineConfig(model=str(model or DEFAULT_MODEL), **kwargs))
        self.handle = handle
        self.tokenizer, self.engine = handle.tokenizer, handle.engine
        self.scheduler, self.loop = handle.scheduler, handle.loop
        self.config = self.engine.config
        self.model_config = self.engine.runner.cfg

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in prompt):
            raise ValueError("prompt: token ids must be integers in [0, vocab_size)")
        return list(prompt)

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Generate for every prompt at once (continuous batching); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling = sampling or SamplingParams()
        sps = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(sps) != len(prompts):
            raise ValueError(f"sampling: {len(sps)} params for {len(prompts)} prompts")
        ids = [self.encode_prompt(p) for p in prompts]
        outs = [Completion("", [], None, prompt_token_ids=i) for i in ids]
        done = threading.Semaphore(0)
        finished = threading.Event()  # set when any request ends: a queue place may be free

        def listener(out: Completion, n_top: int | None):
            def on_event(ev: Event):
                out.text += ev.text
                out.token_ids.extend(ev.token_ids)
                # the device computes the top 20; a request gets the alternatives it asked for
                out.logprobs.extend((lp, top[:n_top]) for lp, top in ev.logprobs)
                if ev.final:
                    out.finish_reason, out.error = ev.finish_reason, ev.error
                    finished.set()
                    done.release()

            return on_event

        # Offline, every prompt is served: submits wait for a place in the scheduler's queue
        # (max_queue, the server's back-pressure) rather than fail as an HTTP request would.
        reqs = []
        for i, sp, out in zip(ids, sps, outs, strict=True):
            cb = listener(out, sp.logprobs)
            while True:
                try:
                    reqs.append(self.loop.submit(i, sp, cb, max_waiting=self.scheduler.max_queue))
                    break
                except QueueFull:
                    finished.wait(0.05)  # admission also frees places, without an event
                    finished.clear()
        for _ in outs:
            done.acquire()
        for req, out in zip(reqs, outs, strict=True):
            out.cached_tokens = req.cached_tokens
        return outs

    def close(self) -> None:
        self.handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
