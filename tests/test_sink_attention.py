"""Attention with per-head sinks over one shared K = V head (pallas_kernels/sink_attention.py)
equals transformers' DeepSeek V4 eager attention with its sinks, masked keys included; a sink
far below the scores changes nothing and one far above them takes almost all the weight; the
kernel over keys gathered by row index equals its reference."""

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from pallas_kernels.sink_attention import sink_attention as sink_attention_kernel
from pallas_kernels.sink_attention import sink_attention_keys as sink_attention
from pallas_kernels.sink_attention import sink_attention_reference


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


@pytest.mark.parametrize("H, D", [(4, 64), (20, 32)])
def test_the_kernel_gathers_each_rows_keys_by_index(H, D):
    """Two key sets (a window's rows and entries' rows) with rows of -1 among them, some query
    rows with no key at all (the sink takes all their weight): the kernel in interpret mode
    equals the reference; heads padded to the kernel's block are never stored."""
    rng = np.random.default_rng(H)
    T, NR, NE = 6, 40, 9
    q = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    window = jnp.asarray(rng.standard_normal((NR, D)), jnp.float32)
    entries = jnp.asarray(rng.standard_normal((NE, D)), jnp.float32)
    rw = rng.integers(0, NR, (T, 5)).astype(np.int32)
    re = rng.integers(0, NE, (T, 19)).astype(np.int32)
    rw[rng.random(rw.shape) < 0.3] = -1
    re[rng.random(re.shape) < 0.5] = -1
    rw[0], re[0] = -1, -1
    sinks = jnp.asarray(rng.standard_normal(H), jnp.float32)
    args = (q, (window, entries), (jnp.asarray(rw), jnp.asarray(re)), sinks)
    want = sink_attention_reference(*args, scale=D**-0.5)
    got = sink_attention_kernel(*args, scale=D**-0.5, interpret=True)
    assert got.shape == (T, H, D)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got)[0]).max() == 0  # no keys: the sink's row carries no value
