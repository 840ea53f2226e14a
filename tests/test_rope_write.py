"""pallas_kernels/rope_write.py: q, k normed and rotated and k, v written into the paged caches
in one kernel, against its reference and against the model's own XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from luce_jax.config import ModelConfig
from luce_jax.models.dense import apply_rope, rope_tables
from pallas_kernels import kv_cache
from pallas_kernels.int8_rows import rms_norm
from pallas_kernels.rope_write import fits, rope_write, rope_write_reference

H, K, D, P, NB, T = 6, 2, 16, 4, 5, 7  # 3 query heads a kv head (not a power of two)


def case(seed, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(seed), 5)
    qkv = jax.random.normal(ks[0], (T, (H + 2 * K) * D), jnp.float32) * 3
    q_w, k_w = (1 + 0.1 * jax.random.normal(k, (D,), jnp.float32) for k in ks[1:3])
    kc, vc = (jax.random.normal(k, (NB, P, K, D), jnp.float32).astype(dtype) for k in ks[3:5])
    # 5 real rows in blocks 2..4 (slots 8..19), 2 padding rows on the sink slot 0
    write_idx = jnp.array([9, 10, 17, 12, 19, 0, 0], jnp.int32)
    positions = jnp.array([3, 40, 1000, 7, 9, 0, 0], jnp.int32)
    return qkv, q_w, k_w, kc, vc, write_idx, positions


def cfg(neox: bool) -> ModelConfig:
    return ModelConfig(arch="qwen3", vocab_size=32, d_model=H * D, n_layers=1, n_heads=H,
                       n_kv_heads=K, head_dim=D, ffn_dim=8, rope_base=10000.0,
                       rope_dim=D, rope_neox=neox)  # fmt: skip


@pytest.mark.parametrize("kp", [None, 1], ids=["row", "kv_head"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
@pytest.mark.parametrize("norm", [True, False], ids=["normed", "unnormed"])
def test_the_kernel_equals_its_reference_and_the_models_xla_path(neox, norm, kp):
    """q in the attention's dtype and the caches after the write, in interpret mode, equal the
    reference, with a program a row or a program a row's kv head (and its 3 query heads); the
    reference equals dense.py's rms_norm, apply_rope and kv_cache.write. The sink block, which
    both padding rows write, is left out."""
    qkv, q_w, k_w, kc, vc, idx, pos = case(int(neox) + 2 * int(norm))
    c = cfg(neox)
    cos, sin = rope_tables(pos, c)
    ws = (q_w, k_w) if norm else (None, None)
    kw = dict(heads=H, kv_heads=K, eps=1e-6, neox=neox, out_dtype=jnp.bfloat16)
    got = rope_write(qkv, *ws, cos, sin, idx, kc, vc, kv_heads_per_program=kp, interpret=True, **kw)
    ref = rope_write_reference(qkv, *ws, cos, sin, idx, kc, vc, **kw)

    q = qkv[:, : H * D].reshape(T, H, D)
    k = qkv[:, H * D : (H + K) * D].reshape(T, K, D)
    v = qkv[:, (H + K) * D :].reshape(T, K, D)
    if norm:
        q, k = rms_norm(q, q_w, 1e-6), rms_norm(k, k_w, 1e-6)
    k_rows = apply_rope(k, cos, sin, c)
    model = (apply_rope(q, cos, sin, c).astype(jnp.bfloat16),
             kv_cache.write(kc, idx, k_rows), kv_cache.write(vc, idx, v))  # fmt: skip
    for a, b, m in zip(got, ref, model, strict=True):
        a, b, m = (np.asarray(z, np.float32) for z in (a, b, m))
        if a.ndim == 4:  # caches: the sink block 0 is garbage by design
            a, b, m = a[1:], b[1:], m[1:]
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)  # bf16 rounding of one ulp
        np.testing.assert_allclose(b, m, rtol=1e-2, atol=1e-2)
    # blocks no row writes keep their values exactly (block 1: slots 4..7)
    np.testing.assert_array_equal(np.asarray(got[1][1], np.float32), np.asarray(kc[1], np.float32))
    np.testing.assert_array_equal(np.asarray(got[2][1], np.float32), np.asarray(vc[1], np.float32))


def test_float32_caches_take_the_exact_values():
    """With float32 caches and q, the kernel's k, v and q match the reference to float32
    rounding (no bf16 step hides a wrong index)."""
    qkv, q_w, k_w, kc, vc, idx, pos = case(7, jnp.float32)
    cos, sin = rope_tables(pos, cfg(True))
    kw = dict(heads=H, kv_heads=K, eps=1e-6, neox=True, out_dtype=jnp.float32)
    got = rope_write(qkv, q_w, k_w, cos, sin, idx, kc, vc, interpret=True, **kw)
    ref = rope_write_reference(qkv, q_w, k_w, cos, sin, idx, kc, vc, **kw)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], ref[1:], strict=True):
        np.testing.assert_allclose(np.asarray(a)[1:], np.asarray(b)[1:], rtol=1e-5, atol=1e-5)


def test_layers_the_kernel_cannot_take_are_refused():
    """Partial rotary, odd head dims and quantized caches whose NEOX half is shorter than a
    scale group take the XLA path (fits is False); the wrapper names what does not fit."""
    qkv, q_w, k_w, kc, vc, idx, pos = case(1)
    assert fits(D, D, kc, vc)
    assert not fits(D, D // 2, kc, vc)
    assert not fits(24, 24, kc, vc)
    quant = kv_cache.init((NB, P, K, 32), "q8_0")
    assert not fits(32, 32, quant, quant)
    cos, sin = rope_tables(pos, cfg(True))
    with pytest.raises(ValueError, match="heads"):
        rope_write(qkv, q_w, k_w, cos, sin, idx, kc, vc, heads=H + 1, kv_heads=K, eps=1e-6,
                   neox=True, out_dtype=jnp.bfloat16, interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="kv_heads_per_program 3"):
        rope_write(qkv, q_w, k_w, cos, sin, idx, kc, vc, heads=H, kv_heads=K, eps=1e-6,
                   neox=True, out_dtype=jnp.bfloat16, kv_heads_per_program=3,
                   interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="norm weights"):
        rope_write(qkv, q_w, None, cos, sin, idx, kc, vc, heads=H, kv_heads=K, eps=1e-6,
                   neox=True, out_dtype=jnp.bfloat16, interpret=True)  # fmt: skip


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "pairs"])
@pytest.mark.parametrize(
    "k_type, v_type, kp",
    [
        ("q8_0", "q8_0", None),
        ("q4_0", "q4_0", None),
        ("q8_0", "q4_0", 1),
        (jnp.bfloat16, "q8_0", None),
    ],
)
def test_quantized_caches_get_ggml_codes_and_scales(neox, k_type, v_type, kp):
    """With q8_0 / q4_0 caches the kernel writes, at each row's slot, the codes and f16 scales
    its reference and kv_cache.write give the model's rotated k and v (ggml's, bit for bit),
    from NEOX's halves or llama's pairs, a program a row or a row's kv head; q is as with plain
    caches, and slots no row writes keep their contents."""
    Dq = 64  # NEOX's halves hold whole groups of 32
    ks = jax.random.split(jax.random.key(11), 4)
    qkv = jax.random.normal(ks[0], (T, (H + 2 * K) * Dq), jnp.float32) * 3
    # v groups whose largest magnitude comes at both signs: q4_0's scale takes the first
    v0 = (H + K) * Dq
    qkv = qkv.at[0, v0 + 5].set(-9.0).at[0, v0 + 9].set(9.0).at[1, v0 + 40].set(9.0)
    qkv = qkv.at[1, v0 + 33].set(-9.0)
    q_w, k_w = (1 + 0.1 * jax.random.normal(k, (Dq,), jnp.float32) for k in ks[1:3])
    _, _, _, _, _, idx, pos = case(0)
    old = jax.random.normal(ks[3], (NB, P, K, Dq), jnp.float32)
    kc, vc = (
        kv_cache.quantize(old, t) if isinstance(t, str) else old.astype(t) for t in (k_type, v_type)
    )
    c = ModelConfig(arch="qwen3", vocab_size=32, d_model=H * Dq, n_layers=1, n_heads=H,
                    n_kv_heads=K, head_dim=Dq, ffn_dim=8, rope_base=10000.0, rope_dim=Dq,
                    rope_neox=neox)  # fmt: skip
    cos, sin = rope_tables(pos, c)
    assert fits(Dq, Dq, kc, vc, neox)
    q_got, kc_got, vc_got = rope_write(qkv, q_w, k_w, cos, sin, idx, kc, vc, heads=H, kv_heads=K,
                                       eps=1e-6, neox=neox, out_dtype=jnp.float32,
                                       kv_heads_per_program=kp, interpret=True)  # fmt: skip
    k = rms_norm(qkv[:, H * Dq : (H + K) * Dq].reshape(T, K, Dq), k_w, 1e-6)
    v = qkv[:, (H + K) * Dq :].reshape(T, K, Dq)
    q = rms_norm(qkv[:, : H * Dq].reshape(T, H, Dq), q_w, 1e-6)
    np.testing.assert_allclose(q_got, apply_rope(q, cos, sin, c), rtol=1e-5, atol=1e-5)
    ref = rope_write_reference(qkv, q_w, k_w, cos, sin, idx, kc, vc, heads=H, kv_heads=K,
                               eps=1e-6, neox=neox, out_dtype=jnp.float32)  # fmt: skip
    for got, cache, rows, r in ((kc_got, kc, apply_rope(k, cos, sin, c), ref[1]),
                                (vc_got, vc, v, ref[2])):  # fmt: skip
        want = kv_cache.write(cache, idx, rows)
        if isinstance(cache, kv_cache.Quantized):  # the reference: the same codes and scales
            np.testing.assert_array_equal(kv_cache.codes(r)[1:], kv_cache.codes(got)[1:])
            np.testing.assert_array_equal(r.scale[1:], got.scale[1:])
        if isinstance(cache, kv_cache.Quantized):
            got, want = (
                (np.asarray(kv_cache.codes(z))[1:], np.asarray(z.scale)[1:]) for z in (got, want)
            )  # block 0: the sink the padding rows write
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
        else:
            got, want = (np.asarray(z, np.float32)[1:] for z in (got, want))
            np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    untouched = kv_cache.codes(vc_got)[1] if v_type != jnp.bfloat16 else vc_got[1]
    np.testing.assert_array_equal(untouched, kv_cache.codes(vc)[1])


def test_quantized_caches_that_do_not_fit_are_refused():
    """A NEOX half shorter than a scale group cannot be quantized where it lies: fits is False
    there (the model then writes through XLA), and the wrapper names the head dim."""
    quant = kv_cache.init((NB, P, K, 32), "q8_0")
    assert not fits(32, 32, quant, quant, neox=True)
    assert fits(32, 32, quant, quant, neox=False)
    assert fits(32, 32, kv_cache.init((NB, P, K, 32), jnp.bfloat16), quant, neox=True)
