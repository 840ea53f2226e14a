"""The sampling program of a step (device/runner.py's second program): its function, the
variants each row width compiles, and its launch.

The forward pass leaves its logits [R, V] on the device (split by vocabulary on a mesh) with
the rows' fed tokens; this program applies the penalties and the grammar masks, samples,
verifies proposals, takes the top logprobs and updates the per-slot sampler state. It reads
no [T] array, so one program serves every bucket of a row width R. Shapes as runner.py's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..step_format import mask_words
from . import proposals, sampling
from .distributed import SAMPLE
from .mesh import abstract_arg
from .step_io import Forward, Launched, sample_inputs, sample_size


class SampleProgram:
    """Runner's sampling program (a mixin: it reads the runner's placement, sampler state,
    draft and stream)."""

    def _sample_fn(self, logits, row_tokens, state, dkv, prompt_mask, sample_in, allow, reads,
                   *, R, S, filtered, logprobs, propose):  # fmt: skip
        """Sampling and verification of one step's logits (device/sampling.py); R, S, filtered
        (some row samples under top-k/p or min-p), logprobs (some row wants top logprobs) and
        propose (run the draft head or the draft's decodes: a later step may verify their
        proposals) static.

        Args: logits float32 [R, V]; row_tokens int32 [R, K + 1]; state (donated): the
          sampler's counts and last; dkv (donated): self.draft's caches, else None;
          prompt_mask (read); sample_in: int32, the sampling's part of the step's upload
          (step_io.sample_inputs: row arrays, float32 [6, S] parameters); allow: int32
          [S, ceil(V / 32)] bitmasks of the tokens each row may sample (host/grammar.py; all
          bits set: any);
          reads: None, or self.draft.feed's reads and then its propose_bufs.
        Returns: (packed int32 [2R + S], top ids [R, 20], top logprobs [R, 20], state (with
          proposals on the device, its device/proposals.py part updated), dkv).
        """
        batch, floats = sample_inputs(sample_in, R, S)
        if self.ahead:
            ahead = {k: state.pop(k) for k in proposals.KEYS}
            # the noise of a row that caught up is as many steps on as it moved
            batch["steps"] = batch["steps"] + proposals.offsets(ahead["acc"], batch)
        with jax.named_scope("sampling"):  # penalty state, sampling, verification, logprobs
            packed, top_ids, top_lp, state = sampling.sample_rows(
                logits, row_tokens, state, prompt_mask, batch, floats, self.k, allow, filtered,
                logprobs, self.placement, self.synthetic_accept,
            )  # fmt: skip
        if self.ahead:
            props = None
            if propose:
                with jax.named_scope("draft"):
                    props, dkv = self.draft.propose(reads[-1], dkv, reads[:-1], packed, batch,
                                                    floats, filtered)  # fmt: skip
            state.update(proposals.update(ahead, packed, batch, R, props))
        # outputs whole on each device: the host reads one
        state, dkv = self._keep(state, -1), self._keep(dkv, 2)
        packed, top_ids, top_lp = self._keep((packed, top_ids, top_lp), -1)
        return packed, top_ids, top_lp, state, dkv

    def _reads(self, fwd_reads):
        """The sampling program's `reads` for a forward pass's (None: nothing proposes)."""
        if self.draft is None:
            return None
        return (*fwd_reads, self.draft.propose_bufs(self.params))

    def _sampler_state(self) -> dict:
        keys = ("counts", "last") + (proposals.KEYS if self.ahead else ())
        return {k: self.state[k] for k in keys}

    def sample_function(self, R: int, S: int, filtered: bool, logprobs: bool, propose: bool):
        """The sampling program for R logits rows and S rows (and the variant: filtered,
        logprobs, propose), and abstract arguments for it."""
        arg = functools.partial(abstract_arg, self.placement)
        sample_in = arg((sample_size(R, S),), jnp.int32)
        logits = self.placement.abstract_split((R, self.cfg.vocab_size), jnp.float32, -1)
        row_tokens = arg((R, self.k + 1), jnp.int32)
        allow = arg((S, mask_words(self.cfg.vocab_size)), jnp.int32)
        fwd_reads = self.draft.read_shapes(R, S, self.max_blocks) if self.ahead else None
        args = (logits, row_tokens, self._sampler_state(), self.draft_kv, self.state["prompt_mask"],
                sample_in, allow, self._reads(fwd_reads))  # fmt: skip
        fn = functools.partial(
            self._sample_fn, R=R, S=S, filtered=filtered, logprobs=logprobs, propose=propose
        )
        return fn, args

    def sample_buckets(self, pairs: list[tuple[int, int]]) -> list[tuple]:
        """The (R, S, filtered, logprobs, propose) sampling programs that the (T, S) bucket
        pairs need: each (R, S) in its four variants, and with proposals on the device each
        with and without making them."""
        rs = sorted({(self.logit_width(t, s), s) for t, s in pairs})
        heads = (False, True) if self.ahead else (False,)
        return [(r, s, f, lp, p) for r, s in rs for f in (False, True) for lp in (False, True)
                for p in heads]  # fmt: skip

    def launch_sample(self, fwd: Forward, b: dict[str, np.ndarray]) -> Launched:
        """Dispatch the sampling of a launched forward pass (b: its lowered arrays; "allow",
        when present, the rows' grammar masks; "propose", when true, makes proposals) and
        start copying its outputs to the host.
        Sampling programs run in launch order, each after the forward pass it samples, so
        the next forward pass reads the tokens this one samples."""
        allow = b.get("allow")
        want_top = bool(b["want_logprobs"][0])
        propose = self.ahead and bool(b.get("propose", False))
        filtered = sampling.needs_filter(b["floats"], b["top_k"])
        variant = (fwd.R, fwd.S, filtered, want_top, propose)
        if self.stream is not None:
            masks = [] if allow is None else [allow]
            self.stream.send(SAMPLE, variant, masks)
        return self.sample(fwd, variant, allow)

    def sample(self, fwd: Forward, variant: tuple, allow: np.ndarray | None) -> Launched:
        """launch_sample's program `variant` (R, S, filtered, logprobs, propose); allow None
        where no row is under a grammar (a mask kept on the device, never sent)."""
        allow = self._open_mask(fwd.S) if allow is None else self.placement.host_input(allow)
        packed, top_ids, top_lp, state, self.draft_kv = self.sample_programs[variant](
            fwd.logits, fwd.row_tokens, self._sampler_state(), self.draft_kv,
            self.state["prompt_mask"], fwd.sample_in, allow, self._reads(fwd.reads),
        )  # fmt: skip
        self.state.update(state)
        top = (top_ids, top_lp) if variant[3] else None
        # this process's copy of the (replicated) outputs
        packed, top = self.placement.local(packed), self.placement.local(top)
        for x in (packed, *(top or ())):
            x.copy_to_host_async()
        return Launched(packed, top, fwd.R)

    def _open_mask(self, S: int) -> jax.Array:
        """The all-allowed masks [S, words] of S rows, made once (at warmup: making one is a
        small compile)."""
        if S not in self._open:
            mask = np.full((S, mask_words(self.cfg.vocab_size)), -1, np.int32)
            self._open[S] = self.placement.put(mask, self.placement.replicated)
        return self._open[S]
