"""The hybrid (qwen35: Gated DeltaNet + gated attention) forward against HF transformers, and
its recurrent state in the slot: chunked equals unchunked, batched equals alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from luce_jax.loading.gguf import GGUFFile, model_config
from luce_jax.loading.params import load_params
from luce_jax.models import hybrid
from luce_jax.sampling_params import SamplingParams
from luce_jax.step_format import Row, lower

P = 16
SLOTS = 4


def hybrid_model(arch, tmp_path_factory):
    """(HF model, ModelConfig, params, GGUF path) of a tiny random `arch` model."""
    from hf_gguf import hf_to_gguf, make_hf_model

    m = make_hf_model(arch, seed=2)
    path = hf_to_gguf(m, arch, tmp_path_factory.mktemp("hybrid") / f"{arch}.gguf")
    f = GGUFFile(path)
    cfg, params = load_params(f, model_config(f.metadata), "float32")
    return m, cfg, params, str(path)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return hybrid_model("qwen35", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen35moe(tmp_path_factory):
    return hybrid_model("qwen35moe", tmp_path_factory)


_step = jax.jit(hybrid.forward, static_argnums=(4,))


def run(cfg, params, kv, state, rows, tables, fresh=(), step=_step, kept=0):
    """One step over `rows` (Row.slot doubles as the state slot); `fresh`: slots starting a
    sequence; `step`: _step's signature; kept: with proposals kept on the device (a state with
    `pend`), the proposals each slot's last verify row kept. Returns (logits at each row's
    last token [n, V], kv, state)."""
    arr = np.zeros((SLOTS, 16), np.int32)
    for slot, blocks in tables.items():
        arr[slot, : len(blocks)] = blocks
    n_tok = sum(len(r.tokens) for r in rows)
    t = max(8, 1 << (n_tok - 1).bit_length())
    batch = lower(rows, arr, P, t, SLOTS)
    batch["fresh"] = np.array([r.slot in fresh for r in rows] + [0] * (SLOTS - len(rows)))
    if "pend" in state:
        batch["kept"] = np.full(SLOTS, kept)
    batch = {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in batch.items()}
    logits, kv, state, _ = step(params, kv, state, batch, cfg)
    return np.asarray(logits)[: len(rows)], kv, state


_OPTIMIZED = {}


def optimized_step(params, kv, state, batch, cfg):
    """_step compiled with XLA's optimizations (the suite compiles without them)."""
    args = (params, kv, state, batch)
    key = (cfg, str(jax.tree.structure(args)), tuple(x.shape for x in jax.tree.leaves(args)))
    if key not in _OPTIMIZED:
        lowered = jax.jit(hybrid.forward, static_argnums=(4,)).lower(*args, cfg)
        _OPTIMIZED[key] = lowered.compile({"xla_backend_optimization_level": 3})
    return _OPTIMIZED[key](*args)


def fresh_caches(cfg):
    return hybrid.init_kv(cfg, 16, P, jnp.float32), hybrid.init_state(cfg, SLOTS)


def test_the_file_describes_the_layers_and_the_state(qwen35):
    _, cfg, params, _ = qwen35
    assert cfg.arch == "qwen35" and cfg.own.recurrent == (True, True, True, False)
    assert (cfg.own.ssm_conv, cfg.own.ssm_k_heads, cfg.own.ssm_v_heads, cfg.own.ssm_k_dim) == (
        4,
        2,
        4,
        16,
    )
    assert cfg.rope_dim == 8 and hybrid.attention_layers(cfg) == 1
    assert params["layers"][0]["w_in"].shape == (64, 2 * 2 * 16 + 4 * 16 + 4 * 16 + 2 * 4)
    assert params["layers"][3]["wqkv"].shape == (64, 2 * 4 * 32 + 2 * 2 * 32)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_logits_match_hf_over_prompt_and_16_greedy_steps(request, arch):
    hf, cfg, params, _ = request.getfixturevalue(arch)
    assert cfg.arch == arch and (cfg.shared_expert_ffn_dim == 40) == (arch == "qwen35moe")
    prompt = [5, 77, 300, 12, 9, 140, 33, 250, 61, 2, 99, 7, 18]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        ref = hf(torch.tensor([seq])).logits[0].numpy()
    kv, state = fresh_caches(cfg)
    table = {1: (3, 1, 6)}
    out, kv, state = run(cfg, params, kv, state, [Row(1, tuple(prompt), 0, True)], table, {1})
    got = [out[0]]
    for i in range(len(prompt), len(seq)):
        out, kv, state = run(cfg, params, kv, state, [Row(1, (seq[i],), i, True)], table)
        got.append(out[0])
    want = ref[len(prompt) - 1 :]
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.stack(got), want, atol=1e-3 * scale, rtol=0)
    assert [int(g.argmax()) for g in got[:-1]] == seq[len(prompt) :]


def prompt_logits(cfg, params, prompt, chunks, slot=0, others=(), state=None):
    """Prefill `prompt` on `slot` in chunks of `chunks` tokens (with `others`' rows, if any,
    in the first step) and decode 3 tokens; returns the logits of each sampling row."""
    kv, zero = fresh_caches(cfg)
    state = zero if state is None else state
    tables = {0: (1, 2, 3), 1: (4, 5, 6), 2: (7, 8, 9), 3: (10, 11, 12)}
    out, pos, first = [], 0, True
    while pos < len(prompt):
        n = min(chunks, len(prompt) - pos)
        rows = [Row(slot, tuple(prompt[pos : pos + n]), pos, pos + n == len(prompt))]
        rows += [Row(s, tuple(p), 0, True) for s, p in others] if first else []
        logits, kv, state = run(
            cfg, params, kv, state, rows, tables, {slot} if first else {s for s, _ in others}
        )
        first, pos = False, pos + n
        if rows[0].sample:
            out.append(logits[0])
    for tok in (11, 12, 13):
        logits, kv, state = run(cfg, params, kv, state, [Row(slot, (tok,), pos, True)], tables)
        out.append(logits[0])
        pos += 1
    return np.stack(out)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_a_prompt_split_over_steps_ends_in_the_state_of_one_pass(qwen35, chunk):
    _, cfg, params, _ = qwen35
    prompt = list(range(3, 40))
    whole = prompt_logits(cfg, params, prompt, len(prompt))
    split = prompt_logits(cfg, params, prompt, chunk)
    np.testing.assert_allclose(split, whole, atol=2e-5 * np.abs(whole).max(), rtol=0)


def test_batched_rows_and_a_reused_slot_leave_each_sequence_its_own_state(qwen35):
    """The same prompt alone on slot 0, then on slot 2 beside two other sequences (slot 2 had
    held another sequence: fresh resets it)."""
    _, cfg, params, _ = qwen35
    prompt = list(range(50, 71))
    alone = prompt_logits(cfg, params, prompt, 8)
    others = [(0, list(range(100, 109))), (3, list(range(200, 230)))]
    dirty = jax.tree.map(lambda s: s + 0.5, fresh_caches(cfg)[1])  # earlier tenants' state
    together = prompt_logits(cfg, params, prompt, 8, slot=2, others=others, state=dirty)
    np.testing.assert_allclose(together, alone, atol=2e-5 * np.abs(alone).max(), rtol=0)


# -- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(qwen35, compile_cache):
    from luce_jax.build import load_engine
    from luce_jax.config import EngineConfig

    from conftest import TINY_ENGINE

    cfg = EngineConfig(model=qwen35[3], compile_cache_dir=compile_cache, **TINY_ENGINE)
    return cfg, *load_engine(cfg)


@pytest.mark.parametrize("chunk, budget", [(128, 128), (8, 16), (5, 32)])
def test_engine_batched_equals_one_at_a_time(engine, chunk, budget):
    """8 requests on 4 slots arriving at different steps (queueing, slot reuse, chunked and
    decode rows in one step) give each the tokens it gets alone."""
    from test_engine import check_batched_equals_alone

    config, tok, eng = engine
    assert eng.runner.cfg.own.recurrent and not eng.pool.cache  # no prefix cache for hybrids
    check_batched_equals_alone(tok, eng, config, chunk, budget)


def test_a_slot_reused_after_a_cancel_or_a_finish_starts_from_a_zero_state(engine):
    from test_engine import prompts, run_schedule

    from luce_jax.host.request import Request
    from luce_jax.host.scheduler import Scheduler
    from luce_jax.sampling_params import SamplingParams

    config, tok, eng = engine
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    p = prompts(3, seed=4)
    alone = run_schedule(eng, tok, [(0, p[2], sp)], config)[0][0]
    sched = Scheduler(eng, tok)
    a = Request(list(p[0]), sp.replace(max_tokens=30))
    sched.add(a)
    for _ in range(4):  # a prefills and decodes a little, then is cancelled
        sched.step()
    sched.cancel(a)
    b = Request(list(p[2]), sp)
    sched.add(b)
    while not sched.idle:
        sched.step()
    assert b.slot == a.slot and b.output_ids == alone
    c = Request(list(p[2]), sp)  # after b finished normally, on the same slot again
    sched.add(c)
    while not sched.idle:
        sched.step()
    assert c.slot == b.slot and c.output_ids == alone


@pytest.fixture(scope="module")
def spec_engines(qwen35, tiny_models, compile_cache):
    """The hybrid target without speculation, with prompt lookup and with a draft model (the
    tiny dense qwen3 of the same vocabulary), each proposing K = 3 on every step."""
    from luce_jax.build import load_engine
    from luce_jax.config import EngineConfig
    from luce_jax.speculation.policy import SpecPolicy

    from conftest import TINY_ENGINE

    base = EngineConfig(model=qwen35[3], compile_cache_dir=compile_cache, **TINY_ENGINE)
    # 16-token buckets: 4 verify rows of 1 + 3 tokens fill one step
    base = base.replace(prefill_chunk=16, prefill_token_budget=16)
    draft = str(tiny_models["qwen3"][1])
    out = {"off": load_engine(base)}
    out["ngram"] = load_engine(base.replace(spec_mode="ngram", draft_tokens=3))
    out["draft"] = load_engine(base.replace(spec_mode="draft", draft=draft, draft_tokens=3))
    # proposals stay on the device: auto proposes K under a throughput gate, as for dense models
    out["auto"] = [(out[m][1].spec.policy.always, out[m][1].spec.gate) for m in ("ngram", "draft")]
    for mode in ("ngram", "draft"):
        engine = out[mode][1]
        engine.spec.policy = SpecPolicy(3, dict.fromkeys(engine.token_buckets, 1.0), min_gain=0.0)
        engine.spec.policy.observe_step = lambda seconds: None  # keep it proposing
        engine.spec.gate = None  # which no measurement turns off
    return out


@pytest.mark.parametrize("mode", ["ngram", "draft"])
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_speculation_on_a_hybrid_target_gives_its_own_tokens(spec_engines, mode, seeded,
                                                            monkeypatch):  # fmt: skip
    """Prompt lookup and the draft model propose on the device, steps overlap, and a verify row
    leaves the slot's recurrent state before its proposals, which the slot's next pass replays
    as far as they were kept: greedy and seeded (with penalties) tokens equal the target's
    alone."""
    from test_speculation import prompts, run

    sp = (
        SamplingParams(
            max_tokens=14, temperature=0.8, top_k=20, presence_penalty=0.4, seed=5, ignore_eos=True
        )
        if seeded
        else SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    )
    arrivals = [
        (i // 3 * 2, p, sp.replace(seed=sp.seed and sp.seed + i)) for i, p in enumerate(prompts())
    ]
    want, _ = run(spec_engines["off"], arrivals)
    runner, events = spec_engines[mode][1].runner, []
    for name, code in (("launch_forward", "F"), ("launch_sample", "S"), ("fetch", "R")):
        f = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _f=f, _c=code: events.append(_c) or _f(*a))
    got, engine = run(spec_engines[mode], arrivals)
    assert got == want
    assert engine.spec.stats()["verify_rows"] > 0
    assert all(always and gate is not None for always, gate in spec_engines["auto"])
    # no host round trip: step N + 1 is launched (forward, sampling) before step N is
    # collected, so one step is in flight at every collect (FS FS R FS R ... R R)
    seq = "".join(events)
    assert engine.overlap and seq.startswith("FSFSR") and seq.endswith("RR"), seq
    assert seq[2:-1] == "FSR" * ((len(seq) - 3) // 3), seq


def test_speculation_on_a_hybrid_moe_target_gives_its_own_tokens(qwen35moe, compile_cache,
                                                                monkeypatch):  # fmt: skip
    """qwen35moe (routed experts and a gated shared expert beside the Gated DeltaNet layers):
    prompt lookup on the device, steps overlapped, its greedy tokens those of the same engine
    with speculation off. (The draft model's part of a step is the target's family's whatever
    the FFN: qwen35 tests it; MTP and DFlash run on qwen35moe in test_mtp.py, test_dflash.py.)"""
    from test_mtp import always_proposing, check_overlapped_and_unchanged

    from luce_jax.build import load_engine
    from luce_jax.config import EngineConfig

    from conftest import TINY_ENGINE

    config = EngineConfig(model=qwen35moe[3], compile_cache_dir=compile_cache, **TINY_ENGINE)
    config = config.replace(prefill_chunk=16, prefill_token_budget=16, spec_mode="ngram",
                            draft_tokens=3)  # fmt: skip
    check_overlapped_and_unchanged(always_proposing(load_engine(config)), False, monkeypatch)


class Oracle:
    """Proposes the target's own next tokens (from a run without speculation), with every third
    proposal list's last token made wrong: rows accept all, some, or none of their proposals."""

    def __init__(self, refs: dict):
        self.refs, self.seq, self.calls = refs, {}, 0

    def start(self, slot, prompt, max_len):
        self.seq[slot] = (tuple(prompt), 0)

    def extend(self, slot, tokens):
        p, n = self.seq[slot]
        self.seq[slot] = (p, n + len(tokens))

    def available(self, want):
        return dict(want)

    def propose(self, want):
        out = {}
        for slot, k in want.items():
            p, n = self.seq[slot]
            prop = list(self.refs[p][n : n + k])
            self.calls += 1
            if prop and self.calls % 3 == 0:
                prop[-1] = (prop[-1] + 1) % 300
            out[slot] = prop
        return out

    def drop(self, slot):
        self.seq.pop(slot, None)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_kept_proposals_are_replayed_from_the_state_before_them(spec_engines, seeded):
    """With proposals that are mostly right, verify rows keep 0 to K of them; the slot's state
    must stand after exactly the emitted tokens each time, or the next tokens would differ."""
    from test_speculation import prompts, run

    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    if seeded:
        sp = sp.replace(temperature=0.8, top_k=20, presence_penalty=0.4, seed=5)
    arrivals = [(i // 3 * 2, p, sp) for i, p in enumerate(prompts())]
    want, _ = run(spec_engines["off"], arrivals)
    tok, engine = spec_engines["ngram"]
    ngram = engine.spec.proposer
    engine.spec.proposer = Oracle(
        {tuple(p): w for (_, p, _), w in zip(arrivals, want, strict=True)}
    )
    before = engine.spec.stats()
    try:
        got, _ = run((tok, engine), arrivals)
    finally:
        engine.spec.proposer = ngram
    assert got == want
    st = engine.spec.stats()
    lengths = {
        n: st["accept_lengths"].get(n, 0) - before["accept_lengths"].get(n, 0) for n in range(4)
    }
    assert lengths[3] > 0 and sum(lengths[n] for n in (1, 2)) > 0, lengths


@pytest.mark.parametrize("kept", [0, 1, 3])
def test_a_verify_row_replayed_leaves_the_state_of_feeding_its_kept_tokens(qwen35, kept):
    """A verify row [token, 3 proposals] stores its proposals' inputs; the slot's next pass,
    told how many were kept, replays them before its own token. Its recurrent state then equals
    that of feeding the token and the kept proposals as a row, bit for bit in float32 (the same
    arithmetic on the same inputs), and so do its logits to rounding. Compiled optimized: the
    suite's unoptimized CPU code (conftest.py) rounds the delta rule's scan differently in
    the two programs, by up to 1e-8."""
    _, cfg, params, _ = qwen35
    step = optimized_step
    prompt, token, props, nxt = (5, 77, 300, 12, 9), 140, (33, 250, 61), 2
    tables = {0: (1, 2)}

    def prefilled():
        kv = hybrid.init_kv(cfg, 16, P, jnp.float32)
        state = hybrid.init_state(cfg, SLOTS, proposals=3)
        return run(cfg, params, kv, state, [Row(0, prompt, 0, True)], tables, {0}, step)[1:]

    kv, state = prefilled()
    verify = Row(0, (token, *props), len(prompt), True, draft=3)
    _, kv, state = run(cfg, params, kv, state, [verify], tables, (), step)
    assert int(state["pend_n"][0]) == 3
    at = len(prompt) + 1 + kept
    replayed, _, replayed_state = run(cfg, params, kv, state, [Row(0, (nxt,), at, True)], tables,
                                      (), step, kept)  # fmt: skip
    kv, state = prefilled()
    fed = Row(0, (token, *props[:kept]), len(prompt), True)
    _, kv, state = run(cfg, params, kv, state, [fed], tables, (), step)
    want, _, want_state = run(cfg, params, kv, state, [Row(0, (nxt,), at, True)], tables, (), step)
    for name in ("conv", "ssm"):
        np.testing.assert_array_equal(replayed_state[name][:, 0], want_state[name][:, 0], name)
    np.testing.assert_allclose(replayed, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
def test_the_replay_walks_each_rows_kept_proposals_and_leaves_the_others(qwen35, kernel):
    """Three rows replay their slots' stored proposals, keeping 0, 2 and all 3: each kept
    row's slot state is that of running the delta rule over its first kept proposals alone
    (the reference rule from the slot's state), the row that kept none and every other slot
    are left as they were. With the kernel (interpret mode) and with its reference."""
    from luce_jax.models import gated_deltanet as gd
    from pallas_kernels.gated_delta import (
        gated_delta_in_place,
        gated_delta_in_place_reference,
        gated_delta_reference,
    )

    _, cfg, params, _ = qwen35
    lp = next(lp for lp, rec in zip(params["layers"], cfg.own.recurrent, strict=True) if rec)
    hc = cfg.own
    S, K, W = 3, 3, gd.stored_width(cfg)
    rng = np.random.default_rng(5)
    pend = rng.standard_normal((S, K, W)).astype(np.float32)
    C, Hv = hc.conv_dim, hc.ssm_v_heads
    pend[..., 2 * C : 2 * C + Hv] = -rng.uniform(0.05, 1.0, (S, K, Hv))  # g: a log decay
    pend[..., 2 * C + Hv :] = rng.uniform(0.0, 1.0, (S, K, Hv))  # beta
    state_shape = (2, SLOTS, Hv, hc.ssm_k_dim, hc.ssm_v_dim)
    ssm = jnp.asarray(rng.standard_normal(state_shape) * 0.3, jnp.float32)
    hist = jnp.asarray(rng.standard_normal((S, hc.ssm_conv - 1, C)), jnp.float32)
    kept, slots, li = jnp.asarray([0, 2, 3]), jnp.asarray([3, 0, 2], jnp.int32), 1
    if kernel:
        delta = functools.partial(gated_delta_in_place, interpret=True)
    else:
        delta = gated_delta_in_place_reference
    _, got = gd.replay(lp, jnp.asarray(pend), kept, hist, ssm, jnp.int32(li), slots, cfg, delta)
    want = np.array(ssm)
    _, ins = gd._unstore(jnp.asarray(pend).reshape(S * K, W), cfg)
    for s in (1, 2):
        n, rows = int(kept[s]), slice(s * K, s * K + int(kept[s]))
        h0 = ssm[li, int(slots[s])][None]
        _, h = gated_delta_reference(*(x[rows] for x in ins), h0, jnp.asarray([0, n]))
        want[li, int(slots[s])] = np.asarray(h[0])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[li, 3], np.asarray(ssm)[li, 3])  # kept none
    np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(ssm)[0])  # another layer


TINY_SHAPES = {
    "qwen35": dict(d=256, L=4, H=2, K=1, D=128, F=256, tied=False, Hk=2, Hv=4),
    "qwen35moe": dict(
        d=256, L=4, H=2, K=1, D=128, F=256, tied=False, Hk=2, Hv=4, E=4, k=2, Fe=256, Fs=256
    ),
}


@pytest.mark.parametrize(
    "arch, file_type", [("qwen35", "q8_0"), ("qwen35", "q4_k_m"), ("qwen35moe", "q4_k_m")]
)
def test_make_model_writes_a_hybrid_file_that_runs_kept_quantized(
    tmp_path, tiny_gguf, monkeypatch, arch, file_type
):
    """bench/make_model.py's qwen35 and qwen35moe shapes (here scaled down) load, and their
    logits are the same with the weights kept in their blocks as dequantized at load."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import make_model

    monkeypatch.setitem(make_model.SHAPES, "qwen35-tiny", TINY_SHAPES[arch])
    path = str(tmp_path / "h.gguf")
    vocab = tiny_gguf  # its 320 tokens: a real vocabulary's head would be most of the work
    make_model.write("qwen35-tiny", file_type, vocab, path)
    outs = []
    for quantized in (True, False):
        f = GGUFFile(path)
        cfg, params = load_params(f, model_config(f.metadata), "float32", quantized)
        assert cfg.arch == arch and cfg.own.recurrent == (True, True, True, False)
        assert cfg.own.conv_dim == 1024 and cfg.n_experts == (4 if arch == "qwen35moe" else 0)
        kv, state = fresh_caches(cfg)
        rows = [Row(0, (5, 9, 100, 7), 0, True), Row(1, (3,) * 11, 0, True)]
        logits, _, _ = run(cfg, params, kv, state, rows, {0: (1,), 1: (2,)}, {0, 1})
        outs.append(logits)
    assert np.isfinite(outs[1]).all()
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5 * np.abs(outs[1]).max())


def test_a_decode_step_on_the_fused_int8_kernels_computes_what_xla_does(tmp_path, tiny_gguf):
    """qwen35 q8_0 kept quantized: a two-row decode step on quant_matmul's int8 vector path
    (interpret mode), each norm and the int8 rows it feeds from norm_int8_rows and the FFN's
    silu(gate) * up and its rows from glu_int8_rows (gate | up unsummed), gives XLA's
    dequantize-then-dot logits to the activations' int8 rounding. The prompts (bucket 16) run
    once, on XLA's path. (test_int8_rows holds the fused kernels to the unfused ones.)"""
    import functools
    import sys
    from pathlib import Path

    from luce_jax.models.linear import QuantMatmul
    from pallas_kernels.int8_rows import glu_int8_rows, norm_int8_rows
    from pallas_kernels.quant_matmul import quant_matmul

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import make_model

    path = str(tmp_path / "h.gguf")
    vocab = tiny_gguf  # its 320 tokens: a real vocabulary's head would be most of the work
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(make_model.SHAPES, "qwen35-tiny", TINY_SHAPES["qwen35"])
        make_model.write("qwen35-tiny", "q8_0", vocab, path)
    f = GGUFFile(path)
    cfg, params = load_params(f, model_config(f.metadata), "float32", True)
    calls = []

    def fused(fn):
        def call(*a, **k):
            calls.append(fn.__name__)
            return fn(*a, interpret=True, **k)

        return call

    qmm = QuantMatmul(functools.partial(quant_matmul, int8_x=True, interpret=True), max_rows=8,
                      norm_int8=fused(norm_int8_rows), glu_int8=fused(glu_int8_rows))  # fmt: skip
    kernel_step = jax.jit(functools.partial(hybrid.forward, quant_matmul=qmm), static_argnums=4)
    kv, state = fresh_caches(cfg)
    rows = [Row(0, (5, 9, 100, 7), 0, True), Row(1, (3,) * 11, 0, True)]
    tables = {0: (1,), 1: (2,)}
    _, kv, state = run(cfg, params, kv, state, rows, tables, {0, 1})  # the same prompts for both
    nxt = [Row(0, (8,), 4, True), Row(1, (8,), 11, True)]
    got = run(cfg, params, kv, state, nxt, tables, (), kernel_step)[0]
    want = run(cfg, params, kv, state, nxt, tables, ())[0]
    # each kind of layer (traced once: hybrid.layer is jitted) ran its two norms and its FFN's
    # glu through the fused kernels, then the head its norm
    layer_calls = ["norm_int8_rows", "norm_int8_rows", "glu_int8_rows"]
    assert calls == layer_calls * len(set(cfg.own.recurrent)) + ["norm_int8_rows"]
    # Measured: up to 0.031 from XLA's (2% of the largest logit), as the kernel rounding its
    # rows itself is.
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-2 * np.abs(want).max())


def test_the_pallas_kernels_give_the_engine_the_same_tokens(engine, qwen35, compile_cache):
    """attention_backend=pallas runs the gated delta kernel and the paged attention kernel
    (interpret mode on CPU): the same greedy tokens as the jnp references."""
    from test_engine import prompts, run_schedule

    from luce_jax.build import load_engine
    from luce_jax.sampling_params import SamplingParams

    config, tok, ref = engine
    cfg = config.replace(
        attention_backend="pallas", max_concurrency=2, prefill_chunk=16, prefill_token_budget=16
    )
    _, eng = load_engine(cfg)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    arrivals = [(0, p, sp) for p in prompts(3, seed=9)]
    assert run_schedule(eng, tok, arrivals, cfg)[0] == run_schedule(ref, tok, arrivals, config)[0]


def test_moe_hybrid_engine_batched_equals_one_at_a_time(qwen35moe, compile_cache, tmp_path):
    """...and records its routing (--record-expert-stats): each MoE layer counts k experts for
    every token fed, prompts and generated tokens alike."""
    from test_engine import GREEDY, check_batched_equals_alone, prompts

    from luce_jax.build import load_engine
    from luce_jax.config import EngineConfig

    from conftest import TINY_ENGINE

    cfg = EngineConfig(model=qwen35moe[3], compile_cache_dir=compile_cache,
                       record_expert_stats=str(tmp_path / "stats.json"), **TINY_ENGINE)  # fmt: skip
    tok, eng = load_engine(cfg)
    mc = eng.runner.cfg
    assert mc.n_experts == 8 and mc.own.recurrent
    check_batched_equals_alone(tok, eng, cfg, 8, 16)
    counts = eng.runner.tally.counts(eng.runner.placement)
    # every prompt twice (alone, then batched); a request's last token is never fed
    fed = 2 * sum(len(p) + GREEDY.max_tokens - 1 for p in prompts(8))
    assert counts.shape == (mc.n_layers, 8)  # every layer's FFN routes
    assert (counts.sum(1) == fed * mc.n_experts_used).all(), counts.sum(1)


def test_the_pool_is_sized_for_attention_layers_and_the_state_is_reserved(engine):
    """Only full-attention layers take KV per token, and the per-slot state that --kv-pool-tokens
    0 leaves out of the pool is what the runner holds."""
    import jax

    from luce_jax.build import kv_cache_types, state_bytes

    config, _, eng = engine
    mc = eng.runner.cfg
    resolved = config.resolved("cpu")
    (group,) = kv_cache_types(resolved, mc)[1]
    assert group.kind == "full" and group.layers == hybrid.attention_layers(mc) == 1
    assert group.bytes_per_token == hybrid.attention_layers(mc) * mc.kv_size * 2 * 4  # f32 K, V
    held = sum(x.nbytes for x in jax.tree.leaves(eng.runner.state["model"]))
    assert state_bytes(mc, resolved) == held > 0
    assert len(eng.runner.kv) == hybrid.attention_layers(mc) == 1
