"""Lower one step's sequence rows to fixed-width packed arrays (bucketed), with segment metadata.

Pure NumPy: the runner hands the result to the jitted step. Shapes: T tokens (bucket),
S segment rows (bucket), MB blocks per sequence, R logits rows (= S: one per segment).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SINK_BLOCK = 0  # padding rows write here; never part of a sequence's block table


@dataclass(frozen=True)
class Row:
    """One sequence's contribution to a step: a prompt slice or a single decode token."""

    slot: int
    tokens: tuple[int, ...]
    start: int  # position of tokens[0] (= KV length before this step)
    block_table: tuple[int, ...]  # physical blocks, logical order; covers start + len(tokens)
    sample: bool  # take logits at the last token (decode rows, prompt slices that complete)


def buckets(limit: int, smallest: int = 1) -> list[int]:
    """Powers of two from `smallest` up to the first one >= limit."""
    out = [smallest]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


def pick_bucket(n: int, sizes: list[int]) -> int:
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


def lower(rows: list[Row], block_size: int, t_bucket: int, s_bucket: int, max_blocks: int) -> dict:
    """Pack rows into the arrays models.dense.forward takes.

    Padding tokens point at the sink block with position 0 and segment s_bucket-1 (or a
    padding segment); padding segments have kv length 0 and an all-sink block table.
    Returns:
      dict of int32 arrays: tokens/positions/seg_ids/write_idx [T], block_tables [S, MB],
      kv_lens [S], cu_q_lens [S+1], logit_rows [S], slots [S] (-1 for padding rows),
      sample_mask [S] (1 where a token is sampled).
    """
    n_tok = sum(len(r.tokens) for r in rows)
    if n_tok > t_bucket or len(rows) > s_bucket:
        raise ValueError(f"{n_tok} tokens / {len(rows)} rows exceed bucket {t_bucket}/{s_bucket}")
    P = block_size
    tokens = np.zeros(t_bucket, np.int32)
    positions = np.zeros(t_bucket, np.int32)
    seg_ids = np.full(t_bucket, s_bucket - 1, np.int32)
    write_idx = np.full(t_bucket, SINK_BLOCK * P, np.int32)
    tables = np.full((s_bucket, max_blocks), SINK_BLOCK, np.int32)
    kv_lens = np.zeros(s_bucket, np.int32)
    cu = np.zeros(s_bucket + 1, np.int32)
    logit_rows = np.zeros(s_bucket, np.int32)
    slots = np.full(s_bucket, -1, np.int32)
    sample_mask = np.zeros(s_bucket, np.int32)
    t = 0
    for s, r in enumerate(rows):
        n = len(r.tokens)
        end = r.start + n
        assert len(r.block_table) * P >= end, (r.slot, len(r.block_table), end)
        assert len(r.block_table) <= max_blocks, (len(r.block_table), max_blocks)
        bt = np.asarray(r.block_table, np.int32)
        pos = np.arange(r.start, end, dtype=np.int32)
        tokens[t : t + n] = r.tokens
        positions[t : t + n] = pos
        seg_ids[t : t + n] = s
        write_idx[t : t + n] = bt[pos // P] * P + pos % P
        tables[s, : len(bt)] = bt
        kv_lens[s] = end
        cu[s + 1] = t + n
        logit_rows[s] = t + n - 1
        slots[s] = r.slot
        sample_mask[s] = int(r.sample)
        t += n
    cu[len(rows) + 1 :] = t
    return {
        "tokens": tokens,
        "positions": positions,
        "seg_ids": seg_ids,
        "write_idx": write_idx,
        "block_tables": tables,
        "kv_lens": kv_lens,
        "cu_q_lens": cu,
        "logit_rows": logit_rows,
        "slots": slots,
        "sample_mask": sample_mask,
    }
