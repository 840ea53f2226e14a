"""The step format: what the host sends the device each step, and what both read of it.

The host lowers one step's rows to fixed-width arrays (bucketed), with segment metadata, and
packs them into one int32 buffer; the device's programs unpack that buffer by the same layout.
Both packages import this module and nothing of each other's (docs/architecture.md). Pure
NumPy. Shapes: T tokens (bucket), S segment rows (bucket), MB blocks per sequence, R logits rows
(>= S: one per sampling row, plus one per speculative proposal a verify row carries).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

SINK_BLOCK = 0  # padding rows write here; never part of a sequence's block table
# A token the device supplies: the slot's last sampled token, kept in a device buffer, so a
# decode row needs nothing from the host and the next step can be dispatched before the
# previous one's tokens reach the host.
FROM_DEVICE = -1


def proposal_from_device(j: int) -> int:
    """The token marker of a slot's j-th proposal that the device holds (a draft head made it
    in the slot's last step): verify rows carry these, not token ids."""
    return -2 - j


def marker_rows(n_draft: np.ndarray) -> np.ndarray:
    """The tokens of decode rows whose proposals the device holds: per row FROM_DEVICE, then
    the markers of proposals 0..n - 1 (n_draft int32 [n]), concatenated: int32 [n + sum]."""
    lens = n_draft.astype(np.int64) + 1
    j = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)  # offset in row
    return np.where(j == 0, FROM_DEVICE, proposal_from_device(j - 1)).astype(np.int32)


@dataclass(frozen=True)
class Row:
    """One sequence's contribution to a step: a prompt slice, a decode token, or a verify row
    (the decode token followed by `draft` proposed tokens)."""

    slot: int
    tokens: tuple[int, ...]
    start: int  # position of tokens[0] (= KV length before this step)
    sample: bool  # take logits at the last token (decode rows, prompt slices that complete)
    draft: int = 0  # trailing tokens that are proposals: logits at each of the last draft + 1


@dataclass(frozen=True)
class Rows:
    """A step's n rows as arrays, in packing order (what `lower` takes).

    slots, starts (position of each row's first token), lens: int32 [n]; tokens: int32
    [sum(lens)], FROM_DEVICE where the device supplies the token; sample: bool [n] (logits at
    the row's last token); n_draft: int32 [n] (trailing proposals of a verify row).
    """

    slots: np.ndarray
    starts: np.ndarray
    lens: np.ndarray
    tokens: np.ndarray
    sample: np.ndarray
    n_draft: np.ndarray

    @staticmethod
    def of(rows: list[Row]) -> Rows:
        n = len(rows)
        return Rows(
            slots=np.fromiter((r.slot for r in rows), np.int32, n),
            starts=np.fromiter((r.start for r in rows), np.int32, n),
            lens=np.fromiter((len(r.tokens) for r in rows), np.int32, n),
            tokens=np.fromiter((t for r in rows for t in r.tokens), np.int32),
            sample=np.fromiter((r.sample for r in rows), bool, n),
            n_draft=np.fromiter((r.draft for r in rows), np.int32, n),
        )

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        return Rows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Rows)))

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def n_logits(self) -> int:
        """Logits rows the step takes: one per row, and one per proposal."""
        return len(self.slots) + int(self.n_draft.sum())


@dataclass(frozen=True)
class GroupShape:
    """One KV cache group's block space, as the host's pool hands it out and the device's
    caches hold it: `num_blocks` blocks (the sink included) of `block_size` entries, a table of
    `max_blocks` blocks per slot; an entry stands for `tokens_per_entry` tokens; a group with a
    `window` keeps only the entries of a sequence's last `window` tokens (a table's blocks
    behind it are the sink)."""

    num_blocks: int
    block_size: int
    max_blocks: int
    tokens_per_entry: int = 1
    window: int = 0

    def blocks_for(self, tokens: int) -> int:
        """Blocks that cover `tokens` tokens' entries (a partial entry counts)."""
        entries = -(-tokens // self.tokens_per_entry)
        return -(-entries // self.block_size)

    def cap(self, tokens: int, span: int) -> int:
        """The most blocks a slot of `tokens` tokens holds at once: all of them, or in a window
        the blocks from its step's first visible position to its last claimed one, where a
        step claims at most `span` positions past the first it queries."""
        full = self.blocks_for(tokens)
        if not self.window:
            return full
        return min(full, -(-(self.window + span) // (self.block_size * self.tokens_per_entry)) + 1)


def group_keys(g: int) -> tuple[str, str]:
    """The batch keys of cache group g's block tables and write indices: group 0's are
    "block_tables" and "write_idx", the others' carry the group's index."""
    return ("block_tables", "write_idx") if g == 0 else (f"block_tables_{g}", f"write_idx_{g}")


SMALLEST_TOKEN_BUCKET = 8  # a step's token axis is padded to at least this many rows


def buckets(limit: int, smallest: int = 1) -> list[int]:
    """Powers of two from `smallest` up to the first one >= limit."""
    out = [smallest]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


def token_buckets(limit: int, one_row: bool = False) -> list[int]:
    """A step's token buckets, up to the first power of two >= limit: from
    SMALLEST_TOKEN_BUCKET (XLA's GPU dot for M=1 measured 9.4 ms a Qwen3-8B step against 6.6 ms
    at M=8 on the H200, so a lone decode row is padded to 8), and with `one_row` a bucket of 1
    before them, where Pallas's quantized kernels run the projections (C1 5-11% faster on an
    H100: bench/results/history/2026-12-06_one_row_bucket_h100.md)."""
    out = buckets(limit, SMALLEST_TOKEN_BUCKET)
    return [1, *out] if one_row else out


def pick_bucket(n: int, sizes: list[int]) -> int:
    for b in sizes:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}")


def lower(
    rows: Rows | list[Row],
    tables: np.ndarray,
    block_size: int,
    t_bucket: int,
    s_bucket: int,
    r_bucket: int | None = None,
    groups: tuple = (),
) -> dict[str, np.ndarray]:
    """Pack rows into the arrays models.dense.forward takes (vectorized over rows).

    Args:
      rows: the step's rows, in packing order.
      tables: int32 [slots, MB] block table of every slot (sink-padded), indexed by slot;
        each row's table must already cover start + len(tokens).
      r_bucket: logits rows R (default s_bucket); a sampling row takes 1 + draft of them.
      groups: (tables, GroupShape) of every cache group after the first (whose tables and
        block_size are the arguments above): each adds its block_tables_g [S, MB_g] and
        write_idx_g [T] (the entry slot a token's position falls in: tokens_per_entry tokens
        share one; the family decides which of them writes).
    Padding tokens write the sink block at position 0 and belong to the last segment; padding
    segments have kv length 0 and an all-sink block table, so whatever they gather is block 0.
    Returns:
      dict of int32 arrays: tokens/positions/seg_ids/write_idx [T], block_tables [S, MB],
      kv_lens [S], cu_q_lens [S+1], slots [S] (-1 for padding rows), sample_mask [S] (1 where
      a token is sampled), n_draft [S], logit_start [S] (its first logits row); per logits
      row: logit_rows [R] (token index), logit_seg [R] (segment), logit_off [R] (0 at the
      decode token, j at the j-th proposal). Rows that sample nothing still own one logits
      row (unused), so logits row i of a plain step is segment i.
    """
    if not isinstance(rows, Rows):
        rows = Rows.of(rows)
    n = len(rows)
    R = s_bucket if r_bucket is None else r_bucket
    lens, starts, slots, n_draft = rows.lens, rows.starts, rows.slots, rows.n_draft
    tot = int(lens.sum())
    if tot > t_bucket or n > s_bucket:
        raise ValueError(f"{tot} tokens / {n} rows exceed bucket {t_bucket}/{s_bucket}")
    P, MB = block_size, tables.shape[1]
    cu = np.zeros(s_bucket + 1, np.int32)
    np.cumsum(lens, out=cu[1 : n + 1])
    cu[n + 1 :] = tot
    seg = np.repeat(np.arange(n, dtype=np.int32), lens)
    pos = np.arange(tot, dtype=np.int32) - cu[seg] + starts[seg]
    bt = tables[slots]  # [n, MB]
    assert (bt[np.arange(n), np.maximum(starts + lens - 1, 0) // P] != SINK_BLOCK).all()
    assert (n_draft < np.maximum(lens, 1)).all() and rows.sample[n_draft > 0].all()

    def padded(x, width, fill):
        out = np.full(width, fill, np.int32)
        out[: len(x)] = x
        return out

    block_tables = np.full((s_bucket, MB), SINK_BLOCK, np.int32)
    block_tables[:n] = bt
    width = n_draft + 1
    l_start = np.zeros(n, np.int32)
    np.cumsum(width[:-1], out=l_start[1:])
    n_logits = int(width.sum())
    if n_logits > R:
        raise ValueError(f"{n_logits} logits rows exceed bucket {R}")
    l_seg = np.repeat(np.arange(n, dtype=np.int32), width)
    l_off = np.arange(n_logits, dtype=np.int32) - l_start[l_seg]
    l_tok = cu[1 : n + 1][l_seg] - 1 - n_draft[l_seg] + l_off
    out = {
        "tokens": padded(rows.tokens, t_bucket, 0),
        "positions": padded(pos, t_bucket, 0),
        "seg_ids": padded(seg, t_bucket, s_bucket - 1),
        "write_idx": padded(bt[seg, pos // P] * P + pos % P, t_bucket, SINK_BLOCK * P),
        "block_tables": block_tables,
        "kv_lens": padded(starts + lens, s_bucket, 0),
        "cu_q_lens": cu,
        "slots": padded(slots, s_bucket, -1),
        "sample_mask": padded(rows.sample, s_bucket, 0),
        "n_draft": padded(n_draft, s_bucket, 0),
        "logit_start": padded(l_start, s_bucket, n_logits),
        "logit_rows": padded(l_tok, R, 0),
        "logit_seg": padded(l_seg, R, s_bucket - 1),
        "logit_off": padded(l_off, R, -1),  # -1: a padding logits row
    }
    for g, (tab, shape) in enumerate(groups, 1):
        Pg, entry = shape.block_size, pos // shape.tokens_per_entry
        bt_g = np.full((s_bucket, tab.shape[1]), SINK_BLOCK, np.int32)
        bt_g[:n] = tab[slots]
        k_tab, k_write = group_keys(g)
        out[k_tab] = bt_g
        out[k_write] = padded(bt_g[seg, entry // Pg] * Pg + entry % Pg, t_bucket, SINK_BLOCK * Pg)
    return out


Layout = list[tuple[str, tuple[int, ...]]]


def step_layout(T: int, S: int, R: int, MB: int, group_blocks: tuple[int, ...] = ()) -> Layout:
    """Names and shapes of the step's int32 inputs, packed into one buffer (one transfer);
    group_blocks: MB of every cache group after the first."""
    extra = [
        (key, shape)
        for g, mb in enumerate(group_blocks, 1)
        for key, shape in zip(group_keys(g), ((S, mb), (T,)), strict=True)
    ]
    return [
        ("tokens", (T,)),
        ("positions", (T,)),
        ("seg_ids", (T,)),
        ("write_idx", (T,)),
        ("block_tables", (S, MB)),
        ("kv_lens", (S,)),
        ("cu_q_lens", (S + 1,)),
        ("logit_rows", (R,)),
        *extra,
        *sample_layout(S, R),
    ]


def sample_layout(S: int, R: int) -> Layout:
    """The row arrays the sampling program reads (device/sampling.sample_rows): no [T] array, so
    buckets of one row width share one sampling program. (want_logprobs is the host's: it
    picks the program.)"""
    return [
        ("slots", (S,)),
        ("sample_mask", (S,)),
        ("n_draft", (S,)),
        ("logit_start", (S,)),
        ("top_k", (S,)),
        ("seeds", (S,)),
        ("steps", (S,)),
        ("fresh", (S,)),
        ("behind", (S,)),
        ("logit_seg", (R,)),
        ("logit_off", (R,)),
    ]


def layout_size(layout: Layout) -> int:
    return sum(int(np.prod(shape)) for _, shape in layout)


def pack(arrays: dict[str, np.ndarray], layout: Layout, tail=None) -> np.ndarray:
    """One int32 buffer holding `arrays` in layout order, then `tail` (int32 [n]) if given."""
    parts = [np.asarray(arrays[name], np.int32).ravel() for name, _ in layout]
    return np.concatenate(parts if tail is None else [*parts, tail])


def unpack(buf, layout: Layout) -> dict:
    """The arrays of a packed buffer (NumPy or jax: static slices and reshapes only)."""
    out, off = {}, 0
    for name, shape in layout:
        n = int(np.prod(shape))
        out[name] = buf[off : off + n].reshape(shape)
        off += n
    return out


# -- sampling inputs ------------------------------------------------------------------------
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")
# A row that samples nothing (padding, a prompt slice that does not complete): greedy, no
# penalties, so it never switches on the step's penalty or filter branches.
NEUTRAL = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 1.0], np.float32)


def padding_inputs(S: int) -> dict[str, np.ndarray]:
    """Sampling inputs of S padding rows: floats [6, S] (FLOAT_FIELDS, NEUTRAL), and int32
    top_k, seeds (the uint32 seed's bits), steps (tokens generated before the row's first
    sample, which with the seed fixes its noise), fresh (1: the slot's first row, whose
    sampler state is reset for a new request), behind (1: the row's slot has a step in flight
    whose accepted proposals the host has not counted; the device shifts the row by them,
    host/engine.py) [S], want_logprobs [1]."""
    out = {k: np.zeros(S, np.int32) for k in ("top_k", "seeds", "steps", "fresh", "behind")}
    out["floats"] = np.repeat(NEUTRAL[:, None], S, axis=1)
    out["want_logprobs"] = np.zeros(1, np.int32)
    return out


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's allowed-token bitmask (a structured output's grammar)."""
    return (vocab_size + 31) // 32
