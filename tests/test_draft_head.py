"""Speculation with a draft head on the target's hidden states (--spec-mode head).

The target is the tiny random qwen3 with its layers' outputs (o_proj, down_proj) scaled by
eps, and the head passes the sampled token's embedding through (fc = [0; I], no MLP): at
eps = 0 the target's hidden state at a position is exactly its token's embedding, so the
head predicts every token the target samples; at eps = 0.05 the layers' small contribution
flips some, so verify rows keep all, some or none of their proposals.
"""

import copy

import jax
import numpy as np
import pytest
import torch
from test_speculation import N_CHI, K, chi_square, first_tokens, prompts, run

from luce_jax.build import load_engine
from luce_jax.config import EngineConfig
from luce_jax.models import draft_head
from luce_jax.sampling_params import SamplingParams
from luce_jax.speculation.policy import SpecPolicy

from hf_gguf import hf_to_gguf, make_hf_model

D, VOCAB = 64, 320  # the tiny models' width and vocabulary (hf_gguf.make_hf_model)


@pytest.fixture(scope="module")
def targets(tiny_models, tmp_path_factory):
    """eps -> GGUF of the tiny qwen3 with its layers' outputs scaled by eps."""
    d = tmp_path_factory.mktemp("head_targets")
    out = {}
    for eps in (0.0, 0.05):
        m = copy.deepcopy(tiny_models["qwen3"][0])
        with torch.no_grad():
            for name, w in m.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    w.mul_(eps)
        out[eps] = str(hf_to_gguf(m, "qwen3", d / f"eps{eps}.gguf"))
    return out


def write_head(path, d=D, vocab=VOCAB):
    """The embedding pass-through head (module docstring)."""
    cfg = draft_head.HeadConfig(d=d, ffn=32)
    hp = {k: np.asarray(v) for k, v in draft_head.init(cfg, jax.random.key(0)).items()}
    hp["fc"] = np.concatenate([np.zeros((d, d)), np.eye(d)]).astype(np.float32)
    hp["wd"] = np.zeros_like(hp["wd"])
    draft_head.save(str(path), cfg, hp, vocab, "tiny")
    return str(path)


@pytest.fixture(scope="module")
def head_gguf(tmp_path_factory):
    return write_head(tmp_path_factory.mktemp("head") / "head.gguf")


@pytest.fixture(scope="module")
def engines(engine_config, targets, head_gguf):
    """(eps, mode) -> loaded engine; head engines always propose K (flat step times). At eps
    0.05 the head takes prompt lookup's proposals where a row's text repeats (head_lookup);
    at eps 0, where the head is exact, it proposes alone."""
    base = engine_config.replace(max_concurrency=4, prefill_chunk=16, prefill_token_budget=16)
    out = {}
    for eps, path in targets.items():
        out[eps, "off"] = load_engine(base.replace(model=path))
        loaded = load_engine(
            base.replace(
                model=path, spec_mode="head", draft=head_gguf, draft_tokens=K, head_lookup=eps > 0
            )  # fmt: skip
        )
        engine = loaded[1]
        engine.spec.policy = SpecPolicy(K, dict.fromkeys(engine.token_buckets, 1.0), min_gain=0.0)
        engine.spec.policy.observe_step = lambda seconds: None  # keep it proposing
        engine.spec.gate = None  # which no measurement turns off
        out[eps, "head"] = loaded
    return out


SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.2,
               presence_penalty=0.4, frequency_penalty=0.2, logprobs=2)  # fmt: skip


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_an_exact_head_has_every_proposal_kept(engines, sampled):
    """Proposals come from the hidden state and token of each row's last emitted position,
    picked with the noise the target's next row draws at each offset: a head that predicts the
    target exactly has all of them kept, greedy and sampled."""
    kw = dict(temperature=1.0, seed=5) if sampled else dict(temperature=0)
    arrivals = [
        (i, p, SamplingParams(max_tokens=14, ignore_eos=True, **{**kw, "seed": i}))
        for i, p in enumerate(prompts())
    ]
    want, _ = run(engines[0.0, "off"], arrivals)
    got, engine = run(engines[0.0, "head"], arrivals)
    assert got == want
    st = engine.spec.stats()
    assert st["proposed"] > 50 and st["accepted"] == st["proposed"], st


def test_sampled_token_distribution_matches_the_target(engines):
    """The chi-square test of test_speculation.py (its negative control is there): the first
    three tokens at temperature 0.8 with the head's proposals (eps 0.05) against none."""
    a, _ = first_tokens(engines[0.05, "off"], 0)
    b, engine = first_tokens(engines[0.05, "head"], 10**6)
    stat, threshold = chi_square(a, b)
    assert stat < threshold, (stat, threshold)
    assert len(set(a) | set(b)) <= 8  # nothing outside the target's top 2
    assert engine.spec.stats()["accepted"] > N_CHI / 4, engine.spec.stats()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded-with-penalties"])
def test_output_is_token_identical_with_proposals_kept_in_full_in_part_and_not_at_all(
    engines, sampled
):
    arrivals = [
        (i // 3 * 2, p, SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True, seed=100 + i,
                                       **(SAMPLED if sampled else {"temperature": 0})))
        for i, p in enumerate(prompts())
    ]  # fmt: skip
    want, _ = run(engines[0.05, "off"], arrivals)
    got, engine = run(engines[0.05, "head"], arrivals)
    assert got == want
    lengths = engine.spec.stats()["accept_lengths"]
    if not sampled:  # penalties make the head's (penalty-free) picks miss more often
        assert {0, K} <= set(lengths) and set(lengths) & set(range(1, K)), lengths


def test_stop_token_inside_an_accepted_block_ends_the_request_there(engines):
    p = prompts()[1]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = run(engines[0.0, "off"], [(0, p, greedy)])[0][0]
    stop = ref[7]
    cut = ref[: ref.index(stop) + 1]
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    assert run(engines[0.0, "head"], [(0, p, sp)])[0][0] == cut


def test_steps_overlap_and_verify_rows_catch_up_on_the_device(engines, monkeypatch):
    """Proposals stay on the device, so step N+1 is dispatched before step N is collected: its
    verify rows carry markers instead of tokens, and rows of slots whose step in flight may
    keep proposals are marked behind (the device moves them on)."""
    loaded = engines[0.0, "head"]
    engine = loaded[1]
    assert engine.overlap
    seen = []
    launch = engine.runner.launch_forward

    def spy(b, T, S):
        seen.append((engine.in_flight, int(b["behind"].sum()), int((b["tokens"] <= -2).sum())))
        return launch(b, T, S)

    monkeypatch.setattr(engine.runner, "launch_forward", spy)
    arrivals = [(0, prompts()[1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))]
    want, _ = run(engines[0.0, "off"], arrivals)
    assert run(loaded, arrivals)[0] == want
    ahead = [s for s in seen if s[0] == 1 and s[1] > 0 and s[2] > 0]
    assert len(ahead) >= 3, seen  # dispatched with a step in flight, behind, markers fed


def test_the_head_runs_only_in_steps_whose_proposals_may_be_verified(engines, monkeypatch):
    """A policy that never proposes (no gain is worth it, no probes) leaves the head out of
    every step but those completing a prompt (a new slot starts from the prior estimate):
    speculation that does not pay costs no head."""
    loaded = engines[0.0, "head"]
    engine = loaded[1]
    never = SpecPolicy(K, dict.fromkeys(engine.token_buckets, 1.0), min_gain=2.0,
                       probe_every=10**6, probe_soon=0)  # fmt: skip
    monkeypatch.setattr(engine.spec, "policy", never)
    seen = []
    launch = engine.runner.launch_sample

    def spy(fwd, b):
        seen.append((bool(b.get("propose")), int(b["sample_mask"].sum()), int(b["n_draft"].sum())))
        return launch(fwd, b)

    monkeypatch.setattr(engine.runner, "launch_sample", spy)
    arrivals = [(i, p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts(3))]  # fmt: skip
    assert run(loaded, arrivals)[0] == run(engines[0.0, "off"], arrivals)[0]
    assert not any(n_draft for _, _, n_draft in seen)
    assert 1 <= sum(p for p, _, _ in seen) <= 3 < len(seen)  # prompt-completing steps only


def test_the_head_adds_no_branch_to_the_sampling_program(engines):
    """The head's K steps are unrolled, so its sampling variants, lowered for CUDA, hold no
    lax.cond or while loop (test_engine.py says why that matters)."""
    import re

    runner = engines[0.05, "head"][1].runner
    keys = [k for k in runner.sample_programs._exec if k[-1]]  # the variants running the head
    assert keys
    for key in keys[:2]:
        fn, args = runner.sample_function(*key)
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert not re.findall(r"stablehlo\.(?:case|if|while)\b", text), key


def test_a_head_round_trips_through_gguf_and_must_fit_the_model(tmp_path):
    path = write_head(tmp_path / "h.gguf")
    cfg, params = draft_head.load(path, D, VOCAB, "float32")
    assert (cfg.d, cfg.ffn) == (D, 32) and params["fc"].shape == (2 * D, D)
    np.testing.assert_array_equal(np.asarray(params["fc"][D:]), np.eye(D))
    with pytest.raises(ValueError, match="width 64"):
        draft_head.load(path, 128, VOCAB, "float32")
    with pytest.raises(ValueError, match="vocabulary 320"):
        draft_head.load(path, D, 1000, "float32")


def test_head_flags_are_validated(engine_config, tiny_gguf, head_gguf, tiny_models, tmp_path):
    with pytest.raises(ValueError, match="draft head"):
        EngineConfig(model=tiny_gguf, spec_mode="head")  # own model, no head given
    assert EngineConfig(spec_mode="head").draft_model.endswith("luce-stdlib-head.gguf")
    with pytest.raises(ValueError, match="architecture"):  # a model is no head
        load_engine(engine_config.replace(spec_mode="head", draft=tiny_gguf))
    wide = write_head(tmp_path / "wide.gguf", d=128)
    with pytest.raises(ValueError, match="width 128"):
        load_engine(engine_config.replace(spec_mode="head", draft=wide))
    hybrid = hf_to_gguf(make_hf_model("qwen35", seed=2), "qwen35", tmp_path / "hy.gguf")
    with pytest.raises(ValueError, match="hybrid"):
        load_engine(engine_config.replace(model=str(hybrid), spec_mode="head", draft=head_gguf))


def test_with_lookup_a_row_whose_text_repeats_takes_the_lookups_proposals(monkeypatch):
    """head_lookup: a row whose last 3 tokens (its new one included) occurred before verifies
    what followed them there; every other row verifies the head's proposals."""
    import jax.numpy as jnp

    from luce_jax.device import head_proposer

    P, MB, S = 4, 4, 3
    monkeypatch.setattr(  # the head's proposals, told apart by their value
        head_proposer.draft_head, "propose", lambda *a: jnp.full((S, K), 99, jnp.int32)
    )
    hp = draft_head.init(draft_head.HeadConfig(d=D, ffn=8), jax.random.key(0))
    cfg = type("Cfg", (), {"d_model": D, "vocab_size": VOCAB, "n_layers": 1})()
    prop = head_proposer.HeadProposer(cfg, draft_head.HeadConfig(d=D, ffn=8), hp, None, k=K,
                                      block_size=P, lookup=True)  # fmt: skip
    seqs = [[5, 6, 7, 8, 5, 6, 7], [5, 6, 7, 8, 9, 6, 7], [1, 2, 3, 1, 2, 4, 2]]
    tables = np.arange(1, S * MB + 1, dtype=np.int32).reshape(S, MB)
    cache = np.zeros((S * MB + 1) * P, np.int32)
    for s, x in enumerate(seqs):
        for p, t in enumerate(x[:-1]):  # the new token is not in the cache yet
            cache[tables[s, p // P] * P + p % P] = t
    R = S
    packed = jnp.asarray(np.concatenate([[x[-1] for x in seqs], np.zeros(R), np.zeros(S)]),
                         jnp.int32)  # fmt: skip
    batch = {"slots": jnp.arange(S), "logit_start": jnp.arange(S), "top_k": jnp.zeros(S),
             "seeds": jnp.zeros(S, jnp.int32), "steps": jnp.zeros(S, jnp.int32)}  # fmt: skip
    lpos = jnp.asarray([len(x) - 2 for x in seqs], jnp.int32)
    reads = (jnp.zeros((R, D)), lpos, jnp.asarray(tables))
    floats = jnp.zeros((6, S))
    props, _ = prop.propose(prop.propose_bufs({}), jnp.asarray(cache), reads, packed, batch,
                            floats, False)  # fmt: skip
    # 5 6 7 occurred before (8 5 6 7 followed); 9 6 7 and 4 2 did not
    assert props.tolist() == [[8, 5, 6, 7][:K], [99] * K, [99] * K]
