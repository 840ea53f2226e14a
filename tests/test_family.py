"""The family seam (models/family.py): a third family, registered here and nowhere else, runs
through the real runner, engine and scheduler. Its rule reads its paged cache through the
block tables and a per-slot counter from its slot state, so batching, chunked prefill and
slot reuse must hand each row its own slot's cache and state, as they do for dense and hybrid
models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import prompts, run_schedule

from luce_jax.config import EngineConfig, ModelConfig
from luce_jax.device.runner import Runner
from luce_jax.host.engine import StepEngine
from luce_jax.models import family
from luce_jax.models.family import CacheGroup, Kernels
from luce_jax.sampling_params import SamplingParams

V = 61  # the toy's vocabulary


class CounterFamily:
    """Next token = (this token + the slot's tokens so far + the sequence's first token) % V:
    the count is per-slot state (reset on a slot's first row), the first token is read back
    from the paged cache (written there by the step that fed it)."""

    name = "counter"
    archs = ("toy-counter",)
    rollback = "kv_length"
    prefix_cacheable = False
    device_proposers = frozenset()

    def cache_groups(self, cfg, kv_bytes_per_entry):
        return [CacheGroup("full", 1, 4)]

    def init_caches(self, cfg, num_blocks, block_size, k_type, v_type):
        return jnp.zeros((num_blocks * block_size,), jnp.int32)  # a token id per position

    def init_slot_state(self, cfg, max_slots):
        return {"count": jnp.zeros((max_slots,), jnp.int32)}

    def forward(self, params, caches, slot_state, batch, cfg, kernels: Kernels, hidden=False):
        P = caches.shape[0] // params["blocks"].shape[0]
        tokens, seg = batch["tokens"], batch["seg_ids"]
        caches = caches.at[batch["write_idx"]].set(tokens)
        slots, cu = batch["slots"], batch["cu_q_lens"]
        before = jnp.where(batch["fresh"] == 1, 0, slot_state["count"][jnp.maximum(slots, 0)])
        count = before + (cu[1:] - cu[:-1])  # [S] tokens the slot has had, this row's too
        first = caches[batch["block_tables"][:, 0] * P]  # [S] each sequence's first token
        rows = batch["logit_rows"]
        nxt = (tokens[rows] + count[seg[rows]] + first[seg[rows]]) % cfg.vocab_size
        logits = jnp.where(jnp.arange(cfg.vocab_size) == nxt[:, None], 10.0, 0.0)
        oob = slot_state["count"].shape[0]  # padding rows write nowhere
        state = {"count": slot_state["count"].at[jnp.where(slots < 0, oob, slots)].set(
            count, mode="drop")}  # fmt: skip
        return logits, caches, state, {}


def expected(prompt: list[int], n: int) -> list[int]:
    out, last, count = [], prompt[-1], len(prompt)
    for _ in range(n):
        last = (last + count + prompt[0]) % V
        out.append(last)
        count += 1
    return out


@pytest.fixture(scope="module")
def engine():
    family.register(CounterFamily())
    cfg = ModelConfig(arch="toy-counter", vocab_size=V, d_model=8, n_layers=1, n_heads=1,
                      n_kv_heads=1, head_dim=8, ffn_dim=8)  # fmt: skip
    config = EngineConfig(max_concurrency=4, max_ctx=128, kv_block_size=16, prefill_chunk=16,
                          prefill_token_budget=16, prefix_cache=False)  # fmt: skip
    blocks = 1 + 4 * config.max_blocks_per_seq
    params = {"blocks": jnp.zeros((blocks,), jnp.int32)}  # its one "weight": the pool's size
    runner = Runner(cfg, params, blocks, config.kv_block_size, config.max_concurrency,
                    config.max_blocks_per_seq, (jnp.int32, jnp.int32))  # fmt: skip
    eng = StepEngine(config, runner, blocks)
    runner.warmup(eng.bucket_pairs())
    return eng


def test_a_family_registered_outside_the_package_is_served_batched_as_alone(engine):
    """8 prompts of 1 to 65 tokens (chunked over 16-token steps) arriving at different steps on
    4 slots: every request gets the toy rule's tokens, as it would alone, with no compile
    after warmup and every block and slot released."""
    compiles = engine.runner.compiles
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ps = [[t % V for t in p] for p in prompts(8)]
    got, _ = run_schedule(engine, None, [(i // 2, p, sp) for i, p in enumerate(ps)])
    assert got == [expected(p, 6) for p in ps]
    assert engine.runner.compiles == compiles
    assert not any(map(engine.slots.live, range(engine.slot_count)))
    assert isinstance(jax.tree.leaves(engine.runner.state["model"])[0], jax.Array)
    assert np.all(np.asarray(engine.outputs.lag) == 0)


def test_an_architecture_has_one_family():
    from luce_jax.models import dense

    qwen3 = ModelConfig("qwen3", V, 8, 1, 1, 1, 8, 8)
    assert family.family_of(qwen3) is dense.FAMILY
    with pytest.raises(ValueError, match="qwen3"):
        family.register(type("Other", (CounterFamily,), {"name": "other", "archs": ("qwen3",)})())
    with pytest.raises(ValueError, match="rollback"):
        family.register(type("Bad", (CounterFamily,), {"rollback": "undo"})())
