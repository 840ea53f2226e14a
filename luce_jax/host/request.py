"""A request's lifecycle and output processing: detokenize, stop strings, EOS, max_tokens."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Literal

from ..sampling_params import SamplingParams

# running: holds a slot (its prompt and decode progress live in the engine's SlotTable)
Phase = Literal["queued", "running", "finished", "cancelled", "failed"]
_ids = itertools.count()


@dataclass
class Event:
    """What a request's stream receives: text/tokens as they come, then one final event."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple = ()  # per token: (logprob, ((id, logprob), ...))
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    retryable: bool = False  # an error of a request that never ran: the client may retry

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)  # identity semantics: two requests are never "equal"
class Request:
    prompt: list[int]
    sampling: SamplingParams
    on_event: object = None  # callable(Event), called on the engine thread
    id: int = field(default_factory=lambda: next(_ids))
    phase: Phase = "queued"
    slot: int = -1
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (set at admission)
    finish_reason: str | None = None
    error: str | None = None
    processor: OutputProcessor | None = None  # set when the scheduler takes the request

    @property
    def done(self) -> bool:
        return self.phase in ("finished", "cancelled", "failed")

    @property
    def output_ids(self) -> list[int]:
        """Tokens delivered so far (the processor owns them)."""
        return self.processor.token_ids if self.processor is not None else []

    def emit(self, ev: Event) -> None:
        if self.on_event is not None:
            self.on_event(ev)


class OutputProcessor:
    """Turns sampled tokens into text deltas and decides when a request is finished.

    Text that could still become a stop string is held back, so a stop string is never
    streamed, even when it spans several tokens.
    """

    def __init__(self, sampling: SamplingParams, tokenizer=None, eog_ids=frozenset()):
        from ..loading.tokenizer import IncrementalDecoder

        self.sp = sampling
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.eog = frozenset(eog_ids)
        self.stop_ids = frozenset(sampling.stop_token_ids)
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of self.text already emitted
        self.token_ids: list[int] = []  # every token delivered

    def push(self, token: int) -> tuple[str, str | None]:
        """Feed one token. Returns (text to emit now, finish reason or None)."""
        self.token_ids.append(token)
        n = len(self.token_ids)
        can_stop = n > self.sp.min_tokens
        if can_stop and (token in self.stop_ids or (not self.sp.ignore_eos and token in self.eog)):
            return self._drain(), "stop"
        if self.decoder is not None:
            self.text += self.decoder.push(token)
        if can_stop and self.sp.stop:
            hit = self._find_stop()
            if hit is not None:
                self.text = self.text[:hit]
                return self._drain(), "stop"
        if n >= self.sp.max_tokens:
            if self.decoder is not None:
                self.text += self.decoder.flush()
            return self._drain(), "length"
        safe = len(self.text) - self._held_back()
        out = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out, None

    def _find_stop(self) -> int | None:
        # only text not yet sent can hold a new match (plus its overlap with what was held back)
        start = max(self.sent - max(len(s) for s in self.sp.stop), 0)
        hits = [i for s in self.sp.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.sp.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _drain(self) -> str:
        out = self.text[self.sent :]
        self.sent = len(self.text)
        return out
