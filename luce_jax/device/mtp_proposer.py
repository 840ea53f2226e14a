"""The model's own MTP block (models/mtp.py) run inside the target's step: fed in the forward
pass, proposing in the sampling program, with no program or host round trip of its own
(`--spec-mode mtp`).

The block pairs each token with the target's final-normed hidden state of the position before
it, and keeps its own paged KV on the target's block ids (as device/draft_model.py keeps a
draft's: a row's block table and KV write slots serve both). Every forward pass feeds it the
step's tokens (`feed`): a token's h is the hidden state of the token before it in the row, or
for a row's first token the one its slot kept (`h` below, per slot: the hidden state of the
slot's last kept position), or zeros at position 0. So its KV holds every sequence as far as
the target's does; entries a verify row wrote past its kept proposals are written again later.
After verification, a sampling program that proposes (`propose`) starts from each row's last
emitted token and the hidden state of its last kept position, keeps that hidden state for the
slot, and chains the block K times, each step fed its own output and proposal; proposal j is
picked as device/head_proposer.py picks a head's.

Shapes: T tokens, S rows, R logits rows, S_max slots, d model width, K proposals, MB blocks per
sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_cache

from ..models import mtp
from . import proposals

LM_KEYS = ("embed", "final_norm", "lm_head")  # the target's params the block's logits use


class MtpProposer:
    """The interface of device/draft_model.DraftModel (init_kv, feed, propose, read_shapes,
    propose_bufs); caches: the block's (k, v) and the slots' hidden states.

    Args: cfg: the target's ModelConfig (params["mtp"] holds the block); kv_types: (k, v)
      cache types; kernels: the runner's; k: K; block_size: P; max_slots: S_max.
    """

    feeds_params = True  # `feed` runs the block: the forward pass is passed its params

    def __init__(self, cfg, kv_types, kernels, *, k: int, block_size: int, max_slots: int):
        self.cfg, self.kv_types, self.kernels = cfg, kv_types, kernels
        self.k, self.block_size, self.max_slots = k, block_size, max_slots
        self.writes_ahead = k  # its decodes write K positions from a row's new token on
        self.hidden_layers = (cfg.n_layers,)  # the last block's output, before the final norm

    def propose_bufs(self, target_params: dict) -> dict:
        """The block's params and the target's embedding, final norm and lm_head."""
        lm = {k: target_params[k] for k in LM_KEYS if k in target_params}
        return {"mtp": target_params["mtp"], **lm}

    def init_kv(self, shape) -> dict:
        """Zeroed caches: the block's paged (k, v) [NB, P, K, D] on the target's first block
        space (a step_format.GroupShape), and h float32 [S_max, d]."""
        c = self.cfg
        kv_shape = (shape.num_blocks, shape.block_size, c.n_kv_heads, c.head_dim)
        k_type, v_type = self.kv_types
        return {
            "kv": (kv_cache.init(kv_shape, k_type), kv_cache.init(kv_shape, v_type)),
            "h": jnp.zeros((self.max_slots, c.d_model), jnp.float32),
        }

    def feed(self, bufs, dkv, batch: dict, hidden):
        """The forward pass's part: the block's KV of every token fed, and each row's last
        hidden state kept for its slot. Returns (dkv, reads: the logits rows' positions [R],
        the rows' block tables [S, MB] and the logits rows' final-normed hidden states
        float32 [R, d])."""
        c, S = self.cfg, batch["slots"].shape[0]
        h = mtp.target_hidden(bufs["final_norm"], hidden[0], c)  # [T, d]
        T = h.shape[0]
        seg = jnp.clip(batch["seg_ids"], 0, S - 1)
        slot = batch["slots"][seg]
        first = jnp.arange(T) == batch["cu_q_lens"][seg]
        kept = dkv["h"][jnp.clip(slot, 0, self.max_slots - 1)]
        prev = jnp.where(first[:, None], kept, jnp.roll(h, 1, axis=0))
        prev = jnp.where((batch["positions"] == 0)[:, None], 0.0, prev)
        with jax.named_scope("mtp"):
            _, kv = mtp.block(bufs["mtp"], bufs["embed"], prev, batch["tokens"], dkv["kv"], batch,
                              c, self.kernels)  # fmt: skip
        # each row's last token's hidden state, for its slot's next row (a sampled row's is
        # set again by `propose`, from its last kept position)
        ends = batch["cu_q_lens"][1:] - 1
        rows = (batch["slots"] >= 0) & (ends >= batch["cu_q_lens"][:-1])
        at = jnp.where(rows, batch["slots"], self.max_slots)
        out = {"kv": kv, "h": dkv["h"].at[at].set(h[jnp.maximum(ends, 0)], mode="drop")}
        return out, (*proposals.row_reads(batch), h[batch["logit_rows"]])

    def read_shapes(self, R: int, S: int, MB: int) -> tuple:
        hidden = jax.ShapeDtypeStruct((R, self.cfg.d_model), jnp.float32)
        return (*proposals.row_read_shapes(R, S, MB), hidden)

    def propose(self, bufs, dkv, reads, packed, batch: dict, floats, filtered: bool):
        """K proposals per sampled row, from its last emitted token (module docstring).

        Args: bufs: `propose_bufs`; dkv: the caches; reads: `feed`'s; packed: sample_rows'
          output; batch: the sampling program's rows (steps already moved by catch_up's
          offsets); floats: [6, S]; filtered: `sample`'s.
        Returns: (int32 [S, K], dkv).
        """
        c = self.cfg
        lpos, tables, hid = reads
        R, S = lpos.shape[0], batch["slots"].shape[0]
        tok, pos0, accepted = proposals.last_emitted(packed, lpos, batch)
        h = hid[jnp.minimum(batch["logit_start"] + accepted, R - 1)]  # [S, d]
        live = (batch["sample_mask"] > 0) & (batch["slots"] >= 0)
        keep = dkv["h"].at[jnp.where(live, batch["slots"], self.max_slots)].set(h, mode="drop")
        pick = proposals.picker(batch, floats, accepted, c.vocab_size, filtered)
        kv, out = dkv["kv"], []
        lm = {k: bufs[k] for k in LM_KEYS if k in bufs}
        for j in range(self.k):  # K is small and static: unrolled
            dec = proposals.decode_batch(tok, pos0 + j, live, tables, self.block_size)
            pad = dec["tokens"].shape[0] - S
            hp = jnp.pad(h, ((0, pad), (0, 0)))
            with jax.named_scope("mtp"):
                x, kv = mtp.block(bufs["mtp"], bufs["embed"], hp, dec["tokens"], kv, dec, c,
                                  self.kernels)  # fmt: skip
                x = x[:S]
                tok = pick(mtp.logits(bufs["mtp"], lm, x, c, self.kernels.quant_matmul), j)
            h = mtp.output(bufs["mtp"], x, c)
            out.append(tok)
        return jnp.stack(out, axis=1).astype(jnp.int32), {"kv": kv, "h": keep}
