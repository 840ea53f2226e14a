"""`--spec-mode dflash`: a DFlash block drafter (models/dflash.py) proposing on the device, on
dense and hybrid targets.

The drafters are random, written in llama.cpp's dflash GGUF form (models/dflash.save). The
device's proposals after every step are checked against the drafter run the plain way
(dflash.reference: one sequence, dense attention) on the target's hidden states of the whole
sequence, and the target's output against the target without speculation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mtp import (
    always_proposing,
    check_overlapped_and_unchanged,
    check_rising,
    proposals_after_each_step,
)

from luce_jax.build import load_engine
from luce_jax.config import EngineConfig
from luce_jax.loading.gguf import GGUFFile
from luce_jax.models import dflash

from conftest import TINY_ENGINE

K = 3


def drafter(target: str, path, block_size: int = 8, layers=(1, 2), seed: int = 0) -> str:
    """A random drafter for the target GGUF, reading its layer outputs `layers`."""
    from luce_jax.loading.gguf import model_config

    md = GGUFFile(target).metadata
    mc = model_config(md)
    cfg = dflash.DFlashConfig(d=mc.d_model, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96,
                              eps=1e-6, rope_base=10000.0, block_size=block_size,
                              target_layers=layers, mask_token=mc.vocab_size - 1)  # fmt: skip
    params = dflash.init(cfg, jax.random.key(seed), scale=0.2)
    dflash.save(str(path), cfg, jax.device_get(params), md, "test-dflash")
    return str(path)


@pytest.fixture(scope="module")
def engines(tiny_models, tmp_path_factory, compile_cache):
    """arch (qwen3, qwen35 or qwen35moe) -> its target with a random drafter proposing K on
    every step, and the drafter's path; built once for the module's tests."""
    from hf_gguf import hf_to_gguf, make_hf_model

    built = {}

    def get(arch):
        if arch in built:
            return built[arch]
        d = tmp_path_factory.mktemp("dflash")
        if arch == "qwen3":
            target = str(tiny_models["qwen3"][1])
        else:
            target = str(hf_to_gguf(make_hf_model(arch, seed=2), arch, d / f"{arch}.gguf"))
        draft = drafter(target, d / "drafter.gguf")
        spec = EngineConfig(model=target, compile_cache_dir=compile_cache, **TINY_ENGINE).replace(
            prefill_chunk=16, prefill_token_budget=16, spec_mode="dflash", draft=draft,
            draft_tokens=K)  # fmt: skip
        built[arch] = {"dflash": always_proposing(load_engine(spec)), "draft": draft}
        return built[arch]

    return get


# seeded sampling on the hybrid only
@pytest.mark.parametrize(
    "arch, seeded",
    [("qwen3", False), ("qwen35", False), ("qwen35", True), ("qwen35moe", False)],
    ids=["qwen3-greedy", "qwen35-greedy", "qwen35-seeded", "qwen35moe-greedy"],
)
def test_dflash_proposals_leave_the_targets_tokens_with_steps_overlapped(engines, arch, seeded,
                                                                        monkeypatch):  # fmt: skip
    """One drafter pass a step proposes for every row, the steps overlap and the tokens are the
    target's."""
    check_overlapped_and_unchanged(engines(arch)["dflash"], seeded, monkeypatch)


def reference_proposals(cfg, params, dcfg, dparams, tokens: list[int]) -> list[int]:
    """K greedy proposals after `tokens` the plain way: the target's streams at the drafter's
    layers over the whole sequence in one pass, then dflash.reference's block of K + 1 from
    the last token, over the context rows of the tokens before it."""
    from luce_jax.models.family import XLA, family_of
    from luce_jax.models.logits import project
    from luce_jax.step_format import GroupShape, Row, lower

    n, P, T = len(tokens), 16, 64  # one shape for every call: compiled once
    assert n <= T
    family = family_of(cfg)
    caches = family.init_caches(cfg, [GroupShape(T // P + 1, P, T // P)], jnp.float32,
                                jnp.float32)  # fmt: skip
    b = lower([Row(0, tuple(tokens), 0, True)], np.arange(1, T // P + 1)[None], P, T, 1)
    b["fresh"] = np.ones(1)
    b = {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in b.items()}
    state = family.init_slot_state(cfg, 1)
    *_, stats = family.forward(params, caches, state, b, cfg, XLA, dcfg.target_layers)
    h = stats["hidden"][:, : n - 1]  # [n_t, n - 1, d]: the context before the last token
    features = jnp.moveaxis(h, 0, 1).reshape(n - 1, -1)
    out = dflash.reference(dparams, dcfg, features, params["embed"], tokens[-1], K + 1)
    return jnp.argmax(project(params, out[1:], None), -1).tolist()


@pytest.mark.parametrize("arch", ["qwen3", "qwen35"])
def test_dflash_proposals_are_the_drafter_run_the_plain_way(engines, arch, monkeypatch):
    """After each step, the K proposals the device keeps for the slot are the plain drafter's
    from the whole sequence so far (its context rows written step by step, its block in one
    pass over every row's)."""
    seq, got = proposals_after_each_step(engines(arch)["dflash"], monkeypatch)
    runner = engines(arch)["dflash"][1].runner
    dcfg, dparams = dflash.load(engines(arch)["draft"], runner.cfg.d_model, runner.cfg.n_layers,
                                "float32")  # fmt: skip
    refs = {m: reference_proposals(runner.cfg, runner.params, dcfg, dparams, seq[:m])
            for m in range(22, len(seq) + 1)}  # fmt: skip
    check_rising(got, refs)


def test_drafters_this_engine_cannot_run_are_refused(tiny_gguf, tmp_path, compile_cache):
    """A DFlash2 drafter (its selector), one for another width, and a block too short for
    draft_tokens are refused at start with one line that says why."""
    from gguf import GGUFWriter

    config = EngineConfig(model=tiny_gguf, compile_cache_dir=compile_cache, **TINY_ENGINE)
    short = drafter(tiny_gguf, tmp_path / "short.gguf", block_size=3)
    with pytest.raises(ValueError, match="draft_tokens=3: the drafter's blocks hold 3 tokens"):
        load_engine(config.replace(spec_mode="dflash", draft=short, draft_tokens=3))
    deep = drafter(tiny_gguf, tmp_path / "deep.gguf", layers=(1, 99))
    with pytest.raises(ValueError, match=r"reading layers \(1, 99\)"):
        load_engine(config.replace(spec_mode="dflash", draft=deep))
    with pytest.raises(ValueError, match="needs a DFlash drafter GGUF"):
        EngineConfig(model=tiny_gguf, spec_mode="dflash")
    with pytest.raises(ValueError, match="the embedded model ships none"):
        EngineConfig(spec_mode="dflash")
    w = GGUFWriter(str(tmp_path / "dflash2.gguf"), "dflash")
    w.add_tensor("selector_hidden.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="has selector_hidden.weight .DFlash2 or DSpark"):
        dflash.load(str(tmp_path / "dflash2.gguf"), 64, 4, "float32")
