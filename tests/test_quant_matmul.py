"""The quantized-weight matmul kernel (interpret mode) against its reference, and the Q8_0
layout against ggml's own quantization and dequantization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pallas_kernels.quant_matmul import (
    dequantize_q8_0,
    q8_0_from_blocks,
    quant_matmul,
    quant_matmul_reference,
    quantize_q8_0,
    tiling,
)

Q8 = GGMLQuantizationType.Q8_0


def test_q8_0_layout_is_ggmls_blocks_reordered():
    """A file tensor of N rows of K values: its blocks reordered to qs [K, N], d [K/32, N]
    dequantize to gguf's own values, and our quantization makes the same bytes as ggml's."""
    rng = np.random.default_rng(0)
    K, N = 96, 5
    rows = (rng.standard_normal((N, K)) * rng.uniform(0.01, 3, (N, 1))).astype(np.float32)
    blocks = quantize(rows, Q8)  # uint8 [N, K / 32 * 34]
    w = q8_0_from_blocks(blocks.reshape(-1, 34), K, N)
    assert w.qs.shape == (K, N) and w.d.shape == (K // 32, N) and w.qs.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(dequantize_q8_0(w)), dequantize(blocks, Q8).T)
    ours = quantize_q8_0(jnp.asarray(rows.T))
    np.testing.assert_array_equal(np.asarray(ours.qs), np.asarray(w.qs))
    np.testing.assert_array_equal(np.asarray(ours.d), np.asarray(w.d))


@pytest.mark.parametrize("per_group", [True, False], ids=["per-group", "per-tile"])
@pytest.mark.parametrize("M", [1, 3, 8, 64, 300])
@pytest.mark.parametrize(
    "K, N, groups",
    [(128, 128, 4), (96, 40, 4), (320, 24, 2)],
    ids=["tile-multiples", "ragged-k-and-n", "split-k"],
)
def test_kernel_matches_reference(M, K, N, groups, per_group):
    kx, kw = jax.random.split(jax.random.key(M * 1000 + K + N))
    x = jax.random.normal(kx, (M, K), jnp.float32)
    w = quantize_q8_0(jax.random.normal(kw, (K, N), jnp.float32))
    ref = quant_matmul_reference(x, w)
    got = quant_matmul(x, w, groups=groups, per_group=per_group, min_programs=8, interpret=True)
    assert got.shape == (M, N) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-3)


def test_a_split_whose_tail_is_past_k_adds_nothing():
    kx, kw = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (2, 320), jnp.float32)
    w = quantize_q8_0(jax.random.normal(kw, (320, 48), jnp.float32))
    assert tiling(2, 320, 48, groups=2, min_programs=3)[2:] == (3, 2)  # 5 chunks in 3 x 2
    got = quant_matmul(x, w, groups=2, min_programs=3, interpret=True)
    np.testing.assert_allclose(got, quant_matmul_reference(x, w), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("per_group", [True, False], ids=["per-group", "per-tile"])
def test_bfloat16_activations_and_output(per_group):
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (8, 256), jnp.float32)
    w = quantize_q8_0(jax.random.normal(kw, (256, 64), jnp.float32))
    ref = quant_matmul_reference(x.astype(jnp.bfloat16), w)
    xb = x.astype(jnp.bfloat16)
    got = quant_matmul(xb, w, out_dtype=jnp.bfloat16, per_group=per_group, interpret=True)
    assert got.dtype == jnp.bfloat16
    err = np.linalg.norm(np.asarray(got, np.float32) - ref) / np.linalg.norm(ref)
    assert err < 1e-2  # bf16 operands: the activations and the dequantized int8 values


def test_the_contraction_is_split_only_where_tiles_are_too_few_to_fill_the_gpu():
    # decode, N = 4096 (an attention output): 32 column tiles; K = 4096 is 32 chunks of 128
    BM, BN, S, chunks = tiling(1, 4096, 4096)
    assert (BM, BN) == (16, 128) and S == 8 and S * chunks == 32
    # decode, N = 24576 (gate/up): 192 tiles, one split each way up to 264 programs
    assert tiling(1, 4096, 24576)[2] == 1
    # prefill: 8 row tiles x 32 column tiles already fill the GPU
    assert tiling(512, 4096, 4096)[2] == 1
    # never more splits than chunks
    assert tiling(1, 64, 16)[2:] == (1, 1)


def test_bad_shapes_are_refused():
    w = quantize_q8_0(jnp.ones((64, 16), jnp.float32))
    with pytest.raises(ValueError, match="do not fit"):
        quant_matmul(jnp.ones((2, 32), jnp.float32), w, interpret=True)
