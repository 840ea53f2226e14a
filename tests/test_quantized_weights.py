"""Weights kept in their GGUF blocks (dtype=quantized): what is loaded, what it costs in
memory, and that the model computes what the dequantized model computes."""

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dense_model import run

from luce_jax.build import keep_quantized
from luce_jax.config import EngineConfig
from luce_jax.loading.gguf import GGUFFile, model_config
from luce_jax.loading.params import load_params, weight_bytes
from luce_jax.models import dense
from luce_jax.models.family import Kernels
from luce_jax.models.linear import QuantMatmul, embed, linear, unembed
from luce_jax.step_format import GroupShape, Row
from pallas_kernels.quant_weight import QuantWeight, dequantize_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import make_model  # noqa: E402

SHAPES = {
    # 4 layers: use_more_bits picks 2 and 3, whose attn_v and ffn_down are Q6_K
    "q4-k-m": dict(d=256, L=4, H=4, K=2, D=64, F=512, tied=False),
    "tied": dict(d=256, L=1, H=4, K=2, D=64, F=256, tied=True),
    "moe": dict(d=256, L=2, H=4, K=2, D=64, F=256, tied=False, E=4, k=2, Fe=256),
    "q5-0": dict(d=128, L=1, H=2, K=1, D=64, F=256, tied=False),
}
FILE_TYPES = {"tied": "iq4_xs", "q5-0": "q5_0"}  # the others are Q4_K_M mixes


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_gguf):
    """name -> GGUF path: a Q4_K_M mix, a tied IQ4_XS model (quantized embedding table used
    as the output head), a Q4_K_M MoE and a Q5_0 model (a type no kernel keeps). The tiny
    model's 320-token vocabulary: with the real 151k-token one, the output head's rows were
    most of every step's work here."""
    d = tmp_path_factory.mktemp("quantized")
    vocab = tiny_gguf
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, shape in SHAPES.items():
            mp.setitem(make_model.SHAPES, name, shape)
            path = str(d / f"{name}.gguf")
            make_model.write(name, FILE_TYPES.get(name, "q4_k_m"), vocab, path)
            out[name] = path
    return out


def load(path, quantized):
    f = GGUFFile(path)
    cfg, params = load_params(f, model_config(f.metadata), "float32", quantized)
    return f, cfg, params


def test_a_q4_k_m_file_keeps_its_types_and_its_size(files):
    f, _, params = load(files["q4-k-m"], True)
    layers = params["layers"]
    # q, k, v of one type fuse into one block matrix; beside a Q6_K v, q and k still fuse
    assert isinstance(layers[0]["wqkv"], QuantWeight) and layers[0]["wqkv"].qtype == "q4_k"
    assert layers[0]["wqkv"].shape == (4 * 64 + 2 * 2 * 64, 256)
    qk, v = layers[2]["wqkv"]
    assert (qk.qtype, qk.shape, v.qtype, v.shape) == ("q4_k", (6 * 64, 256), "q6_k", (2 * 64, 256))
    assert [layers[i]["w_down"].qtype for i in range(4)] == ["q4_k", "q4_k", "q6_k", "q6_k"]
    assert layers[0]["w_gu"].shape == (2 * 512, 256) and params["lm_head"].qtype == "q6_k"
    assert params["embed"].qtype == "q4_k"
    file_bytes = sum(t.nbytes for t in f.tensors.values())
    assert weight_bytes(params) == file_bytes  # blocks as stored, float tensors as they are
    _, _, dequantized = load(files["q4-k-m"], False)
    assert weight_bytes(dequantized) > 5 * file_bytes  # float32 for contrast
    _, _, moe = load(files["moe"], True)  # experts: gate | up fused, down on its own
    gu, down = moe["layers"][1]["w_gu_exps"], moe["layers"][1]["w_down_exps"]
    assert (gu.qtype, gu.shape, down.qtype, down.shape) == (
        "q4_k",
        (4, 512, 256),
        "q6_k",
        (4, 256, 256),
    )


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_quantized_model_computes_what_the_dequantized_one_does(files, name):
    """Logits of a packed prefill step and a decode step from the paged cache, with weights
    kept quantized (XLA's dequantize-then-dot, expert stacks included) against weights
    dequantized at load."""
    outs = [two_steps(files[name], q) for q in (True, False)]
    scale = np.abs(outs[1]).max()
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5 * scale)


def two_steps(path, quantized, qmm=None):
    """Logits of a packed prefill step of two prompts (bucket 16) and a decode step (bucket 4:
    two tokens and two padding rows), concatenated."""
    rng = np.random.default_rng(0)
    prompts = [tuple(rng.integers(0, 1000, n).tolist()) for n in (5, 9)]
    tables = {0: (1,), 1: (2,)}
    _, cfg, params = load(path, quantized)
    kv = dense.init_kv(cfg, 4, 16, jnp.float32)
    rows = [Row(s, p, 0, True) for s, p in enumerate(prompts)]
    a, kv = run(cfg, params, kv, rows, tables, t_bucket=16, s_bucket=2, qmm=qmm)
    nxt = [Row(s, (7,), len(p), True) for s, p in enumerate(prompts)]
    b, _ = run(cfg, params, kv, nxt, tables, t_bucket=4, s_bucket=2, qmm=qmm)
    return np.concatenate([a, b])


def test_the_moe_model_with_its_kernels_computes_what_the_dequantized_one_does(files):
    """The Q4_K_M MoE on the Pallas kernel (interpret mode) where a decode step takes it: the
    prefill step (16 tokens, 32 pairs) on XLA, the decode step's projections on the vector path
    (2 live rows of 4) and its experts a (token, expert) pair at a time (8 pairs), against the
    model dequantized at load."""
    import functools

    from pallas_kernels.quant_matmul import quant_matmul

    kernel = functools.partial(quant_matmul, interpret=True)
    qmm = QuantMatmul(kernel, max_rows=8, max_pairs=8, live_rows_max=4)
    got, want = two_steps(files["moe"], True, qmm), two_steps(files["moe"], False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_prefill_steps_through_the_dequantizing_kernel_compute_what_dequantized_weights_do(
    files,
):
    """The Q4_K_M mix (Q4_K and Q6_K, a q / k / v tuple) with steps past max_rows taken by
    pallas_kernels/dequantize.py then the dot (interpret mode): the prefill step (bucket 16)
    goes there, the decode step (bucket 4) to XLA; logits against the model dequantized at
    load. The engine builds that path for the pallas quant backend."""

    from luce_jax.backends import quant_matmul_fn
    from pallas_kernels.dequantize import dequantized_matmul

    assert quant_matmul_fn("pallas").prefill is dequantized_matmul
    assert quant_matmul_fn("xla").prefill is None
    calls = []

    def prefill(x, w):
        calls.append(x.shape[0])
        return dequantized_matmul(x, w, block_n=128, values_per_program=256, interpret=True)

    qmm = QuantMatmul(None, max_rows=8, prefill=prefill)
    got, want = two_steps(files["q4-k-m"], True, qmm), two_steps(files["q4-k-m"], False)
    assert calls and set(calls) == {16}
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def test_quantized_experts_a_pair_at_a_time_compute_what_grouped_ones_do(files):
    """At decode sizes (at most max_pairs (token, expert) pairs) the experts run a pair at a
    time through quant_matmul's experts mode (interpret mode): the layer's output and its
    expert counts equal the grouped path's over dequantized experts, padding tokens give zero
    and count nowhere; above max_pairs the grouped path runs."""
    import functools

    from luce_jax.models import moe
    from pallas_kernels.quant_matmul import quant_matmul

    _, cfg, params = load(files["moe"], True)
    lp = params["layers"][1]
    qmm = QuantMatmul(functools.partial(quant_matmul, interpret=True), max_pairs=16)
    h = jax.random.normal(jax.random.key(4), (8, cfg.d_model), jnp.float32)
    live = jnp.int32(5)
    got, pairs = moe.ffn(lp, h, cfg, None, live, qmm)
    want, want_pairs = moe.ffn(lp, h, cfg, None, live, None)  # XLA's, experts dequantized
    sizes, want_sizes = (moe.expert_counts(p, cfg.n_experts) for p in (pairs, want_pairs))
    scale = np.abs(np.asarray(want)).max()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5 * scale)
    assert not np.asarray(got)[5:].any() and int(sizes.sum()) == 5 * cfg.n_experts_used
    np.testing.assert_array_equal(np.asarray(sizes), np.asarray(want_sizes))
    ws = (lp["w_gu_exps"], lp["w_down_exps"])
    assert moe.by_rows(ws, 16, qmm) and not moe.by_rows(ws, 17, qmm)
    assert not moe.by_rows(ws, 16, QuantMatmul())  # no kernel: XLA's grouped


def test_a_type_no_kernel_keeps_is_dequantized_with_one_warning_naming_it(files, caplog):
    """Q5_0 (llama.cpp's quantizer writes it where rows are not whole 256-value blocks) is
    neither refused nor kept: it loads dequantized, equal to gguf-py's values, with a warning
    that names the type and its tensors."""
    from gguf.quants import dequantize as gguf_dequantize

    with caplog.at_level("WARNING", logger="luce_jax.loading.gguf"):
        f, _, params = load(files["q5-0"], True)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "Q5_0" in warnings[0], warnings
    assert "blk.0.attn_q.weight" in warnings[0] and "cannot stay packed" in warnings[0]
    t = f.tensors["blk.0.ffn_down.weight"]
    assert t.qtype.name == "Q5_0"
    want = gguf_dequantize(f.raw(t.name).reshape(t.shape[0], -1), t.qtype)  # [out, in]
    np.testing.assert_array_equal(np.asarray(params["layers"][0]["w_down"]), want.T)


def test_a_type_no_loader_knows_is_refused_naming_the_tensor(files, monkeypatch):
    from luce_jax.loading import quants

    monkeypatch.setattr(quants, "HOST_TYPES", frozenset())
    with pytest.raises(
        ValueError, match=r"'blk\.0\.attn_q\.weight'.*unsupported GGML tensor type Q5_0"
    ):
        load(files["q5-0"], False)


def qweight(N=24, K=64, seed=0, dtype="float32"):
    from test_quant_matmul import weight

    w = weight("q8_0", N, K, seed)
    return QuantWeight(w.head, w.body, w.qtype, dtype)


def test_linear_concatenates_parts_of_any_kind():
    x = jax.random.normal(jax.random.key(0), (3, 64), jnp.float32)
    wq, dense_w = qweight(), jax.random.normal(jax.random.key(1), (64, 8), jnp.float32)
    got = linear(x, (wq, dense_w))
    ref = np.concatenate([x @ dequantize_weight(wq).T, x @ dense_w], axis=1)
    assert got.shape == (3, 32)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_the_kernel_runs_only_steps_up_to_its_row_limit():
    """Decode-sized steps go to the kernel; larger ones, without a prefill path, to XLA's
    dequantize-then-dot."""
    seen = []

    def kernel(x, w, live):
        seen.append(x.shape[0])
        return jnp.zeros((x.shape[0], w.shape[0]), jnp.float32)

    qmm, w = QuantMatmul(kernel, max_rows=4), qweight()
    assert not np.asarray(linear(jnp.ones((4, 64)), w, qmm)).any()
    assert np.asarray(linear(jnp.ones((5, 64)), w, qmm)).any()
    assert seen == [4]


def test_steps_past_the_row_limit_take_the_prefill_path():
    seen = []

    def kernel(x, w, live):
        seen.append(("kernel", x.shape[0]))
        return jnp.zeros((x.shape[0], w.shape[0]), jnp.float32)

    def prefill(x, w):
        seen.append(("prefill", x.shape[0]))
        return jnp.ones((x.shape[0], w.shape[0]), jnp.float32)

    qmm, w = QuantMatmul(kernel, max_rows=4, prefill=prefill), qweight()
    assert np.asarray(linear(jnp.ones((5, 64)), w, qmm)).all()
    assert not np.asarray(linear(jnp.ones((4, 64)), w, qmm)).any()
    assert seen == [("prefill", 5), ("kernel", 4)]


def test_only_the_smallest_bucket_passes_its_live_rows_to_the_kernel():
    """A step in a bucket past the smallest is more than half live, so the kernel's few-rows
    path would never run there: those calls get live=None and compile without it."""
    seen = []

    def kernel(x, w, live):
        seen.append((x.shape[0], live))
        return jnp.zeros((x.shape[0], w.shape[0]), jnp.float32)

    qmm, w = QuantMatmul(kernel, max_rows=64, live_rows_max=8), qweight()
    for t in (8, 16, 64):
        linear(jnp.ones((t, 64)), w, qmm, live=jnp.int32(1))
    assert [t for t, _ in seen] == [8, 16, 64]
    assert seen[0][1] is not None and seen[1][1] is None and seen[2][1] is None


def test_the_logits_rows_always_pass_their_live_count():
    """Logits rows are not token rows: a lone prompt's last token is one live row in a row
    bucket of 16, and the head's projection still gets the live count (the few-rows path)."""
    from types import SimpleNamespace

    from luce_jax.models.logits import head

    seen = []

    def kernel(x, w, live):
        seen.append((x.shape[0], live))
        return jnp.zeros((x.shape[0], w.shape[0]), jnp.float32)

    params = {"lm_head": qweight(N=40), "final_norm": jnp.ones((64,), jnp.float32)}
    batch = {"logit_rows": jnp.zeros((16,), jnp.int32),
             "logit_off": jnp.asarray([0] + [-1] * 15, jnp.int32)}  # fmt: skip
    qmm = QuantMatmul(kernel, max_rows=64, live_rows_max=8)
    logits = head(params, jnp.ones((32, 64)), batch, SimpleNamespace(rms_eps=1e-6), qmm)
    assert logits.shape == (16, 40) and seen[0][0] == 16 and int(seen[0][1]) == 1


def test_a_quantized_embedding_table_is_gathered_by_rows_and_tied_as_the_head():
    table = qweight(N=40)  # vocabulary of 40, width 64
    tokens = jnp.asarray([3, 0, 39, 3])
    full = np.asarray(dequantize_weight(table))
    np.testing.assert_array_equal(np.asarray(embed(table, tokens)), full[[3, 0, 39, 3]])
    h = jax.random.normal(jax.random.key(2), (2, 64), jnp.float32)
    np.testing.assert_allclose(unembed(h, table), h @ full.T, rtol=1e-5, atol=1e-4)


class FakeDevice:
    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}


def test_auto_keeps_quantized_weights_only_where_dequantized_ones_would_not_fit(files):
    f = GGUFFile(files["q4-k-m"])
    values = sum(t.nbytes // make_model.GGML_QUANT_SIZES[t.qtype][1]
                 * make_model.GGML_QUANT_SIZES[t.qtype][0] for t in f.tensors.values())  # fmt: skip
    assert keep_quantized("auto", f, FakeDevice(100 * values)) is False
    assert keep_quantized("auto", f, FakeDevice(values)) is True  # 2 bytes a value > 60%
    assert keep_quantized("auto", f, FakeDevice(None)) is False  # CPU: no memory statistics
    assert keep_quantized("quantized", f, FakeDevice(100 * values)) is True
    assert keep_quantized("bfloat16", f, FakeDevice(values)) is False


def test_config_names_the_quantized_choices():
    c = EngineConfig(dtype="quantized").resolved("cpu")
    assert c.dtype == "float32" and c.quant_backend == "xla"
    assert EngineConfig().resolved("gpu").quant_backend == "pallas"
    with pytest.raises(ValueError, match="quant_backend"):
        EngineConfig(quant_backend="triton")
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="q4_k")
    with pytest.raises(ValueError, match="quant_activations"):
        EngineConfig(quant_activations="fp8")


def test_quant_activations_choose_the_kernel_s_activations():
    """The engine's quantized kernel takes int8 activations unless told float."""
    from luce_jax.backends import quant_matmul_fn

    assert quant_matmul_fn("pallas").kernel.keywords == {"int8_x": True}
    assert quant_matmul_fn("pallas", "float").kernel.keywords == {"int8_x": False}
    assert quant_matmul_fn("xla").kernel is None


@pytest.mark.parametrize("qtype", ["q4_k", "q8_0"])
def test_the_engine_s_kernel_takes_int8_dots_for_the_types_they_sped_up(qtype):
    """Five live rows of a bucket of 8 (the dots branch): the engine's kernel runs Q4_K's dots
    on int8 codes (faster on the H200 at C4 and C8) and Q8_0's on the float dots (even there,
    slower at C1), bit for bit as quant_matmul does when asked so."""
    from test_quant_matmul import weight

    from luce_jax.backends import SERVED_INT8_DOTS, quant_matmul_fn
    from pallas_kernels.quant_matmul import quant_matmul

    assert SERVED_INT8_DOTS == ("q4_k",)
    w = weight(qtype, 40, 256, seed=5)
    x = jax.random.normal(jax.random.key(5), (8, 256), jnp.float32)
    kw = dict(block_n=32, vector_programs=4, min_programs=4, interpret=True)
    got = quant_matmul_fn("pallas").kernel(x, w, jnp.int32(5), **kw)
    want = quant_matmul(x, w, jnp.int32(5), int8_x=True, int8_dots=qtype == "q4_k", **kw)
    other = quant_matmul(x, w, jnp.int32(5), int8_x=True, int8_dots=qtype != "q4_k", **kw)
    np.testing.assert_array_equal(np.asarray(got)[:5], np.asarray(want)[:5])
    assert not np.array_equal(np.asarray(got)[:5], np.asarray(other)[:5])


def test_auto_activations_are_int8_on_every_backend_and_a_setting_holds():
    """The default: int8 activations for every model, dense or MoE (both measured faster:
    config.py's note); an explicit setting holds."""
    assert EngineConfig().quant_activations == "auto"
    for backend in ("cpu", "gpu"):
        assert EngineConfig().resolved(backend).quant_activations == "int8"
        cfg = EngineConfig(quant_activations="float").resolved(backend)
        assert cfg.quant_activations == "float"


def test_engine_greedy_tokens_equal_with_the_kernel_and_xla(compile_cache):
    """The embedded draft model (Q8_0, 4 layers: a trained model whose greedy tokens are no
    near-ties) kept quantized through the whole engine, the Pallas kernel (interpret mode) on
    decode steps with its default int8 activations: the same tokens as the model dequantized
    at load. One request runs 4 steps longer, alone: its steps take the kernel's one-row path.
    Measured agreement, 24 greedy tokens each of "def fib(n):", "import os\n", "class
    Stack:\n", "def add(a, b):\n": all 96 agree. (The 8-layer embedded model took 2.4x as
    long to compile here, and one of those prompts leaves its float tokens at the 17th, x
    rounded to int8 per 32 values as llama.cpp rounds it.)"""
    from luce_jax import LLM, SamplingParams
    from luce_jax.config import DEFAULT_DRAFT

    prompts = ["def fib(n):", "import os\n"]
    sp = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (8, 4)]
    out = {}
    for dtype, backend in (("quantized", "pallas"), ("float32", "xla")):
        kw = dict(max_ctx=64, max_concurrency=2, prefill_chunk=16, prefill_token_budget=16)
        kw["compile_cache_dir"] = compile_cache
        with LLM(str(DEFAULT_DRAFT), dtype=dtype, quant_backend=backend, **kw) as llm:
            out[dtype, backend] = [c.token_ids for c in llm.generate(prompts, sp)]
    assert out["quantized", "pallas"] == out["float32", "xla"]


@pytest.mark.parametrize("name", ["q4-k-m", "moe"])
def test_the_step_exports_for_rocm_with_every_pallas_kernel(files, name, verified):
    """The design names ROCm and no AMD GPU is at hand: the whole jitted step (paged attention,
    quantized matmuls, quantized experts, all Triton) exports for platform rocm with
    jax.export, and every Triton module verifies. jax lowers for rocm without its plugin, so
    nothing here is skipped."""
    import functools

    from jax import export

    from luce_jax.backends import served_quant_matmul
    from luce_jax.device.runner import Runner
    from pallas_kernels.int8_rows import glu_int8_rows, norm_int8_rows
    from pallas_kernels.moe_grouping import grouped_matmul
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.rope_write import rope_write

    _, cfg, params = load(files[name], True)
    gpu = functools.partial  # the kernels as on a GPU: Triton, not interpret mode
    runner = Runner(
        cfg, params, [GroupShape(9, 16, 8)], 4, (jnp.bfloat16, jnp.bfloat16),
        Kernels(gpu(paged_attention, interpret=False), gpu(grouped_matmul, interpret=False),
                QuantMatmul(gpu(served_quant_matmul, interpret=False, int8_x=True),
                            norm_int8=gpu(norm_int8_rows, interpret=False),
                            glu_int8=gpu(glu_int8_rows, interpret=False)),
                rope_write=gpu(rope_write, interpret=False)),
    )  # fmt: skip
    fn, args = runner.step_function(8, 4)
    triton = "__gpu$xla.gpu.triton"
    exp = export.export(
        jax.jit(fn), platforms=["rocm"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
    )(*args)  # fmt: skip
    assert exp.platforms == ("rocm",)
    module = exp.mlir_module()
    calls = module.count(f"@{triton}")
    # every layer is a call of a layer function, one per distinct weight-type mix (dense.layer)
    assert len(re.findall(r"call @layer(?:_\d+)?\(", module)) == cfg.n_layers
    layer_fns = len(re.findall(r"func\.func private @layer(?:_\d+)?\(", module))
    # attention, rope_write, qkv / out, gate-up / down
    kernels_per_layer = 3 + (2 if name == "moe" else 2)
    # every distinct Triton module was lowered here and verified (a call whose module equals
    # one lowered before, such as int8_rows of one x for two matmuls, reuses it)
    modules = set(re.findall(r'ir = "((?:[^"\\]|\\.)*)"', module))
    assert calls >= layer_fns * kernels_per_layer and len(verified) >= len(modules) > 0
    # the served kernel runs Q4_K's dots on int8 codes (backends.SERVED_INT8_DOTS)
    integer = r"tt\.dot .*xi8>.*-> tensor<\d+x\d+xi32>"
    assert any(re.search(integer, str(v.module)) for v in verified)
    # no predicate the GPU runtime would read on the host (test_engine's sampling test says why)
    assert not re.findall(r"stablehlo\.(?:case|if|while)\b", module)


def test_the_hybrid_step_exports_for_rocm_with_its_state_updated_in_place(
    tmp_path, tiny_gguf, verified
):
    """A qwen35 Q4_K_M step (decode rows, and a prompt bucket whose whole chunks take the
    chunked gated delta form) exports for rocm with every Triton module verified: one gated
    delta call a linear layer, on the whole state array (in place), and no host predicate."""
    import functools

    from jax import export

    from luce_jax.backends import served_quant_matmul
    from luce_jax.device.runner import Runner
    from pallas_kernels.gated_delta import gated_delta_in_place
    from pallas_kernels.paged_attention import paged_attention

    path = str(tmp_path / "h.gguf")
    vocab = tiny_gguf  # its 320 tokens: the vocabulary is not what this checks
    shape = dict(d=256, L=4, H=2, K=1, D=128, F=256, tied=False, Hk=2, Hv=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(make_model.SHAPES, "qwen35-tiny", shape)
        make_model.write("qwen35-tiny", "q4_k_m", vocab, path)
    _, cfg, params = load(path, True)
    gpu = functools.partial  # the kernels as on a GPU: Triton, not interpret mode
    runner = Runner(
        cfg, params, [GroupShape(9, 16, 8)], 4, (jnp.bfloat16, jnp.bfloat16),
        Kernels(gpu(paged_attention, interpret=False), None,
                QuantMatmul(gpu(served_quant_matmul, interpret=False, int8_x=True)),
                gated_delta=gpu(gated_delta_in_place, chunk=16, interpret=False)),
    )  # fmt: skip
    triton = "__gpu$xla.gpu.triton"
    for T in (8, 64):
        fn, args = runner.step_function(T, 4)
        exp = export.export(
            jax.jit(fn), platforms=["rocm"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
        )(*args)  # fmt: skip
        module = exp.mlir_module()
        state = "x".join(map(str, (sum(cfg.own.recurrent), 4, 4, 128, 128)))
        # every layer a call of a layer function (one per layer kind and weight-type mix);
        # the linear ones' gated delta runs on the whole state array, its output aliased to it
        # (the kernel writes the step's slots' rows in place)
        assert len(re.findall(r"call @layer(?:_\d+)?\(", module)) == cfg.n_layers
        deltas = len(re.findall(r"call @gated_delta_in_place(?:_\d+)?\(", module))
        assert 1 <= deltas <= sum(cfg.own.recurrent)
        kernel = [ln for ln in module.splitlines() if triton in ln and f"{state}xf32>)" in ln]
        assert kernel and all("output_operand_alias" in ln for ln in kernel)
        assert all(f"tensor<{state}xf32>)" in ln.split("->")[-1] for ln in kernel)
        assert not re.findall(r"stablehlo\.(?:case|if|while)\b", module)
    assert len(verified) > 0
