"""The gated delta kernel (interpret mode) against its jnp reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import gated_delta, gated_delta_reference


def inputs(lens, T, Hk=2, Hv=4, Dk=16, Dv=16, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    cu = np.zeros(len(lens) + 1, np.int32)
    np.cumsum(lens, out=cu[1:])

    def x(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    def unit(a):  # l2-normalized, as the model feeds q and k
        return (a / jnp.linalg.norm(a.astype(jnp.float32), axis=-1, keepdims=True)).astype(dtype)

    q, k = unit(x(T, Hk, Dk)) * Dk**-0.5, unit(x(T, Hk, Dk))
    v = x(T, Hv, Dv)
    g = -jnp.asarray(rng.uniform(0.01, 1.0, (T, Hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (T, Hv)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((len(lens), Hv, Dk, Dv)) * 0.3, jnp.float32)
    return q, k, v, g, beta, h0, jnp.asarray(cu)


@pytest.mark.parametrize("chunk", [0, 16, 32], ids=["tokens", "chunk16", "chunk32"])
@pytest.mark.parametrize(
    "lens, T",
    [
        ([16], 16),  # one segment, a whole multiple of a chunk
        ([13], 16),  # not a multiple, bucket padding after it
        ([45, 3], 64),  # whole chunks, then fewer tokens than a chunk
        ([130, 2], 136),  # many chunks
        ([20, 33, 1], 64),  # two segments with whole chunks, and the chunks' parts of each
        ([5, 1, 1, 9, 1], 32),  # prompt chunks and decode rows of one step
        ([1, 1, 1, 1], 8),  # decode rows only
        ([7, 0, 0], 8),  # padding segments (no tokens)
    ],
)
def test_kernel_matches_reference(lens, T, chunk):
    args = inputs(lens, T)
    o, h = gated_delta(*args, interpret=True, chunk=chunk)
    o_ref, h_ref = gated_delta_reference(*args)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)
    assert not np.asarray(o[sum(lens) :]).any()  # padding tokens: zero output


@pytest.mark.parametrize("chunk", [0, 16])
def test_bf16_inputs_keep_a_float32_state(chunk):
    args = inputs([6, 1, 9], 16, dtype=jnp.bfloat16)
    o, h = gated_delta(*args, interpret=True, chunk=chunk)
    o_ref, h_ref = gated_delta_reference(*args)
    assert o.dtype == h.dtype == jnp.float32
    np.testing.assert_allclose(o, o_ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(h, h_ref, rtol=2e-2, atol=2e-2)


def test_a_segment_split_in_two_continues_from_its_state():
    """Running 12 tokens as 5 then 7 (the second call starting from the first's final state)
    equals running them at once: what a prompt chunked over steps relies on."""
    q, k, v, g, beta, h0, _ = inputs([12], 12)
    whole_o, whole_h = gated_delta(q, k, v, g, beta, h0, jnp.array([0, 12]), interpret=True)
    o1, h1 = gated_delta(
        q[:5], k[:5], v[:5], g[:5], beta[:5], h0, jnp.array([0, 5]), interpret=True
    )
    o2, h2 = gated_delta(
        q[5:], k[5:], v[5:], g[5:], beta[5:], h1, jnp.array([0, 7]), interpret=True
    )
    np.testing.assert_allclose(jnp.concatenate([o1, o2]), whole_o, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h2, whole_h, rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_named():
    q, k, v, g, beta, h0, cu = inputs([4], 8)
    with pytest.raises(ValueError, match="Hk=2 Hv=3"):
        gated_delta(q, k, v[:, :3], g[:, :3], beta[:, :3], h0[:, :3], cu, interpret=True)
    with pytest.raises(ValueError, match="chunk=8"):
        gated_delta(q, k, v, g, beta, h0, cu, interpret=True, chunk=8)
    with pytest.raises(ValueError, match="powers of two"):
        gated_delta(q[..., :12], k[..., :12], v, g, beta, h0[:, :, :12], cu, interpret=True)


def test_reference_equals_a_plain_python_loop():
    """The reference itself against the rule written out token by token in NumPy."""
    q, k, v, g, beta, h0, cu = inputs([3, 4], 8, Hk=1, Hv=2, Dk=4, Dv=4)
    o_ref, h_ref = gated_delta_reference(q, k, v, g, beta, h0, cu)
    q, k, v, g, beta, h = map(np.asarray, (q, k, v, g, beta, h0))
    h = h.copy()
    for s, (a, b) in enumerate([(0, 3), (3, 7)]):
        for t in range(a, b):
            for j in range(2):
                h[s, j] *= np.exp(g[t, j])
                delta = (v[t, j] - h[s, j].T @ k[t, 0]) * beta[t, j]
                h[s, j] += np.outer(k[t, 0], delta)
                np.testing.assert_allclose(o_ref[t, j], h[s, j].T @ q[t, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_ref, h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 16])
def test_a_verify_rows_proposals_get_outputs_but_not_the_kept_state(chunk):
    """n_keep: the state returned holds each segment's first n_keep tokens (the real ones);
    the proposals after them still get the outputs of running on."""
    args = inputs([6, 4, 1], 16)
    keep = jnp.array([6, 1, 1])  # a prompt chunk, a verify row with 3 proposals, a decode row
    o, h = gated_delta(*args, keep, interpret=True, chunk=chunk)
    o_all, h_all = gated_delta_reference(*args)
    o_ref, h_ref = gated_delta_reference(*args, keep)
    np.testing.assert_allclose(o, o_all, rtol=1e-5, atol=1e-5)  # outputs: as if all kept
    np.testing.assert_allclose(o_ref, o_all, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)
    q, k, v, g, beta, h0, _ = args  # the verify row's state: after its first token alone
    _, h_one = gated_delta_reference(
        q[6:7], k[6:7], v[6:7], g[6:7], beta[6:7], h0[1:2], jnp.array([0, 1])
    )
    np.testing.assert_allclose(h[1], h_one[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h[0], h_all[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [0, 16])
def test_in_place_kernel_updates_only_its_slots_rows_of_its_layer(chunk):
    """The served form: states read from and written to each segment's slot of one layer of
    the whole state array (aliased), in value-column blocks (block_v 16 of Dv 64). A fresh row
    starts from zero, a padding row (slot -1) touches nothing, a verify row keeps its first
    token's state; every other row of the array is left as it was."""
    from pallas_kernels.gated_delta import gated_delta_in_place, gated_delta_in_place_reference

    q, k, v, g, beta, _, cu = inputs([18, 4, 1, 0], 24, Dv=64, seed=3)
    rng = np.random.default_rng(4)
    state = jnp.asarray(rng.standard_normal((3, 6, 4, 16, 64)) * 0.3, jnp.float32)
    slots = jnp.array([4, 1, 0, -1], jnp.int32)
    fresh = jnp.array([0, 0, 1, 0], jnp.int32)
    keep = jnp.array([18, 1, 1, 0], jnp.int32)  # the second segment: a verify row
    args = (q, k, v, g, beta, state, jnp.int32(1), slots, fresh, cu, keep)
    o, new = gated_delta_in_place(*args, interpret=True, chunk=chunk, block_v=16)
    o_ref, new_ref = gated_delta_in_place_reference(*args)
    np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new, new_ref, rtol=1e-5, atol=1e-5)
    untouched = np.ones((3, 6), bool)
    untouched[1, [4, 1, 0]] = False
    np.testing.assert_array_equal(np.asarray(new)[untouched], np.asarray(state)[untouched])
    assert not np.allclose(new[1, 4], state[1, 4])
    # the fresh row's state is what its one token makes of zero
    _, h_fresh = gated_delta_reference(
        q[22:23], k[22:23], v[22:23], g[22:23], beta[22:23], jnp.zeros_like(state[1, :1]),
        jnp.array([0, 1]),
    )  # fmt: skip
    np.testing.assert_allclose(new[1, 0], h_fresh[0], rtol=1e-5, atol=1e-5)
