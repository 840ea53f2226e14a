"""The routing histogram a server records (--record-expert-stats) and the expert placement read
from it (--expert-placement): counts of real routed tokens per expert, the same whatever the
devices; experts stored so each device takes an even share of them, with every output as
one device's."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from luce_jax import LLM, SamplingParams
from luce_jax.config import EngineConfig
from luce_jax.expert_stats import balanced_order, device_shares, load, save
from luce_jax.loading.params import reorder_experts

PROMPTS = [list(range(5, 45)), [30, 31, 32], [7] * 21]
SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
ENGINE = dict(max_concurrency=2, max_ctx=96, prefill_chunk=16, prefill_token_budget=16,
              dtype="float32")  # fmt: skip


def test_the_placement_evens_out_a_skewed_histogram():
    rng = np.random.default_rng(0)
    counts = (rng.pareto(1.0, (3, 16)) * 100).astype(np.int64)  # a few hot experts a layer
    orders = balanced_order(counts, 4)
    assert all(sorted(o) == list(range(16)) for o in orders)  # each expert stored once
    plain = device_shares(counts, np.tile(np.arange(16), (3, 1)), 4)
    even = device_shares(counts, orders, 4)
    assert (even.max(1) <= plain.max(1)).all() and even.max() < plain.max()
    # no better split than the greedy one by more than the largest expert's share
    biggest = counts.max(1) / counts.sum(1)
    assert (even.max(1) <= 0.25 + biggest).all()


def test_bad_files_and_settings_name_the_field(tmp_path):
    path = tmp_path / "stats.json"
    save(str(path), np.ones((2, 8), np.int64))
    assert load(str(path), 2, 8).sum() == 16
    with pytest.raises(ValueError, match="^expert_placement=.*2 MoE layers of 4 experts"):
        load(str(path), 2, 4)
    (tmp_path / "other.json").write_text(json.dumps({"layers": [[1]]}))
    with pytest.raises(ValueError, match="^expert_placement=.*not a --record-expert-stats"):
        load(str(tmp_path / "other.json"), 1, 1)
    with pytest.raises(ValueError, match="^expert_placement=.*tensor_parallel=1"):
        EngineConfig(expert_placement=str(path))


def test_a_hash_routed_layer_finds_its_experts_at_their_new_places():
    """DeepSeek V4's first layers route by token id (tid2eid [V, k] of file ids): reordered,
    the table points at the stored places of the same experts."""
    E, V, k = 8, 11, 2
    rng = np.random.default_rng(1)
    lp = {"router": jnp.asarray(rng.standard_normal((4, E)), jnp.float32),
          "router_bias": jnp.arange(E, dtype=jnp.float32),
          "tid2eid": jnp.asarray(rng.integers(0, E, (V, k)), jnp.int32),
          "w_gu_exps": jnp.arange(E * 6, dtype=jnp.float32).reshape(E, 2, 3),
          "w_down_exps": jnp.arange(E * 6, dtype=jnp.float32).reshape(E, 3, 2)}  # fmt: skip
    order = rng.permutation(E)
    out = reorder_experts(lp, order)
    assert np.array_equal(order[np.asarray(out["tid2eid"])], np.asarray(lp["tid2eid"]))
    for key in ("w_gu_exps", "w_down_exps", "router_bias"):
        assert np.array_equal(np.asarray(out[key]), np.asarray(lp[key])[order])
    assert np.array_equal(np.asarray(out["router"]), np.asarray(lp["router"])[:, order])


def test_recorded_counts_and_placed_experts_serve_as_one_device(tiny_models, tmp_path):
    """One device records the histogram; two devices with experts placed from it serve the
    same tokens and record the same counts (kept in the file's expert order), though the
    experts are stored in another order."""
    path = str(tiny_models["qwen3moe"][1])
    first, again = str(tmp_path / "one.json"), str(tmp_path / "two.json")
    with LLM(path, **ENGINE, record_expert_stats=first) as llm:
        one = [o.token_ids for o in llm.generate(PROMPTS, SP)]
        k = llm.model_config.n_experts_used
    counts = load(first, 2, 8)
    fed = sum(len(p) + SP.max_tokens - 1 for p in PROMPTS)  # the last token is never fed
    assert (counts.sum(1) == fed * k).all(), counts.sum(1)
    with LLM(path, **ENGINE, tensor_parallel=2, expert_placement=first,
             record_expert_stats=again) as llm:  # fmt: skip
        two = [o.token_ids for o in llm.generate(PROMPTS, SP)]
        orders = llm.engine.runner.expert_orders
    assert two == one
    assert not (orders == np.arange(8)).all()  # stored in another order
    assert np.array_equal(load(again, 2, 8), counts)
