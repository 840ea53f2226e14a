"""StepEngine: the half behind the scheduler that runs packed steps of any model family (the
SeqEngine of seq_engine.py).

The scheduler speaks only in slots and token counts; an engine owns slots (slots.SlotTable),
KV blocks (kv_pool.KVPool) and the device (a Runner). A slot id is stable for a request's
lifetime and is carried by every row.

Steps are asynchronous. `dispatch(plan)` lowers a plan and launches it; `collect()` waits for
the oldest launched step and returns its tokens. A decode row reads its input token from the
device (the slot's last sampled token), so the scheduler dispatches step N+1 before it
collects step N, and the host's planning and lowering overlap the device's work. With
speculation the proposals for a step depend on the tokens of the step before, so `overlap`
is False and each step is collected before the next is planned.

A row under a grammar (host/grammar.py) samples from a mask that needs its last token, which
step N+1's dispatch does not know: its forward pass is launched at once, its sampling when
step N is collected (at the next dispatch or collect), with masks filled meanwhile. Collecting
each step instead lost 19 to 53% at C1 to C32 (structured_qwen3-8b-bf16.md).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..config import EngineConfig
from ..step_format import (
    FROM_DEVICE,
    Rows,
    buckets,
    lower,
    marker_rows,
    pick_bucket,
    token_buckets,
)
from .kv_pool import KVPool
from .seq_engine import AdmitResult, StepFailed, StepLimits, StepPlan, StepResult, TokenOut
from .slot_owner import Admission, SlotOutputs, SlotOwner
from .slots import SlotTable

log = logging.getLogger(__name__)


@dataclass
class _Launched:
    handle: object  # the runner's, for fetch (None while the sampling waits for masks)
    rows: Rows
    epochs: np.ndarray  # [n] slot epochs at dispatch
    logit_start: np.ndarray  # [n] first logits row of each row
    t0: float  # perf_counter at dispatch
    forward: object = None  # the runner's Forward whose sampling waits for masks
    inputs: dict | None = None  # the lowered arrays its sampling needs
    failed: BaseException | None = None  # its sampling's launch raised (at a later dispatch)


class StepEngine:
    """SeqEngine over a Runner, for any model family (models/family.py); reserves prompt +
    max_tokens at admission and starts the slot in each of its owners (host/slot_owner.py).

    Reserving the worst case means a decoding slot never runs out of blocks, so there is no
    preemption: a request waits in the queue until its whole reservation fits.

    Prefix cache (config.prefix_cache): a prompt's leading full blocks that an earlier request
    wrote are matched at admission and join the new slot's table, and prefill starts after
    them. A slot's full blocks are entered in the cache as soon as the step writing them is
    launched (prompt blocks at dispatch, output blocks at retirement), so a request admitted
    a step later already shares them. A failed step clears the cache. A draft model on the
    device keeps its caches on the target's block ids and is fed every token the target is,
    so a matched block holds its KV too; a draft on the host (hybrid targets) recomputes the
    matched prefix in its own pool: its prefill costs a fraction of the target's.
    """

    def __init__(self, config: EngineConfig, runner, one_row: bool = False):
        self.config = config
        self.runner = runner
        self.slot_count = config.max_concurrency
        self.max_context = config.max_ctx
        self.block_size = runner.spaces[0].block_size
        # one block space per cache group, shaped as the runner's caches (runner.spaces)
        self.pool = KVPool(runner.spaces, self.slot_count, config.step_span, config.prefix_cache)
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens looked up / found cached
        self.slots = SlotTable(self.slot_count, config.seed)
        # A slot state rolled back by feeding again (models/family.py's "refeed") stays before a
        # verify row's proposals: those it accepted are fed again at the start of its next row
        # (outputs.lag).
        self.outputs = SlotOutputs(self.slot_count)
        # The step token budget counts decode rows too (as vLLM's max_num_batched_tokens).
        # One row width per token bucket, S(T) = min(T, slots): a decode-only step of C rows
        # pads to the next power of two and no further, and the buckets to compile are few.
        limit = max(config.prefill_token_budget, self.slot_count)
        self.token_buckets = token_buckets(limit, one_row)
        self._max_rows = buckets(self.slot_count, 1)[-1]
        self.spec = None  # speculation.Speculator once enable_speculation is called
        self.grammars = None  # grammar.Grammars: structured output, when the builder sets it
        self.refeed = runner.family.rollback == "refeed"
        self.last_bucket = (0, 0)  # (T, S) of the last dispatched step, for the trace
        self._last_collect = 0.0  # perf_counter when the last step's results came
        self._launched: deque[_Launched] = deque()

    def enable_speculation(self, speculator) -> None:
        """Verify proposals from `speculator` (built after warmup: its policy needs the
        measured step times)."""
        assert not any(map(self.slots.live, range(self.slot_count))), "enable before admitting"
        self.spec = speculator

    @property
    def constraining(self) -> bool:
        """Some live slot's output is constrained by a grammar."""
        return self.grammars is not None and self.grammars.active

    @property
    def overlap(self) -> bool:
        """Whether step N+1 may be dispatched before step N is collected: without speculation,
        and with proposals that stay on the device (draft head, draft model on the device)."""
        return self.spec is None or getattr(self.spec.proposer, "on_device", False)

    @property
    def in_flight(self) -> int:
        return len(self._launched)

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
        if not self.pool.fits_ever(need):
            return AdmitResult("failed", error=f"{need} tokens exceed the whole KV pool")
        if sampling.json_schema is not None and self.grammars is None:
            return AdmitResult("failed", error="json_schema: this engine has no grammar support")
        slot = self.slots.lowest_free()
        if slot is None:
            return AdmitResult("busy")
        if sampling.json_schema is not None:
            try:  # compiled (or found in the cache) before anything is reserved
                self.grammars.compile(
                    sampling.json_schema, sampling.json_prefix, sampling.json_suffix
                )
            except ValueError as e:
                return AdmitResult("failed", error=f"json_schema: {e}")
        # The repetition penalty reads the whole prompt from the device's prompt mask, which only
        # a prefill fills: such a request computes its prompt in full, as does cache_prompt false.
        reuse = sampling.cache_prompt and sampling.repetition_penalty == 1
        cached, shared = self.pool.match(prompt) if reuse else (0, None)
        if not self.pool.reserve(slot, need, shared):
            return AdmitResult("busy")
        self.prefix_queries += len(prompt)
        self.prefix_hits += cached
        req = Admission(list(prompt), sampling, cached, need)
        for owner in self.owners:
            owner.start(slot, req)
        return AdmitResult("admitted", slot, cached_tokens=cached)

    @property
    def owners(self) -> list[SlotOwner]:
        """Every owner of per-slot host state (host/slot_owner.py), in the order a slot starts;
        the grammars and speculation once the builder has set them."""
        return [self.slots, self.outputs, *(x for x in (self.grammars, self.spec) if x is not None)]

    def step_limits(self, num_decode_rows: int) -> StepLimits:
        c = self.config
        room = self.token_buckets[-1] - num_decode_rows - int(self.outputs.lag.sum())
        return StepLimits(
            max_prefill_seqs=c.max_concurrent_prefills,
            max_prefill_tokens_per_seq=c.prefill_chunk,
            max_prefill_tokens_total=min(c.prefill_token_budget, room),
        )

    def dispatch(self, plan: StepPlan) -> None:
        """Lower the plan and launch it; the slots' progress counts it from now on.

        1. Decode rows: each slot's input token comes from the device, at position kv_len;
           with speculation, its proposals follow it (a verify row).
        2. Prompt slices, from each slot's prompt array.
        3. Claim the blocks the rows write, lower to the token bucket, launch.
        4. Only after a launch that did not raise: advance prefilled and generated.
        """
        t0 = time.perf_counter()
        sl = self.slots
        dec = np.asarray(plan.decode, np.int32)
        lag = self.outputs.lag[dec]
        # Slots whose step in flight may keep proposals the host has not counted: their rows
        # are lowered where the host knows they start, and the device moves them on
        # (sampling.catch_up); their blocks and proposals leave room for the largest move.
        behind = self._behind(dec)
        n_draft, props = self._proposals(
            dec, sum(n for _, n in plan.prefills) + int(lag.sum()), behind
        )
        starts = sl.kv_len(dec) - lag
        # rows: accepted proposals fed again (hybrid), the last token, proposals; a step with
        # neither (speculation off, or nothing proposed) lowers as without speculation
        if props is None and n_draft.any():  # the device's proposals: markers, made at once
            tokens = marker_rows(n_draft)
        elif props is not None and (n_draft.any() or lag.any()):
            out = self.outputs.tokens
            tokens = np.concatenate(
                [
                    np.asarray([*out[s][len(out[s]) - 1 - n : -1], FROM_DEVICE, *p], np.int32)
                    for s, n, p in zip(dec.tolist(), lag.tolist(), props, strict=True)
                ]
            )
        else:
            tokens = np.full(len(dec), FROM_DEVICE, np.int32)
        lens = lag + 1 + n_draft
        # A draft model on the device writes its KV up to writes_ahead positions past a
        # sampled row's last token (device/draft_model.DraftModel.propose).
        ahead = self.runner.writes_ahead
        ends = np.minimum(
            starts + lens + behind * self.spec_k + ahead, sl.prompt_len[dec] + sl.max_tokens[dec]
        )
        for slot, start, end in zip(dec.tolist(), starts.tolist(), ends.tolist(), strict=True):
            # Proposals go past kv_len and overwrite nothing of the sequence; rejected ones
            # are rolled back by kv_len alone (it counts emitted tokens), and blocks stay.
            self.pool.ensure(slot, end, start)
        parts = [Rows(dec, starts, lens, tokens, np.ones(len(dec), bool), n_draft)]
        for slot, n in plan.prefills:
            begin = int(sl.prefilled[slot])
            end = begin + n
            assert n > 0 and end <= sl.prompt_len[slot], (slot, n)
            done = end == sl.prompt_len[slot]
            reserved = int(sl.prompt_len[slot] + sl.max_tokens[slot])
            self.pool.ensure(slot, min(end + ahead, reserved) if done else end, begin)
            parts.append(
                Rows(
                    np.array([slot], np.int32),
                    np.array([begin], np.int32),
                    np.array([n], np.int32),
                    sl.prompt[slot][begin:end],
                    np.array([done]),
                    np.zeros(1, np.int32),
                )
            )
        rows = Rows.concat(parts)
        T = pick_bucket(int(rows.lens.sum()), self.token_buckets)
        S = self.rows_for(T)
        first, *groups = self.pool.block_arrays()
        b = lower(rows, first, self.block_size, T, S, self.runner.logit_width(T, S),
                  tuple(zip(groups, self.runner.spaces[1:], strict=True)))  # fmt: skip
        b.update(sl.row_inputs(rows.slots, rows.starts, rows.sample, S))
        b["behind"][: len(dec)] = behind
        if self.overlap and self.spec is not None:  # propose on the device only if it may pay
            b["propose"] = self.spec.wants_proposals(bool(rows.sample[len(dec) :].any()))
        # a row under a grammar needs the step in flight's tokens: this sampling waits for them
        wait = self.constraining and any(map(self.grammars.constrained, rows.slots[rows.sample]))
        if self._launched and self._launched[-1].handle is None:
            self._launch_sampling(self._launched[-1])  # it reads the step in flight's tokens
        try:
            fwd = self.runner.launch_forward(b, T, S)
            handle = None if wait else self.runner.launch_sample(fwd, b)
        except Exception:
            self.pool.clear_cache()  # a launch that raised may have left the KV half-written
            if self.spec is not None:  # no results will come for this step's plan
                self.spec.policy.forget_last()
            raise
        n_dec = len(dec)
        sl.prefilled[rows.slots[n_dec:]] += rows.lens[n_dec:]
        for slot, _ in plan.prefills:
            self.pool.cache_blocks(slot, sl.prompt[slot], int(sl.prefilled[slot]))
        sl.generated[rows.slots[rows.sample]] += 1  # a verify row's accepted ones: at collect
        epochs = sl.epoch[rows.slots]
        self._launched.append(
            _Launched(handle, rows, epochs, b["logit_start"][: len(rows)], t0,
                      *((fwd, b) if wait else ()))
        )  # fmt: skip
        self.last_bucket = (T, S)

    def _launch_sampling(self, f: _Launched) -> None:
        """Launch the sampling of step f, which waits for grammar masks. Every step before it
        is collected (the scheduler keeps at most one step in flight when it dispatches), so
        each matcher has accepted its slot's last token. A launch that raises fails f's
        requests when f is collected."""
        assert f.handle is None and all(g is f for g in self._launched), "steps before f"
        try:
            b = dict(f.inputs)
            allow = self.grammars.masks(f.rows.slots, f.rows.sample, b["floats"].shape[1])
            if allow is not None:
                b["allow"] = allow
            f.handle = self.runner.launch_sample(f.forward, b)
        except Exception as e:
            f.failed = e
        f.forward = f.inputs = None

    def collect(self) -> StepResult:
        """Wait for the oldest launched step; its tokens for the slots still live.

        Raises:
          StepFailed: the step raised on the device or when its outputs were read.
        """
        f = self._launched.popleft()
        sl, rows = self.slots, f.rows
        live = sl.epoch[rows.slots] == f.epochs
        try:
            if f.handle is None and f.failed is None:
                self._launch_sampling(f)
            if f.failed is not None:
                raise f.failed
            out = self.runner.fetch(f.handle)
        except Exception as e:
            self.pool.clear_cache()  # blocks entered for this step may never have been written
            raise StepFailed(rows.slots[live].tolist(), e) from e
        n = rows.n_logits
        tok, lp, accepted = out["tokens"][:n].tolist(), out["logprob"][:n].tolist(), out["accepted"]
        top = None
        if "top_ids" in out:  # per logits row: ((id, logprob), ...)
            ids, lps = out["top_ids"][:n].tolist(), out["top_logprobs"][:n].tolist()
            top = [tuple(zip(i, p, strict=True)) for i, p in zip(ids, lps, strict=True)]
        result = StepResult()
        sampled = np.flatnonzero(rows.sample & live).tolist()
        for i in sampled:
            slot, first, kept = int(rows.slots[i]), int(f.logit_start[i]), int(accepted[i])
            result.tokens[slot] = [
                TokenOut(tok[j], lp[j], top[j] if top else ())
                for j in range(first, first + kept + 1)
            ]
            sl.generated[slot] += kept
            self.outputs.tokens[slot].extend(t.token for t in result.tokens[slot])
            if self.grammars is not None:
                self.grammars.accept(slot, [t.token for t in result.tokens[slot]])
            if self.refeed:
                self.outputs.lag[slot] = kept
            if self.spec is not None:
                n_draft = int(rows.n_draft[i])
                self.spec.record(slot, n_draft, kept, [t.token for t in result.tokens[slot]])
        if self.spec is not None:
            # What a step costs: from its dispatch to its results, or, while steps overlap,
            # the time between results (a step's dispatch-to-results spans the next dispatch).
            now = time.perf_counter()
            since = self._last_collect if self._last_collect > f.t0 else f.t0
            emitted = int(accepted[sampled].sum()) + len(sampled)
            self.spec.step_done(now - since, emitted, len(sampled))
            self._last_collect = now
        return result

    @property
    def spec_k(self) -> int:
        return self.spec.k if self.spec is not None else 0

    def _behind(self, dec: np.ndarray) -> np.ndarray:
        """int32 [len(dec)]: 1 where the slot had a sampled row in a step still in flight whose
        kept proposals the host has not counted (device proposals only; at most one such step,
        the scheduler collects before it dispatches a second one ahead)."""
        if not self.overlap or self.spec is None or not self._launched:
            return np.zeros(len(dec), np.int32)
        assert len(self._launched) == 1, "one step in flight at most"
        f = self._launched[-1]
        mask = np.zeros(self.slot_count, np.int32)  # np.isin took 0.2 ms of a step at C16
        mask[f.rows.slots[f.rows.sample & (f.rows.n_draft > 0)]] = 1
        return mask[dec]

    def _proposals(self, dec: np.ndarray, prompt_tokens: int, behind: np.ndarray) -> tuple:
        """Speculative proposals per decode row (Speculator.rows), capped so a verify row never
        emits past max_tokens, which also keeps its KV writes inside the slot's reservation.
        Generated is exact unless the slot is `behind` by up to K kept proposals of a step in
        flight: those rows leave room for K more. Rows under a grammar get none."""
        if self.spec is None:
            return np.zeros(len(dec), np.int32), None
        sl = self.slots
        left = sl.max_tokens[dec] - sl.generated[dec] - 1 - behind * self.spec.k
        if self.constraining:  # proposals skip the grammar
            left = np.where([self.grammars.constrained(s) for s in dec.tolist()], 0, left)
        return self.spec.rows(dec, left, prompt_tokens)

    def retire(self, slot: int) -> None:
        """Release the slot and its blocks now, whatever is in flight for it: a launched
        step's KV writes for it stay inside blocks it held, and every step launched later runs
        after them on the device, so a new tenant of those blocks overwrites them before it
        reads them."""
        if self.slots.live(slot) and self.pool.cache is not None:
            # Output blocks join the cache too (a chat's next turn repeats this one): every
            # position below kv_len is written by a launched step, and its token is known once
            # collected.
            out = np.asarray(self.outputs.tokens.get(slot, []), np.int32)
            seq = np.concatenate([self.slots.prompt[slot], out])
            written = int(self.slots.kv_len(np.array([slot]))[0])
            self.pool.cache_blocks(slot, seq, min(written, len(seq)))
        for owner in reversed(self.owners):
            owner.release(slot)
        self.pool.release(slot)
