"""A hybrid target's draft model on the device: its own KV and one propose program per bucket
(speculation/draft.py drives it; a dense target's draft runs in its step, device/draft_model.py).

One program per (T, S) bucket: a catch-up step, then up to K - 1 batched decode steps in a
while loop on the device, so K proposals cost one host round trip (draft.py drives it).

Proposals are sampled as the target will sample: with each row's own parameters (temperature,
top-k, top-p, min-p) and, for the proposal the target's logits row at offset j will check, the
noise of (the row's seed, its tokens generated + j), which is the noise that target row draws
(device/sampling.sample). So a draft that predicts the target's distribution well proposes the
very token the target samples, and at temperature 0 the argmax, as before. The target keeps a
proposal when it equals its own sample, so its output is token for token the one without
speculation; this coupling of the two samples through shared noise is what makes sampled
drafts pay without a rejection step that would change the tokens a seed gives.
Shapes: T tokens, S rows, K proposals (depth), V vocabulary, P block size, MB blocks per
sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..device import sampling
from ..device.programs import BucketPrograms, best_of_3
from ..models.family import XLA, Kernels, family_of
from ..step_format import (
    FLOAT_FIELDS,
    layout_size,
    lower,
    pack,
    padding_inputs,
    step_layout,
    unpack,
)

# The step inputs a propose program reads (one logits row each; no penalty state).
_KEYS = ("tokens", "positions", "seg_ids", "write_idx", "block_tables", "kv_lens", "cu_q_lens",
         "sample_mask", "logit_rows", "top_k", "seeds", "steps")  # fmt: skip


class DraftRunner:
    """The draft's KV and BucketPrograms of `_propose_fn`; only the KV is donated.

    Args: as device.runner.Runner's (without max_proposals), and depth: K, the most proposals
      per row; vocab: V, the target's logits width (the draft's are padded to it, so that the
      noise of a (seed, step) is the target's vector; default the draft's own).
    """

    def __init__(
        self, cfg, params, spaces, max_slots, kv_types, kernels: Kernels = XLA, *, depth: int,
        vocab: int | None = None,
    ):  # fmt: skip
        self.cfg, self.params, self.depth = cfg, params, depth
        self.vocab = vocab or cfg.vocab_size
        self.shape = spaces[0]  # the draft's one cache group (the target's first's shape)
        self.block_size, self.max_slots, self.max_blocks = (
            self.shape.block_size, max_slots, self.shape.max_blocks)  # fmt: skip
        family = family_of(cfg)  # one without per-slot state: the draft keeps only its KV
        self.kv = family.init_caches(cfg, [self.shape], *kv_types)

        def forward(params, kv, batch):
            logits, kv, _, stats = family.forward(params, kv, None, batch, cfg, kernels)
            return logits, kv, stats

        self._forward = forward
        self.programs = BucketPrograms(self.step_function, donate=(1,), name="draft")
        self.propose_time: dict[int, float] = {}  # depth -> seconds (smallest bucket)

    @property
    def compiles(self) -> int:
        return self.programs.compiles

    def layout(self, T: int, S: int):
        keep = [(n, s) for n, s in step_layout(T, S, S, self.max_blocks) if n in _KEYS]
        return keep + [("want", (S,)), ("depth", (1,))]

    def _propose_fn(self, params, kv, ints, floats, *, T: int, S: int):
        """A draft model's proposals in one program; T, S static.

        The catch-up batch (prompt chunks, and each speculating row's unfed tokens) runs as a
        step; its rows with sample_mask propose a token, then up to depth - 1 batched decode
        steps (a while loop: depth is data) feed each row its last proposal while the row
        wants more. Rows that want no more write the sink. Proposal j of a row is sampled
        with the row's parameters and the noise of (seed, steps + j) (module docstring).

        Args: params; kv (donated); ints: int32 packed per `layout` (want [S]: proposals
          per row, depth [1]: the largest; top_k, seeds, steps [S]: the rows' sampling as
          the target's step has them); floats: float32 [6, S] (FLOAT_FIELDS).
        Returns: (tokens int32 [S, K], kv).
        """
        batch = unpack(ints, self.layout(T, S))
        sp = sampling.named(floats, batch["top_k"])
        seeds = jax.lax.bitcast_convert_type(batch["seeds"], jnp.uint32)
        none = jnp.zeros((S, self.vocab), jnp.int32)  # no penalty state: proposals only

        def pick(logits, j):
            """[S, V_draft] logits -> the rows' samples for the target's offset j."""
            V = logits.shape[-1]
            if V < self.vocab:  # ids the draft lacks are never proposed
                logits = jnp.pad(logits, ((0, 0), (0, self.vocab - V)), constant_values=-jnp.inf)
            tok, _ = sampling.sample(logits[:, : self.vocab], none, none > 0, sp, seeds,
                                     batch["steps"] + j)  # fmt: skip
            return tok

        logits, kv, _ = self._forward(params, kv, batch)
        tok = pick(logits, 0)  # [S]
        out = jnp.zeros((S, self.depth), jnp.int32).at[:, 0].set(tok)
        P, Td = self.block_size, max(S, 8)  # decode steps pad to 8 tokens, as the step's buckets
        rows = jnp.arange(S)
        live0 = batch["sample_mask"] > 0
        pad = jnp.zeros(Td - S, jnp.int32)

        def body(carry):
            j, kv, tok, out = carry
            live = live0 & (j < batch["want"])
            pos = batch["kv_lens"] + j - 1
            blk = batch["block_tables"][rows, jnp.where(live, pos // P, 0)]
            dec = {
                "tokens": jnp.concatenate([tok, pad]),
                "positions": jnp.concatenate([jnp.where(live, pos, 0), pad]),
                "seg_ids": jnp.concatenate([rows, pad + S - 1]),
                "write_idx": jnp.concatenate([jnp.where(live, blk * P + pos % P, 0), pad]),
                "block_tables": batch["block_tables"],
                "kv_lens": jnp.where(live, pos + 1, 0),
                "cu_q_lens": jnp.arange(S + 1, dtype=jnp.int32),
                "logit_rows": rows,
            }
            logits, kv, _ = self._forward(params, kv, dec)
            tok = pick(logits, j)
            return j + 1, kv, tok, out.at[:, j].set(tok)

        carry = (jnp.int32(1), kv, tok, out)
        _, kv, _, out = jax.lax.while_loop(lambda c: c[0] < batch["depth"][0], body, carry)
        return out, kv

    def step_function(self, T: int, S: int):
        """The propose program for bucket (T, S) and abstract arguments to lower it with."""
        ints = jax.ShapeDtypeStruct((layout_size(self.layout(T, S)),), jnp.int32)
        floats = jax.ShapeDtypeStruct((len(FLOAT_FIELDS), S), jnp.float32)
        fn = functools.partial(self._propose_fn, T=T, S=S)
        return fn, (self.params, self.kv, ints, floats)

    def propose(
        self, rows, tables, t_bucket: int, s_bucket: int, want: list[int], depth=None,
        sampling_rows: dict | None = None,
    ):  # fmt: skip
        """Proposals (see _propose_fn); waits for them.

        Args: rows: the catch-up batch (batch.Row; sample=True on speculating rows, whose
          blocks must cover start + len(tokens) + want - 1); tables: int32 [slots, MB] block
          tables; want: per row, proposals wanted (<= K); depth: loop count (default
          max(want)); sampling_rows: the rows' floats, top_k, seeds and steps as
          SlotTable.row_inputs gives them (default: greedy).
        Returns: int32 [len(rows), K]: row i's proposals are [i, :want[i]].
        """
        T, S = t_bucket, s_bucket
        b = lower(rows, tables, self.block_size, T, S)
        b.update(sampling_rows or padding_inputs(S))
        b["want"] = np.zeros(S, np.int32)
        b["want"][: len(want)] = want
        b["depth"] = np.array([max(want, default=0) if depth is None else depth], np.int32)
        out, self.kv = self.programs[(T, S)](
            self.params, self.kv, pack(b, self.layout(T, S)), b["floats"]
        )
        return np.asarray(out)[: len(rows)]

    def warmup(self, pairs: list[tuple[int, int]]) -> None:
        """Compile every bucket; time the program at depth 1 and K on the smallest bucket
        (proposals come with decode-sized catch-ups)."""
        self.programs.warmup(pairs)
        empty = np.zeros((1, self.max_blocks), np.int32)
        for t, s in pairs:
            self.propose([], empty, t, s, [])
        t, s = pairs[0]
        for d in (1, self.depth):
            self.propose_time[d] = best_of_3(lambda d=d: self.propose([], empty, t, s, [], depth=d))
