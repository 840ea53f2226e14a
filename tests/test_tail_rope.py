"""DeepSeek V4's rotary embedding (luce_jax/models/tail_rope.py) against transformers': the
plain and YaRN frequencies of DeepseekV4RotaryEmbedding's two layer types, the rotation of a
head's trailing dims in interleaved pairs, and its inverse undoing it."""

import jax.numpy as jnp
import numpy as np
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from luce_jax.models.tail_rope import inv_freq, rope_tail, yarn_inv_freq


def test_frequencies_and_rotation_match_transformers():
    yarn = {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    }  # the brief's tiny model; Flash: 65536
    cfg = DeepseekV4Config(hidden_size=64, head_dim=48, qk_rope_head_dim=16,
                           num_attention_heads=2, max_position_embeddings=4096,
                           rope_scaling=yarn)  # fmt: skip
    emb = hf.DeepseekV4RotaryEmbedding(cfg)
    main, comp = cfg.rope_parameters["main"], cfg.rope_parameters["compress"]
    assert comp["rope_type"] == "yarn" and comp.get("attention_factor", 1.0) == 1.0
    r = 16
    np.testing.assert_allclose(inv_freq(r, main["rope_theta"]), emb.main_inv_freq.numpy(),
                               rtol=1e-6)  # fmt: skip
    want = yarn_inv_freq(r, comp["rope_theta"], 16, 256, 32, 1)
    np.testing.assert_allclose(want, emb.compress_inv_freq.numpy(), rtol=1e-6)
    assert not np.allclose(want, inv_freq(r, comp["rope_theta"]))  # YaRN changed some
    x = torch.randn(1, 2, 5, 48, generator=torch.Generator().manual_seed(0))  # [B, H, T, D]
    pos = torch.tensor([[0, 3, 7, 100, 4095]])
    with torch.no_grad():
        cos, sin = emb(x, pos, layer_type="compress")
        ref = hf.apply_rotary_pos_emb(x, cos, sin)[0].transpose(0, 1).numpy()  # [T, H, D]
    xt = jnp.asarray(x[0].transpose(0, 1).numpy())
    got = rope_tail(xt, jnp.asarray(pos[0].numpy()), want)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[..., :32], np.asarray(xt)[..., :32])
    back = rope_tail(got, jnp.asarray(pos[0].numpy()), want, inverse=True)
    np.testing.assert_allclose(np.asarray(back), np.asarray(xt), rtol=1e-5, atol=1e-5)
