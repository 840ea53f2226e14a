"""The Pallas grouped expert matmul (interpret mode) against its jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_matmul import weight

from pallas_kernels.moe_grouping import grouped_matmul, grouped_matmul_reference
from pallas_kernels.query_blocks import query_blocks


def case(sizes, K, N, pad_rows=0, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    M = sum(sizes) + pad_rows
    x = jnp.asarray(r.standard_normal((M, K)), dtype)
    w = jnp.asarray(r.standard_normal((len(sizes), K, N)) * 0.2, dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def check(sizes, K, N, *, swiglu=False, tol=1e-4, **kw):
    x, w, sz = case(sizes, K, 2 * N if swiglu else N, **kw)
    got = grouped_matmul(
        x, w, sz, swiglu=swiglu, interpret=True, block_m=16, block_n=16, block_k=16
    )
    ref = grouped_matmul_reference(x, w, sz, swiglu=swiglu)
    assert got.shape == ref.shape == (x.shape[0], N)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=tol, rtol=tol)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize(
    "sizes",
    [[5, 0, 17, 1, 0, 33], [0, 0, 40, 0], [1] * 8, [0, 0, 0, 0]],
    ids=["mixed-with-empty", "all-on-one", "one-each", "no-rows"],
)
def test_kernel_matches_reference(sizes, swiglu):
    """Empty experts, every row on one expert, single rows, and K / N that are not tiles."""
    check(sizes, K=40, N=24, swiglu=swiglu, pad_rows=3)


def test_decode_sized_steps_use_a_grid_bounded_by_the_rows():
    """Few rows over many experts: at most M row tiles (not ceil(M / BM) + E), same result."""
    x, w, sz = case([1, 0, 2, 0, 0, 1, 0, 0] * 4, K=64, N=32, pad_rows=4)
    got = grouped_matmul(x, w, sz, swiglu=True, interpret=True)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(grouped_matmul_reference(x, w, sz, swiglu=True)), atol=1e-4
    )
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sz)])
    meta = np.asarray(query_blocks(cu, x.shape[0], 16, max_blocks=x.shape[0]))
    assert meta.shape[0] == x.shape[0] < 1 + 32  # 20 rows: 20 tiles, not 1 + 32
    assert meta[:, 2].sum() == 16 and (meta[:, 2] > 0).sum() == 12  # 12 experts with rows


def test_bf16_within_bf16_tolerance():
    check([9, 0, 30, 4], K=64, N=48, swiglu=True, dtype=jnp.bfloat16, tol=3e-2)


def test_rows_past_the_groups_are_zero():
    x, w, sz = case([4, 4], K=16, N=16, pad_rows=5)
    got = np.asarray(grouped_matmul(x, w, sz, interpret=True))
    assert not got[8:].any() and got[:8].any()


def test_bad_shapes_are_named():
    x, w, sz = case([2, 2], K=16, N=16)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_matmul(x[:, :8], w, sz, interpret=True)
    with pytest.raises(ValueError, match="swiglu"):
        grouped_matmul(x, w[:, :, :15], sz, swiglu=True, interpret=True)


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k", "iq4_xs", "mxfp4"])
def test_quantized_experts_match_the_reference(qtype, swiglu):
    """Experts kept in GGML blocks ([E, N, K], gate rows then up rows with swiglu) give the
    dequantized experts' products; empty experts and padding rows as with dense weights."""
    sizes, K, N = [3, 0, 9, 1], 512, 24
    w = weight(qtype, 2 * N if swiglu else N, K, seed=5, lead=(len(sizes),))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((sum(sizes) + 2, K)), jnp.float32)
    sz = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(x, w, sz, swiglu=swiglu, interpret=True, block_n=16)
    ref = np.asarray(grouped_matmul_reference(x, w, sz, swiglu=swiglu))
    assert got.shape == (x.shape[0], N) and not np.asarray(got)[-2:].any()
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
