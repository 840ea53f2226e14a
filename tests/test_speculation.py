"""Speculative decoding in the engine: output equals the target's, greedy and sampled.

Engines of a tiny random qwen3 with 8 slots: without speculation, with prompt lookup, and
with a draft model (the target with perturbed weights, so it agrees often but not always).
The policy is made to propose K tokens for every slot on every step (flat step times), so
verification, multi-token results and rollback run on every step.
"""

import copy

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from test_engine import run_schedule

from luce_jax.build import load_engine
from luce_jax.config import EngineConfig
from luce_jax.sampling_params import SamplingParams
from luce_jax.speculation.policy import SpecPolicy

from hf_gguf import hf_to_gguf, make_hf_model

K = 3


@pytest.fixture(scope="module")
def draft_gguf(tiny_models, tmp_path_factory):
    model = copy.deepcopy(tiny_models["qwen3"][0])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    return str(hf_to_gguf(model, "qwen3", tmp_path_factory.mktemp("draft") / "draft.gguf"))


@pytest.fixture(scope="module")
def engines(engine_config, draft_gguf):
    base = engine_config.replace(max_concurrency=8, prefill_chunk=32, prefill_token_budget=64)
    out = {"off": load_engine(base)}
    out["ngram"] = load_engine(base.replace(spec_mode="ngram", draft_tokens=K))
    out["draft"] = load_engine(base.replace(spec_mode="draft", draft=draft_gguf, draft_tokens=K))
    for mode in ("ngram", "draft"):
        engine = out[mode][1]
        flat = dict.fromkeys(engine.token_buckets, 1.0)
        engine.spec.policy = SpecPolicy(K, flat, min_gain=0.0)
        engine.spec.policy.observe_step = lambda seconds: None  # keep it proposing
    return out


def run(loaded, arrivals):
    """arrivals: (step, prompt, SamplingParams). Returns token ids per request and the engine."""
    tok, engine = loaded
    draft = engine.spec.proposer if engine.spec and engine.spec.mode == "draft" else None
    runners = [engine.runner] + ([draft.runner] if draft else [])
    compiles = [r.compiles for r in runners]
    outs, _ = run_schedule(engine, tok, arrivals)  # checks the pool is whole again
    assert [r.compiles for r in runners] == compiles  # verify rows fit the warmed buckets
    if draft is not None:
        assert draft.pool.available == draft.pool.capacity
    return outs, engine


def prompts(n=8, seed=0):
    """Prompts of different lengths; some repeat a phrase, as code and chat often do."""
    rng = np.random.default_rng(seed)
    out = []
    for i, k in enumerate([3, 40, 17, 1, 65, 16, 9, 33][:n]):
        p = rng.integers(0, 300, k).tolist()
        out.append((p[:6] * 12)[:k] if i % 2 else p)
    return out


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_greedy_output_is_token_identical(engines, mode):
    arrivals = [
        (i // 3 * 2, p, SamplingParams(max_tokens=10 + 3 * i, temperature=0, ignore_eos=True))
        for i, p in enumerate(prompts())
    ]
    want, _ = run(engines["off"], arrivals)
    got, engine = run(engines[mode], arrivals)
    assert got == want
    st = engine.spec.stats()
    assert st["accepted"] > 0 and max(st["accept_lengths"]) >= 2, st  # multi-token steps ran


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_seeded_sampling_with_penalties_is_token_identical(engines, mode):
    """Verification samples each position with the request's own noise (seed, step), and
    penalties count proposals before a position as output: the same tokens as without."""
    arrivals = [
        (
            i,
            p,
            SamplingParams(
                max_tokens=12,
                temperature=0.8,
                top_p=0.9,
                top_k=20,
                repetition_penalty=1.2,
                presence_penalty=0.4,
                frequency_penalty=0.2,
                seed=100 + i,
                ignore_eos=True,
                logprobs=2,
            ),
        )
        for i, p in enumerate(prompts())
    ]
    want, _ = run(engines["off"], arrivals)
    got, engine = run(engines[mode], arrivals)
    assert got == want
    assert engine.spec.stats()["verify_rows"] > 0


def test_stop_token_inside_an_accepted_block_ends_the_request_there(engines):
    p = prompts()[1]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = run(engines["off"], [(0, p, greedy)])[0][0]
    stop = ref[7]
    cut = ref[: ref.index(stop) + 1]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    for mode in ("ngram", "draft"):
        assert run(engines[mode], [(0, p, sp)])[0][0] == cut


def test_sampled_token_distribution_matches_the_target(engines):
    """Two-sample chi-square on the first three output tokens, speculation (draft, which is
    accepted often) against none, N = 800 independent seeds per arm, top_k 2 so there are at
    most 8 sequences (df 7). Threshold: alpha = 0.001. Power (simulated on a 0.6/0.4 split
    per token): a shift of 0.1 probability between two sequences is detected with
    probability 0.999, of 0.05 with 0.26. A rule that kept every proposal would move the
    2nd and 3rd tokens entirely to the draft's choice."""
    n = 800
    p = prompts()[1][:12]

    def sample(loaded, seed0):
        arrivals = [
            (i // 2, p, SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=seed0 + i))
            for i in range(n)
        ]
        outs, engine = run(loaded, arrivals)
        return [tuple(o) for o in outs], engine

    a, _ = sample(engines["off"], 0)
    b, engine = sample(engines["draft"], 10**6)
    bins = sorted(set(a) | set(b))
    ca = np.array([a.count(x) for x in bins], float)
    cb = np.array([b.count(x) for x in bins], float)
    tot = ca + cb
    stat = float((((ca - tot / 2) ** 2 + (cb - tot / 2) ** 2) / (tot / 2)).sum())
    assert len(bins) <= 8
    assert stat < chi2.ppf(0.999, len(bins) - 1), (bins, ca, cb)
    st = engine.spec.stats()
    assert st["accepted"] > n / 4, st  # the draft's proposals were often kept


def test_sampled_proposals_share_the_targets_noise_and_are_kept(engines, engine_config, tiny_gguf):
    """A draft that is the target itself, at temperature 1: its proposals are sampled with the
    noise the target's rows use, so nearly every one is the token the target samples (greedy
    proposals would match a sampled token only as often as it is the argmax), and the output
    is still the one without speculation."""
    base = engine_config.replace(max_concurrency=8, prefill_chunk=32, prefill_token_budget=64)
    loaded = load_engine(base.replace(spec_mode="draft", draft=tiny_gguf, draft_tokens=K))
    engine = loaded[1]
    engine.spec.policy = SpecPolicy(K, dict.fromkeys(engine.token_buckets, 1.0), min_gain=0.0)
    engine.spec.policy.observe_step = lambda seconds: None
    arrivals = [
        (i, p, SamplingParams(max_tokens=16, temperature=1.0, seed=7 + i, ignore_eos=True))
        for i, p in enumerate(prompts())
    ]
    want, _ = run(engines["off"], arrivals)
    got, _ = run(loaded, arrivals)
    assert got == want
    st = engine.spec.stats()
    assert st["proposed"] > 50 and st["accepted"] >= 0.95 * st["proposed"], st


def test_speculation_flags_are_validated(tiny_gguf):
    with pytest.raises(ValueError, match="spec_mode"):
        EngineConfig(spec_mode="eagle")
    with pytest.raises(ValueError, match="draft"):
        EngineConfig(draft=tiny_gguf)  # a draft without spec_mode=draft
    with pytest.raises(ValueError, match="draft"):
        EngineConfig(model=tiny_gguf, spec_mode="draft")  # own model, no draft given
    with pytest.raises(ValueError, match="draft_tokens"):
        EngineConfig(spec_mode="ngram", draft_tokens=0)
    with pytest.raises(ValueError, match="draft_tokens"):
        EngineConfig(spec_mode="ngram", draft_tokens=17)
    with pytest.raises(ValueError, match="draft"):
        EngineConfig(spec_mode="draft", draft="/no/such.gguf")


def test_a_draft_with_another_vocabulary_is_refused(engine_config, tmp_path):
    other = hf_to_gguf(make_hf_model("qwen3", seed=3, vocab=300), "qwen3", tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="vocabulary"):
        load_engine(engine_config.replace(spec_mode="draft", draft=str(other)))


def test_serve_flags_map_to_the_speculation_fields(capsys):
    from luce_jax.serve import parse_config

    _, cfg = parse_config(["--spec-mode", "draft", "--draft-tokens", "3"])
    assert (cfg.spec_mode, cfg.draft, cfg.draft_tokens) == ("draft", None, 3)
    assert cfg.draft_model.endswith("luce-stdlib-draft.gguf")
    with pytest.raises(SystemExit):
        parse_config(["--spec-mode", "eagle"])
    assert "--spec-mode" in capsys.readouterr().err
