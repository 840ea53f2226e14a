"""int8_rows: activations rounded to int8 per 32 values in one kernel, equal to its reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.int8_rows import int8_rows, int8_rows_reference


def rows(M: int, K: int, dtype, seed: int = 0):
    """Random rows with an all-zero group, one outlier and exact rounding ties."""
    x = np.asarray(jax.random.normal(jax.random.key(seed), (M, K), jnp.float32)) * 3
    x[0, :32] = 0.0  # scale 0: codes 0, no division by zero
    x[-1, 40] = 1000.0  # one value sets its group's scale
    # 127 and 63.5 in one group: 63.5 / (127 / 127) is a tie, rounded to even (64)
    x[-1, 64:96] = [127.0, 63.5, -63.5, 0.5, 1.5, -2.5] + [0.0] * 26
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M, K", [(1, 96), (3, 768), (8, 2048), (16, 4096 + 512)])
def test_the_kernel_equals_its_reference_bit_for_bit(M, K, dtype):
    """Codes, scales and sums per 16 and per 32 equal the jnp reference's exactly, over K that
    takes each program size (32 to 1024 values)."""
    x = rows(M, K, dtype, seed=K)
    got, want = int8_rows(x, interpret=True), int8_rows_reference(x)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_rounding_is_llama_cpps_q8_1():
    """Each group's largest |x| becomes +-127, every value is within half a step of x, ties go
    to the even code, and the sums per 16 (or 32) are the codes' sums."""
    x = rows(2, 128, jnp.float32)
    q, d, s, s32 = (np.asarray(a) for a in int8_rows(x, interpret=True))
    xf = np.asarray(x).reshape(2, 4, 32)
    qf = q.astype(np.float32).reshape(2, 4, 32)
    assert np.all(np.abs(qf).max(-1)[d > 0] == 127) and np.all(qf[d == 0] == 0)
    assert np.all(np.abs(qf * d[..., None] - xf) <= d[..., None] / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(q[1, 64:70], [127, 64, -64, 0, 2, -2])
    np.testing.assert_array_equal(s, q.astype(np.float32).reshape(2, 8, 16).sum(-1))
    np.testing.assert_array_equal(s32, q.astype(np.float32).reshape(2, 4, 32).sum(-1))


def test_a_width_that_is_not_a_whole_group_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        int8_rows(jnp.zeros((2, 48), jnp.float32), interpret=True)
