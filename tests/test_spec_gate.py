"""The speculation gate (speculation/gate.py) against simulated serving rates: it settles on the
faster regime, what it costs when speculation never pays stays within the issue's 2%, and it
recovers when the faster regime changes (no model, no jax)."""

import random

import pytest

from luce_jax.speculation.gate import SpecGate
from luce_jax.speculation.policy import SpecPolicy
from luce_jax.speculation.speculator import Speculator


def serve(gate, rate_on, rate_off, steps, rng, rows=4, noise=0.15):
    """Feed `steps` steps whose tokens per row-second are rate_on / rate_off (x per-step noise)
    as the gate's regime says. Returns the steps run with speculation on."""
    on_steps = 0
    for _ in range(steps):
        rate = rate_on if gate.on else rate_off
        on_steps += gate.on
        tokens = rows * (2 if gate.on else 1)  # a speculating step emits more, and takes longer
        seconds = tokens / (rows * rate) * (1 + rng.uniform(-noise, noise))
        gate.observe(tokens, rows, seconds)
    return on_steps


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gain", [1.6, 1.15])
def test_a_speculation_that_pays_stays_on(seed, gain):
    gate = SpecGate()
    on = serve(gate, gain, 1.0, 4000, random.Random(seed))
    assert gate.best and gate.on and on > 0.95 * 4000
    assert gate.log_ratio > 0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("loss", [0.6, 0.85])
def test_a_speculation_that_never_pays_costs_at_most_two_percent(seed, loss):
    """Served time over 4000 steps against never speculating: the trials' share of the loss."""
    gate = SpecGate()
    steps = 4000
    on = serve(gate, loss, 1.0, steps, random.Random(seed))
    assert not gate.best
    # each step of speculation served at `loss` of the rate: extra time per step 1/loss - 1
    cost = on * (1 / loss - 1) / steps
    assert cost <= 0.02, (on, cost)


def test_host_pauses_in_a_trial_do_not_decide_it():
    """A regime 30% slower keeps losing though pauses of 10 step times hit 1 step in 10."""
    rng = random.Random(1)
    gate = SpecGate()
    for _ in range(3000):
        tokens = 8 if gate.on else 4
        seconds = (tokens / 4) / (0.7 if gate.on else 1.0)
        pause = 10 * seconds if rng.random() < 0.1 and not gate.on else 0.0
        gate.observe(tokens, 4, seconds + pause)
    assert not gate.best and gate.trials >= 3


def test_it_follows_a_change_of_the_faster_regime():
    rng = random.Random(0)
    gate = SpecGate()
    serve(gate, 0.7, 1.0, 2000, rng)
    assert not gate.best
    serve(gate, 1.5, 1.0, 3000, rng)  # the text became predictable
    assert gate.best and gate.on


def test_a_change_of_load_brings_a_trial_at_once_and_a_fresh_verdict():
    """Speculation pays at 1 row a step and loses at 32 (bigger buckets cost more there):
    when the load moves, the gate turns speculation off within a few trials, not after its
    longest window."""
    rng = random.Random(2)
    gate = SpecGate()
    serve(gate, 1.5, 1.0, 3000, rng, rows=1)
    assert gate.best and gate.trials >= 4
    on = serve(gate, 0.8, 1.0, 400, rng, rows=32)
    assert not gate.best and on < 100, on


def test_steps_without_rows_and_the_first_after_a_switch_are_not_counted():
    gate = SpecGate(trial=2, window=4, max_window=8)
    for _ in range(100):
        gate.observe(0, 0, 1.0)  # prefill only: nothing learned, no window ends
    assert gate.on and gate.trials == 0
    for _ in range(2):  # the first window (trial steps)
        gate.observe(8, 4, 1.0)
    assert not gate.on  # the trial without speculation starts
    gate.observe(10**6, 4, 1.0)  # dispatched before the switch: skipped
    for _ in range(2):
        gate.observe(4, 4, 1.0)  # half the tokens per row-second: speculation wins
    assert (
        gate.trials == 1 and gate.best and gate.on and gate.log_ratio == pytest.approx(0.693, 1e-3)
    )


def test_while_off_the_speculator_proposes_nothing():
    gate = SpecGate()
    gate.on = gate.best = False
    gate._left = 50

    class Lookup:
        def available(self, want):
            return dict(want)

        def propose(self, want):
            return {s: [7] * k for s, k in want.items()}

    spec = Speculator(Lookup(), SpecPolicy(3, {8: 1.0}, always=True), "ngram", gate)
    spec.policy.start(0)
    assert spec.choose({0: 3}, 0) == {0: []}
    assert not spec.wants_proposals(new_decoders=True)
    gate.on = True
    assert spec.choose({0: 3}, 0) == {0: [7, 7, 7]} and spec.stats()["active"]


def test_bad_windows_are_named():
    with pytest.raises(ValueError, match="trial"):
        SpecGate(trial=0)
    with pytest.raises(ValueError, match="window"):
        SpecGate(trial=32, window=16)


def test_a_load_that_swings_keeps_a_verdict_per_load_level():
    """Waves of concurrent requests: 100 steps at 16 rows, then their ends thin the rows out to
    2 for 60 steps, and again. Speculation pays at 16 rows and loses at 2: each level keeps its
    own verdict across the swings, so after the first waves each phase runs its faster regime
    nearly throughout (a single average restarted at every swing re-decides in each phase)."""
    rng = random.Random(3)
    gate = SpecGate()
    on = {16: [], 2: []}
    for wave in range(40):
        for rows, steps, gain in ((16, 100, 1.3), (2, 60, 0.7)):
            n = serve(gate, gain, 1.0, steps, rng, rows=rows)
            if wave >= 10:
                on[rows].append(n / steps)
    assert sum(on[16]) / len(on[16]) > 0.9 and sum(on[2]) / len(on[2]) < 0.2, on
    assert gate.ratios[4] > 0 > gate.ratios[1]
