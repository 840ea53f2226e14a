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
    base = engine_config.replace(max_concurrency=4, prefill_chunk=16, prefill_token_budget=16)
    out = {"off": load_engine(base)}
    out["ngram"] = load_engine(base.replace(spec_mode="ngram", draft_tokens=K))
    out["draft"] = load_engine(base.replace(spec_mode="draft", draft=draft_gguf, draft_tokens=K))
    out["auto"] = {
        m: (out[m][1].spec.policy.always, out[m][1].spec.gate is not None)
        for m in ("ngram", "draft")
    }
    for mode in ("ngram", "draft"):
        engine = out[mode][1]
        flat = dict.fromkeys(engine.token_buckets, 1.0)
        engine.spec.policy = SpecPolicy(K, flat, min_gain=0.0)
        engine.spec.policy.observe_step = lambda seconds: None  # keep it proposing
        engine.spec.gate = None  # which no measurement turns off
    return out


def run(loaded, arrivals):
    """arrivals: (step, prompt, SamplingParams). Returns token ids per request and the engine."""
    tok, engine = loaded
    compiles = engine.runner.compiles
    outs, _ = run_schedule(engine, tok, arrivals)  # checks the pool is whole again
    assert engine.runner.compiles == compiles  # verify rows fit the warmed buckets
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


N_CHI = 800  # independent seeds per arm


def first_tokens(loaded, seed0, n=N_CHI, prompt_len=12, temperature=0.8):
    """The first three output tokens of n requests with seeds seed0.., top_k 2 (so the second
    and third come from verify rows). Returns (outcomes, engine)."""
    p = prompts()[1][:prompt_len]
    arrivals = [
        (i // 2, p, SamplingParams(max_tokens=3, temperature=temperature, top_k=2, seed=seed0 + i))
        for i in range(n)
    ]
    outs, engine = run(loaded, arrivals)
    return [tuple(o) for o in outs], engine


def chi_square(a, b) -> tuple[float, float]:
    """Two-sample chi-square statistic of outcome lists a, b (equal sizes) and its threshold at
    alpha = 0.001 (df: outcomes seen - 1; with top_k 2 the target has at most 8). Power
    (simulated on a 0.6/0.4 split per token): a shift of 0.1 probability between two outcomes
    is detected with probability 0.999, of 0.05 with 0.26."""
    bins = sorted(set(a) | set(b))
    ca = np.array([a.count(x) for x in bins], float)
    cb = np.array([b.count(x) for x in bins], float)
    tot = ca + cb
    stat = float((((ca - tot / 2) ** 2 + (cb - tot / 2) ** 2) / (tot / 2)).sum())
    return stat, float(chi2.ppf(0.999, len(bins) - 1))


def test_sampled_token_distribution_matches_the_target(engines):
    """Two-sample chi-square on the first three output tokens at temperature 0.8, the draft
    model (its sampled proposals often kept) against no speculation, other seeds per arm (so
    the arms are independent samples). Prompt lookup verifies by the same rule, and proposes
    nothing on this random model's samples."""
    a, _ = first_tokens(engines["off"], 0)
    b, engine = first_tokens(engines["draft"], 10**6)
    stat, threshold = chi_square(a, b)
    assert stat < threshold, (stat, threshold)
    assert len(set(a) | set(b)) <= 8  # nothing outside the target's top 2
    assert engine.spec.stats()["accepted"] > N_CHI / 4, engine.spec.stats()  # often kept


def test_the_distribution_test_fails_a_rule_that_keeps_every_proposal(
    engine_config, engines, draft_gguf
):
    """Negative control: a verifier that keeps every proposal (the next position then samples
    after a proposal the target did not pick) moves the distribution, and the chi-square test
    above rejects it. The engine is a small one (two token buckets, K = 1)."""
    from luce_jax.device import sampling

    right = sampling.sample_rows

    def keep_all(*args, **kw):
        packed, top_ids, top_lp, state = right(*args, **kw)
        batch, R = args[4], args[0].shape[0]
        S = batch["slots"].shape[0]
        return packed.at[2 * R : 2 * R + S].set(batch["n_draft"]), top_ids, top_lp, state

    base = engine_config.replace(max_concurrency=8, prefill_chunk=16, prefill_token_budget=16)
    sampling.sample_rows = keep_all
    try:  # the programs are compiled here, with the wrong rule
        loaded = load_engine(base.replace(spec_mode="draft", draft=draft_gguf, draft_tokens=1))
    finally:
        sampling.sample_rows = right
    engine = loaded[1]
    engine.spec.policy = SpecPolicy(1, dict.fromkeys(engine.token_buckets, 1.0), min_gain=0.0)
    engine.spec.policy.observe_step = lambda seconds: None
    engine.spec.gate = None
    # the shift is large: a smaller sample; short prompts leave the steps room to verify
    n = N_CHI // 2
    a, _ = first_tokens(engines["off"], 0, n, prompt_len=4)
    b, _ = first_tokens(loaded, 10**6, n, prompt_len=4)
    stat, threshold = chi_square(a, b)
    assert loaded[1].spec.stats()["accepted"] > n / 2, loaded[1].spec.stats()
    assert stat > threshold, (stat, threshold)


def test_sampled_proposals_share_the_targets_noise_and_are_kept(engines, engine_config, tiny_gguf):
    """A draft that is the target itself, at temperature 1: its proposals are sampled with the
    noise the target's rows use, so nearly every one is the token the target samples (greedy
    proposals would match a sampled token only as often as it is the argmax), and the output
    is still the one without speculation."""
    base = engine_config.replace(max_concurrency=4, prefill_chunk=16, prefill_token_budget=16)
    loaded = load_engine(base.replace(spec_mode="draft", draft=tiny_gguf, draft_tokens=K))
    engine = loaded[1]
    engine.spec.policy = SpecPolicy(K, dict.fromkeys(engine.token_buckets, 1.0), min_gain=0.0)
    engine.spec.policy.observe_step = lambda seconds: None
    engine.spec.gate = None
    arrivals = [
        (i, p, SamplingParams(max_tokens=16, temperature=1.0, seed=7 + i, ignore_eos=True))
        for i, p in enumerate(prompts())
    ]
    want, _ = run(engines["off"], arrivals)
    got, _ = run(loaded, arrivals)
    assert got == want
    st = engine.spec.stats()
    assert st["proposed"] > 50 and st["accepted"] >= 0.95 * st["proposed"], st


def test_the_auto_policy_proposes_k_under_a_throughput_gate_with_proposals_on_the_device(
    engines,
):
    # on a dense target prompt lookup and the draft both propose on the device
    assert engines["auto"] == {"ngram": (True, True), "draft": (True, True)}


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


@pytest.mark.parametrize("n", [2])
def test_synthetic_acceptance_keeps_exactly_n_proposals_for_benchmarks(engine_config, n):
    """--spec-synthetic-accept N (with --benchmark alone): every verify row keeps min(N, its
    proposals), whatever they are, so a benchmark can price any acceptance length on a random
    file; the sequences stay whole (the pool, no compile while serving)."""
    with pytest.raises(ValueError, match="^spec_synthetic_accept=.*benchmark"):
        EngineConfig(spec_mode="ngram", spec_synthetic_accept=n)
    with pytest.raises(ValueError, match="^spec_synthetic_accept=.*spec_mode"):
        EngineConfig(benchmark=True, spec_synthetic_accept=n)
    base = engine_config.replace(max_concurrency=4, prefill_chunk=16, prefill_token_budget=16)
    loaded = load_engine(base.replace(spec_mode="ngram", draft_tokens=K, benchmark=True,
                                      spec_synthetic_accept=n))  # fmt: skip
    engine = loaded[1]
    engine.spec.policy = SpecPolicy(K, dict.fromkeys(engine.token_buckets, 1.0), min_gain=0.0)
    engine.spec.policy.observe_step = lambda seconds: None
    engine.spec.gate = None
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs, _ = run(loaded, [(0, p, sp) for p in prompts(4)])
    assert all(len(o) == 12 for o in outs)
    lengths = engine.spec.stats()["accept_lengths"]
    assert lengths.get(n, 0) > 5 and set(lengths) <= set(range(n + 1)), lengths


def test_a_draft_with_another_vocabulary_is_refused(engine_config, tmp_path):
    other = hf_to_gguf(make_hf_model("qwen3", seed=3, vocab=300), "qwen3", tmp_path / "o.gguf")
    with pytest.raises(ValueError, match="vocabulary"):
        load_engine(engine_config.replace(spec_mode="draft", draft=str(other)))


def test_serve_flags_map_to_the_speculation_fields(capsys):
    from luce_jax.serve import parse_config

    _, cfg = parse_config(["--spec-mode", "draft", "--draft-tokens", "3"])
    assert (cfg.spec_mode, cfg.draft, cfg.draft_tokens) == ("draft", None, 3)
    assert cfg.spec_policy == "auto"
    assert parse_config(["--spec-policy", "adaptive"])[1].spec_policy == "adaptive"
    with pytest.raises(ValueError, match="spec_policy"):
        EngineConfig(spec_policy="greedy")
    assert cfg.draft_model.endswith("luce-stdlib-draft.gguf")
    with pytest.raises(SystemExit):
        parse_config(["--spec-mode", "eagle"])
    assert "--spec-mode" in capsys.readouterr().err
