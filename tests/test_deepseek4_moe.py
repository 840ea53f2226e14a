"""DeepSeek V4's MoE FFN through models/moe.ffn (XLA's grouped path, and the decode pair path
for dense experts) equals transformers' DeepseekV4SparseMoeBlock on a hash-routed layer and a
biased sqrt-softplus top-k layer: routing, weights scaled by 1.5, the clamped SwiGLU of the
routed experts and of the ungated shared expert."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from luce_jax.config import ModelConfig
from luce_jax.models import moe
from luce_jax.models.linear import QuantMatmul
from pallas_kernels.expert_rows import expert_rows

D, E, K, F, V = 32, 8, 3, 16, 50


def hf_block(layer: int):
    cfg = DeepseekV4Config(hidden_size=D, num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"],
                           n_routed_experts=E, num_experts_per_tok=K, moe_intermediate_size=F,
                           swiglu_limit=0.7, vocab_size=V)  # fmt: skip
    block = hf.DeepseekV4SparseMoeBlock(cfg, layer)
    g = torch.Generator().manual_seed(layer)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (2 if "proj" in name else 1))
        if block.is_hash:
            block.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K]
                                                  for _ in range(V)]))  # fmt: skip
        else:
            block.gate.e_score_correction_bias.copy_(torch.randn(E, generator=g))
    return block


def params(block) -> dict:
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gu = sd["experts.gate_up_proj"]  # [E, 2F, D]: gate rows then up rows
    lp = {"router": sd["gate.weight"].T, "w_gu_exps": gu.transpose(0, 2, 1),
          "w_down_exps": sd["experts.down_proj"].transpose(0, 2, 1),
          "w_gu_shexp": np.concatenate([sd["shared_experts.gate_proj.weight"].T,
                                        sd["shared_experts.up_proj.weight"].T], axis=1),
          "w_down_shexp": sd["shared_experts.down_proj.weight"].T}  # fmt: skip
    if block.is_hash:
        lp["tid2eid"] = sd["gate.tid2eid"].astype(np.int32)
    else:
        lp["router_bias"] = sd["gate.e_score_correction_bias"]
    return {k: jnp.asarray(v) for k, v in lp.items()}


@pytest.mark.parametrize("layer", [0, 1], ids=["hash", "top-k"])
def test_the_ffn_is_transformers_block(layer):
    block = hf_block(layer)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 8, D, generator=g)
    ids = torch.randint(0, V, (1, 8), generator=g)
    with torch.no_grad():
        want = block(x, ids)[0].numpy()
    cfg = ModelConfig("deepseek4", V, D, 1, 1, 1, D, 0, n_experts=E, n_experts_used=K,
                      expert_ffn_dim=F, expert_weights_norm=True, expert_scoring="sqrtsoftplus",
                      expert_weights_scale=1.5, shared_expert_ffn_dim=F,
                      swiglu_limit=0.7)  # fmt: skip
    lp, h, tok = params(block), jnp.asarray(x[0].numpy()), jnp.asarray(ids[0].numpy(), jnp.int32)
    got, _ = moe.ffn(lp, h, cfg, tokens=tok)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    qmm = QuantMatmul(expert_rows=functools.partial(expert_rows, interpret=True))
    rows, _ = moe.ffn(lp, h, cfg, live=jnp.int32(8), qmm=qmm, tokens=tok)
    np.testing.assert_allclose(np.asarray(rows), want, rtol=1e-4, atol=1e-4)
    loose, _ = moe.ffn(lp, h, dataclasses.replace(cfg, swiglu_limit=0.0), tokens=tok)
    assert not np.allclose(np.asarray(loose), want, atol=1e-3)
