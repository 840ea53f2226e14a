"""DeepSeek V4's attention block on a sliding-window layer (luce_jax/models/
shared_kv_attention.py around pallas_kernels/sink_attention.py) equals transformers'
DeepseekV4Attention on a prompt longer than the window: the query LoRA and its norms, the
shared K = V head, interleaved rope on the trailing dims, the sinks, the output's de-rotation and
the grouped output LoRA."""

import jax.numpy as jnp
import numpy as np
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from luce_jax.models.shared_kv_attention import output, queries_and_kv
from luce_jax.models.tail_rope import inv_freq
from pallas_kernels.sink_attention import sink_attention_keys


def test_a_sliding_layer_attends_as_transformers_does():
    cfg = DeepseekV4Config(hidden_size=32, num_attention_heads=4, head_dim=16,
                           qk_rope_head_dim=8, q_lora_rank=12, o_groups=2, o_lora_rank=6,
                           sliding_window=5, num_hidden_layers=1, compress_ratios=[0])  # fmt: skip
    cfg._attn_implementation = "eager"
    attn = hf.DeepseekV4Attention(cfg, 0)
    assert attn.layer_type == "sliding_attention"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 3)
    T, W = 11, cfg.sliding_window
    x = torch.randn(1, T, 32, generator=g)
    pos = torch.arange(T)[None]
    emb = hf.DeepseekV4RotaryEmbedding(cfg)
    pe = {k: emb(x, pos, layer_type=k) for k in ("main", "compress")}
    t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= t) & (j > t - W)  # the window, this token included
    mask = torch.zeros(1, 1, T, T).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        want, _ = attn(x, pe, pos, mask)
    sd = {k: v.detach().numpy() for k, v in attn.state_dict().items()}
    lp = {"wq_a": sd["q_a_proj.weight"].T, "q_norm": sd["q_a_norm.weight"],
          "wq_b": sd["q_b_proj.weight"].T, "wkv": sd["kv_proj.weight"].T,
          "kv_norm": sd["kv_norm.weight"],
          "wo_a": sd["o_a_proj.weight"].reshape(2, 6, -1).transpose(0, 2, 1),
          "wo_b": sd["o_b_proj.weight"].T}  # fmt: skip
    lp = {k: jnp.asarray(v) for k, v in lp.items()}
    freqs = inv_freq(8, cfg.rope_parameters["main"]["rope_theta"])
    p = jnp.arange(T)
    q, _, kv = queries_and_kv(jnp.asarray(x[0].numpy()), lp, p, freqs, heads=4,
                              eps=cfg.rms_norm_eps)  # fmt: skip
    keys = jnp.broadcast_to(kv[None], (T, T, 16))
    o = sink_attention_keys(
        q, keys, jnp.asarray(visible.numpy()), jnp.asarray(sd["sinks"]), 16**-0.5
    )
    got = output(o, lp, p, freqs)
    np.testing.assert_allclose(np.asarray(got), want[0].numpy(), rtol=1e-4, atol=1e-5)
