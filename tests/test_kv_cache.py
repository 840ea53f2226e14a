"""Quantized KV caches: ggml's q8_0 / q4_0 bit for bit, pool accounting, end-to-end agreement."""

import itertools

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants

from luce_jax import LLM, SamplingParams
from luce_jax.build import kv_cache_types
from luce_jax.config import EngineConfig, ModelConfig
from pallas_kernels import kv_cache

GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantization_equals_ggml_bit_for_bit(kind):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 2, 128)) * rng.uniform(1e-3, 50, (300, 2, 1))
    x = x.astype(np.float32)
    x[0, 0, :32] = 0  # an all-zero group: scale 0, no division by zero
    ref = quants.quantize(x, GGML[kind]).reshape(300, 2, 4, -1)  # per group: f16 d, then qs
    q = kv_cache.quantize(jnp.asarray(x), kind)
    assert kv_cache.kind(q) == kind
    np.testing.assert_array_equal(
        np.asarray(q.scale).view(np.uint8).reshape(300, 2, 4, 2), ref[..., :2]
    )
    qs = ref[..., 2:]  # q8_0: int8 values; q4_0: byte i holds values i and i + 16 of its group
    want = qs.view(np.int8) if kind == "q8_0" else np.concatenate([qs & 15, qs >> 4], axis=-1)
    got = np.asarray(kv_cache.codes(q)).reshape(300, 2, 4, 32)
    np.testing.assert_array_equal(got, want.astype(np.int32))
    deq = quants.dequantize(quants.quantize(x, GGML[kind]), GGML[kind]).reshape(x.shape)
    np.testing.assert_array_equal(np.asarray(kv_cache.dequantize(q)), deq)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_write_quantizes_rows_into_their_slots_only(kind):
    NB, P, K, D = 4, 8, 2, 64
    cache = kv_cache.init((NB, P, K, D), kind)
    rng = np.random.default_rng(1)
    first = jnp.asarray(rng.standard_normal((3, K, D)), jnp.float32)
    cache = kv_cache.write(cache, jnp.asarray([9, 10, 30]), first)
    before = np.asarray(kv_cache.dequantize(cache))
    second = jnp.asarray(rng.standard_normal((1, K, D)), jnp.float32)
    cache = kv_cache.write(cache, jnp.asarray([11]), second)
    after = np.asarray(kv_cache.dequantize(cache)).reshape(NB * P, K, D)
    want = np.asarray(kv_cache.dequantize(kv_cache.quantize(second, kind)))[0]
    np.testing.assert_array_equal(after[11], want)
    untouched = np.delete(np.arange(NB * P), 11)
    np.testing.assert_array_equal(after[untouched], before.reshape(NB * P, K, D)[untouched])


def test_pool_accounts_for_the_cache_type():
    mc = ModelConfig("qwen3", 100, 64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=96)
    per = {}
    for t in ("f32", "bf16", "q8_0", "q4_0"):
        types, (group,) = kv_cache_types(EngineConfig(cache_type_k=t, cache_type_v=t), mc)
        per[t] = group.bytes_per_token
        assert (group.kind, group.layers) == ("full", 2)
        assert types[0] == (
            t if t.startswith("q") else jnp.dtype({"f32": "float32", "bf16": "bfloat16"}[t])
        )
    values = 2 * 2 * 64 * 2  # layers x kv heads x head dim x (k, v)
    assert per == {
        "f32": values * 4,
        "bf16": values * 2,
        "q8_0": values * 34 / 32,
        "q4_0": values * 18 / 32,
    }
    _, (mixed,) = kv_cache_types(EngineConfig(cache_type_k="q8_0", cache_type_v="bf16"), mc)
    assert mixed.bytes_per_token == values / 2 * (34 / 32 + 2)


def test_quantized_kv_needs_a_head_dim_divisible_by_32():
    mc = ModelConfig("llama", 100, 64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96)
    with pytest.raises(ValueError, match="cache_type_k='q8_0'.*head dim"):
        kv_cache_types(EngineConfig(cache_type_k="q8_0"), mc)
    with pytest.raises(ValueError, match="cache_type"):
        EngineConfig(cache_type_v="q5_0")


# Measured on 2026-11-30 (CPU, XLA attention, the embedded model, 8 prompts x 32 greedy tokens,
# common prefix with bf16 KV): q8_0 kept 7 of 8 completions identical (one prompt diverges after
# 3 tokens where two tokens are 0.003 apart); q4_0 kept 2 of 8 (99 of 256). On 2026-12-05, the
# same environment's runs differed by one more q8_0 divergence (batches form as requests
# arrive), so the test asks what q8_0 promises: it parts from bf16 only at near ties.
NEAR_TIE = 0.1  # nats between the token q8_0 chose and bf16's choice, in q8_0's logprobs
PROMPTS = [
    "def add(a, b):",
    "import os\n",
    "x = [1, 2, 3]\nfor i in x:",
    "class Foo:\n    def",
    "# sort a list\n",
    "while True:",
    "print('hello')",
    "return None",
]


def test_greedy_tokens_with_quantized_kv_agree_with_bf16_kv(compile_cache):
    sp = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=5)
    out = {}
    for t in ("bf16", "q8_0", "q4_0"):
        # 16-token buckets: the prompts' chunks and 8 decode rows (fewer programs to compile)
        kw = dict(max_concurrency=8, max_ctx=128, kv_pool_tokens=1024, prefill_chunk=16)
        kw.update(prefill_token_budget=16, cache_type_k=t, cache_type_v=t)
        with LLM(compile_cache_dir=compile_cache, attention_backend="xla", **kw) as llm:
            out[t] = llm.generate(PROMPTS, sp)

    def parted(t):
        """Per prompt, the first position where `t`'s tokens leave bf16's (32: never)."""
        pairs = zip(out["bf16"], out[t], strict=True)
        return [
            sum(1 for _ in itertools.takewhile(lambda p: p[0] == p[1],
                                               zip(a.token_ids, b.token_ids, strict=True)))
            for a, b in pairs
        ]  # fmt: skip

    q8, q4 = parted("q8_0"), parted("q4_0")
    assert sum(n == 32 for n in q8) >= 5, q8
    for p, n in enumerate(q8):
        if n < 32:  # a near tie: bf16's token is within NEAR_TIE of q8_0's choice there
            chosen, top = out["q8_0"][p].logprobs[n]
            theirs = dict(top).get(out["bf16"][p].token_ids[n], -1e9)
            assert chosen - theirs <= NEAR_TIE, (p, n, chosen, top)
    assert sum(q4) >= 0.3 * 256, q4  # coarser, yet far from noise (a broken dequant gives ~0)
