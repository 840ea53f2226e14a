"""`--spec-mode mtp`: a hybrid model's own MTP block (models/mtp.py) proposing on the device.

The files are tiny random qwen35 / qwen35moe models with a random MTP block, written as
llama.cpp's converter writes Qwen3.5's (tests/hf_gguf.py); test_converted.py loads the
converter's own. Its proposals are checked against the block run over the whole sequence at
once, and the target's output against the target without speculation.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from luce_jax.build import load_engine
from luce_jax.config import EngineConfig
from luce_jax.sampling_params import SamplingParams
from luce_jax.speculation.policy import SpecPolicy

from conftest import TINY_ENGINE

K = 3


def mtp_file(arch, tmp_path_factory) -> str:
    from hf_gguf import hf_to_gguf, make_hf_model

    path = tmp_path_factory.mktemp("mtp") / f"{arch}-mtp.gguf"
    return str(hf_to_gguf(make_hf_model(arch, seed=2), arch, path, mtp=True))


def always_proposing(loaded):
    """K proposals on every step, whatever the policy would measure."""
    engine = loaded[1]
    engine.spec.policy = SpecPolicy(K, dict.fromkeys(engine.token_buckets, 1.0), min_gain=0.0)
    engine.spec.policy.observe_step = lambda seconds: None
    engine.spec.gate = None
    return loaded


@pytest.fixture(scope="module")
def engines(tmp_path_factory, compile_cache):
    """arch (qwen35 or qwen35moe) -> its target with an MTP block proposing K on every step,
    built once for the module's tests."""
    built = {}

    def get(arch):
        if arch not in built:
            path = mtp_file(arch, tmp_path_factory)
            base = EngineConfig(model=path, compile_cache_dir=compile_cache, **TINY_ENGINE)
            base = base.replace(prefill_chunk=16, prefill_token_budget=16, spec_mode="mtp",
                                draft_tokens=K)  # fmt: skip
            built[arch] = {"mtp": always_proposing(load_engine(base))}
        return built[arch]

    return get


def check_overlapped_and_unchanged(spec, seeded: bool, monkeypatch):
    """Requests arriving over several steps give the tokens the same engine gives with its
    speculation off (greedy, or seeded with a penalty; the target without speculation is held
    to transformers and to one-at-a-time elsewhere), with no compile after warmup
    (test_speculation.run checks it) and one step in flight at every collect: no host round
    trip (FS FS R FS R ... R R)."""
    from test_speculation import prompts, run

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    if seeded:
        sp = sp.replace(temperature=0.8, top_k=20, presence_penalty=0.4, seed=5)
    arrivals = [(i // 3 * 2, p, sp) for i, p in enumerate(prompts())]
    engine = spec[1]
    speculation, engine.spec = engine.spec, None  # no proposals, no verify rows
    try:
        want, _ = run(spec, arrivals)
        assert engine.runner.ahead  # the same programs, proposing nothing
    finally:
        engine.spec = speculation
    runner, events = spec[1].runner, []
    for name, code in (("launch_forward", "F"), ("launch_sample", "S"), ("fetch", "R")):
        f = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _f=f, _c=code: events.append(_c) or _f(*a))
    got, engine = run(spec, arrivals)
    assert got == want
    assert engine.spec.stats()["verify_rows"] > 0
    seq = "".join(events)
    assert engine.overlap and seq.startswith("FSFSR") and seq.endswith("RR"), seq
    assert seq[2:-1] == "FSR" * ((len(seq) - 3) // 3), seq


def proposals_after_each_step(loaded, monkeypatch) -> tuple[list[int], list[list[int]]]:
    """One greedy request alone: (its prompt and output, the proposals the device kept for its
    slot after each sampling program that changed them)."""
    from test_speculation import run

    tok, engine = loaded
    runner, seen = engine.runner, []
    launch = runner.launch_sample
    slot_props = lambda: np.asarray(runner.state["props"]).copy()  # noqa: E731
    monkeypatch.setattr(runner, "launch_sample",
                        lambda *a: (launch(*a), seen.append(slot_props()))[0])  # fmt: skip
    prompt = list(range(40, 61))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    before = slot_props()  # earlier tests' proposals, until the slot's first sampled row
    (out,), _ = run((tok, engine), [(0, prompt, sp)])
    slot = next(s for s in range(len(before)) if (seen[-1][s] != before[s]).any())
    return prompt + out, [p[slot].tolist() for p in seen if (p[slot] != before[slot]).any()]


def check_rising(got: list, refs: dict) -> None:
    """Each step's proposals are the reference's for the sequence as far as it went: one m per
    step, rising."""
    ms = [next((m for m, r in refs.items() if r == g), None) for g in got]
    assert None not in ms and ms == sorted(ms) and len(set(ms)) >= 5, (got, refs)


@pytest.mark.parametrize(
    "arch, seeded",
    [("qwen35", False), ("qwen35", True), ("qwen35moe", False)],
    ids=["qwen35-greedy", "qwen35-seeded", "qwen35moe-greedy"],
)
def test_mtp_proposals_leave_the_targets_tokens_with_steps_overlapped(engines, arch, seeded,
                                                                     monkeypatch):  # fmt: skip
    """The MTP block proposes on the device, steps overlap and the tokens are the target's."""
    check_overlapped_and_unchanged(engines(arch)["mtp"], seeded, monkeypatch)


def reference_proposals(cfg, params, tokens: list[int]) -> list[int]:
    """K greedy proposals after `tokens`, computed the simple way: the target's hidden states
    of the whole sequence in one pass, the MTP block over every position at once (each token
    with the hidden state before it, zeros at 0), then each proposal by running the block
    again over the sequence and the proposals so far, fed its own outputs."""
    from luce_jax.models import hybrid, mtp
    from luce_jax.models.attention import paged_attention_xla
    from luce_jax.models.dense import rms_norm
    from luce_jax.models.family import Kernels
    from luce_jax.step_format import Row, lower

    n, P, T = len(tokens), 16, 64  # one shape for every call: compiled once

    def batch(toks):
        b = lower([Row(0, tuple(toks), 0, True)], np.arange(1, T // P + 1)[None], P, T, 1)
        b["fresh"] = np.ones(1)
        return {k: jnp.asarray(np.asarray(v, np.int32)) for k, v in b.items()}

    assert n + K <= T
    nb = T // P + 1
    kv = hybrid.init_kv(cfg, nb, P, jnp.float32)
    state = hybrid.init_state(cfg, 1)
    *_, stats = hybrid.forward(params, kv, state, batch(tokens), cfg, hidden=(cfg.n_layers,))
    x = stats["hidden"][0, :n]
    h = rms_norm(x, params["final_norm"], cfg.rms_eps)
    hidden, toks, out = jnp.concatenate([jnp.zeros_like(h[:1]), h[:-1]]), list(tokens), []
    for _ in range(K):
        mkv = hybrid.init_kv(cfg, nb, P, jnp.float32)[0]
        b, m = batch(toks), len(toks)
        padded = jnp.pad(hidden, ((0, T - m), (0, 0)))
        y, _ = mtp.block(params["mtp"], params["embed"], padded, b["tokens"], mkv, b, cfg,
                         Kernels(attention=paged_attention_xla))  # fmt: skip
        y = y[m - 1 : m]
        logits = mtp.logits(params["mtp"], params, y, cfg, None)
        out.append(int(jnp.argmax(logits[0])))
        hidden = jnp.concatenate([hidden, mtp.output(params["mtp"], y, cfg)])
        toks.append(out[-1])
    return out


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_mtp_proposals_are_the_blocks_run_over_the_whole_sequence(engines, arch, monkeypatch):
    """After each step, the K proposals the device keeps for the slot are the ones the block
    makes from the whole sequence so far (its KV fed step by step, each row paired with the
    hidden state its slot kept)."""
    seq, got = proposals_after_each_step(engines(arch)["mtp"], monkeypatch)
    runner = engines(arch)["mtp"][1].runner
    refs = {m: reference_proposals(runner.cfg, runner.params, seq[:m]) for m in range(21, len(seq))}
    check_rising(got, refs)


def test_mtp_is_refused_where_it_cannot_run(tiny_gguf, tmp_path, compile_cache):
    """A file without an MTP block, and a model family that runs none, are refused at start
    with one line that says why."""
    from hf_gguf import hf_to_gguf, make_hf_model

    config = EngineConfig(model=tiny_gguf, compile_cache_dir=compile_cache, **TINY_ENGINE)
    with pytest.raises(ValueError, match="spec_mode='mtp': the dense family"):
        load_engine(config.replace(spec_mode="mtp"))
    plain = hf_to_gguf(make_hf_model("qwen35", seed=2), "qwen35", tmp_path / "q.gguf")
    with pytest.raises(ValueError, match="has no MTP block .qwen35.nextn_predict_layers"):
        load_engine(config.replace(model=str(plain), spec_mode="mtp"))
