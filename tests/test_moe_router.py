"""The fused MoE router (pallas_kernels/moe_router.py): the kernel in interpret mode equals
its jnp reference, the reference equals a plain NumPy routing written from the definitions
(every scoring, ties, a selection bias, group-limited top-k, padding rows), and the kernel
lowers to a Triton module that verifies."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_router import NORM_FLOOR, moe_router, moe_router_reference


def numpy_routing(x, router, bias, *, k, scoring, renorm, scale, groups, groups_used):
    """Routing from its definitions, a row at a time, with Python's sort (stable: among equal
    scores the lower expert comes first)."""
    logits = x.astype(np.float64) @ router.astype(np.float64)
    out_w, out_e = [], []
    for row in logits:
        if scoring == "softmax":
            s = np.exp(row - row.max())
            s = s / s.sum()
        elif scoring == "sigmoid":
            s = 1 / (1 + np.exp(-row))
        else:
            s = np.sqrt(np.log1p(np.exp(row)))
        choice = s + (0 if bias is None else bias)
        E = len(s)
        eligible = set(range(E))
        if groups > 1:
            per = E // groups
            score = [sum(sorted(choice[g * per : (g + 1) * per])[-2:]) for g in range(groups)]
            best = sorted(range(groups), key=lambda g: -score[g])[:groups_used]
            eligible = {e for e in range(E) if e // per in best}
        order = sorted(eligible, key=lambda e: -choice[e])[:k]
        w = s[order]
        if renorm:
            w = w / max(w.sum(), NORM_FLOOR)
        out_w.append(w * scale)
        out_e.append(order)
    return np.array(out_w), np.array(out_e)


CASES = {
    "softmax-renorm": dict(scoring="softmax", renorm=True),
    "softmax": dict(scoring="softmax", renorm=False),
    "sigmoid-bias": dict(scoring="sigmoid", renorm=True, bias=True),
    "sqrtsoftplus-bias-scaled": dict(scoring="sqrtsoftplus", renorm=True, bias=True, scale=1.5),
    "groups": dict(scoring="sigmoid", renorm=True, bias=True, groups=4, groups_used=2),
}


def inputs(seed, T=6, d=64, E=16):
    r = np.random.default_rng(seed)
    x = r.standard_normal((T, d)).astype(np.float32)
    router = (r.standard_normal((d, E)) / 8).astype(np.float32)
    bias = (r.standard_normal(E) / 4).astype(np.float32)
    return x, router, bias


@pytest.mark.parametrize("fused_dot", [False, True], ids=["xla-dot", "fused-dot"])
@pytest.mark.parametrize("case", CASES)
def test_the_kernel_equals_the_reference_and_the_reference_the_definitions(case, fused_dot):
    opts = dict(CASES[case])
    use_bias = opts.pop("bias", False)
    kw = dict(k=4, scale=1.0, groups=1, groups_used=1) | opts
    x, router, bias = inputs(1)
    b = bias if use_bias else None
    want_w, want_e = numpy_routing(x, router, b, **kw)
    ref_w, ref_e = moe_router_reference(x, router, b, **kw)
    np.testing.assert_array_equal(np.asarray(ref_e), want_e)
    np.testing.assert_allclose(np.asarray(ref_w), want_w, rtol=1e-5, atol=1e-6)
    got_w, got_e = moe_router(jnp.asarray(x), jnp.asarray(router), b, **kw, fused_dot=fused_dot,
                              interpret=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got_e), want_e)
    np.testing.assert_allclose(np.asarray(got_w), want_w, rtol=1e-5, atol=1e-6)


def test_ties_go_to_the_lower_expert_and_padding_rows_route_nowhere():
    """Experts 1, 5 and 9 have the same router column, so every row's logits tie among them:
    both the reference and the kernel take the lowest first, as jax.lax.top_k does. Rows at or
    past `live` get expert E and weight 0."""
    x, router, _ = inputs(2, T=5)
    router[:, 5] = router[:, 9] = router[:, 1] = np.abs(router).max() * 4  # the best three
    kw = dict(k=2, scoring="softmax", renorm=False)
    ref_w, ref_e = moe_router_reference(x, router, **kw, live=3)
    got_w, got_e = moe_router(jnp.asarray(x), jnp.asarray(router), **kw, live=jnp.int32(3),
                              interpret=True)  # fmt: skip
    ties = x.sum(1) > 0  # where x . column is positive the tied experts lead
    for row in range(3):
        if ties[row]:
            assert np.asarray(ref_e)[row].tolist() == [1, 5]
    np.testing.assert_array_equal(np.asarray(got_e), np.asarray(ref_e))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(ref_w), rtol=1e-5, atol=1e-6)
    assert (np.asarray(got_e)[3:] == 16).all() and (np.asarray(got_w)[3:] == 0).all()


@pytest.mark.parametrize("fused_dot", [False, True], ids=["xla-dot", "fused-dot"])
def test_the_kernel_norms_the_residual_row_itself(fused_dot):
    """With `norm`, the router reads RMSNorm(x) * norm, as the FFN's experts do."""
    x, router, _ = inputs(3)
    nw = np.random.default_rng(4).uniform(0.5, 1.5, x.shape[1]).astype(np.float32)
    h = x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6) * nw
    kw = dict(k=3, scoring="softmax", renorm=True)
    want_w, want_e = numpy_routing(h, router, None, scale=1.0, groups=1, groups_used=1, **kw)
    got_w, got_e = moe_router(jnp.asarray(x), jnp.asarray(router), None, jnp.asarray(nw), **kw,
                              fused_dot=fused_dot, interpret=True)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got_e), want_e)
    np.testing.assert_allclose(np.asarray(got_w), want_w, rtol=1e-5, atol=1e-6)


def test_the_softmax_reference_routes_as_the_model_did():
    """Softmax with renormalization is the softmax of the top k logits (models/moe.route's
    XLA form for qwen3moe): the same experts and weights."""
    x, router, _ = inputs(5)
    logits = x @ router
    z, idx = jax.lax.top_k(logits, 4)
    w, e = moe_router_reference(x, router, k=4, scoring="softmax", renorm=True)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(idx))
    np.testing.assert_allclose(np.asarray(w), np.asarray(jax.nn.softmax(z, -1)), rtol=1e-5)


def test_bad_arguments_are_refused():
    x, router, _ = inputs(6)
    with pytest.raises(ValueError, match="scoring"):
        moe_router(x, router, k=2, scoring="relu", interpret=True)
    with pytest.raises(ValueError, match="groups"):
        moe_router(x, router, k=2, groups=3, interpret=True)


@pytest.mark.parametrize("fused_dot", [False, True], ids=["xla-dot", "fused-dot"])
@pytest.mark.parametrize("case", ["softmax-renorm", "groups"])
def test_the_router_lowers_to_a_valid_triton_module(verified, case, fused_dot):
    opts = dict(CASES[case])
    opts.pop("bias", None)
    x = jnp.zeros((8, 2048), jnp.float32)
    router = jnp.zeros((2048, 128), jnp.float32)
    norm = jnp.ones((2048,), jnp.float32)
    bias = jnp.zeros((128,), jnp.float32)

    def f(x, router, bias, norm, live):
        return moe_router(x, router, bias, norm, k=8, live=live, fused_dot=fused_dot,
                          interpret=False, **opts)  # fmt: skip

    jax.jit(f).trace(x, router, bias, norm, jnp.int32(3)).lower(lowering_platforms=("cuda",))
    assert len(verified) == 1


def test_a_hash_routed_layer_weighs_its_table_experts_as_transformers_does():
    """DeepSeek V4's first layers take their experts from a token-id table (tid2eid) and weigh
    them by the router's sqrt-softplus scores, renormalized and scaled: transformers'
    DeepseekV4HashRouter. moe.route takes that path for a layer with a table."""
    import torch
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    from luce_jax.models import moe

    cfg = DeepseekV4Config(hidden_size=32, vocab_size=50, num_experts_per_tok=3,
                           n_routed_experts=8, routed_scaling_factor=1.5)  # fmt: skip
    mod = hf.DeepseekV4HashRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) / 4)
        mod.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(50)]))
    x = torch.randn(6, 32, generator=g)
    ids = torch.tensor([3, 17, 3, 49, 0, 8])
    with torch.no_grad():
        _, want_w, want_e = mod(x, ids)
    lp = {"router": jnp.asarray(mod.weight.detach().numpy().T),
          "tid2eid": jnp.asarray(mod.tid2eid.numpy().astype(np.int32))}  # fmt: skip
    mc = SimpleNamespace(n_experts_used=3, expert_scoring="sqrtsoftplus",
                         expert_weights_norm=True, expert_weights_scale=1.5, expert_groups=1,
                         expert_groups_used=1)  # fmt: skip
    w, e = moe.route(jnp.asarray(x.numpy()), lp, mc, live=jnp.int32(5),
                     tokens=jnp.asarray(ids.numpy(), jnp.int32))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(e)[:5], want_e.numpy()[:5])
    np.testing.assert_allclose(np.asarray(w)[:5], want_w.numpy()[:5], rtol=1e-5, atol=1e-6)
    assert (np.asarray(e)[5] == 8).all() and not np.asarray(w)[5].any()  # padding
