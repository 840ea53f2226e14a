"""Prompt lookup run inside the target's step: each sequence's tokens kept on the device, and
proposals found there in the sampling program, with no host round trip.

With proposals from the host (speculation/ngram.py), a step's proposals follow the tokens of
the step before, so the host had to read those first and steps could not overlap: on the H200
a random-weight Qwen3-8B, whose proposals were never kept, ran at 0.72 to 0.89x of `off`
(bench/results/speculative_qwen3-8b-bf16_h200.md), 7.0 ms a step at C1 against
4.7. Here the lookup needs nothing from the host, so steps overlap as with a draft head.

A token cache mirrors the target's KV pool (one int32 per KV position, on the same block ids):
the forward pass writes every token it feeds where its K/V go (`feed`), so a row's block table
reads its sequence back, and a prefix-cache hit holds the tokens too. Proposals a verify row
fed past its kept ones are overwritten later, and a lookup reads positions up to the row's
new token only. After verification a sampling program that proposes (`propose`) takes each
row's last n tokens, longest n first, finds where they occurred last before, and proposes the
K tokens that followed there: as speculation/ngram.py does on the host (tested equal).

Shapes: T tokens, S rows, R logits rows, K proposals, MB blocks per sequence, P block size,
L = MB * P positions.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import proposals


class NgramLookup:
    """The device's half of `--spec-mode ngram` on dense models: the interface of
    device/draft_model.DraftModel (init_kv, feed, propose, read_shapes, bufs), with a token
    cache for caches and no params.

    Args: k: K; block_size: P; n_min, n_max: n-gram lengths tried, longest first.
    """

    bufs = None  # no params
    writes_ahead = 0  # proposing writes nothing past a row's last token
    hidden_layers = ()
    feeds_params = False

    def propose_bufs(self, target_params: dict):
        return None

    def __init__(self, *, k: int, block_size: int, n_min: int = 1, n_max: int = 3):
        assert 1 <= n_min <= n_max, (n_min, n_max)
        self.k, self.block_size, self.n_min, self.n_max = k, block_size, n_min, n_max

    def init_kv(self, shape):
        """The token cache: int32 [NB * P], one token id per KV position of the target's first
        block space (a step_format.GroupShape)."""
        return jnp.zeros((shape.num_blocks * self.block_size,), jnp.int32)

    def feed(self, bufs, tokens_kv, batch: dict, hidden=None):
        """The forward pass's part: every token the step fed, written where its K/V go (padding
        writes the sink); hidden: unused. Returns (tokens_kv, reads: logits rows' positions
        int32 [R] and the rows' block tables [S, MB])."""
        tokens_kv = tokens_kv.at[batch["write_idx"]].set(batch["tokens"], mode="drop")
        return tokens_kv, proposals.row_reads(batch)

    read_shapes = staticmethod(proposals.row_read_shapes)

    def propose(self, bufs, tokens_kv, reads, packed, batch: dict, floats, filtered: bool):
        """K proposals per row (`lookup`'s). Args: bufs: unused; tokens_kv: the token cache;
        reads: `feed`'s; packed: sample_rows' output; batch: the sampling program's rows;
        floats, filtered: unused (proposals are the text's own tokens, the same at any
        temperature). Returns: (int32 [S, K], tokens_kv unchanged)."""
        return self.lookup(tokens_kv, reads, packed, batch)[0], tokens_kv

    def lookup(self, tokens_kv, reads, packed, batch: dict):
        """What followed the last earlier occurrence of each row's last n tokens (the token it
        just emitted included), for the longest n in n_max..n_min that occurred. Where that
        continuation runs into the row's own end it repeats itself (a text repeating with
        period p goes on so); with no occurrence, the last token repeats. Rows that sampled
        nothing get proposals nobody reads.

        Returns: (proposals int32 [S, K], the n that matched int32 [S], 0 where none did).
        """
        lpos, tables = reads
        S, P, MB = batch["slots"].shape[0], self.block_size, tables.shape[1]
        L = MB * P
        tok, end, _ = proposals.last_emitted(packed, lpos, batch)
        end = jnp.minimum(end, L - 1)  # the new token's position
        seq = tokens_kv.reshape(-1, P)[tables].reshape(S, L)  # [S, L]
        at = jnp.arange(L)
        seq = jnp.where(at[None] == end[:, None], tok[:, None], seq)
        best = jnp.full((S,), -1, jnp.int32)  # where the continuation starts
        matched = jnp.zeros((S,), jnp.int32)
        for n in range(self.n_max, self.n_min - 1, -1):
            hit = (at[None] + n <= end[:, None]) & (end[:, None] + 1 >= n)
            for j in range(n):  # window at i: seq[i + j] == the suffix's j-th token
                suffix_j = jnp.take_along_axis(seq, jnp.maximum(end - n + 1 + j, 0)[:, None], 1)
                hit &= jnp.roll(seq, -j, axis=1) == suffix_j
            found = jnp.max(jnp.where(hit, at[None] + n, -1), axis=1)
            matched = jnp.where((best < 0) & (found >= 0), n, matched)
            best = jnp.where(best < 0, found, best)
        start = jnp.where(best < 0, end, best)
        period = end + 1 - start  # >= 1: positions start..end are known
        pos = start[:, None] + jnp.arange(self.k)[None] % period[:, None]
        return jnp.take_along_axis(seq, pos, 1).astype(jnp.int32), matched
