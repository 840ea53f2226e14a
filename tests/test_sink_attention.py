"""Attention with per-head sinks over one shared K = V head (luce_jax/models/sink_attention.py)
equals transformers' DeepSeek V4 eager attention with its sinks, masked keys included; a sink
far below the scores changes nothing and one far above them takes almost all the weight."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from luce_jax.models.sink_attention import sink_attention


def test_sinks_join_the_denominator_as_transformers_does():
    g = torch.Generator().manual_seed(0)
    T, H, N, D = 5, 4, 7, 16
    q = torch.randn(1, H, T, D, generator=g)
    kv = torch.randn(1, 1, N, D, generator=g)
    sinks = torch.randn(H, generator=g)
    valid = torch.rand(T, N, generator=g) > 0.3
    valid[:, 0] = True
    mask = torch.zeros(1, 1, T, N).masked_fill(~valid[None, None], float("-inf"))
    module = SimpleNamespace(num_key_value_groups=H, sinks=sinks, training=False)
    want, _ = hf.eager_attention_forward(module, q, kv, kv, mask, D**-0.5)  # [1, T, H, D]
    keys = jnp.broadcast_to(jnp.asarray(kv[0, 0].numpy()), (T, N, D))
    qj = jnp.asarray(q[0].transpose(0, 1).numpy())
    got = sink_attention(qj, keys, jnp.asarray(valid.numpy()), jnp.asarray(sinks.numpy()), D**-0.5)
    np.testing.assert_allclose(np.asarray(got), want[0].numpy(), rtol=1e-5, atol=1e-5)
    plain = sink_attention(qj, keys, jnp.asarray(valid.numpy()), jnp.full((H,), -1e4), D**-0.5)
    loud = sink_attention(qj, keys, jnp.asarray(valid.numpy()), jnp.full((H,), 1e4), D**-0.5)
    p = torch.softmax((q[0] @ kv[0, 0].T * D**-0.5).masked_fill(~valid[None], -torch.inf), -1)
    np.testing.assert_allclose(np.asarray(plain), (p @ kv[0, 0]).transpose(0, 1).numpy(),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert np.abs(np.asarray(loud)).max() < 1e-6
