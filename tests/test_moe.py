"""The qwen3moe FFN: routing, grouping by expert, the grouped matmuls, and batching invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import check_batched_equals_alone

from luce_jax.build import load_engine
from luce_jax.config import ModelConfig
from luce_jax.models import moe


def config(norm=True, E=8, k=2):
    return ModelConfig(
        "qwen3moe",
        100,
        16,
        1,
        2,
        1,
        8,
        0,
        n_experts=E,
        n_experts_used=k,
        expert_ffn_dim=12,
        expert_weights_norm=norm,
    )


def layer(E=8, d=16, F=12, seed=0):
    r = np.random.default_rng(seed)
    return {
        "router": jnp.asarray(r.standard_normal((d, E)), jnp.float32),
        "w_gu_exps": jnp.asarray(r.standard_normal((E, d, 2 * F)) * 0.3, jnp.float32),
        "w_down_exps": jnp.asarray(r.standard_normal((E, F, d)) * 0.3, jnp.float32),
    }


def dense_reference(lp, h, cfg):
    """Every expert on every token, weighted by the top-k router weights (zero elsewhere)."""
    probs = jax.nn.softmax(h @ lp["router"], axis=-1)
    w, idx = jax.lax.top_k(probs, cfg.n_experts_used)
    if cfg.expert_weights_norm:
        w = w / w.sum(-1, keepdims=True)
    full = jnp.zeros_like(probs).at[jnp.arange(h.shape[0])[:, None], idx].set(w)  # [T, E]
    gate, up = jnp.split(jnp.einsum("td,edf->tef", h, lp["w_gu_exps"]), 2, axis=-1)
    y = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, lp["w_down_exps"])
    return jnp.einsum("te,ted->td", full, y)


@pytest.mark.parametrize("norm", [True, False])
def test_route_takes_top_k_of_the_softmax_and_normalizes_as_configured(norm):
    cfg, lp = config(norm), layer()
    h = jnp.asarray(np.random.default_rng(1).standard_normal((5, 16)), jnp.float32)
    w, idx = moe.route(h, lp, cfg)
    probs = np.asarray(jax.nn.softmax(h @ lp["router"], axis=-1))
    np.testing.assert_array_equal(
        np.sort(np.asarray(idx), 1), np.sort(np.argsort(-probs, 1)[:, :2], 1)
    )
    want = np.take_along_axis(probs, np.asarray(idx), 1)
    if norm:
        want = want / want.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)


def test_grouping_is_stable_and_counts_empty_and_full_experts():
    experts = jnp.asarray([[3, 1], [3, 0], [1, 3]], jnp.int32)
    order, sizes = moe.group(experts, 5)
    assert np.asarray(sizes).tolist() == [1, 2, 0, 3, 0]
    assert np.asarray(order).tolist() == [3, 1, 4, 0, 2, 5]  # by expert, then pair index
    order, sizes = moe.group(jnp.full((4, 2), 2, jnp.int32), 5)  # every row on one expert
    assert np.asarray(sizes).tolist() == [0, 0, 8, 0, 0] and np.asarray(order).tolist() == list(
        range(8)
    )


def test_every_layers_counts_come_from_one_call():
    """expert_counts over a step's layers [L, P] at once equals each layer counted alone;
    padding pairs (expert E) count nowhere."""
    pairs = jnp.asarray([[3, 1, 5, 3], [0, 0, 2, 5]], jnp.int32)
    counts = np.asarray(moe.expert_counts(pairs, 5))
    assert counts.tolist() == [[0, 1, 0, 2, 0], [2, 0, 1, 0, 0]]
    for layer in range(2):
        assert np.asarray(moe.expert_counts(pairs[layer], 5)).tolist() == counts[layer].tolist()


def test_padding_rows_sort_last_and_join_no_expert():
    experts = jnp.asarray([[3, 1], [5, 5], [1, 3]], jnp.int32)  # token 1 is padding (route's)
    order, sizes = moe.group(experts, 5)
    assert np.asarray(sizes).tolist() == [0, 2, 0, 2, 0]  # token 1's pairs count nowhere
    assert np.asarray(order).tolist() == [1, 4, 0, 5, 2, 3]


def test_ffn_of_real_rows_ignores_padding_rows():
    """Padding rows come out zero and leave the real rows' outputs and counts unchanged."""
    cfg, lp = config(True), layer(seed=3)
    h = jnp.asarray(np.random.default_rng(3).standard_normal((6, 16)), jnp.float32)
    y, pairs = moe.ffn(lp, h, cfg, live=jnp.int32(4))
    y_real, pairs_real = moe.ffn(lp, h[:4], cfg)
    sizes, sizes_real = (moe.expert_counts(p, cfg.n_experts) for p in (pairs, pairs_real))
    np.testing.assert_allclose(np.asarray(y[:4]), np.asarray(y_real), atol=1e-6)
    assert not np.asarray(y[4:]).any()
    assert np.asarray(sizes).tolist() == np.asarray(sizes_real).tolist()
    assert int(sizes.sum()) == 4 * cfg.n_experts_used


@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("norm", [True, False])
def test_ffn_equals_every_expert_on_every_token(T, norm):
    cfg, lp = config(norm), layer(seed=T)
    h = jnp.asarray(np.random.default_rng(T).standard_normal((T, 16)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(moe.ffn(lp, h, cfg)[0]),
        np.asarray(dense_reference(lp, h, cfg)),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.fixture(scope="module")
def moe_engine(tiny_models, engine_config):
    config = engine_config.replace(model=str(tiny_models["qwen3moe"][1]))
    return config, load_engine(config)


@pytest.mark.parametrize("chunk, budget", [(128, 128), (8, 16)], ids=["unchunked", "chunk8"])
def test_moe_batched_equals_one_at_a_time(moe_engine, chunk, budget):
    config, (tok, engine) = moe_engine
    assert engine.runner.cfg.n_experts == 8
    check_batched_equals_alone(tok, engine, config, chunk, budget)


def test_engine_greedy_tokens_equal_with_pallas_and_xla_grouping(tiny_models, compile_cache):
    """The whole engine on the tiny MoE model: the kernels (interpret mode: the router's, the
    grouped matmul at prefill, expert_rows at decode) change no token."""
    from luce_jax import LLM, SamplingParams
    from luce_jax.config import EngineConfig

    from conftest import TINY_ENGINE

    assert EngineConfig().resolved("gpu").moe_backend == "pallas"  # measured faster there
    assert EngineConfig().resolved("cpu").moe_backend == "xla"  # interpret mode is slow
    prompts = ["def add(a, b):", "import os\n", "x = [1, 2, 3]\nfor i in x:"]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    out = {}
    for backend in ("xla", "pallas"):
        kw = dict(TINY_ENGINE, moe_backend=backend, quant_backend=backend,
                  compile_cache_dir=compile_cache)  # fmt: skip
        with LLM(str(tiny_models["qwen3moe"][1]), **kw) as llm:
            kernels = llm.engine.runner.kernels
            assert (kernels.quant_matmul.expert_rows is not None) == (backend == "pallas")
            out[backend] = [c.token_ids for c in llm.generate(prompts, sp)]
    assert out["pallas"] == out["xla"]


def test_step_tracer_records_tokens_per_expert_of_real_rows_only(moe_engine):
    """Each MoE layer routes every real token (not bucket padding) to k experts."""
    from test_engine import GREEDY, prompts, run_schedule

    from luce_jax.trace import StepTracer

    config, (tok, engine) = moe_engine
    tracer = StepTracer(engine)
    try:
        run_schedule(engine, tok, [(0, p, GREEDY) for p in prompts(3)], config)
    finally:
        tracer.detach()
    assert tracer.records
    for r in tracer.records:
        tokens = r.decode_rows + r.prefill_tokens
        assert len(r.expert_tokens) == 2  # one row per MoE layer, 8 experts each
        assert all(len(layer) == 8 and sum(layer) == 2 * tokens for layer in r.expert_tokens)
    # some steps were padded to their bucket, so padding rows were left out of the counts
    assert any(r.token_bucket > r.decode_rows + r.prefill_tokens for r in tracer.records)
