"""Per-slot host state of an engine: each request's prompt, sampling and progress, kept in
persistent arrays that a step's per-row inputs are gathered from (pure NumPy, no jax).

Progress counts what has been dispatched, not what has come back: `prefilled` prompt tokens are
written by steps already launched, and `generated` tokens are sampled by them. So the host can
plan step N+1 while step N runs; it reads step N's tokens one step later. A slot's `epoch` grows
when the slot is released: rows of steps launched before then are stale, and their tokens are
dropped when those steps are collected.

As in vLLM v1's persistent input batch, a slot's sampling parameters and seed are written once,
at admission, and each step gathers its rows' values with one fancy index per array instead of
rebuilding them row by row. Shapes: n slots, S row bucket.
"""

from __future__ import annotations

import random

import numpy as np

from ..sampling_params import SamplingParams
from ..step_format import FLOAT_FIELDS, NEUTRAL, padding_inputs


def sampling_arrays(params: list[SamplingParams]) -> tuple[np.ndarray, np.ndarray]:
    """float32 [6, n] (FLOAT_FIELDS) and int32 top_k [n] of n requests' parameters."""
    floats = np.array(
        [
            [
                p.temperature,
                p.top_p,
                p.min_p,
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty,
            ]
            for p in params
        ],
        np.float32,
    ).reshape(-1, len(FLOAT_FIELDS))
    return floats.T.copy(), np.array([p.top_k for p in params], np.int32)


class SlotTable:
    """Slots 0..n-1: which are live, and each live slot's request state.

    Args:
      n: slot count; seed: seeds the per-request seeds of requests that give none.
    """

    def __init__(self, n: int, seed: int = 0):
        self.n = n
        self.prompt: list[np.ndarray | None] = [None] * n  # int32 [prompt length], None: free
        self.prompt_len = np.zeros(n, np.int32)
        self.prefilled = np.zeros(n, np.int32)  # prompt tokens in dispatched steps
        self.cached = np.zeros(n, np.int32)  # prompt tokens whose KV came from the prefix cache
        self.generated = np.zeros(n, np.int32)  # tokens sampled by dispatched steps
        self.max_tokens = np.zeros(n, np.int32)
        self.epoch = np.zeros(n, np.int64)  # grows on release; stale rows carry an older one
        self.floats = np.repeat(NEUTRAL[:, None], n, axis=1)  # [len(FLOAT_FIELDS), n]
        self.top_k = np.zeros(n, np.int32)
        self.seeds = np.zeros(n, np.uint32)
        self.logprobs = np.zeros(n, bool)
        self._rng = random.Random(seed)

    # -- lifecycle --------------------------------------------------------------------------
    def live(self, slot: int) -> bool:
        return self.prompt[slot] is not None

    def lowest_free(self) -> int | None:
        """The lowest free slot (reused at once, which keeps block tables compact)."""
        return next((s for s in range(self.n) if self.prompt[s] is None), None)

    def claim(self, slot: int, prompt: list[int], sp: SamplingParams, cached: int = 0) -> None:
        """Take `slot` for a request whose first `cached` prompt tokens are in the KV cache
        already (shared prefix blocks): its prefill starts after them."""
        assert not self.live(slot), f"slot {slot} is taken"
        assert 0 <= cached < len(prompt), (cached, len(prompt))
        self.prompt[slot] = np.asarray(prompt, np.int32)
        self.prompt_len[slot] = len(prompt)
        self.prefilled[slot] = self.cached[slot] = cached
        self.generated[slot] = 0
        self.max_tokens[slot] = sp.max_tokens
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(32)
        self.seeds[slot] = seed & 0xFFFFFFFF
        floats, top_k = sampling_arrays([sp])
        self.floats[:, slot], self.top_k[slot] = floats[:, 0], top_k[0]
        self.logprobs[slot] = sp.logprobs is not None

    def start(self, slot: int, req) -> None:
        """claim for an admitted request (host/slot_owner.Admission)."""
        self.claim(slot, req.prompt, req.sampling, req.cached)

    def release(self, slot: int) -> None:
        """Free the slot; rows of steps still in flight for it become stale. A free slot stays
        as it is."""
        if self.prompt[slot] is None:
            return
        self.prompt[slot] = None
        self.epoch[slot] += 1

    # -- progress ---------------------------------------------------------------------------
    def prefill_left(self, slot: int) -> int:
        return int(self.prompt_len[slot] - self.prefilled[slot])

    def decoding(self, slot: int) -> bool:
        """The whole prompt is in dispatched steps: the slot's rows are decode rows."""
        return self.prompt[slot] is not None and self.prefilled[slot] == self.prompt_len[slot]

    def can_decode(self, slot: int) -> bool:
        """Decoding, and max_tokens not yet reached by dispatched steps (so a step never writes
        KV past the slot's reservation of prompt + max_tokens)."""
        return self.decoding(slot) and self.generated[slot] < self.max_tokens[slot]

    def kv_len(self, slots: np.ndarray) -> np.ndarray:
        """Tokens in the cache once dispatched steps have run: the prompt so far, then each
        sampled token but the last (fed by the next decode row)."""
        return self.prefilled[slots] + np.maximum(self.generated[slots] - 1, 0)

    # -- per-row step inputs ----------------------------------------------------------------
    def row_inputs(
        self, slots: np.ndarray, starts: np.ndarray, sample: np.ndarray, S: int
    ) -> dict[str, np.ndarray]:
        """Sampling inputs of a step's rows (`padding_inputs`' arrays, rows filled): each
        sampling row gets its slot's parameters, seed and tokens generated so far; a slot's
        first row (it starts where the slot's prefill started) is marked fresh."""
        out, n = padding_inputs(S), len(slots)
        out["fresh"][:n] = (starts == self.cached[slots]) & (self.generated[slots] == 0)
        out["floats"][:, :n] = np.where(sample, self.floats[:, slots], NEUTRAL[:, None])
        out["top_k"][:n] = np.where(sample, self.top_k[slots], 0)
        out["seeds"][:n] = self.seeds[slots].view(np.int32)
        out["steps"][:n] = self.generated[slots]
        out["want_logprobs"][0] = self.logprobs[slots[sample]].any()
        return out
