"""Each supported GGML type dequantizes exactly as gguf.quants.dequantize does."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from luce_jax.loading.quants import DEQUANTIZERS, dequantize

T = GGMLQuantizationType


def random_blocks(qtype, rows, cols, rng):
    """Random bytes in qtype's layout, with every f16 scale field set to a finite value."""
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in (T.F32, T.F16):
        dt = np.float32 if qtype == T.F32 else np.float16
        return rng.standard_normal((rows, cols)).astype(dt).view(np.uint8)
    if qtype == T.BF16:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scale_offsets = {
        T.Q8_0: [0], T.Q4_0: [0], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_XS: [0],
        T.Q2_K: [80, 82], T.Q3_K: [108], T.MXFP4: [],
    }  # fmt: skip
    for off in scale_offsets[qtype]:
        d = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:  # E8M0 scales 2**-11 .. 2**-5 (XLA flushes subnormal results to 0)
        raw[:, 0] = rng.integers(117, 124, raw.shape[0])
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(DEQUANTIZERS), ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 6, 512
    raw = random_blocks(qtype, rows, cols, rng)
    ours = np.asarray(dequantize(raw, qtype, (rows, cols)))
    ref = gguf_dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(ours, ref)


def test_transposed_and_cast_output():
    rng = np.random.default_rng(0)
    raw = random_blocks(T.Q8_0, 4, 64, rng)
    ref = gguf_dequantize(raw, T.Q8_0).reshape(4, 64)
    out = dequantize(raw, T.Q8_0, (4, 64), np.float32, transpose=True)
    np.testing.assert_array_equal(np.asarray(out), ref.T)


def test_a_type_without_a_device_dequantizer_is_unpacked_by_gguf_on_the_host():
    raw = np.random.default_rng(0).integers(0, 256, (16, 22), np.uint8)  # Q5_0: 32 a block
    raw[:, 0:2] = np.array([1e-3], np.float16).view(np.uint8)  # finite block scales
    assert T.Q5_0 not in DEQUANTIZERS
    got = np.asarray(dequantize(raw.reshape(-1), T.Q5_0, (2, 256), np.float32))
    np.testing.assert_array_equal(got, gguf_dequantize(raw, T.Q5_0).reshape(2, 256))


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="Q8_1"):
        dequantize(np.zeros(36, np.uint8), T.Q8_1, (1, 32))


def test_wrong_size_is_an_error():
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(np.zeros(30, np.uint8), T.Q8_0, (1, 32))
