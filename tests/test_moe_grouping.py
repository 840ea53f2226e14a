"""The Pallas grouped expert matmul (interpret mode) against its jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe_grouping
from pallas_kernels.moe_grouping import grouped_matmul, grouped_matmul_reference


def case(sizes, K, N, pad_rows=0, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    M = sum(sizes) + pad_rows
    x = jnp.asarray(r.standard_normal((M, K)), dtype)
    w = jnp.asarray(r.standard_normal((len(sizes), K, N)) * 0.2, dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def check(sizes, K, N, *, swiglu=False, tol=1e-4, split_k=1, **kw):
    x, w, sz = case(sizes, K, 2 * N if swiglu else N, **kw)
    got = grouped_matmul(
        x, w, sz, swiglu=swiglu, interpret=True, block_m=16, block_n=16, block_k=16,
        split_k=split_k,
    )  # fmt: skip
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


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_contraction_splits_add_up(split_k, swiglu):
    """Splits that divide the 5 BK chunks unevenly, and more splits than chunks (empty ones)."""
    check([5, 0, 17, 1], K=80, N=24, swiglu=swiglu, pad_rows=2, split_k=split_k)


def test_decode_sized_steps_split_automatically():
    """Few rows make few tiles: the default splits the contraction, with the same result."""
    x, w, sz = case([1, 0, 2, 0, 0, 1, 0, 0], K=256, N=32, pad_rows=4)
    got = grouped_matmul(x, w, sz, swiglu=True, interpret=True, block_k=16)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(grouped_matmul_reference(x, w, sz, swiglu=True)), atol=1e-4
    )
    assert moe_grouping._splits(programs=8, k_chunks=16) == 8  # 2 chunks per split at least
    assert moe_grouping._splits(programs=2048, k_chunks=16) == 1


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
