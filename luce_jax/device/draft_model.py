"""A dense draft model run inside the target's step: fed in the forward pass, proposing in
the sampling program, with no program or host round trip of its own.

Its caches mirror the target's pool: the same block count and size, so a row's block table
and KV write slots serve both, and a prefix-cache hit holds the draft's KV too. Every forward
pass feeds the draft the step's tokens (`feed`), so its caches hold every sequence as far as
the target's do (proposals a verify row fed past its kept ones are overwritten later). After
verification, a sampling program that proposes runs K decode steps (`propose`): each row's
last emitted token, then its own proposals, and keeps them per slot on the device
(device/proposals.py), where the next step's verify row reads them.

On the H200 the embedded pair gave the same acceptance this way as with the draft's own
program and host round trip (1.84 against 1.86 proposals kept per verify row of 4, greedy,
every step proposing), at 1273 against 680 tok/s at C1.

Shapes: T tokens, S rows, R logits rows, K proposals, V vocabulary, MB blocks per sequence,
P block size.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..models.family import Kernels, family_of
from . import packed_params, proposals


class DraftModel:
    """A draft's config, packed params (packed_params.py: two launch arguments, not one per
    tensor) and kernels; the runner owns its caches.

    Args: cfg, params: the draft (loading.params.load_params; its vocabulary the target's or a
      prefix of it; a family with no per-slot state); kv_types: its cache types; kernels: the
      runner's, with the draft's quant_matmul; k: K; block_size: P; vocab: V, the target's.
    """

    def __init__(self, cfg, params, kv_types, kernels: Kernels, *, k: int, block_size: int,
                 vocab: int):  # fmt: skip
        self.cfg, self.kv_types, self.k, self.block_size, self.vocab = (
            cfg,
            kv_types,
            k,
            block_size,
            vocab,
        )
        self.writes_ahead = k  # its decodes write K positions past a row's last token
        self.hidden_layers, self.feeds_params = (), True
        self.bufs, self._layout = packed_params.pack(params)
        self.family, self._kernels = family_of(cfg), kernels

    def init_kv(self, shape):
        """Zeroed caches of the target's first block space (a step_format.GroupShape)."""
        return self.family.init_caches(self.cfg, [shape], *self.kv_types)

    def forward(self, bufs, dkv, batch: dict):
        """The draft's forward pass over a batch: (logits, dkv, stats)."""
        params = packed_params.unpack(bufs, self._layout)
        logits, dkv, _, stats = self.family.forward(params, dkv, None, batch, self.cfg,
                                                    self._kernels)  # fmt: skip
        return logits, dkv, stats

    def propose_bufs(self, target_params: dict):
        return self.bufs

    def feed(self, bufs, dkv, batch: dict, hidden=None):
        """The forward pass's part: the draft's KV of every token the step fed (its logits go
        unused, and XLA drops them); hidden: unused. Returns (dkv, reads: the logits rows'
        positions int32 [R] and the rows' block tables [S, MB], what `propose` needs)."""
        _, dkv, _ = self.forward(bufs, dkv, batch)
        return dkv, proposals.row_reads(batch)

    read_shapes = staticmethod(proposals.row_read_shapes)

    def propose(self, bufs, dkv, reads, packed, batch: dict, floats, filtered: bool):
        """K proposals per sampled row, from the token the row emitted last.

        The draft's KV already holds the row's kept proposals (`feed` wrote every token the
        step fed), so decode step 0 feeds the row's last emitted token at the position after
        its last kept one, and each step j > 0 feeds proposal j - 1, one batch of S rows
        (unrolled: K is small and static, and the program keeps no device branch). Each step
        writes the draft's KV at its position in the row's blocks (the host claimed K positions
        past a sampled row's last token within the slot's reservation; past the table the
        write goes to the sink). Proposal j is picked as device/head_proposer.py picks a
        head's: with the row's parameters and the noise its verify row draws at offset j.

        Args: bufs: the packed params; dkv: the caches; reads: `feed`'s; packed: sample_rows'
          output; batch: the sampling program's rows (steps already moved by catch_up's
          offsets); floats: [6, S]; filtered: `sample`'s.
        Returns: (int32 [S, K], dkv).
        """
        lpos, tables = reads
        tok, pos0, accepted = proposals.last_emitted(packed, lpos, batch)
        live = (batch["sample_mask"] > 0) & (batch["slots"] >= 0)
        V = self.vocab
        pick = proposals.picker(batch, floats, accepted, V, filtered)
        out = []
        for j in range(self.k):
            dec = proposals.decode_batch(tok, pos0 + j, live, tables, self.block_size)
            logits, dkv, _ = self.forward(bufs, dkv, dec)
            if logits.shape[-1] < V:  # ids the draft lacks are never proposed
                logits = jnp.pad(logits, ((0, 0), (0, V - logits.shape[-1])),
                                 constant_values=-jnp.inf)  # fmt: skip
            # the target's width: its noise vector for (seed, step)
            tok = pick(logits[:, :V], j)
            out.append(tok)
        return jnp.stack(out, axis=1).astype(jnp.int32), dkv
