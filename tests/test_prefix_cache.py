"""Prefix caching in the engine: reused KV blocks change no output, and are the only ones read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_engine import run_schedule

from luce_jax.build import load_engine
from luce_jax.sampling_params import SamplingParams

P = 16  # the engine's kv_block_size
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# Penalties too: a request's first row resets its slot's counts, wherever its prefill starts.
SEEDED = SamplingParams(
    max_tokens=8,
    temperature=1.0,
    seed=11,
    ignore_eos=True,
    presence_penalty=0.8,
    frequency_penalty=0.5,
)
STEM = np.random.default_rng(3).integers(0, 300, 64).tolist()
SUFFIX = np.random.default_rng(4).integers(0, 300, 64).tolist()
# Prompts sharing 0, 1, several and all full blocks of the stem, then the whole stem alone (64
# tokens: 4 full blocks, of which 3 can be shared, since the last token is always computed).
PROMPTS = [SUFFIX[:20], STEM[:16] + SUFFIX[:7], STEM[:48] + SUFFIX[:21], STEM + SUFFIX[:5], STEM]


@pytest.fixture(scope="module")
def engines(engine_config):
    """(tokenizer, engine with the cache, engine without); one compile cache serves both."""
    tok, on = load_engine(engine_config)
    _, off = load_engine(engine_config.replace(prefix_cache=False))
    return tok, on, off


def common(a, b) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fresh_cache(engine):
    engine.pool.clear_cache()
    engine.prefix_queries = engine.prefix_hits = 0


@pytest.mark.parametrize("chunk", [128, 8], ids=["unchunked", "chunk8"])
@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_outputs_equal_with_the_cache_on_and_off(engines, engine_config, chunk, sp):
    """The stem alone first, then the prompts one after another (each finds the stem's
    blocks), then all together (requests admitted in one step share nothing with each other
    but the stem): every request's tokens equal those of the engine without a cache."""
    tok, on, off = engines
    cfg = engine_config.replace(prefill_chunk=chunk, prefill_token_budget=max(chunk, 64))
    want = [run_schedule(off, tok, [(0, p, sp)], cfg)[0][0] for p in PROMPTS]
    fresh_cache(on)
    run_schedule(on, tok, [(0, STEM, sp)], cfg)
    one_by_one = []
    for p in PROMPTS:
        one_by_one.append(run_schedule(on, tok, [(0, p, sp)], cfg)[0][0])
    assert one_by_one == want
    # each finds the stem's full blocks it begins with, and computes at least its last token
    assert on.prefix_hits == sum(min(common(p, STEM), len(p) - 1) // P * P for p in PROMPTS)
    together, _ = run_schedule(on, tok, [(0, p, sp) for p in PROMPTS], cfg)
    assert together == want
    assert off.prefix_hits == 0 and off.pool.cached == 0


def test_a_chat_turn_reuses_the_previous_turns_prompt_and_output(engines, engine_config):
    """The next request repeats the last prompt and its output, then adds a turn: the output's
    full blocks whose KV is written are cached too, and its tokens equal the uncached
    engine's."""
    tok, on, off = engines
    fresh_cache(on)
    first, _ = run_schedule(on, tok, [(0, STEM[:40], GREEDY.replace(max_tokens=24))])
    follow = STEM[:40] + first[0] + SUFFIX[:9]  # 73 tokens
    outs, _ = run_schedule(on, tok, [(0, follow, GREEDY)])
    # 40 + 24 = 64 tokens, but the last output token was never fed back: 63 are written, so
    # 3 blocks are cached, not 4
    assert on.prefix_hits == 48
    assert outs[0] == run_schedule(off, tok, [(0, follow, GREEDY)], engine_config)[0][0]


def test_a_request_reads_only_the_cached_blocks_it_shares(engines, engine_config):
    """Every KV block but the ones a request will share is filled with a large value before it
    runs: its output is unchanged, so it read nothing but the shared blocks and what it wrote
    itself (positions past a sequence's length are masked, so a poisoned value there counts
    for nothing)."""
    tok, on, off = engines
    fresh_cache(on)
    prompt = STEM[:48] + SUFFIX[:10]
    want = run_schedule(off, tok, [(0, prompt, GREEDY)], engine_config)[0][0]
    run_schedule(on, tok, [(0, STEM[:50], GREEDY), (0, SUFFIX[:40], GREEDY)], engine_config)
    tokens, (keep,) = on.pool.match(prompt)
    assert len(keep) == 3 and tokens == 3 * on.block_size
    poison = np.setdiff1d(np.arange(on.pool.first.num_blocks), keep)
    on.runner.kv = jax.tree.map(
        lambda x: x.at[poison].set(1e4) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        on.runner.kv,
    )
    outs, _ = run_schedule(on, tok, [(0, prompt, GREEDY)], engine_config)
    assert outs[0] == want
    # and the poison is strong enough to show a wrong read: with the shared blocks poisoned too
    on.runner.kv = jax.tree.map(
        lambda x: x.at[jnp.asarray(keep)].set(1e4) if jnp.issubdtype(x.dtype, jnp.floating) else x,
        on.runner.kv,
    )
    bad, _ = run_schedule(on, tok, [(0, prompt, GREEDY)], engine_config)
    assert bad[0] != want
    fresh_cache(on)  # its blocks hold poison now


def test_a_request_that_asks_not_to_reuse_computes_its_whole_prompt(engines, engine_config):
    tok, on, off = engines
    fresh_cache(on)
    run_schedule(on, tok, [(0, STEM, GREEDY)], engine_config)
    hits = on.prefix_hits
    sp = GREEDY.replace(cache_prompt=False)
    outs, _ = run_schedule(on, tok, [(0, STEM + SUFFIX[:3], sp)], engine_config)
    assert on.prefix_hits == hits
    assert outs[0] == run_schedule(off, tok, [(0, STEM + SUFFIX[:3], sp)], engine_config)[0][0]


def test_a_repetition_penalty_request_computes_its_whole_prompt(engines, engine_config):
    """The repetition penalty counts every prompt token, which the device learns by prefill:
    such a request shares nothing and samples as without the cache."""
    tok, on, off = engines
    fresh_cache(on)
    sp = GREEDY.replace(repetition_penalty=1.5)
    run_schedule(on, tok, [(0, STEM, GREEDY)], engine_config)
    hits = on.prefix_hits
    outs, _ = run_schedule(on, tok, [(0, STEM + SUFFIX[:3], sp)], engine_config)
    assert on.prefix_hits == hits
    assert outs[0] == run_schedule(off, tok, [(0, STEM + SUFFIX[:3], sp)], engine_config)[0][0]
