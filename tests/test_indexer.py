"""DeepSeek V4's lightning indexer (luce_jax/models/indexer.py): its scores equal transformers'
DeepseekV4IndexerScorer, and its selection keeps each query's best visible entries as
transformers' DeepseekV4Indexer does, marking picks past the visible ones -1."""

import jax.numpy as jnp
import numpy as np
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from luce_jax.models.indexer import index_scores, select_entries, visible_entries


def test_scores_and_selection_match_transformers():
    cfg = DeepseekV4Config(hidden_size=32, index_n_heads=8, index_head_dim=16)
    scorer = hf.DeepseekV4IndexerScorer(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        scorer.weights_proj.weight.copy_(torch.randn(8, 32, generator=g))
    T, NE, m, k = 12, 3, 4, 2
    q = torch.randn(1, T, 8, 16, generator=g)
    keys = torch.randn(1, NE, 16, generator=g)
    x = torch.randn(1, T, 32, generator=g)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        want = scorer(q, keys, x)[0]  # [T, NE]
        w = (scorer.weights_proj(x) * scorer.weights_scaling)[0].numpy()
    n = visible_entries(jnp.arange(T), m)
    got = index_scores(jnp.asarray(q[0].numpy()), jnp.asarray(w),
                       jnp.broadcast_to(jnp.asarray(keys[0].numpy()), (T, NE, 16)), n)  # fmt: skip
    vis = np.arange(NE)[None, :] < np.asarray(n)[:, None]
    np.testing.assert_allclose(np.asarray(got)[vis], want.numpy()[vis], rtol=1e-5, atol=1e-5)
    assert np.isneginf(np.asarray(got)[~vis]).all()
    # transformers' selection: future entries at -inf, top k, picks past the threshold -1
    threshold = (pos + 1) // m
    masked = want[None].masked_fill(torch.arange(NE).view(1, 1, -1) >= threshold[..., None],
                                    float("-inf"))  # fmt: skip
    idx = masked.topk(k, dim=-1).indices
    ref = torch.where(idx >= threshold[..., None], torch.full_like(idx, -1), idx)[0].numpy()
    sel = np.asarray(select_entries(got, k, n))
    for t in range(T):  # ties only among the -inf (invisible) entries, all marked -1
        assert sorted(sel[t]) == sorted(ref[t]), (t, sel[t], ref[t])
    assert (sel[:3] == -1).all() and (sel[7:] >= 0).all()
