"""bench/make_model.py's DeepSeek V4 files: the keys, tensor names and key types llama.cpp's
converter writes (so that llama-server loads them as it loads the converter's), experts kept
in MXFP4, Q2_K or Q4_K that compute what they compute dequantized, and the Flash shape at full
width (its first block) accepted by our loader."""

import sys
from pathlib import Path

import deepseek4_converted as ds4
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_deepseek4 import P, spaces_and_tables

from luce_jax.loading.gguf import GGUFFile, model_config
from luce_jax.loading.params import abstract_params, load_params
from luce_jax.models import deepseek4
from luce_jax.step_format import Row, lower

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from luce_jax.config import DEFAULT_MODEL  # noqa: E402

import make_model  # noqa: E402

VOCAB = str(DEFAULT_MODEL)  # the embedded model's 8192 tokens: the files' vocabulary


def _fields(path) -> dict:
    f = GGUFFile(path)
    return {k: t for k, t in f.value_types.items() if k.startswith("deepseek4.")}


def _layer(f: GGUFFile, i: int) -> set[str]:
    return {n.split(".", 2)[2] for n in f.tensors if n.startswith(f"blk.{i}.")}


def test_a_small_file_has_the_converters_keys_and_tensor_names(tmp_path):
    path = tmp_path / "s.gguf"
    make_model.write("deepseek4-small", "mxfp4", VOCAB, str(path))
    assert _fields(path) == _fields(ds4.gguf())  # every key, with its value type
    ours, theirs = GGUFFile(path), GGUFFile(ds4.gguf())
    assert {n for n in ours.tensors if "blk." not in n} == {
        n for n in theirs.tensors if "blk." not in n
    }
    # layer kinds: ours 0 window-only (hash-routed), 1 CSA, 2 HCA; the converter's 0 window-only,
    # 1 CSA (both hash-routed), 2 HCA
    assert _layer(ours, 0) == _layer(theirs, 0) and _layer(ours, 2) == _layer(theirs, 2)
    assert _layer(ours, 1) - {"exp_probs_b.bias"} == _layer(theirs, 1) - {"ffn_gate_tid2eid.weight"}
    assert ours.tensors["blk.1.ffn_gate_exps.weight"].qtype == gguf.GGMLQuantizationType.MXFP4


@pytest.mark.parametrize("expert_type", ["mxfp4", "q2_k"])  # Q4_K: test_quantized_weights
def test_experts_kept_in_their_blocks_compute_what_they_do_dequantized(tmp_path, expert_type):
    """A prompt and a decode row through every layer kind of the small shape: the same logits
    with the weights kept in their blocks as dequantized at load."""
    path = str(tmp_path / "s.gguf")
    make_model.write("deepseek4-small", expert_type, VOCAB, path)
    outs = []
    for quantized in (True, False):
        f = GGUFFile(path)
        cfg, params = load_params(f, model_config(f.metadata), "float32", quantized)
        assert cfg.own.ratios == (0, 4, 128, 4) and cfg.n_experts == 8
        kept = params["layers"][1]["w_gu_exps"]
        assert (type(kept).__name__ == "QuantWeight") == quantized
        groups = spaces_and_tables(cfg, slots=2)
        family = deepseek4.FAMILY
        caches = family.init_caches(cfg, [s for s, _ in groups], jnp.float32, jnp.float32)
        state = family.init_slot_state(cfg, 2)
        rows = [Row(0, tuple(range(5, 135)), 0, True), Row(1, (3,), 0, True)]
        (_, t0), *rest = groups
        batch = lower(rows, t0, P, 256, 2, groups=tuple((t, s) for s, t in rest))
        batch["fresh"] = np.ones(2, np.int32)
        batch = {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in batch.items()}
        logits, *_ = jax.jit(deepseek4.forward, static_argnums=(4,))(
            params, caches, state, batch, cfg
        )
        outs.append(np.asarray(logits))
    assert np.isfinite(outs[1]).all() and np.abs(outs[1]).max() > 0
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4 * np.abs(outs[1]).max())


def test_the_flash_shape_at_full_width_is_accepted_by_the_loader(tmp_path):
    """`--shape deepseek4-flash --type q2_k --layers 1`: Flash's first block at full width
    (4096 wide, 64 heads of 512, 256 experts of 2048 in Q2_K), read from its header as the
    server reads it before loading, its experts kept in their blocks."""
    path = tmp_path / "flash.gguf"
    make_model.write("deepseek4-flash", "q2_k", VOCAB, str(path), layers=1)
    f = GGUFFile(path)
    cfg, shapes = abstract_params(f, model_config(f.metadata), "bfloat16", quantized=True)
    assert (cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_layers) == (4096, 64, 512, 1)
    assert cfg.own.ratios == (0,) and cfg.own.index_topk == 512 and cfg.own.hash_layers == 1
    lp = shapes["layers"][0]
    assert lp["w_gu_exps"].qtype == "q2_k"
    assert lp["w_gu_exps"].shape == (256, 2 * 2048, 4096) and lp["tid2eid"].shape[1] == 6
    assert lp["wo_a"].shape == (8, 64 * 512 // 8, 1024)
