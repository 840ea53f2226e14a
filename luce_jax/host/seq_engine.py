"""SeqEngine: the interface the scheduler speaks to an engine, in slots and token counts, and
the dataclasses that cross it (host/engine.py's StepEngine implements it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..sampling_params import SamplingParams
from .slots import SlotTable


@dataclass(frozen=True)
class AdmitResult:
    status: Literal["admitted", "busy", "failed"]
    slot: int = -1
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache supplied


@dataclass(frozen=True)
class StepLimits:
    max_prefill_seqs: int
    max_prefill_tokens_per_seq: int
    max_prefill_tokens_total: int


@dataclass(frozen=True)
class StepPlan:
    decode: list[int]  # every slot that decodes, once (its input token is on the device)
    prefills: list[tuple[int, int]]  # (slot, number of prompt tokens to append)


@dataclass(frozen=True)
class TokenOut:
    token: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepResult:
    """A collected step: per live slot that sampled, its new tokens in order (one, or more when
    it verified accepted proposals). Slots released since the step was dispatched are absent."""

    tokens: dict[int, list[TokenOut]] = field(default_factory=dict)


class StepFailed(Exception):
    """A launched step failed; `slots` are its rows' slots that are still live."""

    def __init__(self, slots: list[int], cause: BaseException):
        super().__init__(str(cause))
        self.slots = slots


class SeqEngine(Protocol):
    slot_count: int
    max_context: int
    block_size: int
    slots: SlotTable  # progress the scheduler plans from
    overlap: bool  # may step N+1 be dispatched before step N is collected
    in_flight: int  # steps dispatched and not yet collected

    def admit(self, request_id, prompt: list[int], sampling: SamplingParams) -> AdmitResult: ...
    def step_limits(self, num_decode_rows: int) -> StepLimits: ...
    def dispatch(self, plan: StepPlan) -> None: ...
    def collect(self) -> StepResult: ...
    def retire(self, slot: int) -> None: ...
