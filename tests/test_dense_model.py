"""The dense forward against HF transformers, and packed/paged invariances."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from luce_jax.loading.gguf import GGUFFile, model_config
from luce_jax.loading.params import load_params
from luce_jax.models import dense
from luce_jax.step_format import Row, lower

P = 16  # block size


def load(path):
    f = GGUFFile(path)
    return load_params(f, model_config(f.metadata), "float32")


def run(cfg, params, kv, rows, tables, t_bucket=None, s_bucket=None, max_blocks=16, qmm=None):
    """Run one step over `rows` (block tables: slot -> blocks; qmm: dense.forward's
    quant_matmul); returns (logits at each row's last token [n, V], kv)."""
    arr = np.zeros((max(tables) + 1, max_blocks), np.int32)
    for slot, blocks in tables.items():
        arr[slot, : len(blocks)] = blocks
    n_tok = sum(len(r.tokens) for r in rows)
    batch = lower(rows, arr, P, t_bucket or n_tok, s_bucket or len(rows))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    fwd = functools.partial(dense.forward, quant_matmul=qmm)
    logits, kv, _ = jax.jit(fwd, static_argnums=(3,))(params, kv, batch, cfg)
    return np.asarray(logits)[: len(rows)], kv


@pytest.fixture(scope="module")
def linear_rope_llama(tmp_path_factory):
    from hf_gguf import hf_to_gguf, make_hf_model

    m = make_hf_model("llama", seed=3, rope_scaling={"rope_type": "linear", "factor": 4.0})
    return m, hf_to_gguf(m, "llama", tmp_path_factory.mktemp("rope") / "llama-linear.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe", "llama-linear-rope"])
def test_logits_match_hf_over_prompt_and_16_greedy_steps(tiny_models, linear_rope_llama, arch):
    hf, path = linear_rope_llama if arch == "llama-linear-rope" else tiny_models[arch]
    cfg, params = load(path)
    assert cfg.arch == arch.split("-")[0]
    assert (cfg.rope_scaling == "linear") == arch.endswith("rope")
    prompt = [5, 77, 300, 12, 9, 140, 33, 250, 61, 2, 99]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(16):  # HF greedy continuation, recomputed in full each time
            logits = hf(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
        ref = hf(torch.tensor([seq])).logits[0].numpy()  # [len, V]
    kv = dense.init_kv(cfg, 8, P, jnp.float32)
    table = (3, 1, 6)  # scattered physical blocks
    # prefill: logits of every prompt position, one row per position via a 1-token segment each
    out, kv = run(cfg, params, kv, [Row(0, tuple(prompt), 0, True)], {0: table})
    diffs = [np.abs(out[0] - ref[len(prompt) - 1]).max()]
    for i in range(len(prompt), len(seq)):
        out, kv = run(cfg, params, kv, [Row(0, (seq[i],), i, True)], {0: table})
        diffs.append(np.abs(out[0] - ref[i]).max())
        assert int(out[0].argmax()) == (seq[i + 1] if i + 1 < len(seq) else int(ref[i].argmax()))
    assert max(diffs) <= 1e-3, diffs


def test_packed_equals_per_sequence_and_paged_equals_contiguous(tiny_gguf):
    cfg, params = load(tiny_gguf)
    rng = np.random.default_rng(0)
    prompts = [tuple(rng.integers(0, 300, n).tolist()) for n in (5, 17, 1, 33)]
    # alone, with contiguous blocks starting at 1
    alone = []
    for p in prompts:
        kv = dense.init_kv(cfg, 8, P, jnp.float32)
        table = tuple(range(1, 1 + -(-len(p) // P)))
        out, _ = run(cfg, params, kv, [Row(0, p, 0, True)], {0: table})
        alone.append(out[0])
    # packed together, shuffled physical blocks, padded token and row buckets
    free = rng.permutation(np.arange(1, 12)).tolist()
    rows, tables = [], {}
    for s, p in enumerate(prompts):
        nb = -(-len(p) // P)
        rows.append(Row(s, p, 0, True))
        tables[s], free = tuple(free[:nb]), free[nb:]
    kv = dense.init_kv(cfg, 12, P, jnp.float32)
    out, kv = run(cfg, params, kv, rows, tables, t_bucket=64, s_bucket=8)
    for a, b in zip(alone, out, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    # a second step continuing every sequence from the paged cache matches too
    nxt = []
    for r in rows:  # a full last block needs one more block for the new token
        if len(r.tokens) % P == 0:
            tables[r.slot] += (free.pop(),)
        nxt.append(Row(r.slot, (7,), len(r.tokens), True))
    out2, _ = run(cfg, params, kv, nxt, tables, t_bucket=8, s_bucket=4)
    for p, o in zip(prompts, out2, strict=True):
        kv1 = dense.init_kv(cfg, 8, P, jnp.float32)
        table = tuple(range(1, 1 + -(-(len(p) + 1) // P)))
        ref, _ = run(cfg, params, kv1, [Row(0, p + (7,), 0, True)], {0: table})
        np.testing.assert_allclose(o, ref[0], atol=1e-4, rtol=1e-4)
