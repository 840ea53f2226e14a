"""The one-kernel dequantization of prefill-sized steps (interpret mode) against gguf's own
dequantization for every type the device keeps quantized, and its matmul against the
reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from test_quants import random_blocks

from luce_jax.loading.quants import keep_quantized
from pallas_kernels.dequantize import dequantize, dequantize_reference, dequantized_matmul
from pallas_kernels.ggml_blocks import FORMATS
from pallas_kernels.quant_matmul import quant_matmul_reference


def weight(qtype: str, N: int, K: int, seed=0):
    t = FORMATS[qtype].qtype
    raw = random_blocks(t, N, K, np.random.default_rng(seed))
    return raw, keep_quantized(raw, t, (N, K), jnp.float32)


@pytest.mark.parametrize("qtype", list(FORMATS))
def test_every_value_decodes_as_gguf_does(qtype):
    """N = 40 ends inside a program's 32 rows and K = 3 blocks inside its 2 (K-quants) or 16
    blocks of Q8_0 / Q4_0 (512 values): those rows and blocks are written nowhere else, so a
    masked or misplaced store shows. float32 is gguf's value bit for bit; bfloat16 the
    reference's (Q4_K: one rounding, in the kernel)."""
    B = FORMATS[qtype].block
    raw, w = weight(qtype, 40, 3 * B if B == 256 else 17 * B)
    got = dequantize(w, jnp.float32, block_n=32, values_per_program=512, interpret=True)
    np.testing.assert_array_equal(np.asarray(got), gguf_dequantize(raw, FORMATS[qtype].qtype))
    if qtype == "q4_k":
        got16 = dequantize(w, jnp.bfloat16, block_n=32, values_per_program=512, interpret=True)
        assert got16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got16), np.asarray(dequantize_reference(w)))


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q8_0", "iq4_xs"])
def test_the_transposed_layout_holds_the_same_values(qtype):
    """transpose writes W^T [K, N] (the bf16 model's weight layout): value for value W's,
    with N and K ending inside a program's rows and blocks as above."""
    B = FORMATS[qtype].block
    raw, w = weight(qtype, 40, 3 * B if B == 256 else 17 * B, seed=2)
    got = dequantize(w, jnp.float32, block_n=32, values_per_program=512, transpose=True,
                     interpret=True)  # fmt: skip
    assert got.shape == (w.shape[1], w.shape[0])
    np.testing.assert_array_equal(np.asarray(got), gguf_dequantize(raw, FORMATS[qtype].qtype).T)


@pytest.mark.parametrize("transpose", [False, True], ids=["W", "W^T"])
@pytest.mark.parametrize("qtype", ["q4_k", "q6_k", "q8_0"])
def test_the_matmul_over_it_matches_the_reference(qtype, transpose):
    _, w = weight(qtype, 48, 512, seed=1)
    x = jax.random.normal(jax.random.key(0), (100, 512), jnp.float32)
    got = dequantized_matmul(x, w, transpose=transpose, interpret=True)
    np.testing.assert_allclose(got, quant_matmul_reference(x, w), rtol=1e-5, atol=1e-4)


def test_a_stack_of_experts_is_refused():
    _, w = weight("q8_0", 8, 64)
    stacked = type(w)(w.head[None], w.body[None], w.qtype, w.dtype)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        dequantize(stacked, interpret=True)
