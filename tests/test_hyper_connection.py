"""DeepSeek V4's hyper-connections (luce_jax/models/hyper_connection.py) against transformers'
DeepseekV4HyperConnection, DeepseekV4HyperHead and the decoder layer's expansion, on random
weights: the block input, post and comb (doubly stochastic), the streams after a block and
the head's collapse agree in float32."""

import jax.numpy as jnp
import numpy as np
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from luce_jax.models.hyper_connection import hc_head, hc_post, hc_pre

N, D, T = 4, 32, 5


def config():
    return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=20, hc_eps=1e-6,
                            rms_norm_eps=1e-6)  # fmt: skip


def randomized(module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def streams(seed: int):
    return torch.randn(1, T, N, D, generator=torch.Generator().manual_seed(seed))


def test_a_site_collapses_and_expands_the_streams_as_transformers_does():
    cfg = config()
    site = randomized(hf.DeepseekV4HyperConnection(cfg), 0)
    X = streams(1)
    out = torch.randn(1, T, D, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        post, comb, collapsed = site(X)
        after = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), X)
    w = {"fn": jnp.asarray(site.fn.detach().numpy()), "base": jnp.asarray(site.base.detach()),
         "scale": jnp.asarray(site.scale.detach().numpy())}  # fmt: skip
    Xj = jnp.asarray(X[0].numpy())
    y, p, c = hc_pre(Xj, w, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_sinkhorn_iters)
    np.testing.assert_allclose(np.asarray(y), collapsed[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(p), post[0].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(c), comb[0].numpy(), rtol=1e-5, atol=1e-6)
    # doubly stochastic (columns exactly, the last pass's; rows nearly, after 20 iterations),
    # and not symmetric: the direction of the mix matters
    np.testing.assert_allclose(np.asarray(c).sum(-2), 1.0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(c).sum(-1), 1.0, atol=3e-2)
    assert np.abs(np.asarray(c) - np.swapaxes(np.asarray(c), -1, -2)).max() > 1e-3
    got = hc_post(jnp.asarray(out[0].numpy()), Xj, p, c)
    np.testing.assert_allclose(np.asarray(got), after[0].numpy(), rtol=1e-5, atol=1e-5)


def test_the_head_collapses_the_streams_as_transformers_does():
    cfg = config()
    head = randomized(hf.DeepseekV4HyperHead(cfg), 3)
    X = streams(4)
    with torch.no_grad():
        want = head(X)[0].numpy()
    w = {"fn": jnp.asarray(head.hc_fn.detach().numpy()),
         "base": jnp.asarray(head.hc_base.detach().numpy()),
         "scale": jnp.asarray(head.hc_scale.detach().numpy())}  # fmt: skip
    got = hc_head(jnp.asarray(X[0].numpy()), w, eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
