"""The tile-dequantize prefill kernel (interpret mode) against the dequantize-then-dot
reference."""

import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_matmul import weight

from pallas_kernels.ggml_blocks import QuantWeight
from pallas_kernels.quant_matmul import quant_matmul_reference
from pallas_kernels.quant_prefill import quant_prefill


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k", "q6_k"])
@pytest.mark.parametrize(
    "M, K, N, tile",
    [
        (64, 256, 64, (64, 64, 128)),  # whole tiles
        (300, 768, 40, (64, 32, 128)),  # ragged M and N, several 256-value blocks
        (5, 512, 24, (16, 16, 32)),  # a few rows, small tiles
    ],
)
def test_kernel_matches_reference(qtype, M, K, N, tile):
    w = weight(qtype, N, K, seed=M)
    x = jnp.asarray(np.random.default_rng(K).standard_normal((M, K)), jnp.float32)
    bm, bn, bk = tile
    got = quant_prefill(x, w, block_m=bm, block_n=bn, block_k=bk, interpret=True)
    want = quant_matmul_reference(x, w)
    assert got.shape == (M, N)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_bf16_activations():
    w = weight("q8_0", 48, 256)
    w = QuantWeight(w.head, w.body, w.qtype, "bfloat16")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((70, 256)), jnp.bfloat16)
    got = quant_prefill(x, w, interpret=True, out_dtype=jnp.bfloat16)
    want = quant_matmul_reference(x, w)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        got.astype(jnp.float32), want, rtol=2e-2, atol=2e-2 * float(jnp.abs(want).max())
    )


def test_a_legacy_block_that_ends_inside_a_step():
    """K of 10 Q8_0 blocks (320 values) with steps of 128: the last step is partly past K."""
    w = weight("q8_0", 40, 320, seed=3)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((33, 320)), jnp.float32)
    got = quant_prefill(x, w, block_m=32, block_n=32, block_k=128, interpret=True)
    want = quant_matmul_reference(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_other_types_and_bad_tiles_are_refused_by_name():
    x = jnp.zeros((8, 256), jnp.float32)
    with pytest.raises(ValueError, match="iq4_xs"):
        quant_prefill(x, weight("iq4_xs", 16, 256), interpret=True)
    with pytest.raises(ValueError, match="block_k=48"):
        quant_prefill(x, weight("q8_0", 16, 256), block_k=48, interpret=True)
    with pytest.raises(ValueError, match="do not contract"):
        quant_prefill(x[:, :128], weight("q8_0", 16, 256), interpret=True)
