"""DeepSeek V4's attention of one layer over its paged caches, for a packed step.

Every layer attends to its raw window: the K = V rows of a sequence's last W positions, the
current one included, in the sliding cache group. A compressed layer attends to its entries
too: HCA (m = 128) to every entry the query may see (entry i once (i + 1) m <= t + 1), CSA
(m = 4) to the ones its lightning indexer picks (indexer.py). A step's tokens close entries
as they complete blocks (compressor.py; the open blocks live in the slot's rings); an entry
is normed, roped at its block's first position and written at its closing token's write
index in the layer's group before any query of the step reads the cache, so a query reads
every key from the caches, its own step's included.

Each query row's keys are rows of the caches given by index (its window's positions through
the block tables, then its visible or picked entries), which the sink attention kernel
(pallas_kernels/sink_attention.py) gathers itself; the indexer's keys are gathered by XLA.

Shapes: T tokens, S segments, H heads, D head width, W window, NE entries a table reaches,
HI / dI the indexer's heads and width, d model width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.int8_rows import rms_norm
from pallas_kernels.sink_attention import sink_attention_reference

from ..step_format import group_keys
from .compressor import closes, compress
from .indexer import index_scores, select_entries, visible_entries
from .shared_kv_attention import output, queries_and_kv
from .tail_rope import rope_tail


class StepTokens(NamedTuple):
    """What a layer reads of each token of the step ([T] int32 unless said): its segment, its
    position, its slot (-1: padding), the first position of its row and one past the last
    the row keeps (a verify row's proposals are not kept), and whether it is real (bool)."""

    seg: object
    pos: object
    slot: object
    start: object
    end: object
    real: object

    @staticmethod
    def of(batch: dict) -> StepTokens:
        cu, seg, pos = batch["cu_q_lens"], batch["seg_ids"], batch["positions"]
        T = seg.shape[0]
        real = jnp.arange(T) < cu[-1]
        start = batch["kv_lens"] - (cu[1:] - cu[:-1])  # [S] each row's first position
        keep = batch["kv_lens"] - batch["n_draft"]
        slot = jnp.where(real, batch["slots"][seg], -1)
        return StepTokens(seg, pos, slot, start[seg], keep[seg], real)


def _rows(tables, seg, e, P: int):
    """Flat cache rows of entries e [T, N] (clipped at 0) through each token's segment's
    block table [S, MB] of P-entry blocks."""
    e = jnp.maximum(e, 0)
    blk = jnp.take_along_axis(tables[seg], jnp.minimum(e // P, tables.shape[1] - 1), axis=1)
    return blk * P + e % P


def write(cache, idx, rows, mask):
    """cache [NB, P, w] with rows [T, w] written at flat entries idx [T] where mask [T]."""
    NB, P, w = cache.shape
    at = jnp.where(mask, idx, NB * P)  # out of range: dropped
    return (
        cache.reshape(NB * P, w)
        .at[at]
        .set(rows.astype(cache.dtype), mode="drop")
        .reshape(cache.shape)
    )


def window_rows(tables, tok: StepTokens, W: int, P: int):
    """[T, W] flat rows of each token's positions t - W + 1 .. t in the window's cache (-1 before
    the sequence's start)."""
    p = tok.pos[:, None] - (W - 1) + jnp.arange(W)[None, :]
    return jnp.where(p >= 0, _rows(tables, tok.seg, p, P), -1)


def entries(lp: dict, x, ring_c, ring_z, tok: StepTokens, *, m: int, overlap: bool, freqs,
            eps: float, proj):  # fmt: skip
    """(entries [T, w] normed and roped at their block's first position, where a token closes
    one; the rings after the step) of one compressor (lp: wkv, wgate, ape [m, W], norm [w])."""
    c = proj(x, lp["wkv"]).astype(jnp.float32)
    z = proj(x, lp["wgate"]).astype(jnp.float32) + lp["ape"][jnp.mod(tok.pos, m)]
    e, ring_c, ring_z = compress(c, z, ring_c, ring_z, tok.slot, tok.pos, tok.start, tok.end,
                                 m=m, overlap=overlap)  # fmt: skip
    e = rope_tail(rms_norm(e, lp["norm"], eps), (tok.pos // m) * m, freqs)
    return e, ring_c, ring_z


def attend(lp: dict, x, caches: dict, rings: dict, tok: StepTokens, batch: dict, *, ratio: int,
           window: int, heads: int, topk: int, freqs, eps: float, groups: tuple, proj,
           attention=None):  # fmt: skip
    """One layer's attention.

    Args:
      lp: the layer's params (shared_kv_attention's, sinks [H]; a compressed layer's
        compressor {wkv, wgate, ape, norm}; a CSA layer's indexer {wq_b, proj} and its
        compressor); x [T, d] the normed layer input; caches: "window" [NB, P, D], and a
        compressed layer's "entries" [NB', P', D] (a CSA layer's "index" [NB', P', dI] too);
        rings: its compressors' rings {"kv", "score"} ("index_kv", "index_score" for CSA's
        indexer) [S_max, R, w]; ratio: 0, 4 (CSA) or 128 (HCA); groups: (window group,
        the layer's compressed group or None) for the batch's tables and write indices;
        proj: (x, w) -> x @ w; attention: pallas_kernels/sink_attention's kernel, or None
        (its reference).
    Returns:
      (out [T, d] float32, caches, rings).
    """
    pos = tok.pos
    with jax.named_scope("qkv"):
        q, qr, kv = queries_and_kv(x, lp, pos, freqs, heads=heads, eps=eps, proj=proj)
    wt, ww = group_keys(groups[0])
    with jax.named_scope("kv_write"):
        caches = dict(caches, window=write(caches["window"], batch[ww], kv, tok.real))
    flat = [caches["window"].reshape(-1, kv.shape[-1])]
    rows = [window_rows(batch[wt], tok, window, caches["window"].shape[1])]
    if ratio:
        et, ew = group_keys(groups[1])
        tables, P = batch[et], caches["entries"].shape[1]
        n = visible_entries(pos, ratio)
        close = tok.real & closes(pos, ratio)
        csa = "index" in caches
        with jax.named_scope("compressor"):
            e, rc, rz = entries(lp["compressor"], x, rings["kv"], rings["score"], tok, m=ratio,
                                overlap=csa, freqs=freqs, eps=eps, proj=proj)  # fmt: skip
            rings = dict(rings, kv=rc, score=rz)
            caches["entries"] = write(caches["entries"], batch[ew], e, close)
        flat.append(caches["entries"].reshape(-1, e.shape[-1]))
        every = jnp.broadcast_to(jnp.arange(tables.shape[1] * P), (x.shape[0], tables.shape[1] * P))
        if csa:
            with jax.named_scope("indexer"):
                ix = lp["indexer"]
                ring = rings["index_kv"], rings["index_score"]
                ie, rc, rz = entries(ix["compressor"], x, *ring, tok, m=ratio, overlap=True,
                                     freqs=freqs, eps=eps, proj=proj)  # fmt: skip
                rings = dict(rings, index_kv=rc, index_score=rz)
                caches["index"] = write(caches["index"], batch[ew], ie, close)
                iq = proj(qr, ix["wq_b"]).reshape(x.shape[0], -1, ie.shape[-1])
                iq = rope_tail(iq, pos, freqs)
                w = proj(x, ix["proj"]).astype(jnp.float32) * iq.shape[1] ** -0.5
                ikeys = caches["index"].reshape(-1, ie.shape[-1])[_rows(tables, tok.seg, every, P)]
                pick = select_entries(index_scores(iq, w, ikeys, n), min(topk, every.shape[1]), n)
                rows.append(jnp.where(pick >= 0, _rows(tables, tok.seg, pick, P), -1))
        else:
            rows.append(jnp.where(every < n[:, None], _rows(tables, tok.seg, every, P), -1))
    with jax.named_scope("attention"):
        o = (attention or sink_attention_reference)(q, tuple(flat), tuple(rows), lp["sinks"],
                                                    scale=q.shape[-1] ** -0.5)  # fmt: skip
    with jax.named_scope("attn_out"):
        return output(o, lp, pos, freqs, proj=proj), caches, rings
