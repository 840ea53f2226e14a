"""The experts' SwiGLU clamp (pallas_kernels/swiglu.py: DeepSeek V4's swiglu_limit) in every
path that computes a SwiGLU: equal to transformers' DeepseekV4Experts gate; the GLU kernel's
int8 rows and the grouped kernel's epilogue equal their references with it; the MoE FFN's
decode path (expert_rows) and grouped path agree with it and differ from the unclamped FFN;
the shared expert takes it; a file whose blocks disagree on the clamp is refused."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_moe import config, layer
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from luce_jax.models import moe
from luce_jax.models.linear import Gated, QuantMatmul
from pallas_kernels.expert_rows import expert_rows
from pallas_kernels.int8_rows import glu_int8_rows, glu_int8_rows_reference
from pallas_kernels.moe_grouping import grouped_matmul, grouped_matmul_reference
from pallas_kernels.swiglu import swiglu

LIMIT = 0.6


def test_the_clamp_is_transformers_experts_gate():
    experts = hf.DeepseekV4Experts(DeepseekV4Config(swiglu_limit=LIMIT))
    gu = torch.randn(9, 64, generator=torch.Generator().manual_seed(0)) * 2
    with torch.no_grad():
        want = experts._apply_gate(gu).numpy()
    gate, up = np.split(gu.numpy(), 2, axis=-1)
    got = swiglu(jnp.asarray(gate), jnp.asarray(up), LIMIT)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    plain = swiglu(jnp.asarray(gate), jnp.asarray(up))
    np.testing.assert_allclose(np.asarray(plain), np.asarray(jax.nn.silu(gate) * up), rtol=1e-6)
    assert not np.allclose(np.asarray(plain), want)


def test_the_kernels_clamp_as_their_references():
    parts = jax.random.normal(jax.random.key(1), (2, 4, 192), jnp.float32) * 3
    got = glu_int8_rows(parts, jnp.int32(3), dtype=jnp.float32, limit=LIMIT, interpret=True)
    want = glu_int8_rows_reference(parts, jnp.int32(3), jnp.float32, LIMIT)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    r = np.random.default_rng(2)
    x = jnp.asarray(r.standard_normal((20, 40)), jnp.float32)
    w = jnp.asarray(r.standard_normal((3, 40, 48)), jnp.float32)
    sz = jnp.asarray([7, 0, 11], jnp.int32)
    got = grouped_matmul(x, w, sz, swiglu=True, limit=LIMIT, interpret=True, block_m=16,
                         block_n=16, block_k=16)  # fmt: skip
    want = grouped_matmul_reference(x, w, sz, swiglu=True, limit=LIMIT)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.asarray(want), grouped_matmul_reference(x, w, sz, swiglu=True))


def test_the_moe_ffn_clamps_on_the_decode_and_grouped_paths_and_its_shared_expert():
    cfg = dataclasses.replace(config(True), swiglu_limit=LIMIT)
    cfg = dataclasses.replace(cfg, expert_ffn_dim=16)
    lp = layer(F=16, seed=4)  # expert_rows' tiles: K a multiple of 16
    h = jnp.asarray(np.random.default_rng(4).standard_normal((8, 16)) * 3, jnp.float32)
    qmm = QuantMatmul(expert_rows=functools.partial(expert_rows, interpret=True))
    assert moe.by_rows((lp["w_gu_exps"], lp["w_down_exps"]), 16, qmm)
    rows, _ = moe.ffn(lp, h, cfg, None, jnp.int32(6), qmm)
    grouped, _ = moe.ffn(lp, h, cfg, None, jnp.int32(6))
    np.testing.assert_allclose(np.asarray(rows), np.asarray(grouped), rtol=1e-4, atol=1e-5)
    unclamped, _ = moe.ffn(lp, h, dataclasses.replace(cfg, swiglu_limit=0.0), None, jnp.int32(6))
    assert not np.allclose(np.asarray(unclamped)[:6], np.asarray(grouped)[:6])
    gu = jnp.asarray(np.random.default_rng(5).standard_normal((4, 24)) * 3, jnp.float32)
    gate, up = jnp.split(gu, 2, axis=-1)
    np.testing.assert_allclose(np.asarray(Gated(gu, LIMIT).array()),
                               np.asarray(swiglu(gate, up, LIMIT)), rtol=1e-6)  # fmt: skip


def test_blocks_that_disagree_on_the_clamp_are_refused():
    meta = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 12}
    ok = moe.read_config(lambda k, d=None: {**meta, "swiglu_clamp_exp": [10.0] * 3}.get(k, d))
    assert ok["swiglu_limit"] == 10.0
    bad = {**meta, "swiglu_clamp_exp": [10.0, 10.0, 7.0]}
    with pytest.raises(ValueError, match="swiglu_clamp"):
        moe.read_config(lambda k, d=None: bad.get(k, d))
    assert moe.read_config(lambda k, d=None: meta.get(k, d))["swiglu_limit"] == 0.0
