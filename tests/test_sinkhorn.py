"""The Sinkhorn kernel (pallas_kernels/sinkhorn.py) in interpret mode against its jnp
reference: tokens past a program's block, stream counts that are not a power of two, one
iteration and DeepSeek V4's twenty."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sinkhorn import BT, sinkhorn, sinkhorn_reference


@pytest.mark.parametrize("T", [1, BT, 2 * BT + 5])
@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("iters", [1, 20])
def test_the_kernel_normalizes_as_the_reference(T, n, iters):
    logits = jax.random.normal(jax.random.PRNGKey(T * 10 + n), (T, n, n)) * 3.0
    got = np.asarray(sinkhorn(logits, iters=iters, eps=1e-6, interpret=True))
    want = np.asarray(sinkhorn_reference(logits, iters, 1e-6))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-3)  # the last pass is over columns
    assert np.isfinite(got).all()


def test_extreme_logits_stay_finite():
    """A row whose logits differ by hundreds (a softmax of one 1 and zeros) is still a
    normalized, finite matrix."""
    logits = jnp.asarray([[[300.0, -300.0], [0.0, 0.0]]])
    got = np.asarray(sinkhorn(logits, iters=20, eps=1e-6, interpret=True))
    np.testing.assert_allclose(got, np.asarray(sinkhorn_reference(logits, 20, 1e-6)), atol=1e-6)
    assert np.isfinite(got).all()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\(2, 3, 4\)"):
        sinkhorn(jnp.zeros((2, 3, 4)), iters=20, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="iters=0"):
        sinkhorn(jnp.zeros((2, 4, 4)), iters=0, eps=1e-6, interpret=True)
