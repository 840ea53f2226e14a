"""The speculation policy: estimates, the tokens-per-second choice, turning down, probing."""

import itertools
import random

import numpy as np
import pytest

from luce_jax.speculation.policy import SpecPolicy

FLAT = {8: 0.010, 16: 0.010, 32: 0.010, 64: 0.011}  # memory-bound: tokens are nearly free
LINEAR = {8: 0.010, 16: 0.020, 32: 0.040, 64: 0.080}  # compute-bound: time grows with tokens


def policy(step_time=FLAT, k=4, rates=None, **kw):
    kw.setdefault("probe_soon", 0)  # the full interval only, unless a test asks
    p = SpecPolicy(k, step_time, probe_every=kw.pop("probe_every", 10**9), **kw)
    for s, a in (rates or {}).items():
        p.start(s)
        p._slots[s].rate = a
    return p


def test_expected_tokens_count_the_correction_and_each_kept_prefix():
    p = policy(rates={0: 0.5})
    assert p.expected_tokens(0, 0) == 1.0
    assert p.expected_tokens(0, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_observations_move_the_estimate():
    p = policy(prior=0.5, smoothing=0.5)
    p.start(3)
    p.observe(3, proposed=4, accepted=4)  # all kept: observation 1
    assert p.rate(3) == pytest.approx(0.75)
    p.observe(3, proposed=4, accepted=0)  # first rejected: observation 0
    assert p.rate(3) == pytest.approx(0.375)
    p.observe(3, proposed=4, accepted=1)  # one kept, one rejected, two never tested: 1/2
    assert p.rate(3) == pytest.approx(0.4375)
    with pytest.raises(ValueError, match="accepted 5 of 4"):
        p.observe(3, proposed=4, accepted=5)


def test_cheap_tokens_make_every_slot_speculate_fully():
    p = policy(FLAT, k=4, rates={0: 0.6, 1: 0.8, 2: 0.9})
    assert p.plan({0: 4, 1: 4, 2: 2}) == {0: 4, 1: 4, 2: 2}  # 3 + 10 tokens fit bucket 16
    # ... but only proposals likelier than min_gain (0.1) to be kept: 0.3^2 is not
    assert policy(FLAT, k=4, rates={0: 0.3}).plan({0: 4}) == {0: 1}


def test_costly_tokens_turn_speculation_off_at_high_concurrency():
    rates = {s: 0.7 for s in range(16)}
    assert set(policy(LINEAR, rates=rates).plan(dict.fromkeys(range(16), 4)).values()) == {0}
    # one slot alone still speculates: bucket 8 holds its proposals at no extra cost
    assert policy(LINEAR, rates={0: 0.7}).plan({0: 4}) == {0: 4}


def test_measured_host_cost_of_speculating_steps_turns_it_down():
    """Warmup says tokens are free; real speculating steps take 3x as long (host work): after
    a few such observations the policy stops proposing, and plain steps do not move that."""
    p = policy(FLAT, k=4, rates=dict.fromkeys(range(8), 0.6), smoothing=0.5)
    want = dict.fromkeys(range(8), 4)
    assert sum(p.plan(want).values()) > 0
    for _ in range(6):
        p.observe_step(0.030)
        if not any(p.plan(want).values()):
            break
    assert not any(p.plan(want).values())
    assert p.overhead[True] > 0.01 and p.overhead[False] == 0.0
    p.observe_step(0.010)  # a plain step costs what warmup said: nothing to learn
    assert p.overhead[False] == pytest.approx(0.0)


def test_observations_go_to_the_steps_they_measure_in_dispatch_order():
    """With overlapped steps the next step is planned before this one's time is known: each
    observation belongs to the oldest step not yet observed, and a step that planned nothing
    (no decode rows) teaches nothing."""
    p = policy(FLAT, k=4, rates={0: 0.6}, smoothing=1.0)
    assert sum(p.plan({0: 4}).values()) > 0  # step 1 proposes
    p.skip()  # step 2: prompt rows only
    p._slots[0].rate = 0.0
    assert not any(p.plan({0: 4}).values())  # step 3 does not
    p.observe_step(0.030)  # step 1's time
    assert p.overhead[True] == pytest.approx(0.020) and p.overhead[False] == 0.0
    p.observe_step(0.500)  # step 2's: nothing to learn
    assert p.overhead[False] == 0.0
    p.observe_step(0.012)  # step 3's
    assert p.overhead[False] == pytest.approx(0.002)
    p._slots[0].rate = 0.6
    p.plan({0: 4})  # a proposing step whose launch raised: it never gets a time
    p.forget_last()
    p.skip()
    p.observe_step(0.500)  # the next step's, which planned nothing
    assert p.overhead[True] == pytest.approx(0.020)


def test_a_draft_models_cost_is_weighed_per_depth():
    """Draft steps of 4 ms fixed + 2 ms per depth on 10 ms target steps: with acceptance 0.9
    one slot proposes; with 0.3 (1.3 tokens for 16 ms against 1 for 10) it does not."""
    kw = dict(proposal_fixed=0.004, proposal_time=0.002)
    assert sum(policy(FLAT, rates={0: 0.9}, **kw).plan({0: 4}).values()) >= 2
    assert policy(FLAT, rates={0: 0.3}, **kw).plan({0: 4}) == {0: 0}


def test_a_slot_with_poor_acceptance_stops_while_a_good_one_continues():
    step_time = {8: 0.010, 16: 0.0125, 32: 0.016}
    p = policy(step_time, k=4, rates={s: 0.9 if s < 4 else 0.05 for s in range(8)})
    plan = p.plan(dict.fromkeys(range(8), 4))
    assert all(plan[s] == 4 for s in range(4)) and all(plan[s] == 0 for s in range(4, 8))


def test_prompt_tokens_in_the_step_leave_less_room():
    p = policy(LINEAR, k=4, rates={0: 0.5, 1: 0.5})
    assert p.plan({0: 4, 1: 4}) == {0: 3, 1: 3}  # 2 rows + 6 proposals fill bucket 8
    # 6 prompt tokens fill bucket 8; 6 proposals would double the step for 1.75 more tokens
    assert p.plan({0: 4, 1: 4}, other_tokens=6) == {0: 0, 1: 0}


def test_an_idle_slot_is_probed_with_one_proposal_when_it_fits():
    p = policy(LINEAR, k=4, rates={0: 0.0, 1: 0.0}, probe_every=3, proposal_time=1e-6)
    plans = [p.plan({0: 4, 1: 4}) for _ in range(3)]
    assert plans[:2] == [{0: 0, 1: 0}] * 2 and plans[2] == {0: 1, 1: 1}
    assert p.plan({0: 4, 1: 4}) == {0: 0, 1: 0}  # probed: idle again from zero


def test_probes_come_together_and_rarer_when_proposals_cost_a_draft_step():
    # draft program 10 ms on 10 ms target steps: the interval doubles (3 -> 6)
    p = policy(FLAT, k=4, rates={0: 0.0, 1: 0.0}, probe_every=3, proposal_fixed=0.01)
    assert p.probe_interval == 6
    plans = [p.plan({0: 4}) for _ in range(2)]  # slot 0 alone for two steps
    plans += [p.plan({0: 4, 1: 4}) for _ in range(4)]  # then slot 1 joins, less idle
    # both probed at once, with as many proposals as fit bucket 8 (depth costs nothing)
    assert [sum(x.values()) for x in plans] == [0, 0, 0, 0, 0, 6]


def test_the_always_policy_verifies_k_for_every_slot_within_the_largest_bucket():
    p = policy(LINEAR, k=4, rates={s: 0.0 for s in range(16)}, always=True)
    assert p.plan({0: 4, 1: 2, 2: 0}) == {0: 4, 1: 2, 2: 0}  # estimates of 0 do not matter
    plan = p.plan(dict.fromkeys(range(16), 4), other_tokens=20)  # 36 tokens before proposals
    assert sum(plan.values()) == 64 - 36 and max(plan.values()) == 4  # bucket 64 is full


@pytest.mark.parametrize("seed", range(4))
def test_the_always_plan_on_arrays_equals_the_plan_on_slots(seed):
    """take_all (proposals held on the device: no dicts) plans what the always plan does, and
    notes the same predicted step for observe_step."""
    rng = random.Random(seed)
    a, b = (policy(LINEAR, k=4, always=True) for _ in range(2))
    for _ in range(20):
        caps = [rng.randint(0, 6) for _ in range(rng.randint(1, 24))]
        other = rng.choice([0, 5, 40])
        want = a.plan(dict(enumerate(caps)), other_tokens=other)
        got = b.take_all(np.asarray(caps, np.int32), len(caps) + other)
        assert got.tolist() == [want[s] for s in range(len(caps))]
    assert list(a._pending) == list(b._pending)


# measured at warmup on the random Qwen3-8B file (2026-12-03, ms): a step costs more past 128
STEEP = {32: 0.0067, 64: 0.0074, 128: 0.0085, 256: 0.0099, 512: 0.0143}


def test_the_fitted_plan_keeps_verify_rows_in_a_bucket_that_pays_for_them():
    """spec_policy auto: 32 rows that keep a proposal with probability 0.44 verify 3 each (128
    tokens, bucket 128) rather than 4 (160, bucket 256); rows that keep nearly everything, or
    step times that do not grow, still verify K; without fit (always) every row verifies K."""
    caps = np.full(32, 4, np.int32)
    fitted = policy(STEEP, k=4, always=True, fit=True)
    assert fitted.take_all(caps, 32, np.full(32, 0.44)).tolist() == [3] * 32
    assert fitted.take_all(caps, 32, np.full(32, 0.95)).tolist() == [4] * 32
    assert (
        policy(FLAT, k=4, always=True, fit=True)
        .take_all(np.full(4, 4, np.int32), 4, np.full(4, 0.2))
        .tolist()
        == [4] * 4
    )
    assert (
        policy(STEEP, k=4, always=True).take_all(caps, 32, np.full(32, 0.44)).tolist() == [4] * 32
    )
    # the chosen depth maximizes expected tokens per predicted second over every depth
    rates = np.random.default_rng(0).uniform(0, 1, 32)
    got = fitted.take_all(caps, 32, rates)

    def per_second(c):
        used = 32 + 32 * c
        bucket = next(b for b in sorted(STEEP) if b >= used)
        return sum(sum(a**j for j in range(c + 1)) for a in rates) / STEEP[bucket]

    assert per_second(int(got.max())) == max(per_second(c) for c in range(1, 5))


def test_a_probe_verifies_as_many_proposals_as_fit_when_depth_costs_nothing():
    p = policy(FLAT, k=4, rates={0: 0.0, 1: 0.0}, probe_every=2)
    assert p.plan({0: 4, 1: 4}) == {0: 0, 1: 0}
    assert p.plan({0: 4, 1: 2}) == {0: 4, 1: 2}  # 2 rows + 6 proposals fit bucket 8


def test_a_slot_that_stopped_is_probed_soon_then_less_often_while_nothing_is_kept():
    p = policy(FLAT, k=4, rates={0: 0.0}, probe_every=20, probe_soon=2)

    def probes(steps, kept=0):
        out = []
        for i in range(steps):
            if n := p.plan({0: 4})[0]:
                out.append(i)
                p.observe(0, proposed=n, accepted=min(kept, n))
                p._slots[0].rate = 0.0  # stays below what pays: only probes propose
        return out

    # waits 2, 4, 8, 16, then the full interval (20)
    assert probes(70) == [1, 5, 13, 29, 49, 69]
    assert probes(25, kept=1) == [19, 21, 23]  # a kept proposal: 2 again


@pytest.mark.parametrize("seed", range(30))
def test_the_plan_maximizes_expected_tokens_per_second(seed):
    r = random.Random(seed)
    buckets = [8, 16, 32]
    times = sorted(r.uniform(0.005, 0.05) for _ in buckets)
    step_time = dict(zip(buckets, times, strict=True))
    n = r.randint(1, 6)
    rates = {s: r.random() for s in range(n)}
    avail = {s: r.randint(0, 4) for s in range(n)}
    other = r.randint(0, 8)
    p = policy(step_time, k=3, rates=rates, min_gain=0.0)

    def value(ks):
        total = n + other + sum(ks.values())
        b = next((b for b in buckets if b >= total), None)
        if b is None:
            return -1.0
        return sum(p.expected_tokens(s, k) for s, k in ks.items()) / step_time[b]

    best = max(
        value(dict(zip(avail, ks, strict=True)))
        for ks in itertools.product(*(range(min(a, 3) + 1) for a in avail.values()))
    )
    assert value(p.plan(avail, other)) == pytest.approx(best)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="max_proposals"):
        SpecPolicy(0, FLAT)
    with pytest.raises(ValueError, match="step_time"):
        SpecPolicy(2, {8: 0.0})
    with pytest.raises(ValueError, match="smoothing"):
        SpecPolicy(2, FLAT, smoothing=0)
