"""The Pallas ragged paged attention kernel (interpret mode) against its jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_cache
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference, plan_tiles
from pallas_kernels.query_blocks import query_blocks


def make_step(segs, *, H, K, D, P, pad_rows=3, dtype=jnp.float32, seed=0, extra_blocks=5):
    """A packed step: segs = [(rows this step, kv length after it)], then padding rows.

    Physical blocks are shuffled so logical order differs from physical order; block 0 is the
    sink that padding rows and unused table entries point at.
    """
    rng = np.random.default_rng(seed)
    S = len(segs)
    MB = max(-(-kv // P) for _, kv in segs) + 1
    NB = 1 + sum(-(-kv // P) for _, kv in segs) + extra_blocks
    perm = rng.permutation(np.arange(1, NB))
    tables = np.zeros((S, MB), np.int32)
    at = 0
    for s, (_, kv) in enumerate(segs):
        n = -(-kv // P)
        tables[s, :n] = perm[at : at + n]
        at += n
    seg_ids, positions, cu = [], [], [0]
    for s, (q, kv) in enumerate(segs):
        seg_ids += [s] * q
        positions += list(range(kv - q, kv))
        cu.append(cu[-1] + q)
    T = cu[-1] + pad_rows
    seg_ids += [0] * pad_rows
    positions += [0] * pad_rows
    k = jnp.asarray(rng.standard_normal((NB, P, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((NB, P, K, D)), dtype)
    q = jnp.asarray(rng.standard_normal((T, H, D)), dtype)
    args = (
        q,
        k,
        v,
        jnp.asarray(seg_ids, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(tables),
        jnp.asarray([kv for _, kv in segs], jnp.int32),
    )
    return args, jnp.asarray(cu, jnp.int32), cu[-1]


def check(segs, *, H, K, D, P, dtype=jnp.float32, tol=2e-5, kv_types=None, kernel_kw=(), **kw):
    """Kernel against the reference; kv_types (k, v) quantizes the caches first, and the
    reference then reads the dequantized values."""
    args, cu, real = make_step(segs, H=H, K=K, D=D, P=P, dtype=dtype, **kw)
    if kv_types:
        args = list(args)
        for i, t in zip((1, 2), kv_types, strict=True):
            args[i] = kv_cache.quantize(args[i], t) if t != "plain" else args[i]
    scale = D**-0.5
    got = paged_attention(*args, scale=scale, cu_q_lens=cu, interpret=True, **dict(kernel_kw))
    ref = paged_attention_reference(*args, scale=scale)
    assert got.shape == ref.shape and got.dtype == args[0].dtype
    g, r = np.asarray(got[:real], np.float32), np.asarray(ref[:real], np.float32)
    np.testing.assert_allclose(g, r, atol=tol, rtol=tol)
    # Padding rows belong to no segment and come back as zeros.
    assert not np.any(np.asarray(got[real:], np.float32))


# A mixed step: a prompt chunk starting a sequence, a later chunk of another, decode rows with
# kv lengths that are and are not multiples of the block size, a one-token prompt.
MIXED = [(21, 21), (9, 40), (1, 33), (1, 16), (1, 1), (5, 70)]


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,K", [(4, 4), (8, 2), (16, 2)])
@pytest.mark.parametrize("P", [16, 32])
def test_kernel_matches_reference_on_mixed_steps(D, H, K, P):
    check(MIXED, H=H, K=K, D=D, P=P)


def test_head_groups_that_are_not_a_power_of_two_are_padded():
    """The embedded model has 6 query heads on 2 kv heads (G 3); Triton tiles need powers of 2."""
    check(MIXED, H=6, K=2, D=64, P=16)


@pytest.mark.parametrize("block_k", [16, 32, 128])
def test_kv_tiles_smaller_and_larger_than_blocks(block_k):
    """Tiles gather tokens across block boundaries; the last tile may run past the table."""
    check(MIXED, H=8, K=2, D=64, P=32, kernel_kw={"block_k": block_k, "split_tokens": 32})


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kv_types", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0")])
def test_quantized_kv_matches_reference_on_dequantized_kv(D, kv_types):
    check(MIXED, H=8, K=2, D=D, P=16, kv_types=kv_types, tol=1e-4)


def test_quantized_kv_with_bf16_queries():
    check(MIXED, H=8, K=2, D=128, P=16, dtype=jnp.bfloat16, kv_types=("q8_0", "q4_0"), tol=2e-2)


@pytest.mark.parametrize(
    "kv_types,pieces,dtype",
    [
        (("q8_0", "q8_0"), 1, jnp.bfloat16),
        (("q8_0", "q8_0"), 2, jnp.bfloat16),
        (("q4_0", "q4_0"), 1, jnp.bfloat16),
        (("q4_0", "q4_0"), 4, jnp.bfloat16),
        (("q4_0", "q4_0"), 8, jnp.float32),
        (("q8_0", "q4_0"), 2, jnp.float32),
    ],
)
def test_quantized_tiles_in_any_number_of_dots_match_reference(kv_types, pieces, dtype):
    """A quantized tile contracted in 1 to 8 dots, q read and the output stored in each piece's
    column order, is still attention over the dequantized caches (defaults: q8_0 4, q4_0 2)."""
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    check(MIXED, H=8, K=2, D=128, P=16, dtype=dtype, kv_types=kv_types, tol=tol,
          kernel_kw={"pieces": pieces})  # fmt: skip


def test_pieces_that_do_not_divide_the_planes_are_refused():
    args, cu, _ = make_step([(2, 5)], H=4, K=4, D=64, P=16)
    args = (args[0], kv_cache.quantize(args[1], "q8_0"), *args[2:])
    for pieces in (3, 8, 0):  # q8_0 has 4 planes
        with pytest.raises(ValueError, match=f"pieces {pieces}"):
            paged_attention(*args, scale=1.0, cu_q_lens=cu, interpret=True, pieces=pieces)


def test_bf16_within_bf16_tolerance():
    check(MIXED, H=8, K=2, D=128, P=16, dtype=jnp.bfloat16, tol=2e-2)


def test_long_context_is_split_and_combined():
    """A 1500-token decode row spans several kv splits of 256 tokens; chunked prefill too."""
    _, tps, ns = plan_tiles(T=8, G=4, MB=-(-1500 // 16) + 1, P=16, K=2, D=64, block_k=64)
    assert ns >= 2 and tps * 64 == 256
    check([(1, 1500), (7, 1300)], H=8, K=2, D=64, P=16, pad_rows=0)


@pytest.mark.parametrize("T", [8, 64, 512])
def test_partials_stay_under_their_budget_at_a_long_max_ctx(T):
    """The combine reads every split's partials in every layer, and the block table is as long
    as the engine's max_ctx: an 8B-shaped step with a 32k table holds its float32 partials
    [NS, T + BQ, K, G, D + 2] under 16 MB (or takes one split), decode buckets still spread a
    long context over splits, and the splits cover the table."""
    bq, tps, ns = plan_tiles(T=T, G=4, MB=32768 // 16, P=16, K=8, D=128)
    assert ns == 1 or ns * (T + bq) * 8 * 4 * 130 * 4 <= 16 << 20
    assert tps * 64 * ns >= 32768
    assert ns >= 8 or T > 64


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("kv_types", [None, ("q8_0", "q4_0")])
def test_a_fixed_split_count_shares_each_blocks_keys_out(splits, kv_types):
    """With `splits`, every query block's keys are cut into that many equal runs whatever the
    longest context the table holds: more runs than a short row has tiles (empty runs), a long
    row over three, prompt chunks and decode rows together, all equal the reference."""
    segs = [(1, 1500), (7, 300), (1, 17), (21, 21), (1, 1)]
    kw = {"block_k": 32, "splits": splits}
    check(segs, H=8, K=2, D=64, P=16, kv_types=kv_types, tol=1e-4, kernel_kw=kw)
    args, cu, _ = make_step(segs, H=8, K=2, D=64, P=16)
    with pytest.raises(ValueError, match="splits 0"):
        paged_attention(*args, scale=1.0, cu_q_lens=cu, splits=0, interpret=True)


@pytest.mark.parametrize("block_qg", [32, 128])
def test_prompt_steps_match_reference_at_other_query_tiles(block_qg):
    """A step over 64 rows (a prompt chunk after a cached prefix, and a decode row) with query
    tiles of other sizes than the default still equals the reference; a size that is not a
    power of two is refused by name."""
    segs = [(70, 150), (1, 40)]
    assert plan_tiles(T=128, G=4, MB=10, P=16, K=2, D=64, block_qg=block_qg)[0] == block_qg // 4
    check(segs, H=8, K=2, D=64, P=16, kernel_kw={"block_qg": block_qg})
    args, cu, _ = make_step(segs, H=8, K=2, D=64, P=16)
    with pytest.raises(ValueError, match="block_qg 96"):
        paged_attention(*args, scale=1.0, cu_q_lens=cu, block_qg=96, interpret=True)


def test_query_blocks_cover_every_row_once():
    cu = jnp.asarray([0, 21, 30, 31, 31, 36], jnp.int32)  # includes an empty segment
    meta = np.asarray(query_blocks(cu, T=40, block_q=4))
    rows = [r for seg, start, n in meta for r in range(start, start + n)]
    assert sorted(rows) == list(range(36))
    for seg, start, n in meta:
        if n:
            assert cu[seg] <= start and start + n <= cu[seg + 1]


def test_bad_shapes_are_named():
    args, cu, _ = make_step([(2, 5)], H=4, K=4, D=64, P=16)
    with pytest.raises(ValueError, match="cu_q_lens"):
        paged_attention(*args, scale=1.0, cu_q_lens=cu[:-1], interpret=True)
    q = args[0][:, :3]
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q, *args[1:], scale=1.0, cu_q_lens=cu, interpret=True)


def test_jit_compiles_once_per_shape():
    args, cu, _ = make_step(MIXED, H=8, K=2, D=64, P=16)
    f = jax.jit(lambda *a: paged_attention(*a, scale=0.125, cu_q_lens=cu, interpret=True))
    f(*args)
    args2, _, _ = make_step(MIXED, H=8, K=2, D=64, P=16, seed=1)
    f(*args2)
    assert f._cache_size() == 1


@pytest.mark.parametrize("kv", [("f32", "f32"), ("q8_0", "q4_0"), ("f32", "q8_0")])
def test_engine_greedy_tokens_equal_with_pallas_and_xla(tiny_gguf, compile_cache, monkeypatch, kv):
    """The whole engine on the tiny model: the kernels (interpret mode) change no token, with
    float32 KV or quantized K and V (the kernel's word layouts against XLA's dequantized
    values). The pallas backend runs q and k's norms, rope and the KV write as rope_write's
    kernel in every layer (counted as the step traces it) where it fits: a q8_0 V is quantized
    there too; the tiny model's NEOX half head (16) is shorter than a quantized K's group."""
    from luce_jax import LLM, SamplingParams
    from pallas_kernels import rope_write

    from conftest import TINY_ENGINE

    traced = []
    kernel = rope_write.rope_write
    monkeypatch.setattr(
        rope_write, "rope_write", lambda *a, **k: traced.append(1) or kernel(*a, **k)
    )
    prompts = ["def add(a, b):", "import os\n", "x = [1, 2, 3]\nfor i in x:"]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = {}
    for backend in ("xla", "pallas"):
        kw = dict(TINY_ENGINE, attention_backend=backend, compile_cache_dir=compile_cache)
        # 16-token buckets (8, 16): the prompts' steps and the decode steps, and no 32-token
        # program of interpret-mode kernels to compile
        kw.update(cache_type_k=kv[0], cache_type_v=kv[1], prefill_chunk=16, prefill_token_budget=16)
        with LLM(tiny_gguf, **kw) as llm:
            out[backend] = [c.token_ids for c in llm.generate(prompts, sp)]
        assert bool(traced) == (backend == "pallas" and kv[0] == "f32")
    assert out["pallas"] == out["xla"]


def test_attention_backend_auto_is_pallas_on_gpu_and_xla_on_cpu():
    from luce_jax.config import EngineConfig

    assert EngineConfig().resolved("gpu").attention_backend == "pallas"
    assert EngineConfig().resolved("cpu").attention_backend == "xla"
    assert EngineConfig(attention_backend="xla").resolved("gpu").attention_backend == "xla"


@pytest.mark.parametrize("kv_types", [None, ("q8_0", "q4_0")])
def test_tiles_without_masks_before_the_diagonal_change_nothing(kv_types):
    """split_masks walks the tiles every row of a query block sees whole without the mask, then
    the diagonal and the tail with it: prompt chunks after a cached prefix (whole tiles before
    them), at their start (none), decode rows, and kv lengths on and off tile edges all equal
    the reference, and the same kernel without the split."""
    segs = [(70, 150), (21, 21), (1, 33), (1, 64), (9, 40), (1, 1)]
    kw = {"block_k": 16, "block_qg": 32, "split_masks": True}
    check(segs, H=8, K=2, D=64, P=16, kv_types=kv_types, tol=1e-4, kernel_kw=kw)
    args, cu, real = make_step(segs, H=8, K=2, D=64, P=16)
    if kv_types:
        k, v = (kv_cache.quantize(a, t) for a, t in zip(args[1:3], kv_types, strict=True))
        args = (args[0], k, v, *args[3:])
    on = paged_attention(*args, scale=0.125, cu_q_lens=cu, interpret=True, **kw)
    off = paged_attention(
        *args, scale=0.125, cu_q_lens=cu, interpret=True, **{**kw, "split_masks": False}
    )
    np.testing.assert_allclose(np.asarray(on[:real]), np.asarray(off[:real]), atol=1e-5, rtol=1e-5)
