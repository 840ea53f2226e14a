"""Proposals kept on the device: per-slot state, its update in the sampling program, and the
offset by which a row lowered behind its slot's state moves (a draft head's proposals:
device/head_proposer.py; a draft model's: device/draft_model.py; prompt lookup's:
device/ngram_lookup.py; an MTP block's: device/mtp_proposer.py).

Per slot the state holds `props` [S_max, K], the proposals for the slot's next verify row (a
draft head's, a draft model's or the lookup's), and `acc` [S_max], the proposals the slot's
last sampled row kept. The forward pass reads both (sampling.feed resolves proposal markers,
sampling.catch_up moves rows by `offsets`); the sampling program rewrites them after
verification. Shapes: S rows, R logits rows, S_max slots, K proposals, V vocabulary, MB blocks
per sequence, P block size."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import sampling

KEYS = ("acc", "props")  # the state's entries, beside the sampler's in the runner's state


def proposer(cfg, family, kernels, k: int, block_size: int, head, draft, ngram: bool,
             head_lookup: bool, mtp, dflash, max_slots: int):  # fmt: skip
    """The device proposer of a Runner's arguments (runner.py says what each is): a draft
    head's, a draft model's, prompt lookup's, the model's MTP block's, a DFlash drafter's, or
    None."""
    from .dflash_proposer import DFlashProposer
    from .draft_model import DraftModel
    from .head_proposer import HeadProposer
    from .mtp_proposer import MtpProposer
    from .ngram_lookup import NgramLookup

    # build.py runs a proposer here only where the family runs it on the device
    proposers = {"head": head, "draft": draft, "ngram": ngram or None, "mtp": mtp,
                 "dflash": dflash}  # fmt: skip
    for name, x in proposers.items():
        assert x is None or (name in family.device_proposers and k), name
    assert sum(x is not None for x in proposers.values()) <= 1, "one proposer"
    if head is not None:
        return HeadProposer(cfg, *head, kernels.quant_matmul, k=k, block_size=block_size,
                            lookup=head_lookup)  # fmt: skip
    if draft is not None:
        # the draft's weights load in order (draft_files.py: no mesh layout)
        return DraftModel(*draft[:3], kernels._replace(quant_matmul=draft[3], shards=1), k=k,
                          block_size=block_size, vocab=cfg.vocab_size)  # fmt: skip
    if ngram:
        return NgramLookup(k=k, block_size=block_size)
    if mtp is not None:
        return MtpProposer(cfg, mtp, kernels, k=k, block_size=block_size, max_slots=max_slots)
    if dflash is not None:
        return DFlashProposer(*dflash, kernels, k=k, block_size=block_size)
    return None


def of(state: dict) -> dict:
    """This state's entries out of the runner's state (a forward pass reads them)."""
    return {k: state[k] for k in KEYS}


def init(max_slots: int, k: int) -> dict:
    """Zeroed state: acc [S_max], props [S_max, K]."""
    return {
        "acc": jnp.zeros((max_slots,), jnp.int32),
        "props": jnp.zeros((max_slots, k), jnp.int32),
    }


def row_reads(batch: dict) -> tuple:
    """What a proposer with caches on the pool's block ids (a draft model, the lookup) reads
    from the forward pass: the logits rows' positions int32 [R] and the rows' block tables
    [S, MB]."""
    return batch["positions"][batch["logit_rows"]], batch["block_tables"]


def row_read_shapes(R: int, S: int, MB: int) -> tuple:
    """Abstract `row_reads`, to compile a sampling program with."""
    return (jax.ShapeDtypeStruct((R,), jnp.int32), jax.ShapeDtypeStruct((S, MB), jnp.int32))


def last_emitted(packed, lpos, batch: dict) -> tuple:
    """Per row, the token it emitted last, the position after it (where that token goes) and
    the proposals it kept, each [S]; lpos: `row_reads`' positions, packed: sample_rows'."""
    R, S = lpos.shape[0], batch["slots"].shape[0]
    accepted = packed[2 * R : 2 * R + S]
    last = jnp.minimum(batch["logit_start"] + accepted, R - 1)  # [S] logits row
    return packed[last], lpos[last] + 1, accepted


# A draft decode step pads its S rows to at least this many tokens, as the step's smallest
# token bucket does (XLA's GPU dot for M=1 is slower than for M=8: host/engine.py).
MIN_DECODE_TOKENS = 8


def decode_batch(tok, pos, live, tables, block_size: int) -> dict:
    """A decode batch of S rows, one token each (a draft's step over caches on the pool's block
    ids): tok [S] at positions pos [S] of the rows' block tables [S, MB], writing K/V there;
    rows not `live`, and positions past the table, write the sink and attend to nothing."""
    S, MB, P = tok.shape[0], tables.shape[1], block_size
    rows = jnp.arange(S)
    pad = jnp.zeros(max(S, MIN_DECODE_TOKENS) - S, jnp.int32)
    ok = live & (pos // P < MB)
    blk = tables[rows, jnp.where(ok, pos // P, 0)]
    return {
        "tokens": jnp.concatenate([tok, pad]),
        "positions": jnp.concatenate([jnp.where(ok, pos, 0), pad]),
        "seg_ids": jnp.concatenate([rows, pad + S - 1]),  # past cu_q_lens[-1]: padding
        "write_idx": jnp.concatenate([jnp.where(ok, blk * P + pos % P, 0), pad]),
        "block_tables": tables,
        "kv_lens": jnp.where(ok, pos + 1, 0),
        "cu_q_lens": jnp.arange(S + 1, dtype=jnp.int32),
        "logit_rows": rows,
    }


def offsets(acc, batch: dict):
    """int32 [S]: how far each row the host marked `behind` really starts past where it was
    lowered (its slot's last row's kept proposals); 0 for every other row."""
    return acc[jnp.clip(batch["slots"], 0, acc.shape[0] - 1)] * (batch["behind"] > 0)


def update(state: dict, packed, batch: dict, R: int, props=None) -> dict:
    """The state after a sampling program: each sampled row's kept count, and its next
    proposals props [S, K] (None: the slots keep older ones, which only cost a rejection if a
    step verifies them). Rows that sample nothing (and padding) write nothing.

    Args: state: acc and props; packed: sampling.sample_rows' output; batch: the sampling
      program's rows; R: logits rows.
    """
    at = jnp.where(batch["sample_mask"] > 0, batch["slots"], state["acc"].shape[0])
    out = {"acc": state["acc"].at[at].set(packed[2 * R :], mode="drop"), "props": state["props"]}
    if props is not None:
        out["props"] = state["props"].at[at].set(props, mode="drop")
    return out


def picker(batch: dict, floats, accepted, vocab: int, filtered: bool):
    """pick(logits [S, V], j) -> tokens [S]: proposal j chosen as the target's row will sample
    at offset j, with the row's parameters and the noise of (seed, tokens generated by then +
    j), penalties aside (a draft head's and a draft model's rule). accepted: [S] proposals each
    row kept; floats: [6, S]; filtered: sampling.sample's."""
    sp = sampling.named(floats, batch["top_k"])
    seeds = jax.lax.bitcast_convert_type(batch["seeds"], jnp.uint32)
    steps = batch["steps"] + accepted + 1  # generated before the next row's first token
    none = jnp.zeros((accepted.shape[0], vocab), jnp.int32)  # no penalty state

    def pick(logits, j):
        return sampling.sample(logits, none, none > 0, sp, seeds, steps + j, filtered)[0]

    return pick
