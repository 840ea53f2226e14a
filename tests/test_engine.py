"""The dense engine driven by the scheduler: batching must not change any sequence's tokens."""

import logging

import numpy as np
import pytest

from luce_jax.build import load_engine
from luce_jax.device.bucket_runs import first_runs
from luce_jax.host.request import Request
from luce_jax.host.scheduler import Scheduler
from luce_jax.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(engine_config):
    return load_engine(engine_config)


def run_schedule(engine, tok, arrivals, config=None, check=None):
    """arrivals: list of (step index, prompt ids, SamplingParams); check: called after every
    step. Returns token ids per request."""
    if config is not None:
        engine.config = config
    sched = Scheduler(engine, tok, max_queue=max(256, len(arrivals)))  # arrivals may outpace
    reqs = [Request(list(p), sp) for _, p, sp in arrivals]
    pending = sorted((a[0], i) for i, a in enumerate(arrivals))
    step = 0
    while pending or not sched.idle:
        while pending and pending[0][0] <= step:
            sched.add(reqs[pending.pop(0)[1]])
        sched.step()
        if check is not None:
            check()
        step += 1
        assert step < 1000
    engine.pool.check()
    assert engine.pool.available == engine.pool.capacity  # everything released
    return [r.output_ids for r in reqs], sched


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [3, 40, 17, 1, 65, 16, 9, 33][:n]
    return [rng.integers(0, 300, k).tolist() for k in lengths]


@pytest.mark.parametrize(
    "chunk, budget",
    [(128, 128), (32, 64), (8, 16), (5, 32)],
    ids=["unchunked", "chunk32", "chunk8-below-block", "chunk5-odd"],
)
def test_batched_equals_one_at_a_time(loaded, engine_config, chunk, budget):
    tok, engine = loaded
    check_batched_equals_alone(tok, engine, engine_config, chunk, budget)


def check_batched_equals_alone(tok, engine, config, chunk, budget):
    """8 prompts alone, then 8 requests on 4 slots arriving at different steps (queueing and
    slot reuse): every request's greedy tokens are the same."""
    cfg = config.replace(prefill_chunk=chunk, prefill_token_budget=budget)
    ps = prompts(8)
    alone = [run_schedule(engine, tok, [(0, p, GREEDY)], cfg)[0][0] for p in ps]
    arrivals = [(i // 2 * 3, p, GREEDY) for i, p in enumerate(ps)]
    batched, _ = run_schedule(engine, tok, arrivals, cfg)
    assert batched == alone
    assert all(len(t) == GREEDY.max_tokens for t in alone)


def test_no_compiles_after_warmup_across_a_random_run(loaded, engine_config):
    tok, engine = loaded
    before = engine.runner.compiles
    rng = np.random.default_rng(5)
    arrivals = []
    for i in range(12):
        n = int(rng.integers(1, 90))
        sp = SamplingParams(
            max_tokens=int(rng.integers(1, 30)),
            temperature=float(rng.choice([0.0, 0.8])),
            top_p=float(rng.choice([1.0, 0.9])),
            logprobs=int(rng.choice([0, 3])) or None,
            seed=i,
        )
        arrivals.append((int(rng.integers(0, 20)), rng.integers(0, 300, n).tolist(), sp))
    outs, _ = run_schedule(engine, tok, arrivals, engine_config)
    assert all(outs)
    assert engine.runner.compiles == before


def test_first_runs_at_start_up_leave_no_trace(loaded, engine_config):
    """Start-up on a GPU runs each bucket once on an all-padding step (bucket_runs.first_runs),
    so that no request pays a program's first run: that compiles nothing, holds no block, and
    leaves the cache as it was: the same requests (the second time from the prefix cache,
    whose blocks the padding steps must not have touched) give the same tokens."""
    tok, engine = loaded
    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    arrivals = [(0, p, GREEDY) for p in prompts(3)] + [(1, prompts(5)[4], sampled)]
    before, _ = run_schedule(engine, tok, arrivals, engine_config)
    compiles = engine.runner.compiles
    first_runs(engine.runner, engine.bucket_pairs())
    assert engine.runner.compiles == compiles
    engine.pool.check()
    assert engine.pool.available == engine.pool.capacity
    after, _ = run_schedule(engine, tok, arrivals, engine_config)
    assert after == before


def test_prompt_steps_can_compile_without_cuda_graphs(loaded, engine_config, monkeypatch):
    """--cuda-graph-max-tokens N: step buckets of more than N tokens compile with XLA's options
    that form no CUDA graph (their launch is not held up by a graph update), smaller ones with
    the defaults; 0 keeps the defaults everywhere. The options reach the compiler, and a
    runner built with them gives the same tokens."""
    import dataclasses

    import jax

    from luce_jax.device.programs import NO_GRAPHS, graph_options

    assert graph_options(0, 512, 8) is None
    assert graph_options(64, 64, 8) is None
    assert graph_options(64, 128, 8) == NO_GRAPHS
    tok, engine = loaded
    assert engine.runner.programs.options(512, 8) is None  # the default: 0
    arrivals = [(0, p, GREEDY) for p in prompts(3)]
    before, _ = run_schedule(engine, tok, arrivals, engine_config)
    cfg = dataclasses.replace(engine_config, cuda_graph_max_tokens=16)
    seen, compile_ = [], jax.stages.Lowered.compile

    def compile_and_note(self, compiler_options=None):
        seen.append(compiler_options)
        return compile_(self, compiler_options=compiler_options)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_and_note)
    tok2, other = load_engine(cfg)
    monkeypatch.undo()
    pairs = other.bucket_pairs()
    assert {t for t, _ in pairs} > {8, 16} and max(t for t, _ in pairs) > 16
    for t, s in pairs:
        assert other.runner.programs.options(t, s) == (NO_GRAPHS if t > 16 else None)
    big = sum(t > 16 for t, _ in pairs)
    assert seen.count(NO_GRAPHS) == big and len(seen) > big  # sampling: the defaults
    after, _ = run_schedule(other, tok2, arrivals, cfg)
    assert after == before


def test_no_sampling_program_branches_on_the_device(loaded):
    """XLA:GPU reads a lax.cond's (or a while loop's) predicate on the host, so dispatching a
    program that holds one waits for the work queued before it: on the H200 a prefix-cached
    request's sampling launch waited 14 ms for its forward pass, and the host could never run
    a step ahead of the device. Every sampling variant, lowered for CUDA, holds none; the host
    picks the variant, and each one the steps use was compiled at warmup. No variant sorts (a
    sort of a split vocabulary gathers it): the filtered ones halve each row's cut 32 times,
    a count and a sum each, only where asked."""
    import re

    import jax

    from luce_jax.device.sampling import CUT_BITS

    _, engine = loaded
    runner = engine.runner
    keys = list(runner.sample_programs._exec)
    assert {(f, lp) for _, _, f, lp, _ in keys} == {(f, lp) for f in (0, 1) for lp in (0, 1)}
    assert not any(propose for *_, propose in keys)  # no draft head, no variant running one
    reduces = {}
    for key in keys:
        fn, args = runner.sample_function(*key)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert not re.findall(r"stablehlo\.(?:case|if|while|sort)\b", text), key
        reduces[key] = text.count("stablehlo.reduce")
    for (R, S, filtered, lp, p), n in reduces.items():
        if filtered:
            assert n >= reduces[(R, S, 0, lp, p)] + 2 * (32 // CUT_BITS), (R, S, lp)


def test_seeded_sampling_is_reproducible_under_batching(loaded, engine_config):
    tok, engine = loaded
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    p = prompts(3)
    alone = run_schedule(engine, tok, [(0, p[1], sp)], engine_config)[0][0]
    other = SamplingParams(max_tokens=12, temperature=0.7, seed=99)
    mixed = run_schedule(
        engine, tok, [(0, p[0], other), (0, p[1], sp), (1, p[2], other)], engine_config
    )[0]
    assert mixed[1] == alone


def test_max_ctx_is_clamped_to_the_model_context(caplog):
    """Clamped with a warning when asked for, quietly (INFO) when it is the default."""

    from luce_jax.build import fit_to_model
    from luce_jax.config import EngineConfig, ModelConfig

    mc = ModelConfig("qwen3", 100, 64, 2, 4, 2, 16, 96, context_length=2048)
    with caplog.at_level(logging.INFO, logger="luce_jax.build"):
        assert fit_to_model(EngineConfig(), mc).max_ctx == 2048  # the default 4096
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        assert fit_to_model(EngineConfig(max_ctx=8192), mc).max_ctx == 2048
        assert caplog.records[-1].levelno == logging.WARNING
    assert fit_to_model(EngineConfig(max_ctx=1024), mc).max_ctx == 1024


def kv_pool_blocks(c, dev, per_token, reserved=0, weights=0):
    """Blocks (the sink included) of a one-group pool of `per_token` bytes a token."""
    from luce_jax.kv_sizing import kv_spaces
    from luce_jax.models.family import CacheGroup

    (space,) = kv_spaces(c, [CacheGroup("full", 1, per_token)], dev, reserved, weights)
    assert space.max_blocks == c.max_blocks_per_seq and space.block_size == c.kv_block_size
    return space.num_blocks


def test_kv_pool_sizing():
    from luce_jax.config import EngineConfig

    class Dev:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    c = EngineConfig(max_ctx=1024, kv_block_size=16, kv_pool_tokens=1100)
    # whole blocks for any split over the slots (one partial block each) + the sink
    assert kv_pool_blocks(c, Dev(None), 100) == 69 + c.max_concurrency - 1 + 1
    auto = c.replace(kv_pool_tokens=0)
    gib = 2**30
    stats = {"bytes_limit": 10 * gib, "bytes_in_use": 2 * gib}
    blocks = kv_pool_blocks(auto, Dev(stats), 1024)  # 16 KiB per block
    assert blocks - 1 == int((10 * gib * 0.92 - 2 * gib) // (1024 * 16))
    with pytest.raises(ValueError, match="max_ctx=1024"):
        kv_pool_blocks(auto, Dev({"bytes_limit": gib, "bytes_in_use": gib - 2**20}), 1024)


def test_the_pool_is_the_same_size_on_every_start(caplog):
    """Two starts whose allocators report a few MB more or less in use (as the H200 did) get
    one pool size, so the restart's programs are the ones the compile cache holds; an
    allocator holding far more than the weights is counted, with a warning."""
    from luce_jax.config import EngineConfig
    from luce_jax.kv_sizing import ALLOCATOR_SLACK

    class Dev:
        def __init__(self, in_use):
            self.in_use = in_use

        def memory_stats(self):
            return {"bytes_limit": 100 * 2**30, "bytes_in_use": self.in_use}

    c = EngineConfig(max_ctx=1024, kv_block_size=16, kv_pool_tokens=0)
    weights, per_token = 5 * 2**30, 147456  # an 8B model's bf16 KV per token
    sizes = {kv_pool_blocks(c, Dev(weights + mb * 2**20), per_token, 2**28, weights)
             for mb in (3, 38, 500)}  # fmt: skip
    assert len(sizes) == 1
    free = 100 * 2**30 * 0.92 - weights - ALLOCATOR_SLACK - 2**28
    assert sizes.pop() - 1 == int(free // (per_token * 16))
    with caplog.at_level(logging.WARNING, logger="luce_jax.build"):
        more = kv_pool_blocks(c, Dev(weights + 3 * 2**30 + 5), per_token, 2**28, weights)
    assert "in use besides the weights" in caplog.text
    assert more - 1 == int((100 * 2**30 * 0.92 - 9 * 2**30 - 2**28) // (per_token * 16))


def test_too_long_prompt_fails_alone(loaded, engine_config):
    tok, engine = loaded
    events = []
    sched = Scheduler(engine, tok)
    bad = Request(list(range(200)), GREEDY, events.append)
    good = Request([1, 2, 3], GREEDY)
    sched.add(bad)
    sched.add(good)
    while not sched.idle:
        sched.step()
    assert bad.phase == "failed" and "context" in bad.error
    assert events[-1].finish_reason == "error"
    assert good.phase == "finished" and len(good.output_ids) == GREEDY.max_tokens


def test_a_slot_reused_right_after_its_request_ends_gives_the_new_request_its_own_output(
    loaded, engine_config
):
    """A ends on a stop token while the step after it is already computed for it (its token is
    dropped); B, queued behind three long requests, gets A's slot in the very next step and
    samples exactly as alone: the device's last token, penalty counts and prompt mask of the
    slot are B's own from its first step."""
    tok, engine = loaded
    engine.config = engine_config
    p = prompts(8)
    a_ref = run_schedule(engine, tok, [(0, p[1], GREEDY.replace(max_tokens=20))])[0][0]
    stop = a_ref[5]
    a_sp = GREEDY.replace(max_tokens=20, stop_token_ids=[stop])
    b_sp = SamplingParams(
        max_tokens=12, temperature=0.9, seed=7, repetition_penalty=1.3, presence_penalty=0.5
    )
    b_alone = run_schedule(engine, tok, [(0, p[4], b_sp)])[0][0]
    sched = Scheduler(engine, tok)
    seen = {}

    def on_a(ev):
        if ev.final:  # the step after A's last is in flight, computing a token for it
            seen["in_flight"] = engine.in_flight
            seen["ahead"] = int(engine.slots.generated[a.slot]) - len(a.output_ids)
            seen["step"] = sched.steps

    a = Request(list(p[1]), a_sp, on_a)
    fillers = [Request(list(p[i]), GREEDY.replace(max_tokens=40)) for i in (0, 2, 3)]
    b = Request(list(p[4]), b_sp)
    for r in (a, *fillers, b):
        sched.add(r)
    b_admitted = None
    while not sched.idle:
        sched.step()
        if b_admitted is None and b.phase == "running":
            b_admitted = sched.steps
    assert a.finish_reason == "stop" and a.output_ids == a_ref[: a_ref.index(stop) + 1]
    assert seen["in_flight"] == 1 and seen["ahead"] == 1
    assert b.slot == a.slot and b_admitted == seen["step"] + 1
    assert b.output_ids == b_alone
    engine.pool.check()
    assert engine.pool.available == engine.pool.capacity


def test_the_penalty_state_sees_the_tokens_the_steps_fed(loaded, engine_config):
    """The repetition penalty's 'seen' mask of a slot holds its prompt and the outputs fed back
    (a decode row's token comes from the device, and the sampling program must count that
    token, not the row's placeholder), and nothing else."""
    tok, engine = loaded
    engine.config = engine_config
    prompt = prompts(2)[1][:12]
    req = Request(list(prompt), GREEDY.replace(max_tokens=12, repetition_penalty=1.3))
    sched = Scheduler(engine, tok)
    sched.add(req)
    while not sched.idle:
        sched.step()
    seen = set(np.flatnonzero(np.asarray(engine.runner.state["prompt_mask"][req.slot])).tolist())
    assert set(prompt) | set(req.output_ids[:-1]) <= seen <= set(prompt) | set(req.output_ids)
