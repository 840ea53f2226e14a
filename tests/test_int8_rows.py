"""int8_rows: activations rounded to int8 per 32 values in one kernel, equal to its reference
(and norm_int8_rows: the RMSNorm before it in the same kernel; norm_rows: that norm alone)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from luce_jax.models.linear import Normed, QuantMatmul, Splits, linear, summed
from pallas_kernels.int8_rows import (
    glu_int8_rows,
    glu_int8_rows_reference,
    int8_rows,
    int8_rows_reference,
    norm_int8_rows,
    norm_int8_rows_reference,
    norm_rows,
    rms_norm,
)


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M, K", [(1, 96), (3, 384), (8, 4096)])
def test_the_norm_kernel_rounds_the_normed_rows_it_returns(M, K, dtype):
    """norm_int8_rows: h is the models' RMSNorm in dtype (to float32 rounding: its sum of
    squares adds in another order than XLA's), and the int8 rows are int8_rows' of that h bit
    for bit, over widths whose groups are and are not a power of two (96: 3, 384: 12)."""
    x = rows(M, K, jnp.float32, seed=K)
    w = jax.random.normal(jax.random.key(1), (K,), jnp.float32)
    got = norm_int8_rows(x, w, eps=1e-6, dtype=dtype, interpret=True)
    check_rows(got, norm_int8_rows_reference(x, w, 1e-6, dtype)[0], 1e-6)


def check_rows(got, want_h, f32_tol: float):
    """got = (h, x8): h as want_h (its dtype and shape; its values to f32_tol in float32, to
    bf16's rounding in bf16) and x8 int8_rows' of h bit for bit."""
    h, x8 = got
    assert h.dtype == want_h.dtype and h.shape == want_h.shape
    tol = f32_tol if h.dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32),
                               rtol=tol, atol=tol)  # fmt: skip
    for g, want in zip(x8, int8_rows_reference(h), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))


def test_a_normed_input_is_normed_and_rounded_in_one_kernel_where_the_kernel_takes_int8():
    """A decode step's norm (Normed) and the int8 rows of its result come from one kernel,
    norm_int8_rows, and reach the kernel as x8 for every part of a tuple weight; a step past
    the kernel's live-rows bucket norms with XLA and passes none. Either way the product equals
    the kernel's on rms_norm(x), which rounds its rows itself (interpret mode)."""
    import functools

    from test_quantized_weights import qweight

    from pallas_kernels.int8_rows import rms_norm
    from pallas_kernels.quant_matmul import quant_matmul

    qk = functools.partial(quant_matmul, int8_x=True, interpret=True)
    seen = []

    def kernel(x, w, live, **kw):
        seen.append((x.shape[0], sorted(kw)))
        return qk(x, w, live, **kw)

    norm = functools.partial(norm_int8_rows, interpret=True)
    qmm = QuantMatmul(kernel, max_rows=64, live_rows_max=8, norm_int8=norm)
    w, nw = (qweight(N=24), qweight(N=16, seed=1)), jax.random.normal(jax.random.key(9), (64,))
    for T, live in ((8, 2), (16, 3)):
        x = jax.random.normal(jax.random.key(T), (T, 64), jnp.float32) * 3
        got = linear(Normed(x, nw, 1e-6), w, qmm, jnp.int32(live))
        h = rms_norm(x, nw, 1e-6)
        want = jnp.concatenate([qk(h, p, jnp.int32(live) if T <= 8 else None) for p in w], -1)
        np.testing.assert_allclose(got[:live], want[:live], rtol=1e-3, atol=1e-3)
    assert seen == [(8, ["x8"])] * 2 + [(16, [])] * 2


@pytest.mark.parametrize("M, K, dtype", [(1, 96, jnp.float32), (3, 2048, jnp.bfloat16)])
def test_the_norm_alone_is_the_models_rms_norm(M, K, dtype):
    """norm_rows: rms_norm(x, w) in dtype (to float32 rounding: its sum of squares adds in
    another order than XLA's), over widths whose groups are and are not a power of two."""
    x = rows(M, K, jnp.float32, seed=K)
    w = jax.random.normal(jax.random.key(2), (K,), jnp.float32)
    got = norm_rows(x, w, eps=1e-6, dtype=dtype, interpret=True)
    want = rms_norm(x, w, 1e-6).astype(dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of 32"):
        norm_rows(x[:, :48], w[:48], eps=1e-6, dtype=dtype, interpret=True)


def test_a_normed_input_on_float_activations_is_normed_in_one_kernel():
    """Where the kernel takes float activations, a decode step's norm is norm_rows' (one
    kernel) and no int8 rows go to the kernel; a step past the live-rows bucket norms with
    XLA. The products equal the kernel's on rms_norm(x) (interpret mode)."""
    import functools

    from test_quantized_weights import qweight

    from pallas_kernels.quant_matmul import quant_matmul

    qk = functools.partial(quant_matmul, interpret=True)
    normed = []

    def norm(x, w, **kw):
        normed.append(x.shape[0])
        return norm_rows(x, w, interpret=True, **kw)

    def kernel(x, w, live, **kw):
        assert "x8" not in kw
        return qk(x, w, live, **kw)

    qmm = QuantMatmul(kernel, max_rows=64, live_rows_max=8, norm=norm)
    w, nw = qweight(N=24), jax.random.normal(jax.random.key(9), (64,))
    for T, live in ((1, 1), (8, 2), (16, 3)):
        x = jax.random.normal(jax.random.key(T), (T, 64), jnp.float32) * 3
        got = linear(Normed(x, nw, 1e-6), w, qmm, jnp.int32(live))
        want = qk(rms_norm(x, nw, 1e-6), w, jnp.int32(live) if T <= 8 else None)
        np.testing.assert_allclose(got[:live], want[:live], rtol=1e-2, atol=1e-2)
    assert normed == [1, 8]


def padded_parts(S: int, M: int, N: int, live: int, seed: int):
    """Split partials [S, M, N] whose rows past live are NaN: quant_matmul's `splits` leaves
    them unwritten, so a consumer that read them would show it."""
    parts = jax.random.normal(jax.random.key(seed), (S, M, N), jnp.float32) * 2
    return jnp.where(jnp.arange(M)[:, None] < live, parts, jnp.nan)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("S, M, F, live", [(1, 1, 96, 1), (4, 8, 960, 2), (3, 2, 2048, 2)])
def test_the_glu_kernel_sums_the_partials_and_rounds_the_rows_it_returns(S, M, F, live, dtype):
    """glu_int8_rows: h is silu(gate) * up of the live rows' partial sums in dtype (to float32
    rounding: its sigmoid is 1 / (1 + exp(-x)), XLA's its own), zeros in padding rows, whose
    partials (NaN here) are not read; the int8 rows are int8_rows' of that h bit for bit, over
    F of 3, 30 and 64 groups of 32."""
    parts = padded_parts(S, M, 2 * F, live, seed=F)
    got = glu_int8_rows(parts, jnp.int32(live), dtype=dtype, interpret=True)
    assert got[0].shape == (M, F)
    want = glu_int8_rows_reference(parts, jnp.int32(live), dtype)[0]
    assert np.all(np.asarray(want[live:], np.float32) == 0)
    check_rows(got, want, 1e-5)


def test_a_decode_step_ffn_takes_the_gate_up_partials_to_the_glu_kernel():
    """models/dense.swiglu in a decode step on the int8 kernel: gate | up comes back as its
    split partials (Splits), one glu_int8_rows call sums them, takes silu(gate) * up and rounds
    it, and the down projection gets those rows as x8; the live rows equal the FFN's with XLA's
    norm, glu and the kernel's own rounding (interpret mode)."""
    import functools

    from test_quantized_weights import qweight

    from luce_jax.models.dense import swiglu
    from pallas_kernels.quant_matmul import quant_matmul

    qk = functools.partial(quant_matmul, int8_x=True, interpret=True)
    seen = []

    def kernel(x, w, live, **kw):
        out = qk(x, w, live, **kw)
        seen.append((w.shape, sorted(kw), isinstance(out, tuple) or out.ndim))
        return out

    fused = QuantMatmul(kernel, max_rows=64, live_rows_max=8,
                        norm_int8=functools.partial(norm_int8_rows, interpret=True),
                        glu_int8=functools.partial(glu_int8_rows, interpret=True))  # fmt: skip
    apart = QuantMatmul(qk, max_rows=64, live_rows_max=8)
    lp = {"w_gu": qweight(N=128, K=64), "w_down": qweight(N=64, K=64, seed=1)}
    nw = jax.random.normal(jax.random.key(9), (64,))
    x = jax.random.normal(jax.random.key(3), (8, 64), jnp.float32) * 3
    live = jnp.int32(2)
    got = swiglu(lp, Normed(x, nw, 1e-6), fused, live)
    want = swiglu(lp, Normed(x, nw, 1e-6), apart, live)
    assert seen == [((128, 64), ["splits", "x8"], 3), ((64, 64), ["x8"], 2)]
    np.testing.assert_allclose(got[:2], want[:2], rtol=2e-2, atol=2e-2 * np.abs(want[:2]).max())
    assert isinstance(linear(x, lp["w_gu"], fused, live, splits=True), Splits)
    assert not isinstance(linear(x, lp["w_gu"], fused, None, splits=True), Splits)  # no live


def test_split_partials_hold_live_rows_only_and_sum_to_the_product():
    """linear(..., splits=True) on the kernel's live-rows path (dense.layer asks it of the
    attention output and the FFN): the kernel writes the partials of live rows only (the rest
    stay NaN in interpret mode), and `summed` adds them over live rows, zeros in padding rows,
    equal to the unsplit call's live rows; the engine's tests (test_quantized_weights) run a
    whole model so."""
    import functools

    from test_quantized_weights import qweight

    from pallas_kernels.quant_matmul import quant_matmul

    qk = functools.partial(quant_matmul, int8_x=True, interpret=True)
    qmm = QuantMatmul(qk, max_rows=64, live_rows_max=8)
    w, live = qweight(N=64, K=256), jnp.int32(2)
    x = jax.random.normal(jax.random.key(4), (8, 256), jnp.float32) * 3
    y = linear(x, w, qmm, live, splits=True)
    assert isinstance(y, Splits) and y.parts.shape[1:] == (8, 64)
    assert (
        np.isnan(np.asarray(y.parts[:, 2:])).all() and np.isfinite(np.asarray(y.parts[:, :2])).all()
    )
    got, want = np.asarray(summed(y)), np.asarray(linear(x, w, qmm, live))
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    assert not got[2:].any()
