"""Dense experts at decode sizes (pallas_kernels/expert_rows.py, interpret mode): each pair is
its token's row times its expert, as the gathering reference and jax.lax.ragged_dot over the
same pairs grouped by expert give it, whether tokens share experts or not, with x a row per
token or per pair; padding pairs give zeros; the splits sum to the product; the Triton
lowering verifies."""

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


def grouped(x, w, ex):
    """XLA's ragged_dot over the real pairs of rows x [P, K] sorted by expert: [P, N], zeros
    for padding."""
    E = w.shape[0]
    ex = np.asarray(ex)
    order = np.argsort(ex, kind="stable")
    real = order[ex[order] < E]
    sizes = jnp.asarray(np.bincount(ex[real], minlength=E), jnp.int32)
    y = jax.lax.ragged_dot(x[real].astype(jnp.float32), w.astype(jnp.float32), sizes,
                           precision=jax.lax.Precision.HIGHEST)  # fmt: skip
    out = np.zeros((ex.shape[0], w.shape[2]), np.float32)
    out[real] = np.asarray(y)
    return out


# pairs token-major, 2 a token: tokens 0, 1 and 3 share expert 1 (its tiles read once for all
# three), token 2 has a padding pair, token 4's experts are its own
EXPERTS = [1, 4, 0, 1, 2, 5, 1, 3, 0, 2]


@pytest.mark.parametrize("rows", ["per-token", "per-pair"])
def test_each_pair_is_its_row_times_its_expert(rows):
    x, w = case(0, T=5)
    k, E = 2, w.shape[0]
    ex = jnp.asarray(EXPERTS, jnp.int32)
    assert EXPERTS[5] == E  # padding
    if rows == "per-token":  # gate | up: a token's k pairs read its one row
        got = expert_rows(x, w, experts=ex, fan_out=k, interpret=True)
        xp = jnp.repeat(x, k, axis=0)
    else:  # down: a row per pair
        xp = jnp.asarray(np.random.default_rng(5).standard_normal((10, 512)), jnp.bfloat16)
        got = expert_rows(xp, w, experts=ex, per_token=k, interpret=True)
    got = np.asarray(got)
    want = np.asarray(expert_rows_reference(xp, w, ex))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, grouped(xp, w, ex), rtol=1e-4, atol=1e-4)
    assert not got[5].any()


def test_one_token_and_all_tokens_on_one_expert():
    """A decode step of one sequence (its other rows padding), and every token choosing the
    same experts (one leader does them all)."""
    x, w = case(2, T=4)
    E = w.shape[0]
    for ex in ([3, 0, E, E, E, E, E, E], [2, 4, 2, 4, 2, 4, 2, 4]):
        ex = jnp.asarray(ex, jnp.int32)
        got = np.asarray(expert_rows(x, w, experts=ex, fan_out=2, interpret=True))
        want = np.asarray(expert_rows_reference(x, w, ex, fan_out=2))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_splits_sum_to_the_product_and_bad_shapes_are_refused():
    x, w = case(1, T=2, K=1024, N=64)
    ex = jnp.asarray([3, 0], jnp.int32)
    parts = expert_rows(x, w, experts=ex, splits=True, interpret=True)
    assert parts.shape[0] > 1 and parts.shape[1:] == (2, 64)
    whole = expert_rows(x, w, experts=ex, interpret=True)
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(whole), rtol=1e-6)
    with pytest.raises(ValueError, match="fan_out"):
        expert_rows(x, w, experts=ex, fan_out=2, interpret=True)
    with pytest.raises(ValueError, match="per_token"):
        expert_rows(x, w, experts=ex, per_token=4, interpret=True)
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
