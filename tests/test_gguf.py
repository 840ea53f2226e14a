"""GGUF reading: metadata and tensors, and the errors that name what is wrong."""

import numpy as np
import pytest
from gguf import GGUFWriter

from luce_jax.loading.gguf import GGUFFile, model_config
from luce_jax.loading.params import load_params


def test_header_matches_gguf_reader(tiny_models):
    from gguf import GGUFReader

    path = tiny_models["qwen2"][1]
    ours, ref = GGUFFile(path), GGUFReader(str(path))
    assert set(ours.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(reversed(t.shape.tolist())) and mine.qtype == t.tensor_type
        np.testing.assert_array_equal(ours.raw(t.name), np.asarray(t.data).view(np.uint8).ravel())
    assert ours.metadata["general.architecture"] == "qwen2"
    assert ours.metadata["tokenizer.ggml.tokens"][ord("!")] == "!"


def test_config_fields(tiny_models):
    cfg = model_config(GGUFFile(tiny_models["qwen3"][1]).metadata)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (4, 2, 32)  # head_dim from key_length
    assert cfg.qk_norm and not cfg.attn_bias and cfg.rope_neox
    cfg2 = model_config(GGUFFile(tiny_models["qwen2"][1]).metadata)
    assert cfg2.attn_bias and not cfg2.qk_norm
    assert not model_config(GGUFFile(tiny_models["llama"][1]).metadata).rope_neox


def test_unknown_architecture_is_named(tmp_path):
    w = GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="mamba"):
        model_config(GGUFFile(tmp_path / "x.gguf").metadata)


def test_missing_tensor_is_named(tiny_models, tmp_path):
    f = GGUFFile(tiny_models["qwen3"][1])
    del f.tensors["blk.1.ffn_up.weight"]
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight"):
        load_params(f, model_config(f.metadata), "float32")


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFFile(p)
