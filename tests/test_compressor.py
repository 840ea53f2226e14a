"""DeepSeek V4's compressors over packed steps (luce_jax/models/compressor.py): entries equal a
one-pass reference written from the definitions (HCA: softmax over a block's tokens per
channel; CSA: over block i-1's first halves and block i's second halves), which in turn equals
transformers' DeepseekV4HCACompressor; two sequences packed into steps cut at arbitrary points
(blocks split across steps, runs shorter than a block, a lone decode row) close the same
entries as one pass each, and a padding row writes no ring."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from luce_jax.models.compressor import closes, compress, ring_rows


def one_pass(c, z, m: int, overlap: bool):
    """Entries [n_blocks, d] of one sequence's rows c, z [L, W] (z with its bias added)."""
    L, W = c.shape
    d = W // 2 if overlap else W
    out = []
    for i in range(L // m):
        cc, zz = c[i * m : (i + 1) * m], z[i * m : (i + 1) * m]
        if overlap:
            prev_c = c[(i - 1) * m : i * m, :d] if i else np.zeros((m, d))
            prev_z = z[(i - 1) * m : i * m, :d] if i else np.full((m, d), -np.inf)
            cc = np.concatenate([prev_c, cc[:, d:]])
            zz = np.concatenate([prev_z, zz[:, d:]])
        w = np.exp(zz - zz.max(0))
        out.append((w / w.sum(0) * cc).sum(0))
    return np.asarray(out, np.float32).reshape(-1, d)


def rows(seed: int, L: int, W: int):
    r = np.random.default_rng(seed)
    return r.standard_normal((L, W)).astype(np.float32), r.standard_normal((L, W)).astype(
        np.float32
    )


def run_steps(seqs, cuts, m: int, overlap: bool, S: int = 3):
    """Feed sequences {slot: (c, z)} through steps; cuts[k] = {slot: rows in step k}. Returns
    {slot: entries in order of closing}."""
    W = next(iter(seqs.values()))[0].shape[1]
    R = ring_rows(m, overlap)
    ring_c = jnp.full((S, R, W), 7.0)  # whatever a slot held before: never read
    ring_z = jnp.full((S, R, W), 7.0)
    done = {s: 0 for s in seqs}
    got = {s: [] for s in seqs}
    for step in cuts:
        c, z, slot, pos, start, end = [], [], [], [], [], []
        for s, n in step.items():
            a = done[s]
            c.append(seqs[s][0][a : a + n])
            z.append(seqs[s][1][a : a + n])
            slot += [s] * n
            pos += list(range(a, a + n))
            start += [a] * n
            end += [a + n] * n
            done[s] += n
        pad = 64 - len(slot)  # padding rows to the end of the step's one bucket
        c.append(np.full((pad, W), 5.0, np.float32))
        z.append(np.full((pad, W), 5.0, np.float32))
        slot += [-1] * pad
        pos += [0] * pad
        start += [0] * pad
        end += [1] * pad
        arr = lambda v: jnp.asarray(np.asarray(v, np.int32))  # noqa: E731
        before = np.asarray(ring_c)
        e, ring_c, ring_z = compress(jnp.asarray(np.concatenate(c)), jnp.asarray(np.concatenate(z)),
                                     ring_c, ring_z, arr(slot), arr(pos), arr(start), arr(end),
                                     m=m, overlap=overlap)  # fmt: skip
        unused = [s for s in range(S) if s not in step]
        np.testing.assert_array_equal(np.asarray(ring_c)[unused], before[unused])
        shut = np.asarray(closes(arr(pos), m)) & (np.asarray(slot) >= 0)
        for t in np.flatnonzero(shut):
            got[slot[t]].append(np.asarray(e[t]))
    return {s: np.asarray(v, np.float32).reshape(-1, e.shape[1]) for s, v in got.items()}


@pytest.mark.parametrize("overlap, m", [(False, 8), (True, 4)], ids=["hca", "csa"])
def test_steps_cut_anywhere_close_the_entries_of_one_pass(overlap, m):
    W = 12 if overlap else 6
    seqs = {0: rows(0, 37, W), 2: rows(1, 26, W)}
    cuts = [{0: 5, 2: 11}, {0: 1, 2: 3}, {0: 13}, {0: 1, 2: 1}, {0: 9, 2: 7}, {0: 8, 2: 4}]
    assert all(sum(c.get(s, 0) for c in cuts) == len(seqs[s][0]) for s in seqs)
    got = run_steps(seqs, cuts, m, overlap)
    for s, (c, z) in seqs.items():
        want = one_pass(c, z, m, overlap)
        assert len(got[s]) == len(want) == len(c) // m
        np.testing.assert_allclose(got[s], want, rtol=1e-5, atol=1e-6)
    whole = run_steps(seqs, [{0: 37, 2: 26}], m, overlap)
    for s in seqs:
        np.testing.assert_allclose(whole[s], got[s], rtol=1e-5, atol=1e-6)


def test_the_hca_reference_is_transformers_compressor():
    """transformers' HCA compressor (its rope made the identity, its norm undone by ours) gives
    the one-pass reference's entries."""
    rates = {"heavily_compressed_attention": 8, "compressed_sparse_attention": 4}
    cfg = DeepseekV4Config(hidden_size=16, head_dim=8, compress_rates=rates)
    mod = hf.DeepseekV4HCACompressor(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g))

    class Identity(torch.nn.Module):  # the rotation by angle 0
        def forward(self, x, position_ids, layer_type):
            return torch.ones(*position_ids.shape, 2), torch.zeros(*position_ids.shape, 2)

    mod.rotary_emb = Identity()
    x = torch.randn(1, 21, 16, generator=g)
    with torch.no_grad():
        want, _ = mod(x, None, torch.arange(21)[None], None, 0)
        c = mod.kv_proj(x)[0].numpy()
        z = (mod.gate_proj(x)[0] + mod.position_bias.repeat(3, 1)[:21]).numpy()
    e = one_pass(c, z, 8, False)
    normed = e / np.sqrt((e * e).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    normed = normed * mod.kv_norm.weight.detach().numpy()
    np.testing.assert_allclose(normed, want[0, 0].numpy(), rtol=1e-5, atol=1e-5)
