"""The step's q, k and v from the qkv projection in one kernel: per-head RMS norm, rotary
embedding, and k, v written into the paged caches in place.

Kernel, wrapper and pure-jnp reference together, in the style of JAX's Pallas ops.

In XLA a decode layer ran these as five small kernels (q norm, k norm + rope, q rope into
attention's layout, a scatter for k and one for v), 1.5 to 2.1 us each on the H200
(results/history/2026-12-02_profile_qwen3-8b-q4_k_m_c1_9345aba.md). Program (t, g) takes token row
t's kv heads g * KP .. (g + 1) * KP - 1 and their query heads: it loads each head as two halves
(NEOX rotates the halves of a head, llama adjacent pairs: the halves are then its even and odd
values), norms each head over both halves, rotates, stores q and writes k and v at the row's
KV slot. Padding rows write the sink slot their write_idx points at (block 0), as the XLA
scatter does. With a program a row (KP = K) the 8B Q4_K_M's decode step on the H200 was 1% to
2% shorter than with XLA's kernels (3.90 against 3.98 ms at C1), 4 kernels a layer fewer
(results/history/2026-12-02_engine_decode_qwen3-8b-q4_k_m_pallas_2b8d095.md).

Quantized caches (q8_0 / q4_0, kv_cache.py) are written by the same kernel: each row's groups
of 32 values are quantized as ggml does, from the rotated float32 k and the loaded v, and stored
as kv_cache's words and f16 scales. In XLA that write (quantize, then a scatter for codes and
one for scales, for k and v) took 0.37 to 0.41 ms of an 8B decode step at 4096 keys on the H200
(bench/results/history/2026-12-04_profile_decode_4k_qwen3-8b-bf16_kvq8_0_2ae5267.md). The rotated
halves are quantized where they lie: NEOX's halves each hold whole groups, llama's pairs put
each group's even values in one half and its odd values in the other. Divisions go through
PTX's div.rn.f32 (Triton's f32 division is div.full, two ulps off), so the codes and scales
equal kv_cache.quantize's.

Shapes: T rows, H query heads, K kv heads, D head dim, NB blocks of P slots.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import kv_cache
from .call_options import call_options, uses_ptx, whole
from .kv_cache import GROUP, VALUES_PER_WORD


def _halves(D: int, neox: bool):
    """The value indices of a head's two rotated halves, [D / 2] each."""
    j = jnp.arange(D // 2)
    return (j, j + D // 2) if neox else (2 * j, 2 * j + 1)


def _norm_rope(x1, x2, w1, w2, c, s, eps, D):
    """RMS-normed (w1, w2 the weight's halves, or None: no norm) and rotated halves [n, D / 2]."""
    if w1 is not None:
        r = jax.lax.rsqrt((jnp.sum(x1 * x1, -1) + jnp.sum(x2 * x2, -1)) / D + eps)[:, None]
        x1, x2 = x1 * r * w1[None, :], x2 * r * w2[None, :]
    return x1 * c - x2 * s, x2 * c + x1 * s


def rope_write_reference(qkv, q_w, k_w, cos, sin, write_idx, kc, vc, *, heads, kv_heads, eps,
                         neox, out_dtype):  # fmt: skip
    """qkv [T, (H + 2K) * D] float32 -> (q [T, H, D] out_dtype, kc, vc with k, v at
    write_idx [T], plain or quantized as kv_cache.write writes them); q_w, k_w [D] norm weights
    or None; cos, sin [T, D / 2]."""
    T = qkv.shape[0]
    H, K = heads, kv_heads
    D = qkv.shape[1] // (H + 2 * K)
    lo, hi = _halves(D, neox)
    c, s = cos[:, None, :], sin[:, None, :]

    def part(first, n, w):
        x = qkv[:, first * D : (first + n) * D].reshape(T, n, D).astype(jnp.float32)
        x1, x2 = x[..., lo], x[..., hi]
        if w is not None:
            r = jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)
            x1, x2 = x1 * r * w[lo], x2 * r * w[hi]
        return jnp.zeros_like(x).at[..., lo].set(x1 * c - x2 * s).at[..., hi].set(x2 * c + x1 * s)

    q, k = part(0, H, q_w), part(H, K, k_w)
    v = qkv[:, (H + K) * D :].reshape(T, K, D)

    return q.astype(out_dtype), kv_cache.write(kc, write_idx, k), kv_cache.write(vc, write_idx, v)


def _div(a, b, ptx: bool):
    """a / b rounded as IEEE division (kv_cache.quantize's), shapes broadcast."""
    a, b = jnp.broadcast_arrays(a, b)
    if not ptx:
        return a / b
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )[0]


def _quantized(parts, kind: str, ptx: bool):
    """ggml's q8_0 / q4_0 of a run of values given as parts (x [n, L] float32, stride, offset):
    part value j is the run's value j * stride + offset (one part: a run of consecutive values;
    two with stride 2: its even and odd values). Returns (words [n, L * stride / vpw] int32 in
    kv_cache's layout, vpw values a word, scales [n, L * stride / 32] f16)."""
    stride = len(parts)
    n, L = parts[0][0].shape
    per_group = GROUP // stride
    grouped = [(x.reshape(n, L // per_group, per_group), o) for x, _, o in parts]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), -1) for x, _ in grouped])
    if kind == "q8_0":
        d = _div(amax, jnp.float32(127), ptx)
    else:  # the first value of the largest magnitude, with its sign, over -8

        def first(x, o, target):  # index in the group of the first x == target, or GROUP
            pos = jnp.arange(per_group)[None, None, :] * stride + o
            return jnp.min(jnp.where(x == target[..., None], pos, GROUP), -1)

        pos_at = functools.reduce(jnp.minimum, [first(x, o, amax) for x, o in grouped])
        neg_at = functools.reduce(jnp.minimum, [first(x, o, -amax) for x, o in grouped])
        d = _div(jnp.where(pos_at <= neg_at, amax, -amax), jnp.float32(-8), ptx)
    inv = jnp.where(d == 0, 0.0, _div(jnp.float32(1), jnp.where(d == 0, 1.0, d), ptx))
    vpw = VALUES_PER_WORD[kind]
    words = None
    for x, o in grouped:
        y = x * inv[..., None]
        if kind == "q8_0":  # round half away from zero; the byte of the int8 code
            r = jnp.floor(jnp.abs(y) + 0.5)
            code = jnp.where(y < 0, -r, r).astype(jnp.int32) & 0xFF
        else:
            code = jnp.clip(jnp.floor(y + 8.5), 0, 15).astype(jnp.int32)
        chunk = vpw // stride
        i = jnp.arange(chunk) * stride + o  # each element's value index in its word
        shift = 8 * i if kind == "q8_0" else 8 * (i % 4) + 4 * (i // 4)
        w = jnp.sum(code.reshape(n, L // chunk, chunk) << shift[None, None, :], -1)
        words = w if words is None else words | w
    return words, d.astype(jnp.float16)


def _write_quantized(data_ref, scale_ref, blk, off, heads, ok, runs, kind, ptx):
    """Quantize one row's heads and store words and scales at the row's slot. runs: [(the
    run's first value in the head, its parts as _quantized takes them)]."""
    for first, parts in runs:
        words, sc = _quantized(parts, kind, ptx)
        w0, g0 = first // VALUES_PER_WORD[kind], first // GROUP
        wi = w0 + jnp.arange(words.shape[1])[None, :]
        gi = g0 + jnp.arange(sc.shape[1])[None, :]
        words = words if kind == "q8_0" else jax.lax.bitcast_convert_type(words, jnp.uint32)
        plgpu.store(data_ref.at[blk, off, heads, wi], words, mask=ok)
        plgpu.store(scale_ref.at[blk, off, heads, gi], sc, mask=ok)


def _kernel(qkv_ref, qw_ref, kw_ref, cos_ref, sin_ref, idx_ref, *refs, H, K, D, P, eps, neox,
            norm, KP, kinds, ptx):  # fmt: skip
    """Program (t, g): row t's kv heads g * KP .. (g + 1) * KP - 1 and their query heads. refs:
    the caches' input arrays (unused: aliased), q's output, the caches' output arrays (a plain
    cache one, a quantized one data and scale)."""
    n_cache = sum(1 if k == "plain" else 2 for k in kinds)
    q_ref, *caches = refs[n_cache:]
    k_refs = caches[: 1 if kinds[0] == "plain" else 2]
    v_refs = caches[len(k_refs) :]
    t, g = pl.program_id(0), pl.program_id(1)
    QP = KP * H // K  # query heads a program
    q0, k0 = g * QP, g * KP
    lo, hi = _halves(D, neox)
    c = plgpu.load(cos_ref.at[t, jnp.arange(D // 2)])[None, :]
    s = plgpu.load(sin_ref.at[t, jnp.arange(D // 2)])[None, :]
    slot = idx_ref[t]
    blk, off = slot // P, slot % P

    def heads(first, n):  # [n'] head offsets (n' a power of two), their mask, clamped rows
        h = jnp.arange(1 << (n - 1).bit_length())
        return h, (h < n)[:, None], (first + jnp.minimum(h, n - 1))[:, None] * D

    def rotated(first, n, w_ref):
        h, ok, base = heads(first, n)
        x1 = plgpu.load(qkv_ref.at[t, base + lo[None, :]])
        x2 = plgpu.load(qkv_ref.at[t, base + hi[None, :]])
        w1 = w2 = None
        if norm:
            w1, w2 = plgpu.load(w_ref.at[lo]), plgpu.load(w_ref.at[hi])
        return h[:, None], ok, _norm_rope(x1, x2, w1, w2, c, s, eps, D)

    h, ok, (q1, q2) = rotated(q0, QP, qw_ref)
    plgpu.store(q_ref.at[t, q0 + h, lo[None, :]], q1.astype(q_ref.dtype), mask=ok)
    plgpu.store(q_ref.at[t, q0 + h, hi[None, :]], q2.astype(q_ref.dtype), mask=ok)
    h, ok, (k1, k2) = rotated(H + k0, KP, kw_ref)
    if kinds[0] == "plain":
        kc_ref = k_refs[0]
        plgpu.store(kc_ref.at[blk, off, k0 + h, lo[None, :]], k1.astype(kc_ref.dtype), mask=ok)
        plgpu.store(kc_ref.at[blk, off, k0 + h, hi[None, :]], k2.astype(kc_ref.dtype), mask=ok)
    else:  # NEOX: each half a run of its own; pairs: the halves are one run's even, odd values
        runs = (
            [(0, [(k1, 1, 0)]), (D // 2, [(k2, 1, 0)])] if neox else [(0, [(k1, 2, 0), (k2, 2, 1)])]
        )
        _write_quantized(*k_refs, blk, off, k0 + h, ok, runs, kinds[0], ptx)
    hv, ok, base = heads(H + K + k0, KP)
    d = jnp.arange(D)[None, :]
    v = plgpu.load(qkv_ref.at[t, base + d])
    if kinds[1] == "plain":
        vc_ref = v_refs[0]
        plgpu.store(vc_ref.at[blk, off, k0 + hv[:, None], d], v.astype(vc_ref.dtype), mask=ok)
    else:
        _write_quantized(*v_refs, blk, off, k0 + hv[:, None], ok, [(0, [(v, 1, 0)])], kinds[1], ptx)


def fits(head_dim: int, rope_dim: int, kc, vc, neox: bool = True) -> bool:
    """Whether the kernel takes this layer: the whole head rotated, a power-of-two head dim
    (Triton tiles), and quantized caches' groups of 32 within what it quantizes at once (v's
    head, k's head, or with NEOX k's half head)."""
    D = head_dim
    k_run = D // 2 if neox else D
    quant_ok = (kv_cache.kind(kc) == "plain" or k_run % GROUP == 0) and (
        kv_cache.kind(vc) == "plain" or D % GROUP == 0
    )
    return quant_ok and rope_dim == D and D >= 4 and not D & (D - 1)


def rope_write(qkv, q_w, k_w, cos, sin, write_idx, kc, vc, *, heads: int, kv_heads: int,
               eps: float, neox: bool, out_dtype, kv_heads_per_program: int | None = None,
               interpret: bool | None = None, num_warps: int = 4):  # fmt: skip
    """Pallas rope_write_reference: q normed (q_w) and rotated, k likewise and written with v
    into the caches at write_idx, in place (the caches are aliased to the outputs).

    Args:
      qkv: [T, (H + 2K) * D] the qkv projection's rows (float32).
      q_w, k_w: [D] the per-head norm weights, both or neither (None: no norm).
      cos, sin: [T, D / 2] the rows' rotary tables (float32).
      write_idx: [T] int32 flat KV slots (block * P + offset).
      kc, vc: [NB, P, K, D] plain caches, or kv_cache.Quantized q8_0 / q4_0 ones.
      heads, kv_heads: H and K; eps: the norm's epsilon; neox: rotate halves (else pairs).
      out_dtype: q's dtype (the attention's compute dtype).
      kv_heads_per_program: KP, a divisor of K: a program takes one row's KP kv heads and
        their H / K query heads each (grid T x K / KP). None: all K, a program a row (the
        form timed on the H200, history/2026-12-02_engine_decode_qwen3-8b-q4_k_m_pallas_2b8d095.md).
      interpret: run in interpret mode (default: when the backend is the CPU).
      num_warps: Triton's warps a program.
    Returns:
      (q [T, H, D] out_dtype, kc, vc).
    """
    T, width = qkv.shape
    H, K = heads, kv_heads
    D = width // (H + 2 * K)
    NB, P, _ = kv_cache.leading_shape(kc)
    kinds = (kv_cache.kind(kc), kv_cache.kind(vc))
    if width != (H + 2 * K) * D or any(
        kv_cache.leading_shape(c) != (NB, P, K) or kv_cache.head_dim(c) != D for c in (kc, vc)
    ):
        raise ValueError(
            f"qkv {qkv.shape} does not fit {H} + 2 x {K} heads and caches {(NB, P, K)} ({kinds})"
        )
    if not fits(D, 2 * cos.shape[-1], kc, vc, neox) or cos.shape != (T, D // 2):
        raise ValueError(f"rope tables {cos.shape} or head dim {D} do not fit the kernel ({kinds})")
    if (q_w is None) != (k_w is None) or write_idx.shape != (T,):
        raise ValueError(f"norm weights ({q_w is None}, {k_w is None}) or slots {write_idx.shape}")
    KP = K if kv_heads_per_program is None else kv_heads_per_program
    if K % KP:
        raise ValueError(f"kv_heads_per_program {KP} does not divide {K} kv heads")
    norm = q_w is not None
    one = jnp.ones((D,), jnp.float32)
    arrays = [*((kc,) if kinds[0] == "plain" else tuple(kc)),
              *((vc,) if kinds[1] == "plain" else tuple(vc))]  # fmt: skip
    inputs = (qkv.astype(jnp.float32), one if q_w is None else q_w.astype(jnp.float32),
              one if k_w is None else k_w.astype(jnp.float32), cos.astype(jnp.float32),
              sin.astype(jnp.float32), write_idx.astype(jnp.int32), *arrays)  # fmt: skip
    kernel = functools.partial(_kernel, H=H, K=K, D=D, P=P, eps=eps, neox=neox, norm=norm, KP=KP,
                               kinds=kinds, ptx=uses_ptx(interpret))  # fmt: skip
    outs = (jax.ShapeDtypeStruct((T, H, D), out_dtype), *arrays)
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outs)
    q, *new = pl.pallas_call(
        kernel,
        grid=(T, K // KP),
        in_specs=[whole(a) for a in inputs],
        out_specs=[whole(a) for a in shapes],
        out_shape=shapes,
        input_output_aliases={6 + i: 1 + i for i in range(len(arrays))},
        **call_options(interpret, num_warps, 1, name="rope_write"),
    )(*inputs)
    if kinds[0] == "plain":
        kc, new = new[0], new[1:]
    else:
        kc, new = kv_cache.Quantized(*new[:2]), new[2:]
    vc = new[0] if kinds[1] == "plain" else kv_cache.Quantized(*new)
    return q, kc, vc
