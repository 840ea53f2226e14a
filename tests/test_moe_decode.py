"""The MoE decode path (models/moe.py at decode sizes, every kernel in interpret mode): the
router kernel, the experts a (token, expert) pair at a time reading each token's one row
(`fan_out`), glu_int8_rows between gate | up and down. For every weight type the engine keeps
quantized, and for bf16 experts (expert_rows), it equals the grouped path over the same
experts dequantized (jax.lax.ragged_dot), for rows that share experts, rows whose experts are
all distinct, padding rows and one row."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants
from test_quantized_weights import load

from luce_jax.backends import served_quant_matmul
from luce_jax.models import moe
from luce_jax.models.linear import Normed, QuantMatmul
from pallas_kernels.expert_rows import expert_rows
from pallas_kernels.int8_rows import glu_int8_rows, norm_int8_rows, norm_rows
from pallas_kernels.moe_router import moe_router
from pallas_kernels.quant_matmul import quant_matmul
from pallas_kernels.quant_weight import QuantWeight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import make_model  # noqa: E402

SHAPE = dict(d=256, L=1, H=4, K=2, D=64, F=256, tied=False, E=8, k=2, Fe=256)
TYPES = ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "iq4_xs"]


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory, tiny_gguf):
    d = tmp_path_factory.mktemp("moe_types")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(make_model.SHAPES, "moe-types", SHAPE)
        for t in [*TYPES, "bf16"]:
            out[t] = str(d / f"{t}.gguf")
            make_model.write("moe-types", t, tiny_gguf, out[t])
    return out


def served(int8: bool) -> QuantMatmul:
    """The engine's quantized matmuls (backends.quant_matmul_fn) in interpret mode."""
    interp = functools.partial
    return QuantMatmul(
        interp(served_quant_matmul, int8_x=int8, interpret=True),
        norm_int8=interp(norm_int8_rows, interpret=True) if int8 else None,
        norm=None if int8 else interp(norm_rows, interpret=True),
        glu_int8=interp(glu_int8_rows, interpret=True) if int8 else None,
        expert_rows=interp(expert_rows, interpret=True),
    )


def rows(kind: str, T: int, d: int, seed: int):
    """Residual rows [T, d]: random; or all one row repeated (every row the same experts)."""
    x = jax.random.normal(jax.random.key(seed), (T, d), jnp.float32)
    return jnp.broadcast_to(x[:1], x.shape) if kind == "shared" else x


# The int8 dots decode each type its own way (each held to the reference in
# test_quant_matmul.py, experts' rows included); the whole layer runs for a type of each block
# size and of 16-value groups by default, the rest with `-m slow`. The float path decodes them
# all alike.
LAYER_TYPES = ("q8_0", "q4_k", "q6_k")
CASES = [pytest.param(t, True, id=f"{t}-int8", marks=() if t in LAYER_TYPES else pytest.mark.slow)
         for t in TYPES] + [pytest.param("q6_k", False, id="q6_k-float"),
                            pytest.param("bf16", False, id="bf16")]  # fmt: skip


@pytest.mark.parametrize("qtype, int8", CASES)
def test_the_decode_path_equals_the_grouped_path_for_every_type(moe_files, qtype, int8):
    _, cfg, params = load(moe_files[qtype], True)
    lp = params["layers"][0]
    if qtype == "bf16":  # dense experts: pallas_kernels/expert_rows.py
        assert not isinstance(lp["w_gu_exps"], QuantWeight)
        assert moe.by_rows((lp["w_gu_exps"], lp["w_down_exps"]), 16, served(False))
    else:
        assert lp["w_gu_exps"].qtype == qtype or qtype == "q4_k"  # a q4_k file's mix
    router = functools.partial(moe_router, interpret=True)
    qmm = served(int8)
    cases = [("random", 8, 5), ("shared", 8, 8)]
    if qtype == "q4_k":  # one live row: the decode step of one sequence
        cases.append(("random", 8, 1))
    for kind, T, live in cases:
        x = rows(kind, T, cfg.d_model, seed=T + live)
        nw = jnp.asarray(np.random.default_rng(live).uniform(0.5, 1.5, cfg.d_model), jnp.float32)
        h = Normed(x, nw, cfg.rms_eps)
        got, pairs = moe.ffn(lp, h, cfg, None, jnp.int32(live), qmm, router)
        # the grouped path, XLA's routing and ragged_dot over the dequantized experts
        want, want_pairs = moe.ffn(lp, h.array(), cfg, None, jnp.int32(live), None)
        np.testing.assert_array_equal(np.asarray(pairs), np.asarray(want_pairs))
        got, want = np.asarray(got), np.asarray(want)
        scale = np.abs(want).max()
        # int8 activations round as llama.cpp's q8_1 does: a few parts in a thousand; bf16
        # experts: the grouped path's dots run in bf16
        tol = 2e-2 if int8 else 1e-2 if qtype == "bf16" else 1e-4
        np.testing.assert_allclose(got[:live], want[:live], rtol=tol, atol=tol * scale)
        assert not got[live:].any()
        p = np.asarray(pairs).reshape(T, -1)[:live]
        if kind == "shared":  # every row chose the same experts
            assert (p == p[0]).all()


def test_the_experts_kernel_reads_one_row_per_token():
    """quant_matmul's fan_out: row m of the product is x's row m // fan_out times expert
    experts[m], as x repeated k times would give, and a wrong count is refused."""
    r = np.random.default_rng(0)
    E, N, K, T, k = 4, 64, 256, 3, 2
    codes = quants.quantize(r.standard_normal((E * N, K)).astype(np.float32),
                            GGMLQuantizationType.Q8_0)  # fmt: skip
    w = QuantWeight.from_rows(codes.reshape(E, N, -1), "q8_0")
    x = jnp.asarray(r.standard_normal((T, K)), jnp.float32)
    ex = jnp.asarray([0, 3, 2, 2, 1, E], jnp.int32)  # the last pair is padding
    got = quant_matmul(x, w, experts=ex, fan_out=k, interpret=True)
    want = quant_matmul(jnp.repeat(x, k, axis=0), w, experts=ex, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert not np.asarray(got)[-1].any()
    with pytest.raises(ValueError, match="fan_out"):
        quant_matmul(x, w, experts=ex[:5], fan_out=k, interpret=True)


def test_the_engine_on_the_decode_path_gives_batched_what_it_gives_alone(
    tmp_path, tiny_gguf, compile_cache
):
    """A Q4_K_M qwen35moe file (routed experts and a shared one) served with the GPU's
    backends (every kernel in interpret mode: experts a pair at a time on each token's int8
    row, the GLU's int8 rows between them; XLA's routing, as backends.moe_router_fn says why):
    two prompts at once, one of them prefilled in two chunks, get the tokens each
    gets alone, together in the engine's 8-token bucket and alone in its one-row bucket (the
    kernels compiled for one row, no padding pairs). (qwen3moe's engine runs the router kernel
    in test_moe.py; its layers' FFN is this one.)"""
    arch = "qwen35moe"
    from luce_jax import LLM, SamplingParams

    from conftest import TINY_ENGINE

    shape = dict(SHAPE, L=2, Hk=2, Hv=4, D=128, Fs=256)
    path = str(tmp_path / f"{arch}.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(make_model.SHAPES, "engine-moe", shape)
        make_model.write("engine-moe", "q4_k_m", tiny_gguf, path)
    kw = dict(TINY_ENGINE, dtype="quantized", quant_backend="pallas", moe_backend="pallas",
              quant_activations="int8", compile_cache_dir=compile_cache, max_concurrency=2,
              prefill_chunk=8, prefill_token_budget=8)  # fmt: skip
    prompts = [[5, 9, 2], list(range(3, 14))]
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with LLM(path, **kw) as llm:
        assert llm.engine.runner.kernels.quant_matmul.glu_int8 is not None
        assert llm.engine.token_buckets == [1, 8]  # alone: one row, unpadded
        together = [c.token_ids for c in llm.generate(prompts, sp)]
        alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == 5 for t in together)
