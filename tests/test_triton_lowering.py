"""The Pallas kernels lower to Triton modules that verify, checked on CPU without a GPU.

Interpret mode runs the kernels' jaxpr, not their Triton lowering: a kernel can pass every
interpret-mode test and still be refused by Triton on the GPU (for example a loop whose bounds
lowered to different integer types). Lowering for the cuda platform works without a device;
the Triton module of each pallas_call is verified as it is built.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_cache
from pallas_kernels.dequantize import dequantize
from pallas_kernels.ggml_asm import DECODERS as FLOAT_DECODERS
from pallas_kernels.ggml_blocks import FORMATS
from pallas_kernels.int8_rows import glu_int8_rows, int8_rows, norm_int8_rows, norm_rows
from pallas_kernels.moe_grouping import grouped_matmul
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.quant_matmul import INT8_DOTS, quant_matmul
from pallas_kernels.quant_weight import QuantWeight
from pallas_kernels.rope_write import rope_write
from pallas_kernels.split_combine import split_combine


def lower_for_cuda(f, *args):
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(
    "split_masks, splits", [(False, None), (True, None), (False, 16)],
    ids=["masked", "split-masks", "16-splits"],
)  # fmt: skip
@pytest.mark.parametrize("kv_type", ["bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("segs", [[(1, 100)] * 3, [(40, 60), (1, 33)]], ids=["decode", "mixed"])
def test_paged_attention_lowers_to_a_valid_triton_module(
    verified, kv_type, segs, split_masks, splits
):
    H, K, D, P = 8, 2, 128, 16
    r = np.random.default_rng(0)
    MB = max(-(-kv // P) for _, kv in segs)
    k = jnp.asarray(r.standard_normal((1 + MB * len(segs), P, K, D)), jnp.bfloat16)
    if kv_type != "bf16":
        k = kv_cache.quantize(k, kv_type)
    T = sum(q for q, _ in segs)
    cu = jnp.asarray(np.cumsum([0] + [q for q, _ in segs]), jnp.int32)
    args = (
        jnp.zeros((T, H, D), jnp.bfloat16),
        k,
        k,
        jnp.zeros((T,), jnp.int32),
        jnp.zeros((T,), jnp.int32),
        jnp.zeros((len(segs), MB), jnp.int32),
        jnp.asarray([kv for _, kv in segs], jnp.int32),
    )
    kw = dict(scale=0.1, cu_q_lens=cu, interpret=False, split_masks=split_masks, splits=splits)
    lower_for_cuda(lambda *a: paged_attention(*a, **kw), *args)
    assert len(verified) == 1


@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("M, K, N", [(16, 40, 24), (64, 2048, 768), (512, 768, 2048)])
def test_grouped_matmul_lowers_to_a_valid_triton_module(verified, swiglu, M, K, N):
    x = jnp.zeros((M, K), jnp.bfloat16)
    w = jnp.zeros((8, K, 2 * N if swiglu else N), jnp.bfloat16)
    sizes = jnp.full((8,), M // 8, jnp.int32)
    lower_for_cuda(lambda *a: grouped_matmul(*a, swiglu=swiglu, interpret=False), x, w, sizes)
    assert len(verified) == 1


@pytest.mark.parametrize("neox, norm, kp", [(True, True, None), (False, False, 1), (True, True, 2)])
@pytest.mark.parametrize("H, K", [(32, 8), (28, 4)])
@pytest.mark.parametrize("kv_type", ["bf16", "q8_0", "q4_0"])
def test_rope_write_lowers_to_a_valid_triton_module(verified, neox, norm, kp, H, K, kv_type):
    """The qkv rows' norm, rope and KV write in one kernel, its caches aliased to its outputs,
    a program a row or a program a row's KP kv heads; quantized caches with their divisions
    in PTX."""
    D, T, NB, P = 128, 8, 64, 16
    ws = (jnp.ones((D,), jnp.float32),) * 2 if norm else (None, None)
    cache = kv_cache.init((NB, P, K, D), jnp.bfloat16 if kv_type == "bf16" else kv_type)
    f = lambda qkv, cos, idx, kc, vc: rope_write(  # noqa: E731
        qkv, *ws, cos, cos, idx, kc, vc, heads=H, kv_heads=K, eps=1e-6, neox=neox,
        out_dtype=jnp.bfloat16, kv_heads_per_program=kp, interpret=False)  # fmt: skip
    qkv = jnp.zeros((T, (H + 2 * K) * D), jnp.float32)
    cos = jnp.zeros((T, D // 2), jnp.float32)
    lower_for_cuda(f, qkv, cos, jnp.zeros((T,), jnp.int32), cache, cache)
    assert len(verified) == 1
    assert (kv_type != "bf16") == ("div.rn.f32" in str(verified[0].module))


@pytest.mark.parametrize("NS", [32, 40])
def test_split_combine_lowers_to_a_valid_triton_module(verified, NS):
    """The splits' combine, a program a row and head, splits padded to a power of two."""
    T, K, G, D = 8, 8, 4, 128
    acc = jnp.zeros((NS, T + 4, K, G, D), jnp.float32)
    m = jnp.zeros((NS, T + 4, K, G), jnp.float32)
    cu = jnp.asarray([0, 1], jnp.int32)
    f = lambda *a: split_combine(*a, T, 32, jnp.bfloat16, interpret=False)  # noqa: E731
    lower_for_cuda(f, acc, m, m, cu)
    assert len(verified) == 1


def zero_weight(qtype: str, N: int, K: int, lead=()) -> QuantWeight:
    f = FORMATS[qtype]
    return QuantWeight.from_rows(
        jnp.zeros((*lead, N, K // f.block * f.type_size), jnp.uint8), qtype
    )


@pytest.mark.parametrize("transpose", [False, True], ids=["W", "W^T"])
@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("K, N", [(4096, 4096), (768, 40)])
def test_dequantize_lowers_to_a_valid_triton_module(verified, qtype, K, N, transpose):
    w = zero_weight(qtype, N, K)
    lower_for_cuda(lambda w: dequantize(w, transpose=transpose, interpret=False), w)
    assert len(verified) == 1


@pytest.mark.parametrize("qtype", list(FORMATS))
@pytest.mark.parametrize("M, K, N", [(1, 4096, 4096), (8, 12288, 4096), (300, 512, 40)])
def test_quant_matmul_lowers_to_a_valid_triton_module(verified, qtype, M, K, N):
    w = zero_weight(qtype, N, K)
    x = jnp.zeros((M, K), jnp.bfloat16)
    lower_for_cuda(lambda x: quant_matmul(x, w, interpret=False), x)
    lower_for_cuda(lambda x, n: quant_matmul(x, w, n, interpret=False), x, jnp.int32(1))
    assert len(verified) == 2  # with live rows: the vector path and the dots under one branch


@pytest.mark.parametrize(
    "qtype, splits", [("q8_0", None), ("q4_k", None), ("q6_k", None), ("q4_k", 3)]
)
def test_rows_times_their_experts_lower(verified, qtype, splits):
    """The decode path of quantized experts (a row a program, 30B-A3B's gate/up shape), and
    with expert_splits a loop over each split's steps (8 steps in 3: the last split's tail
    masked)."""
    w = zero_weight(qtype, 2 * 768, 2048, lead=(8,))
    x = jnp.zeros((64, 2048), jnp.bfloat16)
    f = lambda x, ex: quant_matmul(x, w, experts=ex, expert_splits=splits, interpret=False)  # noqa: E731
    lower_for_cuda(f, x, jnp.zeros((64,), jnp.int32))
    assert len(verified) == 1


# the vector path's PTX options and the instruction each puts in the module: int8
# activations' dp4a (on by default in the engine), unit codes' byte permute
PTX_CASES = [("int8_x", q, "dp4a") for q in ("q8_0", "q4_k", "q6_k")] + [
    ("unit_codes", q, "prmt.b32") for q in sorted(FLOAT_DECODERS)
]


@pytest.mark.parametrize("option, qtype, instruction", PTX_CASES)
def test_the_vector_path_lowers_with_its_ptx(verified, option, qtype, instruction):
    w = zero_weight(qtype, 4096, 4096)
    x = jnp.zeros((8, 4096), jnp.bfloat16)
    f = lambda x, n: quant_matmul(x, w, n, interpret=False, **{option: True})  # noqa: E731
    lower_for_cuda(f, x, jnp.int32(1))
    assert len(verified) == 1 + (option == "int8_x")  # int8_x: int8_rows' kernel first
    assert instruction in str(verified[-1].module)  # the codes go through ggml_asm's PTX


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_int8_dots_lower_with_integer_dots(verified, qtype):
    """int8_dots: the dots branch multiplies int8 x by int8 codes into int32 (Triton's dot
    with an i32 accumulator), beside the vector path's dp4a, for the INT8_DOTS types (pieces
    of 32 values); the others keep their float dots."""
    w = zero_weight(qtype, 4096, 4096)
    x = jnp.zeros((8, 4096), jnp.bfloat16)
    f = lambda x, n: quant_matmul(x, w, n, interpret=False, int8_x=True, int8_dots=True)  # noqa: E731
    lower_for_cuda(f, x, jnp.int32(5))
    assert len(verified) == 2  # int8_rows' kernel, then the matmul's
    module = str(verified[-1].module)
    integer_dot = re.search(r"tt\.dot .*tensor<16x\d+xi8>.*-> tensor<16x64xi32>", module)
    assert bool(integer_dot) == (qtype in INT8_DOTS)
    assert "tt.dot" in module


@pytest.mark.parametrize("qtype", ["q4_k", "q6_k"])
def test_weight_loads_a_step_ahead_lower_with_the_loads_in_the_loop_carry(verified, qtype):
    """prefetch: the loop carries a step's weight bytes (uint8 / uint32 tensors) into the next."""
    w = zero_weight(qtype, 4096, 4096)
    x = jnp.zeros((8, 4096), jnp.bfloat16)
    f = lambda x, n, p: quant_matmul(x, w, n, interpret=False, int8_x=True, prefetch=p)  # noqa: E731
    lower_for_cuda(functools.partial(f, p=False), x, jnp.int32(1))
    lower_for_cuda(functools.partial(f, p=True), x, jnp.int32(1))
    plain, ahead = (str(v.module) for v in verified[1::2])
    assert ahead.count("scf.for") == plain.count("scf.for")
    assert ahead.count("tensor<64x1x") > plain.count("tensor<64x1x")


def test_int8_rows_lower_with_their_rounding(verified):
    """The activation rounding of int8_x, one kernel, its rounding PTX's cvt.rni."""
    lower_for_cuda(lambda x: int8_rows(x, interpret=False), jnp.zeros((64, 768), jnp.bfloat16))
    assert len(verified) == 1
    assert "cvt.rni.s32.f32" in str(verified[0].module)


@pytest.mark.parametrize("K", [4096, 384])
def test_the_norm_and_its_int8_rows_lower_as_one_kernel(verified, K):
    """norm_int8_rows: a row's RMSNorm and rounding in one module, groups padded to a power of
    two where K / 32 is not one (384: 12 of 16)."""
    w = jnp.ones((K,), jnp.float32)
    f = lambda x: norm_int8_rows(x, w, eps=1e-6, dtype=jnp.bfloat16, interpret=False)  # noqa: E731
    lower_for_cuda(f, jnp.zeros((8, K), jnp.float32))
    assert len(verified) == 1
    assert "cvt.rni.s32.f32" in str(verified[0].module)


@pytest.mark.parametrize("K, dtype", [(2048, jnp.float32), (384, jnp.bfloat16)])
def test_the_norm_alone_lowers(verified, K, dtype):
    """norm_rows: the RMSNorm of float activations, a row a program (float32 rows as the MoE
    FFN's router and experts read them; 384: groups padded to a power of two)."""
    w = jnp.ones((K,), jnp.float32)
    f = lambda x: norm_rows(x, w, eps=1e-6, dtype=dtype, interpret=False)  # noqa: E731
    lower_for_cuda(f, jnp.zeros((8, K), jnp.float32))
    assert len(verified) == 1


def test_the_glu_and_its_int8_rows_lower_as_one_kernel(verified):
    """glu_int8_rows on the 8B's gate | up partials (4 splits of 8 rows x 2 x 12288)."""
    f = lambda p, n: glu_int8_rows(p, n, dtype=jnp.bfloat16, interpret=False)  # noqa: E731
    lower_for_cuda(f, jnp.zeros((4, 8, 2 * 12288), jnp.float32), jnp.int32(1))
    assert len(verified) == 1
    assert "cvt.rni.s32.f32" in str(verified[0].module)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k"])
def test_grouped_matmul_of_quantized_experts_lowers(verified, qtype):
    w = zero_weight(qtype, 2 * 768, 2048, lead=(8,))
    x = jnp.zeros((64, 2048), jnp.bfloat16)
    sizes = jnp.full((8,), 8, jnp.int32)
    lower_for_cuda(lambda x: grouped_matmul(x, w, sizes, swiglu=True, interpret=False), x)
    assert len(verified) == 1


@pytest.mark.parametrize("chunk", [0, 16, 64])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gated_delta_lowers_to_a_valid_triton_module(verified, dtype, chunk):
    """Qwen3.5-27B's linear-layer sizes: 16 key heads, 48 value heads, Dk = Dv = 128; the
    served form, on a state array of 4 layers x 8 slots updated in place."""
    from pallas_kernels.gated_delta import gated_delta_in_place

    T, Hk, Hv, D = 64, 16, 48, 128
    args = (
        jnp.zeros((T, Hk, D), dtype),
        jnp.zeros((T, Hk, D), dtype),
        jnp.zeros((T, Hv, D), dtype),
        jnp.zeros((T, Hv), jnp.float32),
        jnp.zeros((T, Hv), jnp.float32),
        jnp.zeros((4, 8, Hv, D, D), jnp.float32),
        jnp.int32(2),
        jnp.asarray([5, 0, 3, -1], jnp.int32),
        jnp.asarray([0, 1, 0, 0], jnp.int32),
        jnp.asarray([0, 40, 41, 42, 42], jnp.int32),
    )
    lower_for_cuda(lambda *a: gated_delta_in_place(*a, interpret=False, chunk=chunk), *args)
    assert len(verified) == 1


@pytest.mark.parametrize("H, D", [(64, 512), (4, 64)], ids=["flash", "small"])
def test_sink_attention_lowers_to_a_valid_triton_module(verified, H, D):
    """DeepSeek V4's attention over a window's and picked entries' rows, bf16 caches."""
    from pallas_kernels.sink_attention import sink_attention

    T = 8
    caches = (jnp.zeros((1024, D), jnp.bfloat16), jnp.zeros((512, D), jnp.bfloat16))
    rows = (jnp.zeros((T, 128), jnp.int32), jnp.zeros((T, 512), jnp.int32))
    args = (jnp.zeros((T, H, D), jnp.bfloat16), caches, rows, jnp.zeros((H,), jnp.float32))
    lower_for_cuda(functools.partial(sink_attention, scale=D**-0.5, interpret=False), *args)
    assert len(verified) == 1


@pytest.mark.parametrize("T, n", [(8, 4), (37, 3)])
def test_sinkhorn_lowers_to_a_valid_triton_module(verified, T, n):
    """DeepSeek V4's hyper-connection mixing matrices, every iteration in one kernel."""
    from pallas_kernels.sinkhorn import sinkhorn

    f = functools.partial(sinkhorn, iters=20, eps=1e-6, interpret=False)
    lower_for_cuda(f, jnp.zeros((T, n, n), jnp.float32))
    assert len(verified) == 1
