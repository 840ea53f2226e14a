"""The family seam (models/family.py): a third family, registered here and nowhere else, runs
through the real runner, engine and scheduler. Its rule reads two cache groups through their
block tables (a full one, and a sliding window that keeps the last W tokens in a pool far
smaller than its sequences) and a per-slot counter from its slot state, so batching, chunked
prefill, the window's released blocks and slot reuse must hand each row its own slot's cache
and state, as they do for dense and hybrid models."""

from dataclasses import dataclass

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import prompts, run_schedule

from luce_jax.config import EngineConfig, ModelConfig
from luce_jax.device.runner import Runner
from luce_jax.host.engine import StepEngine
from luce_jax.kv_sizing import kv_spaces
from luce_jax.loading.gguf import GGUFFile, model_config
from luce_jax.loading.params import load_params
from luce_jax.models import family
from luce_jax.models.family import CacheGroup, Kernels
from luce_jax.sampling_params import SamplingParams

V = 61  # the toy's vocabulary
W = 5  # its window, as its file says
SHIFT = 7  # its one weight, as its file holds it


@dataclass(frozen=True)
class CounterConfig:
    """The toy family's own ModelConfig fields."""

    window: int


class CounterFamily:
    """Next token = (this token + the slot's tokens so far + the sequence's first token + the
    token W - 1 positions back, 0 before the start + the file's shift) % V: the count is
    per-slot state (reset on a slot's first row), the first token is read back from the full
    group's paged cache, the one W - 1 back from the window group's (each written by the
    step that fed it); W comes from the file's metadata, the shift from its tensors."""

    name = "counter"
    archs = ("toy-counter",)
    rollback = "kv_length"
    prefix_cacheable = False
    device_proposers = frozenset()
    rope_scalings = ("none",)

    def read_config(self, arch, get, md, n_layers):
        return {"own": CounterConfig(window=int(get("window")))}

    def model_params(self, cfg, t):
        return {}

    def layer_params(self, cfg, i, t):
        return {"shift": t.tensor(f"blk.{i}.shift.weight", out_dtype=t.f32)}

    def tensor_shapes(self, cfg):
        return {"shift.weight": (1,)}

    def cache_groups(self, cfg, kv_bytes_per_entry):
        window = cfg.own.window
        return [CacheGroup("full", 1, 4), CacheGroup("sliding", 1, 4, window=window, block_size=4)]

    def init_caches(self, cfg, spaces, k_type, v_type):
        # a token id per position of each group: [NB, P]
        return [jnp.zeros((s.num_blocks, s.block_size), jnp.int32) for s in spaces]

    def init_slot_state(self, cfg, max_slots, proposals=0):
        return {"count": jnp.zeros((max_slots,), jnp.int32)}

    def forward(self, params, caches, slot_state, batch, cfg, kernels: Kernels, hidden=False):
        (full, window), w = caches, cfg.own.window
        Pw = window.shape[1]
        tokens, seg, pos = batch["tokens"], batch["seg_ids"], batch["positions"]
        full = full.reshape(-1).at[batch["write_idx"]].set(tokens).reshape(full.shape)
        window = window.reshape(-1).at[batch["write_idx_1"]].set(tokens).reshape(window.shape)
        slots, cu = batch["slots"], batch["cu_q_lens"]
        before = jnp.where(batch["fresh"] == 1, 0, slot_state["count"][jnp.maximum(slots, 0)])
        count = before + (cu[1:] - cu[:-1])  # [S] tokens the slot has had, this row's too
        first = full[batch["block_tables"][:, 0], 0]  # [S] each sequence's first token
        rows = batch["logit_rows"]
        q = pos[rows] - (w - 1)  # [R] the position W - 1 back: inside the window
        blk = batch["block_tables_1"][seg[rows], jnp.maximum(q, 0) // Pw]
        back = jnp.where(q >= 0, window[blk, jnp.maximum(q, 0) % Pw], 0)
        shift = params["layers"][0]["shift"][0].astype(jnp.int32)
        nxt = (tokens[rows] + count[seg[rows]] + first[seg[rows]] + back + shift) % V
        logits = jnp.where(jnp.arange(cfg.vocab_size) == nxt[:, None], 10.0, 0.0)
        oob = slot_state["count"].shape[0]  # padding rows write nowhere
        state = {"count": slot_state["count"].at[jnp.where(slots < 0, oob, slots)].set(
            count, mode="drop")}  # fmt: skip
        return logits, [full, window], state, {}


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        back = seq[len(seq) - W] if len(seq) >= W else 0
        seq.append((seq[-1] + len(seq) + seq[0] + back + SHIFT) % V)
    return seq[len(prompt) :]


def write_toy(path: str) -> None:
    """A GGUF of the toy architecture: its window in the metadata, its shift a tensor."""
    w = gguf.GGUFWriter(path, "toy-counter")
    for key, value in (
        ("block_count", 1),
        ("embedding_length", 8),
        ("vocab_size", V),
        ("attention.head_count", 1),
        ("window", W),
        ("context_length", 128),
    ):
        w.add_uint32(f"toy-counter.{key}", value)  # fmt: skip
    w.add_tensor("token_embd.weight", np.zeros((V, 8), np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float32))
    w.add_tensor("blk.0.shift.weight", np.full(1, SHIFT, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    family.register(CounterFamily())
    path = str(tmp_path_factory.mktemp("toy") / "toy.gguf")
    write_toy(path)
    f = GGUFFile(path)
    cfg, params = load_params(f, model_config(f.metadata), "float32")
    assert cfg.own == CounterConfig(W) and cfg.vocab_size == V
    config = EngineConfig(max_concurrency=4, max_ctx=128, kv_block_size=16, prefill_chunk=16,
                          prefill_token_budget=16, prefix_cache=False)  # fmt: skip
    groups = family.family_of(cfg).cache_groups(cfg, 4)
    spaces = kv_spaces(config, groups, jax.devices()[0])  # on CPU: every slot at full context
    full, window = spaces
    assert full.num_blocks == 1 + 4 * config.max_blocks_per_seq
    # the window's pool holds a window (and a step) per slot, far less than its sequences need
    assert window.num_blocks == 1 + 4 * (-(-(W + config.prefill_chunk) // 4) + 1) < full.num_blocks
    runner = Runner(cfg, params, spaces, config.max_concurrency, (jnp.int32, jnp.int32))
    eng = StepEngine(config, runner)
    runner.warmup(eng.bucket_pairs())
    return eng


def test_a_family_registered_outside_the_package_is_served_batched_as_alone(engine):
    """8 prompts of 1 to 65 tokens (chunked over 16-token steps) arriving at different steps on
    4 slots: every request gets the toy rule's tokens, as it would alone, with no compile
    after warmup and every block and slot released."""
    compiles = engine.runner.compiles
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ps = [[t % V for t in p] for p in prompts(8)]
    got, _ = run_schedule(engine, None, [(i // 2, p, sp) for i, p in enumerate(ps)],
                          check=engine.pool.check)  # fmt: skip
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
