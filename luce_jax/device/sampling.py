"""On-device sampling and verification, and the per-slot state they keep on the device.

The step's sampler (`sample_rows`) owns three per-slot device arrays, indexed by slot and
donated with the KV cache: penalty counts and prompt membership ([S_max, V]), and the last token
each slot emitted ([S_max]). Decode rows read their input token from the last one (`feed`),
so the host never sends a sampled token back down. Every row samples with its own parameters
and noise from (seed, step), so a seeded request reproduces whatever it is batched with.

The sampling program holds no data-dependent control flow (lax.cond, while_loop): XLA:GPU reads
such a predicate on the host, so dispatching the program waited for the forward pass queued
before it, 14 ms of a prefix-cached request's 21
(bench/results/history/2026-12-01_warm_ttft_h200.md).
What a step needs (the top-k/p filters, top logprobs) is known on the host and chosen by static
arguments; the cheap parts (penalties, grammar masks) always run, an identity when unused.

Shapes: T tokens, S segment rows, R logits rows, K proposals per verify row, V vocabulary,
S_max slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..step_format import FLOAT_FIELDS

TOP_LOGPROBS = 20  # OpenAI's maximum; computed only in steps where some row asks for logprobs


def init_state(max_slots: int, vocab: int) -> dict:
    """Zeroed per-slot sampler state: counts [S_max, V], prompt_mask [S_max, V], last [S_max]."""
    return {
        "counts": jnp.zeros((max_slots, vocab), jnp.int32),
        "prompt_mask": jnp.zeros((max_slots, vocab), jnp.bool_),
        "last": jnp.zeros((max_slots,), jnp.int32),
    }


def named(floats, top_k) -> dict:
    """Per-row parameter arrays by name from floats [6, R] (FLOAT_FIELDS order) and top_k [R]."""
    return {**{k: floats[i] for i, k in enumerate(FLOAT_FIELDS)}, "top_k": top_k}


def feed(batch: dict, state: dict):
    """The step's tokens [T]: where the host sent batch.FROM_DEVICE (-1), the row's slot's last
    emitted token, written by an earlier step's `sample_rows`; where it sent
    batch.proposal_from_device(j) (-2 - j), the slot's j-th proposal in state["props"] [S_max,
    K] (made by the slot's last step)."""
    S_max = state["last"].shape[0]
    tok_slot = jnp.clip(batch["slots"][batch["seg_ids"]], 0, S_max - 1)
    tokens = batch["tokens"]
    out = jnp.where(tokens == -1, state["last"][tok_slot], tokens)
    if "props" in state:
        K = state["props"].shape[1]
        prop = state["props"][tok_slot, jnp.clip(-2 - tokens, 0, K - 1)]
        out = jnp.where(tokens <= -2, prop, out)
    return out


def catch_up(batch: dict, off, block_size: int) -> dict:
    """Shift the rows the host lowered behind their slot's device state.

    A row marked `behind` belongs to a slot whose last step, still in flight when the host
    lowered this one, kept acc[slot] proposals the host has not yet counted: the row really
    starts that many positions later. Its positions, KV write slots and kv length move by
    that offset (the host claimed blocks for the largest). Other rows and padding stay.

    Args: batch: the step's arrays (step_format.lower's); off: int32 [S] each row's move
      (device/proposals.offsets); block_size: P.
    Returns: the shifted batch.
    """
    T = batch["tokens"].shape[0]
    seg, bt = batch["seg_ids"], batch["block_tables"]
    real = jnp.arange(T) < batch["cu_q_lens"][-1]
    shift = jnp.where(real, off[seg], 0)
    pos = batch["positions"] + shift
    blk = bt[seg, jnp.clip(pos // block_size, 0, bt.shape[1] - 1)]
    moved = jnp.where(shift > 0, blk * block_size + pos % block_size, batch["write_idx"])
    return {**batch, "positions": pos, "write_idx": moved, "kv_lens": batch["kv_lens"] + off}


def apply_penalties(logits, counts, prompt_mask, sp):
    """vLLM's penalties: repetition over prompt+output tokens, presence/frequency over output.

    Args:
      logits: [R, V] float32.
      counts: [R, V] int32 times each token was generated so far.
      prompt_mask: [R, V] bool tokens present in the prompt.
      sp: dict of [R] arrays (`named`).
    """
    seen = prompt_mask | (counts > 0)
    rep = sp["repetition"][:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sp["frequency"][:, None] * counts
    return logits - sp["presence"][:, None] * (counts > 0)


def _ordered(x):
    """uint32 keys of float32 x in the floats' order (-inf lowest, +inf highest; no NaN)."""
    i = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(i >> 31 == 1, ~i, i | jnp.uint32(1 << 31))


def _unordered(u):
    """The float32 values of `_ordered`'s keys."""
    i = jnp.where(u >> 31 == 1, u & jnp.uint32(0x7FFFFFFF), ~u)
    return jax.lax.bitcast_convert_type(i, jnp.float32)


CUT_BITS = 4  # key bits settled per pass: 8 passes of 15 candidate cuts each


def _cut(logits, sp):
    """Each row's smallest logit kept by its top-k, top-p (nucleus) and min-p: [R, 1].

    The sort a nucleus is usually taken from is replaced by a search over the float32 values:
    keep-all-at-or-above-t is monotone in t, and a row's cut is the smallest t for which fewer
    than k logits lie above t, less than top_p of the probability lies above t, and t is at
    least the min-p logit. At t = the row's k-th largest logit exactly fewer than k lie above
    it, and the mass above t only changes at a logit, so the cut is the sorted form's: the k-th
    logit, the last of the smallest prefix reaching top_p (the first always stays), or the
    min-p logit, whichever is highest. The search settles the largest t's uint32 key that
    keeps too much, CUT_BITS bits a pass (each pass a count and a sum over V for each of
    2^CUT_BITS - 1 candidates), so on a mesh that splits V only [R, 15, 2] partial sums cross
    between devices, never the rows (XLA's sort of a split axis gathers them). Fewer, wider
    passes: 32 one-bit passes had taken 349 us for one row on an H100 against the sort's 218
    (bench/results/history/2026-12-06_sampling_filters_one_bit_h100.md); eight take 213 against
    233, and 980 against 1449 for 32 rows (bench/results/sampling_filters_h100.md)."""
    V = logits.shape[-1]
    k = jnp.where(sp["top_k"] > 0, jnp.minimum(sp["top_k"], V), V)[:, None, None]
    top = jnp.max(logits, axis=-1, keepdims=True)
    top_p = sp["top_p"][:, None, None]  # 1 keeps all, though float32 sums reach 1 sooner
    probs = jax.nn.softmax(logits, axis=-1)[:, None, :]
    min_logit = jnp.where(
        sp["min_p"][:, None] > 0, top + jnp.log(jnp.maximum(sp["min_p"][:, None], 1e-30)), -jnp.inf
    )[:, :, None]
    keep_all_above = _ordered(top)[:, :, None]  # from the row's max up every t qualifies
    base = jnp.zeros_like(keep_all_above)  # the key found so far: its bits above `shift`
    steps = jnp.arange(1, 1 << CUT_BITS, dtype=jnp.uint32)[None, :, None]  # [1, C, 1]
    for shift in range(32 - CUT_BITS, -1, -CUT_BITS):  # unrolled: no device control flow
        cand = base + (steps << shift)  # [R, C, 1]
        t = _unordered(cand)
        above = logits[:, None, :] > t  # [R, C, V]
        n = jnp.sum(above, axis=-1, keepdims=True)
        mass = jnp.sum(jnp.where(above, probs, 0.0), axis=-1, keepdims=True)
        # keys under -inf's are NaNs, which never qualify; over the max, always
        ok = ((n < k) & ((mass < top_p) | (top_p >= 1)) & (t >= min_logit)) | (
            cand >= keep_all_above
        )
        base = base + (jnp.sum(~ok, axis=1, keepdims=True).astype(jnp.uint32) << shift)
    return _unordered(base[:, :, 0] + 1)


def _filter(logits, sp):
    """Mask logits outside top-k, top-p (nucleus) and min-p, per row."""
    return jnp.where(logits >= _cut(logits, sp), logits, -jnp.inf)


def sample(logits, counts, prompt_mask, sp, seeds, steps, filtered: bool | None = None):
    """Pick one token per row.

    Args:
      logits: [R, V] float32.
      counts, prompt_mask: penalty state for each row's sequence ([R, V]); neutral penalties
        leave the logits exactly as they are.
      sp: dict of [R] parameter arrays (`named`).
      seeds: [R] uint32 per-request seed; steps: [R] int32 tokens generated so far. The noise
        depends only on (seed, step), so a seeded request reproduces whatever it is batched with.
      filtered: static; True if some row samples under top-k, top-p or min-p (`needs_filter`),
        False if none does (the filters are skipped), None to decide on the device (a lax.cond,
        for a program whose output the host waits for anyway).
    Returns:
      (tokens [R] int32, logprobs [R, V] float32 of the distribution sampled from).
    """
    logits = apply_penalties(logits, counts, prompt_mask, sp)
    greedy = sp["temperature"] == 0
    scaled = logits / jnp.where(greedy, 1.0, sp["temperature"])[:, None]
    needs = ((sp["top_k"] > 0) | (sp["top_p"] < 1) | (sp["min_p"] > 0)) & ~greedy

    def filter_rows(x):  # only the rows that ask: a row's draw never depends on its batch
        return jnp.where(needs[:, None], _filter(x, sp), x)

    if filtered is None:
        scaled = jax.lax.cond(jnp.any(needs), filter_rows, lambda x: x, scaled)
    elif filtered:
        scaled = filter_rows(scaled)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],)))(keys)
    drawn = jnp.argmax(scaled + gumbel, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, jax.nn.log_softmax(jnp.where(greedy[:, None], logits, scaled), axis=-1)


def constrain(logits, allow):
    """Logits [R, V] with the tokens outside each row's bitmask allow [R, ceil(V / 32)] (bit v
    % 32 of word v // 32) set to -inf."""
    v = jnp.arange(logits.shape[-1])
    bits = (allow[:, v >> 5] >> (v & 31)) & 1
    return jnp.where(bits > 0, logits, -jnp.inf)


def mark_fed(prompt_mask, batch: dict, k: int):
    """The fed-token half of the sampler's bookkeeping, run in the forward pass (it needs the
    step's [T] tokens; the sampling program then depends on rows alone, one per row width).

    Args:
      prompt_mask: [S_max, V] bool, the tokens each slot has seen (consumed).
      batch: the step's arrays, with `feed`'s tokens; k: K.
    Returns:
      (prompt_mask with fresh slots cleared and the fed tokens, proposals excepted, marked;
      row_tokens int32 [R, K + 1]: per logits row, the fed tokens at its row minus 0 .. K - 1
      (the proposals before it) and at its row plus 1 (the proposal it verifies)).
    """
    T = batch["tokens"].shape[0]
    oob = prompt_mask.shape[0]  # padding rows (slot -1) index past the end: dropped
    slots = jnp.where(batch["slots"] < 0, oob, batch["slots"])
    # A request's first row may start past 0 (a cached prefix): the host marks it.
    fresh = jnp.where((batch["fresh"] > 0) & (batch["slots"] >= 0), slots, oob)
    pmask = prompt_mask.at[fresh].set(False, mode="drop")  # a new tenant starts clean
    # Fed tokens count as seen for the repetition penalty (prompt or earlier output), except
    # proposals: those count in sample_rows, for the positions after them only.
    seg_ids, cu, tokens_in = batch["seg_ids"], batch["cu_q_lens"], batch["tokens"]
    proposal = jnp.arange(T) >= cu[1:][seg_ids] - batch["n_draft"][seg_ids]
    real_tok = (jnp.arange(T) < cu[-1]) & ~proposal
    pmask = pmask.at[jnp.where(real_tok, slots[seg_ids], oob), tokens_in].set(True, mode="drop")
    at = batch["logit_rows"][:, None] + jnp.array([*(-m for m in range(k)), 1])  # [R, K + 1]
    return pmask, tokens_in[jnp.clip(at, 0, T - 1)]


def needs_filter(floats: np.ndarray, top_k: np.ndarray) -> bool:
    """Whether a step's rows (host arrays: floats [6, S] FLOAT_FIELDS, top_k [S]) include one
    that samples under top-k, top-p or min-p: `sample`'s static `filtered`."""
    f = dict(zip(FLOAT_FIELDS, floats, strict=True))
    needs = (top_k > 0) | (f["top_p"] < 1) | (f["min_p"] > 0)
    return bool((needs & (f["temperature"] != 0)).any())


def top_k_by_parts(x, k: int, placement=None):
    """jax.lax.top_k of x [R, V] over V. On a mesh that splits V in n parts (`placement`,
    device/mesh.py), each device takes its part's k best and only [R, n * k] candidates cross
    between devices (XLA's top_k over a split axis gathers the whole rows first). Ties go to
    the lower index either way."""
    R, V = x.shape
    parts = 1 if placement is None else placement.n
    if parts == 1 or V % parts:
        return jax.lax.top_k(x, k)
    x = x.reshape(R, parts, V // parts)
    vals, ids = placement.on_parts(lambda p: jax.lax.top_k(p, k), x)  # [R, parts, k] each
    ids = ids + (jnp.arange(parts) * (V // parts))[None, :, None]
    best, at = jax.lax.top_k(vals.reshape(R, parts * k), k)
    return best, jnp.take_along_axis(ids.reshape(R, parts * k), at, axis=-1)


def sample_rows(logits, row_tokens, state: dict, prompt_mask, batch: dict, floats, k: int,
                allow=None, filtered: bool = True, logprobs: bool = True,
                placement=None, synthetic_accept: int = -1):  # fmt: skip
    """Sample every logits row, verify speculative proposals, and update the slot state.

    Every logits row samples with its segment's parameters and noise (seed, step + offset),
    and with penalties that count the proposals before it as output. A verify row keeps its
    leading proposals while each equals the token sampled at the position before it.
    Proposals are deterministic (prompt lookup, a greedy draft), so this is the standard
    rejection rule with a one-hot proposal distribution: proposal x survives with probability
    p(x), and after a rejection the sampled token is p conditioned on not x, the residual. The
    output is distributed as the target's, token for token the same as without speculation
    for the same seed.

    Args:
      logits: [R, V] float32; row_tokens: [R, K + 1] (mark_fed's); state: counts and last
        (consumed); prompt_mask: mark_fed's, read only.
      batch: the step's row arrays (step_format.sample_layout's: slots, sample_mask, n_draft,
        logit_start, top_k, seeds, steps, fresh [S], logit_seg, logit_off [R]); floats: [6, S]
        FLOAT_FIELDS per row; k: K;
      allow: int32 [S, ceil(V / 32)] token bitmasks per row (structured output; all bits
        set: any token), or None.
      filtered: static, `sample`'s (`needs_filter` of the step's rows).
      logprobs: static; whether some row asked for top logprobs.
      placement: on a mesh whose devices each hold a part of V of the logits, its Placement
        (device/mesh.py): the counts are kept whole on every device (else XLA splits their
        update by vocabulary, as the logits, and gathers them back) and the top logprobs
        are taken by parts (top_k_by_parts). None (or OneDevice) on one device.
      synthetic_accept: static; benchmarks only: N >= 0 keeps exactly min(N, n_draft) of each
        verify row's proposals, whatever they are (they are emitted as its tokens there, then
        the token sampled after them); -1: the rule above.
    Returns:
      (packed int32 [2R + S]: sampled token per logits row, its logprob's float32 bits, and
      proposals accepted per row; top ids int32 [R, 20] and top logprobs [R, 20], zeros
      without `logprobs`; the new state, counts and last).
    """
    S, R = batch["slots"].shape[0], logits.shape[0]
    oob = state["counts"].shape[0]  # padding rows (slot -1) index past the end: dropped
    slots = jnp.where(batch["slots"] < 0, oob, batch["slots"])
    fresh = jnp.where((batch["fresh"] > 0) & (batch["slots"] >= 0), slots, oob)
    pin = (lambda x: x) if placement is None else (lambda x: placement.constrain(x, None))
    counts = pin(state["counts"].at[fresh].set(0, mode="drop"))  # a new tenant starts clean
    pmask = prompt_mask
    seg, off = batch["logit_seg"], batch["logit_off"]  # [R]
    if allow is not None:
        logits = constrain(logits, allow[seg])
    row_slots = jnp.minimum(slots, oob - 1)[seg]
    row_counts = counts[row_slots]
    for m in range(k):  # proposals 1..off precede the logits row at offset off
        t = row_tokens[:, m]
        row_counts = row_counts.at[jnp.arange(R), t].add((m < off).astype(jnp.int32))
    sp = {name: v[seg] for name, v in named(floats, batch["top_k"]).items()}
    seeds = jax.lax.bitcast_convert_type(batch["seeds"], jnp.uint32)[seg]
    steps = batch["steps"][seg] + jnp.maximum(off, 0)
    tokens, logp = sample(logits, row_counts, pmask[row_slots], sp, seeds, steps, filtered)
    # Verification: the first proposal unequal to the token sampled before it.
    n_draft = batch["n_draft"][seg]
    nxt = row_tokens[:, k]
    miss = (off >= 0) & (off < n_draft) & (tokens != nxt)
    if synthetic_accept >= 0:  # a benchmark's acceptance: the first N proposals, always
        miss = (off >= 0) & (off < n_draft) & (off >= synthetic_accept)
        tokens = jnp.where((off >= 0) & (off < n_draft) & ~miss, nxt, tokens)
    first_miss = jax.ops.segment_min(jnp.where(miss, off, R), seg, num_segments=S)
    accepted = jnp.minimum(first_miss, batch["n_draft"])  # [S]
    sampled = batch["sample_mask"] > 0
    emitted = (off >= 0) & (off <= accepted[seg]) & sampled[seg]
    counts = pin(counts.at[jnp.where(emitted, slots[seg], oob), tokens].add(1, mode="drop"))
    # The token each sampling row emitted last feeds its slot's next decode row.
    last_tok = tokens[jnp.minimum(batch["logit_start"] + accepted, R - 1)]
    last = state["last"].at[jnp.where(sampled, slots, oob)].set(last_tok, mode="drop")
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if logprobs:
        top_lp, top_ids = top_k_by_parts(logp, TOP_LOGPROBS, placement)
    else:
        top_lp = jnp.zeros((R, TOP_LOGPROBS), logp.dtype)
        top_ids = jnp.zeros((R, TOP_LOGPROBS), jnp.int32)
    packed = jnp.concatenate(
        [tokens, jax.lax.bitcast_convert_type(chosen, jnp.int32), accepted.astype(jnp.int32)]
    )
    return packed, top_ids, top_lp, {"counts": counts, "last": last}
