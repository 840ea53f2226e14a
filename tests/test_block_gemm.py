"""luce_jax/models/block_gemm.py: prefill products on a file's own Q8_0 and Q4_K blocks, as XLA
GEMM operands (codes converted and scaled; Q4_K's nibbles in their order, x permuted)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_matmul import weight

from luce_jax.models.block_gemm import block_gemm
from pallas_kernels.quant_matmul import quant_matmul_reference


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k"])
@pytest.mark.parametrize("M, N", [(1, 40), (70, 96), (300, 24)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_products_on_the_blocks_equal_the_dequantized_reference(qtype, M, N, dtype):
    """Over two Q4_K blocks (512 values) per row and N that no tile divides: float32
    activations match the reference (W dequantized as gguf does, then the dot) to float32
    rounding of the scales; bf16 ones to bf16 rounding of the operand."""
    w = weight(qtype, N, 512, seed=M)
    x = jax.random.normal(jax.random.key(M), (M, 512), jnp.float32).astype(dtype)
    got = np.asarray(jax.jit(block_gemm)(x, w))
    ref = np.asarray(quant_matmul_reference(x, w))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_other_types_take_the_fallback_or_are_refused():
    w = weight("q6_k", 16, 256, seed=1)
    x = jnp.ones((4, 256), jnp.float32)
    seen = []
    out = block_gemm(x, w, fallback=lambda x, w: seen.append(w.qtype) or jnp.zeros((4, 16)))
    assert seen == ["q6_k"] and out.shape == (4, 16)
    with pytest.raises(ValueError, match="q6_k"):
        block_gemm(x, w)
