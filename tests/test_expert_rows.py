"""Dense experts a (token, expert) pair at a time (pallas_kernels/expert_rows.py, interpret
mode): each pair is its token's row times its expert, as the gathering reference and
jax.lax.ragged_dot over the same pairs grouped by expert give it; padding pairs give zeros;
the splits sum to the product; the Triton lowering verifies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.expert_rows import expert_rows, expert_rows_reference


def case(seed: int, T=3, K=512, N=96, E=5):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((T, K)), jnp.bfloat16)
    w = jnp.asarray(r.standard_normal((E, K, N)) / 16, jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("fan_out", [1, 2])
def test_each_pair_is_its_row_times_its_expert(fan_out):
    x, w = case(0)
    T, E = x.shape[0], w.shape[0]
    ex = jnp.asarray([4, 1, 1, 0, 2, E][: T * fan_out], jnp.int32)  # a shared expert, padding
    got = np.asarray(expert_rows(x, w, experts=ex, fan_out=fan_out, interpret=True))
    want = np.asarray(expert_rows_reference(x, w, ex, fan_out=fan_out))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the same pairs grouped by expert through XLA's ragged_dot
    order = np.argsort(np.asarray(ex), kind="stable")
    real = order[np.asarray(ex)[order] < E]
    rows = jnp.repeat(x, fan_out, axis=0)[real].astype(jnp.float32)
    sizes = jnp.asarray(np.bincount(np.asarray(ex)[real], minlength=E), jnp.int32)
    grouped = jax.lax.ragged_dot(rows, w.astype(jnp.float32), sizes,
                                 precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    np.testing.assert_allclose(got[real], np.asarray(grouped), rtol=1e-4, atol=1e-4)
    padding = np.asarray(ex) >= E
    assert not got[padding].any()


def test_the_splits_sum_to_the_product_and_bad_shapes_are_refused():
    x, w = case(1, T=2, K=1024, N=64)
    ex = jnp.asarray([3, 0], jnp.int32)
    parts = expert_rows(x, w, experts=ex, splits=True, block_k=256, interpret=True)
    assert parts.shape == (4, 2, 64)
    whole = expert_rows(x, w, experts=ex, interpret=True)
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(whole), rtol=1e-6)
    with pytest.raises(ValueError, match="fan_out"):
        expert_rows(x, w, experts=ex, fan_out=2, interpret=True)
    with pytest.raises(ValueError, match="do not fit"):
        expert_rows(x[:, :512], w, experts=ex, interpret=True)


def test_the_kernel_lowers_to_a_valid_triton_module(verified):
    x = jnp.zeros((8, 2048), jnp.bfloat16)
    w = jnp.zeros((128, 2048, 1536), jnp.bfloat16)
    ex = jnp.zeros((64,), jnp.int32)

    def f(x, w, ex):
        return expert_rows(x, w, experts=ex, fan_out=8, splits=True, interpret=False)

    jax.jit(f).trace(x, w, ex).lower(lowering_platforms=("cuda",))
    assert len(verified) == 1
