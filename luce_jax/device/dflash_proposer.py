"""A DFlash block drafter (models/dflash.py) run inside the target's step (`--spec-mode
dflash --draft drafter.gguf`): one drafter forward per step drafts K tokens for every
proposing row, with no program or host round trip of its own.

The drafter's KV holds context rows on the target's block ids (as device/draft_model.py keeps
a draft's): every forward pass writes, for each token it fed, each draft layer's K/V of the
target's streams at that position (`feed`; entries a verify row wrote past its kept proposals
are written again later). After verification, a sampling program that proposes (`propose`)
runs one block per sampled row, [its last emitted token, MASK x K] at the positions from that
token's on, all rows in one pass: the block's queries see the row's context rows and the whole
block (the attention's causal mask is given the block's last position for every block query,
while the rope takes each token's own), and its K/V are written at those positions (the next
forward pass overwrites them with context rows). Block index j + 1's logits give proposal j,
picked as device/head_proposer.py picks a head's.

Shapes: T tokens, S rows, R logits rows, n target layers read, d width, K proposals (B = K + 1
block tokens), MB blocks per sequence, P block size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_cache

from ..models import dflash
from ..models.linear import embed
from ..models.logits import project
from . import packed_params, proposals

LM_KEYS = ("embed", "lm_head")  # the target's params the block reads


class DFlashProposer:
    """The interface of device/draft_model.DraftModel (init_kv, feed, propose, read_shapes,
    propose_bufs); caches: each draft layer's (k, v) on the target's block ids.

    Args: dcfg, params: the drafter (dflash.load); kv_types: (k, v) cache types; kernels: the
      runner's; k: K (at most the drafter's block size - 1); block_size: P.
    """

    feeds_params = True  # `feed` projects the target's streams: the forward pass gets params

    def __init__(self, dcfg, params, kv_types, kernels, *, k: int, block_size: int):
        assert k < dcfg.block_size, (k, dcfg.block_size)
        self.dcfg, self.kv_types, self.kernels = dcfg, kv_types, kernels
        self.k, self.block_size = k, block_size
        self.hidden_layers = dcfg.target_layers
        self.writes_ahead = k + 1  # a block writes K + 1 positions from a row's new token on
        self.bufs, self._layout = packed_params.pack(params)

    def propose_bufs(self, target_params: dict):
        """The drafter's packed params and the target's embedding and lm_head."""
        return self.bufs, {k: target_params[k] for k in LM_KEYS if k in target_params}

    def init_kv(self, shape) -> list:
        """Zeroed (k, v) [NB, P, K, D] per draft layer on the target's first block space."""
        c = self.dcfg
        kv_shape = (shape.num_blocks, shape.block_size, c.kv_heads, c.head_dim)
        k_type, v_type = self.kv_types
        return [(kv_cache.init(kv_shape, k_type), kv_cache.init(kv_shape, v_type))
                for _ in range(c.layers)]  # fmt: skip

    def feed(self, bufs, dkv, batch: dict, hidden):
        """The forward pass's part: every fed token's context rows. hidden: [n, T, d] the
        target's streams at target_layers. Returns (dkv, reads: the logits rows' positions
        [R] and the rows' block tables [S, MB])."""
        p = packed_params.unpack(bufs[0], self._layout)
        n, T, d = hidden.shape
        features = jnp.moveaxis(hidden, 0, 1).reshape(T, n * d)
        with jax.named_scope("dflash"):
            rows = dflash.context_kv(p, self.dcfg, features, batch["positions"])
            at = batch["write_idx"]
            dkv = [(kv_cache.write(kc, at, k), kv_cache.write(vc, at, v))
                   for (kc, vc), (k, v) in zip(dkv, rows, strict=True)]  # fmt: skip
        return dkv, proposals.row_reads(batch)

    read_shapes = staticmethod(proposals.row_read_shapes)

    def propose(self, bufs, dkv, reads, packed, batch: dict, floats, filtered: bool):
        """K proposals per sampled row from one block pass (module docstring).

        Args: bufs: `propose_bufs`; dkv: the caches; reads: `feed`'s; packed: sample_rows'
          output; batch: the sampling program's rows (steps already moved by catch_up's
          offsets); floats: [6, S]; filtered: `sample`'s.
        Returns: (int32 [S, K], dkv).
        """
        c, K, P = self.dcfg, self.k, self.block_size
        p, lm = packed_params.unpack(bufs[0], self._layout), bufs[1]
        lpos, tables = reads
        S, MB = batch["slots"].shape[0], tables.shape[1]
        B = K + 1
        tok, pos0, accepted = proposals.last_emitted(packed, lpos, batch)
        live = (batch["sample_mask"] > 0) & (batch["slots"] >= 0)
        pos = pos0[:, None] + jnp.arange(B)  # [S, B]
        ok = live[:, None] & (pos // P < MB)
        blk = tables[jnp.arange(S)[:, None], jnp.where(ok, pos // P, 0)]
        T = -(-S * B // 8) * 8  # padded as the step's token buckets are
        pad = T - S * B

        def flat(x, fill=0):
            return jnp.concatenate([x.reshape(-1), jnp.full(pad, fill, jnp.int32)])

        top = jnp.minimum(pos0 + K, MB * P - 1)  # every block query sees the whole block
        dec = {
            "seg_ids": flat(jnp.broadcast_to(jnp.arange(S)[:, None], (S, B)), S - 1),
            "positions": flat(jnp.where(ok, top[:, None], 0)),
            "write_idx": flat(jnp.where(ok, blk * P + pos % P, 0)),
            "block_tables": tables,
            "kv_lens": jnp.where(live, top + 1, 0),
            "cu_q_lens": jnp.arange(S + 1, dtype=jnp.int32) * B,
        }
        tokens = jnp.concatenate([tok[:, None], jnp.full((S, K), c.mask_token, jnp.int32)], 1)
        x = embed(lm["embed"], flat(tokens))
        caches = list(dkv)
        attend = dflash.paged_attend(self.kernels.attention, caches, dec, p, c)
        with jax.named_scope("dflash"):
            h = dflash.block(p, c, x, flat(jnp.where(ok, pos, 0)), attend)[: S * B]
            h = h.reshape(S, B, -1)[:, 1:].reshape(S * K, -1)
            logits = project(lm, h, self.kernels.quant_matmul).reshape(S, K, -1)
        pick = proposals.picker(batch, floats, accepted, logits.shape[-1], filtered)
        out = [pick(logits[:, j], j) for j in range(K)]
        return jnp.stack(out, axis=1).astype(jnp.int32), caches
