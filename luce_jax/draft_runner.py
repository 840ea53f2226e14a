"""The draft model's runner: its executables are greedy propose programs, not steps.

One program per (T, S) bucket: a catch-up step, then up to K - 1 batched greedy decode steps
in a while loop on the device, so K proposals cost one host round trip (draft.py drives it).
Shapes: T tokens, S rows, K proposals (depth), P block size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .models import dense
from .runner import Runner, best_of_3
from .sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


class DraftRunner(Runner):
    """A Runner whose buckets compile `_propose_fn`; only the KV is donated.

    Args: as Runner's (without max_proposals), and depth: K, the most proposals per row.
    """

    donate = (1,)

    def __init__(self, *args, depth: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.depth = depth
        self.state = {}  # greedy proposals need no penalty state
        self.propose_time: dict[int, float] = {}  # depth -> seconds (smallest bucket)

    def _layout(self, T: int, S: int) -> list[tuple[str, tuple[int, ...]]]:
        return self._int_layout(T, S) + [("want", (S,)), ("depth", (1,))]

    def _propose_fn(self, params, kv, ints, floats, *, T: int, S: int):
        """A draft model's greedy proposals in one program; T, S static.

        The catch-up batch (prompt chunks, and each speculating row's unfed tokens) runs as a
        step; its rows with sample_mask propose argmax tokens, then up to depth - 1 batched
        decode steps (a while loop: depth is data) feed each row its last proposal while the
        row wants more. Rows that want no more write the sink.

        Args: params; kv (donated); ints: int32 packed per _layout (want [S]: proposals
          per row, depth [1]: the largest); floats: unused sampling parameters.
        Returns: (tokens int32 [S, draft_depth], kv).
        """
        batch, _ = self._unpack(ints, floats, T, S, self._layout(T, S))
        fwd = functools.partial(
            dense.forward, cfg=self.cfg, attention_fn=self._attention,
            grouped_matmul=self._grouped_matmul,
        )  # fmt: skip
        logits, kv, _ = fwd(params, kv, batch)
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [S]
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
            logits, kv, _ = fwd(params, kv, dec)
            tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            return j + 1, kv, tok, out.at[:, j].set(tok)

        carry = (jnp.int32(1), kv, tok, out)
        _, kv, _, out = jax.lax.while_loop(lambda c: c[0] < batch["depth"][0], body, carry)
        return out, kv

    def step_function(self, T: int, S: int):
        """The propose program for bucket (T, S) and abstract arguments to lower it with."""
        ints, floats = self._abstract_inputs(S, self._layout(T, S))
        return functools.partial(self._propose_fn, T=T, S=S), (self.params, self.kv, ints, floats)

    def propose(self, rows, tables, t_bucket: int, s_bucket: int, want: list[int], depth=None):
        """Greedy proposals (see _propose_fn).

        Args: rows: the catch-up batch (batch.Row; sample=True on speculating rows, whose
          blocks must cover start + len(tokens) + want - 1); tables: as for run; want: per
          row, proposals wanted (<= draft_depth); depth: loop count (default max(want)).
        Returns: int32 [len(rows), draft_depth]: row i's proposals are [i, :want[i]].
        """
        T, S = t_bucket, s_bucket
        greedy = [GREEDY if r.sample else None for r in rows]
        zeros = [0] * len(rows)
        b, ints, floats, _ = self._pack(rows, tables, T, S, greedy, zeros, zeros)
        w = np.zeros(S, np.int32)
        w[: len(want)] = want
        depth = max(want, default=0) if depth is None else depth
        ints = np.concatenate([ints, w, np.array([depth], np.int32)])
        out, self.kv = self._executable(T, S)(self.params, self.kv, ints, floats)
        return np.asarray(out)[: len(rows)]

    def _time(self, pairs, empty) -> None:
        """The propose program's seconds at depth 1 and K, on the smallest bucket (proposals
        come with decode-sized catch-ups); the other buckets run once."""
        for t, s in pairs:
            self.propose([], empty, t, s, [])
        t, s = pairs[0]
        for d in (1, self.depth):
            self.propose_time[d] = best_of_3(lambda d=d: self.propose([], empty, t, s, [], depth=d))
