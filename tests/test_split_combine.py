"""pallas_kernels/split_combine.py: flash-decoding's splits combined, the kernel against XLA's
reduction, and paged attention through it against its reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_attention import make_step

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.split_combine import MASK_VALUE, split_combine, split_combine_reference


def partials(NS, T, K, G, D, real, seed=0):
    """Random partial states; splits that saw no key (m MASK_VALUE, l 0) at some rows, and NaN
    where the kernel writes nothing: rows from `real` on and heads past the real group of 3."""
    r = np.random.default_rng(seed)
    acc = r.standard_normal((NS, T, K, G, D)).astype(np.float32)
    m = r.standard_normal((NS, T, K, G)).astype(np.float32) * 4
    den = r.uniform(0.5, 3, (NS, T, K, G)).astype(np.float32)
    empty = r.random((NS, T, K, G)) < 0.3
    empty[:, 0] = True  # row 0: no split saw a key
    m[empty], den[empty], acc[empty] = MASK_VALUE, 0.0, 0.0
    for a in (acc, m, den):
        a[:, real:] = np.nan
        a[:, :, :, 3:] = np.nan
    return jnp.asarray(acc), jnp.asarray(m), jnp.asarray(den)


@pytest.mark.parametrize("NS", [1, 5, 32])
def test_the_kernel_equals_xlas_reduction_and_reads_no_unwritten_partial(NS):
    """Every real row and head as XLA's reduction gives it (a row no split saw is zero, not
    NaN); rows past the segments are zero, though their partials are NaN; a split count that is
    not a power of two works."""
    T, K, G, D, real = 7, 2, 4, 32, 5
    acc, m, den = partials(NS, T + 2, K, G, D, real, seed=NS)
    cu = jnp.asarray([0, 2, real], jnp.int32)
    got = split_combine(acc, m, den, cu, T, 3 * K, jnp.float32, interpret=True)
    want = split_combine_reference(acc, m, den, cu, T, 3 * K, jnp.float32)
    assert got.shape == (T, 3 * K, D)
    np.testing.assert_allclose(
        np.asarray(got)[:real], np.asarray(want)[:real], rtol=1e-5, atol=1e-6
    )
    assert np.all(np.asarray(got)[real:] == 0) and np.all(np.asarray(got)[0] == 0)
    assert not np.isnan(np.asarray(got)).any()


def test_many_splits_take_the_kernel_and_equal_the_reference(monkeypatch):
    """Decode rows with 32 splits go through the kernel (counted as it traces) and equal the
    row-at-a-time reference; 4 splits stay with XLA's reduction."""
    from pallas_kernels import paged_attention as pa

    traced = []
    kernel = pa.split_combine
    monkeypatch.setattr(pa, "split_combine", lambda *a, **k: traced.append(1) or kernel(*a, **k))
    segs = [(1, 300), (1, 1), (1, 64)]
    args, cu, real = make_step(segs, H=8, K=2, D=64, P=16)
    ref = paged_attention_reference(*args, scale=0.125)
    for splits, uses_kernel in ((32, True), (4, False)):
        traced.clear()
        out = paged_attention(*args, scale=0.125, cu_q_lens=cu, interpret=True, splits=splits)
        assert bool(traced) == uses_kernel
        np.testing.assert_allclose(
            np.asarray(out[:real]), np.asarray(ref[:real]), atol=1e-5, rtol=1e-5
        )
        assert np.all(np.asarray(out[real:]) == 0)


def test_partials_that_do_not_fit_the_heads_are_refused():
    acc, m, den = partials(2, 4, 2, 4, 32, 4)
    with pytest.raises(ValueError, match="10 heads"):
        split_combine(
            acc, m, den, jnp.asarray([0, 4], jnp.int32), 4, 10, jnp.float32, interpret=True
        )
