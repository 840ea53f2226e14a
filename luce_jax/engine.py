"""SeqEngine: the model-specific half behind the scheduler, its dataclasses, and DenseEngine.

The scheduler speaks only in slots and token counts; an engine owns slots, KV blocks and
the device. A slot id is stable for a request's lifetime and is carried by every row.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

from .batch import Row, buckets, pick_bucket
from .config import EngineConfig
from .kv_pool import KVPool
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmitResult:
    status: Literal["admitted", "busy", "failed"]
    slot: int = -1
    error: str | None = None


@dataclass(frozen=True)
class StepLimits:
    max_prefill_seqs: int
    max_prefill_tokens_per_seq: int
    max_prefill_tokens_total: int


@dataclass(frozen=True)
class StepPlan:
    decode: list[tuple[int, int]]  # (slot, input token): every decoding slot, once
    prefills: list[tuple[int, int]]  # (slot, number of prompt tokens to append)


@dataclass(frozen=True)
class TokenOut:
    token: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StepResult:
    # slot -> its next tokens, in order: one, or more when it verified accepted proposals
    decoded: dict[int, list[TokenOut]] = field(default_factory=dict)
    completed: dict[int, TokenOut] = field(default_factory=dict)  # slot -> first token
    advanced: set[int] = field(default_factory=set)  # prefilling slots that are not done
    errors: dict[int, str] = field(default_factory=dict)  # slot -> message


class SeqEngine(Protocol):
    slot_count: int
    max_context: int
    block_size: int

    def admit(self, request_id, prompt: list[int], sampling: SamplingParams) -> AdmitResult: ...
    def step_limits(self, num_decode_rows: int) -> StepLimits: ...
    def step(self, plan: StepPlan) -> StepResult: ...
    def retire(self, slot: int) -> None: ...


@dataclass
class Slot:
    request_id: object
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    prefilled: int = 0  # prompt tokens in the cache
    generated: int = 0  # tokens sampled so far

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)

    @property
    def kv_len(self) -> int:
        """Tokens in the cache: the prompt so far, then each decode input as it is fed."""
        return self.prefilled + max(self.generated - 1, 0)


class DenseEngine:
    """SeqEngine over models/dense.py; reserves prompt + max_tokens at admission.

    Reserving the worst case means a decoding slot never runs out of blocks, so there is no
    preemption: a request waits in the queue until its whole reservation fits.
    """

    def __init__(self, config: EngineConfig, runner, num_blocks: int):
        self.config = config
        self.runner = runner
        self.slot_count = config.max_concurrency
        self.max_context = config.max_ctx
        self.block_size = config.kv_block_size
        self.pool = KVPool(
            num_blocks, config.kv_block_size, self.slot_count, config.max_blocks_per_seq
        )
        self.slots: dict[int, Slot] = {}
        self._free_slots = list(range(self.slot_count))
        # The step token budget counts decode rows too (as vLLM's max_num_batched_tokens).
        # One row width per token bucket, S(T) = min(T, slots): a decode-only step of C rows
        # pads to the next power of two and no further, and the buckets to compile are few.
        # Smallest bucket 8: XLA's GPU dot for M=1 measured 9.4 ms a Qwen3-8B step against
        # 6.6 ms at M=8 on the H200, so a lone decode row is padded to 8.
        self.token_buckets = buckets(max(config.prefill_token_budget, self.slot_count), 8)
        self._max_rows = buckets(self.slot_count, 1)[-1]
        self._rng = random.Random(config.seed)
        self.spec = None  # speculation.Speculator once enable_speculation is called
        self.last_bucket = (0, 0)  # (T, S) of the last step, for the trace

    def enable_speculation(self, speculator) -> None:
        """Verify proposals from `speculator` (built after warmup: its policy needs the
        measured step times)."""
        assert not self.slots, "speculation is enabled before the first admission"
        self.spec = speculator

    def rows_for(self, t_bucket: int) -> int:
        return min(t_bucket, self._max_rows)

    def bucket_pairs(self) -> list[tuple[int, int]]:
        """Every (T, S) pair a plan can lower to (rows never exceed tokens or slots)."""
        return [(t, self.rows_for(t)) for t in self.token_buckets]

    def admit(self, request_id, prompt, sampling) -> AdmitResult:
        if not prompt:
            return AdmitResult("failed", error="prompt is empty")
        need = len(prompt) + sampling.max_tokens
        if need > self.max_context:
            return AdmitResult(
                "failed",
                error=f"prompt ({len(prompt)}) + max_tokens ({sampling.max_tokens}) exceeds "
                f"the context of {self.max_context} tokens",
            )
        if self.pool.blocks_for(need) > self.pool.capacity:
            return AdmitResult("failed", error=f"{need} tokens exceed the whole KV pool")
        if not self._free_slots:
            return AdmitResult("busy")
        slot = min(self._free_slots)  # lowest free slot: reuse at once, compact tables
        if not self.pool.reserve(slot, need):
            return AdmitResult("busy")
        self._free_slots.remove(slot)
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(32)
        self.slots[slot] = Slot(request_id, list(prompt), sampling, seed & 0xFFFFFFFF)
        if self.spec is not None:
            self.spec.start(slot, list(prompt), need)
        return AdmitResult("admitted", slot)

    def step_limits(self, num_decode_rows: int) -> StepLimits:
        c = self.config
        room = self.token_buckets[-1] - num_decode_rows
        return StepLimits(
            max_prefill_seqs=c.max_concurrent_prefills,
            max_prefill_tokens_per_seq=c.prefill_chunk,
            max_prefill_tokens_total=min(c.prefill_token_budget, room),
        )

    def step(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        props = self._proposals(plan)
        rows, params, seeds, steps = [], [], [], []
        for slot, token in plan.decode:
            s = self.slots[slot]
            assert s.decoding, f"slot {slot} is not decoding"
            start, draft = s.kv_len, props.get(slot, [])
            # Proposals go past kv_len and overwrite nothing of the sequence; rejected ones are
            # rolled back by kv_len alone (it counts emitted tokens), and their blocks stay.
            self.pool.ensure(slot, start + 1 + len(draft))
            rows.append(Row(slot, (token, *draft), start, True, len(draft)))
            params.append(s.sampling), seeds.append(s.seed), steps.append(s.generated)
        for slot, n in plan.prefills:
            s = self.slots[slot]
            assert not s.decoding and n > 0, (slot, n)
            end = s.prefilled + n
            self.pool.ensure(slot, end)
            done = end == len(s.prompt)
            rows.append(Row(slot, tuple(s.prompt[s.prefilled : end]), s.prefilled, done))
            params.append(s.sampling if done else None), seeds.append(s.seed)
            steps.append(0)
        n_tok = sum(len(r.tokens) for r in rows)
        t_bucket = pick_bucket(n_tok, self.token_buckets)
        s_bucket = self.rows_for(t_bucket)
        self.last_bucket = (t_bucket, s_bucket)
        out = self.runner.run(rows, self.pool.block_array, t_bucket, s_bucket, params, seeds, steps)
        result = StepResult()
        for i, r in enumerate(rows):
            s = self.slots[r.slot]
            first = int(out["logit_start"][i])
            if s.decoding:
                kept = int(out["accepted"][i])
                toks = [self._token(out, first + j) for j in range(kept + 1)]
                s.generated += len(toks)
                result.decoded[r.slot] = toks
                if self.spec is not None:
                    self.spec.record(r.slot, r.draft, kept, [t.token for t in toks])
                continue
            s.prefilled += len(r.tokens)
            if s.decoding:  # commit: the whole prompt is in the cache
                s.generated = 1
                result.completed[r.slot] = tok = self._token(out, first)
                if self.spec is not None:
                    self.spec.record(r.slot, 0, 0, [tok.token])
            else:
                result.advanced.add(r.slot)
        if self.spec is not None:
            self.spec.step_done(time.perf_counter() - t0)
        return result

    def _proposals(self, plan: StepPlan) -> dict[int, list[int]]:
        """Speculative proposals per decoding slot, capped so a verify row never emits past
        max_tokens (which also keeps its KV writes inside the slot's reservation)."""
        if self.spec is None:
            return {}
        caps = {}
        for slot, _ in plan.decode:
            s = self.slots[slot]
            caps[slot] = max(0, min(self.spec.k, s.sampling.max_tokens - s.generated - 1))
        return self.spec.choose(caps, sum(n for _, n in plan.prefills))

    def _token(self, out, i: int) -> TokenOut:
        top = ()
        if "top_ids" in out:
            top = tuple(
                zip(out["top_ids"][i].tolist(), out["top_logprobs"][i].tolist(), strict=True)
            )
        return TokenOut(int(out["tokens"][i]), float(out["logprob"][i]), top)

    def retire(self, slot: int) -> None:
        if self.slots.pop(slot, None) is not None:
            self._free_slots.append(slot)
        self.pool.release(slot)
        if self.spec is not None:
            self.spec.drop(slot)
