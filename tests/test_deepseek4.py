"""DeepSeek V4 (models/deepseek4.py) on a tiny random model that llama.cpp's own converter
made (tests/deepseek4_converted.py): its logits are transformers', over a prompt longer than
the window and an HCA block and greedy steps that close the next HCA entry; a prompt split at
any point ends in the caches and rings of one pass; the engine gives each request of a batch
its tokens alone, reuses slots from empty state and compiles nothing after warmup; and the
server answers through the official client."""

import functools
import logging

import deepseek4_converted as ds4
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from luce_jax.loading.gguf import model_config, open_gguf
from luce_jax.loading.params import load_params
from luce_jax.models import deepseek4
from luce_jax.models.family import XLA, Kernels, family_of
from luce_jax.sampling_params import SamplingParams
from luce_jax.step_format import GroupShape, Row, lower
from pallas_kernels.sink_attention import sink_attention
from pallas_kernels.sinkhorn import sinkhorn

P, T_BUCKET, MAX_CTX = 16, 256, 512
GREEDY = SamplingParams(max_tokens=ds4.GREEDY, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    f = open_gguf(ds4.gguf())
    cfg, params = load_params(f, model_config(f.metadata), "float32")
    return cfg, params


def spaces_and_tables(cfg, slots=1):
    """Each cache group's space at MAX_CTX per slot, and its tables [slots, MB] (disjoint)."""
    out = []
    for g in family_of(cfg).cache_groups(cfg, 2 * cfg.kv_size * 4):
        s = GroupShape(0, P, 0, g.tokens_per_entry, g.window)
        mb = s.blocks_for(MAX_CTX)
        tables = 1 + np.arange(slots * mb, dtype=np.int32).reshape(slots, mb)
        out.append((GroupShape(slots * mb + 1, P, mb, g.tokens_per_entry, g.window), tables))
    return out


_step = jax.jit(deepseek4.forward, static_argnums=(4, 5))


class Runner:
    """The family's forward on caches of its own: steps of rows on slots (Row.slot)."""

    def __init__(self, cfg, params, slots=1, kernels=XLA):
        self.cfg, self.params, self.groups = cfg, params, spaces_and_tables(cfg, slots)
        self.kernels = kernels
        family = family_of(cfg)
        spaces = [s for s, _ in self.groups]
        self.caches = family.init_caches(cfg, spaces, jnp.float32, jnp.float32)
        self.state = family.init_slot_state(cfg, slots)
        self.slots = slots

    def step(self, rows, fresh=()):
        """Logits at each row's last token [n, V]."""
        (_, t0), *rest = self.groups
        batch = lower(rows, t0, P, T_BUCKET, self.slots, groups=tuple((t, s) for s, t in rest))
        batch["fresh"] = np.array([r.slot in fresh for r in rows] +
                                  [0] * (self.slots - len(rows)))  # fmt: skip
        batch = {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in batch.items()}
        logits, self.caches, self.state, _ = _step(self.params, self.caches, self.state, batch,
                                                   self.cfg, self.kernels)  # fmt: skip
        return np.asarray(logits)[: len(rows)]

    def prompt(self, tokens, chunk, slot=0) -> np.ndarray:
        """The prompt in chunks of `chunk` tokens: the logits at its last token."""
        for s in range(0, len(tokens), chunk):
            out = self.step([Row(slot, tuple(tokens[s : s + chunk]), s, True)],
                            fresh=(slot,) if s == 0 else ())  # fmt: skip
        return out[0]


def test_the_file_describes_the_layers_it_holds(model, caplog):
    cfg, params = model
    own = cfg.own
    assert own.ratios == tuple(ds4.RATIOS) and own.window == ds4.CONFIG["sliding_window"]
    assert own.yarn == (16.0, 256, 32.0, 1.0) and own.hash_layers == 2
    assert cfg.expert_scoring == "sqrtsoftplus" and cfg.swiglu_limit == 1.5
    assert cfg.shared_expert_ffn_dim == ds4.CONFIG["moe_intermediate_size"]
    layers = params["layers"]
    assert layers[0]["tid2eid"].dtype == jnp.int32 and "router_bias" not in layers[0]
    assert "tid2eid" not in layers[2] and "router_bias" in layers[2]
    assert "indexer" in layers[1] and "indexer" not in layers[2] and "compressor" in layers[2]
    assert "compressor" not in layers[0] and "shexp_gate" not in layers[0]
    kinds = [(g.kind, g.tokens_per_entry, g.window) for g in
             family_of(cfg).cache_groups(cfg, 8.0 * cfg.kv_size)]  # fmt: skip
    assert kinds == [("sliding", 1, 16), ("compressed", 4, 0), ("compressed", 128, 0)]


KERNELS = Kernels(sink_attention=functools.partial(sink_attention, interpret=True),
                  sinkhorn=functools.partial(sinkhorn, interpret=True))  # fmt: skip


@pytest.mark.parametrize("kernels", [XLA, KERNELS], ids=["xla", "kernels"])
def test_logits_are_transformers_over_a_prompt_and_greedy_steps(model, kernels):
    """float32 logits at the prompt's last position and after each of 16 greedy tokens within
    1e-3 of transformers, the same greedy tokens; position 255 closes HCA entry 1 meanwhile.
    With the sink attention and Sinkhorn kernels (interpret mode) as with their references."""
    ref = ds4.reference()
    r = Runner(*model, kernels=kernels)
    prompt = ref["prompt"].tolist()
    out = [r.prompt(prompt, T_BUCKET)]
    steps = ds4.GREEDY if kernels is XLA else 3  # the kernels: the prompt and 3 decode steps
    for i in range(steps):
        tok = int(out[-1].argmax())
        out.append(r.step([Row(0, (tok,), len(prompt) + i, True)])[0])
    got = np.stack(out)
    assert got[:-1].argmax(-1).tolist() == ref["greedy"][:steps].tolist()
    np.testing.assert_allclose(got, ref["logits"][: steps + 1], atol=1e-3, rtol=0)


@pytest.mark.parametrize("chunk", [7])
def test_a_prompt_split_over_steps_ends_in_the_state_of_one_pass(model, chunk):
    """Chunks of 7 cut CSA blocks (4 tokens) and HCA blocks (128: the chunk from 126 closes
    entry 0 at 127 and runs on): the logits, every cache entry and every ring equal one
    pass's."""
    prompt = ds4.reference()["prompt"].tolist()
    whole, split = Runner(*model), Runner(*model)
    want = whole.prompt(prompt, T_BUCKET)
    got = split.prompt(prompt, chunk)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves((split.caches, split.state)),
                    jax.tree.leaves((whole.caches, whole.state)), strict=True):  # fmt: skip
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


# -- the engine ------------------------------------------------------------------------------

# the engine's and the server's shapes (the server then finds the engine's programs compiled)
ENGINE = dict(dtype="float32", cache_type_k="f32", cache_type_v="f32", max_concurrency=2,
              max_ctx=320, kv_pool_tokens=1280, prefill_chunk=16,
              prefill_token_budget=16)  # fmt: skip


@pytest.fixture(scope="module")
def engine(compile_cache):
    from luce_jax.build import load_engine
    from luce_jax.config import EngineConfig

    cfg = EngineConfig(model=str(ds4.gguf()), compile_cache_dir=compile_cache, **ENGINE)
    return cfg, *load_engine(cfg)


def test_engine_batched_equals_one_at_a_time_without_compiling(engine):
    """Requests of 130 to 170 tokens (past an HCA block) arriving at different steps on 2
    slots (some wait for one), prompts in chunks beside decode rows, give each its tokens
    alone; the
    transformers prompt gives transformers' tokens; nothing compiles after warmup."""
    from test_engine import run_schedule

    config, tok, eng = engine
    assert not eng.pool.cache and len(eng.runner.spaces) == 3
    before = eng.runner.compiles
    ref = ds4.reference()
    first = run_schedule(eng, tok, [(0, ref["prompt"].tolist(), GREEDY)])[0][0]
    assert first == ref["greedy"].tolist()
    rng = np.random.default_rng(5)
    ps = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(130, 170, 5)]
    sp = GREEDY.replace(max_tokens=6)
    alone = [run_schedule(eng, tok, [(0, p, sp)])[0][0] for p in ps]
    batched, _ = run_schedule(eng, tok, [(i * 3, p, sp) for i, p in enumerate(ps)])
    assert batched == alone
    assert eng.runner.compiles == before


def test_a_slot_reused_after_a_cancel_starts_from_empty_state(engine):
    from test_engine import run_schedule

    from luce_jax.host.request import Request
    from luce_jax.host.scheduler import Scheduler

    config, tok, eng = engine
    rng = np.random.default_rng(6)
    p, q = rng.integers(0, 1000, 180).tolist(), rng.integers(0, 1000, 133).tolist()
    alone = run_schedule(eng, tok, [(0, q, GREEDY)])[0][0]
    sched = Scheduler(eng, tok)
    a = Request(p, GREEDY.replace(max_tokens=40))
    sched.add(a)
    for _ in range(16):  # a's prompt is in, its rings hold an open HCA block
        sched.step()
    sched.cancel(a)
    b = Request(q, GREEDY)
    sched.add(b)
    while not sched.idle:
        sched.step()
    assert b.slot == a.slot and b.output_ids == alone
    eng.pool.check()
    assert eng.pool.available == eng.pool.capacity


def test_the_rings_are_reserved_beside_the_pool(engine):
    """The slot state the pool sizing reserves is every compressor ring of every slot."""
    from luce_jax.build import state_bytes

    config, tok, eng = engine
    cfg = eng.runner.cfg
    own, D, S = cfg.own, cfg.head_dim, config.max_concurrency
    rings = 2 * 4 * S * (2 * 8 * (2 * D) + 2 * 8 * (2 * own.index_dim) + 2 * 128 * D)
    assert state_bytes(cfg, config) == rings


def test_a_vision_routing_bias_is_ignored_with_a_log_line(tmp_path, caplog):
    """A file of the vision variant holds exp_probs_b_vl.bias on its layers: read past, said."""
    import gguf

    src = open_gguf(ds4.gguf())
    path = tmp_path / "vl.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek4")
    for k, v in src.metadata.items():
        if k.startswith("deepseek4.") and isinstance(v, list):
            w.add_array(k, v)
        elif k.startswith("deepseek4."):
            w.add_key_value(k, v, src.value_types[k])
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(50)])
    for name, t in src.tensors.items():  # the bytes as they are, the vocabulary cut to 50
        raw = np.asarray(src.raw(name)).reshape(*t.shape[:-1], -1)
        if name in ("token_embd.weight", "output.weight"):
            raw = raw[:50]
        w.add_tensor(name, raw, raw_dtype=t.qtype)
    w.add_tensor("blk.2.exp_probs_b_vl.bias", np.zeros(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = open_gguf(path)
    with caplog.at_level(logging.INFO, logger="luce_jax.models.deepseek4"):
        cfg, params = load_params(f, model_config(f.metadata), "float32")
    assert cfg.vocab_size == 50 and "exp_probs_b_vl" not in str(jax.tree.structure(params))
    assert "blk.2.exp_probs_b_vl.bias" in caplog.text


def test_the_converter_made_file_is_served_end_to_end():
    """`python -m luce_jax.serve --model` the file: a chat completion through the official
    client with the file's chat template, and transformers' greedy tokens for its prompt."""
    from test_converted import check_served

    ref = ds4.reference()
    e = ENGINE
    check_served(ds4.gguf(), ref["prompt"].tolist(), ref["greedy"].tolist(), e["max_ctx"],
                 e["prefill_chunk"], e["max_concurrency"], e["kv_pool_tokens"])  # fmt: skip
