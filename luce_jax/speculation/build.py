"""Speculation for a built engine: its proposer, the policy's step costs (measured now), the
gate; called by luce_jax/build.py once every bucket is compiled and the weights are in."""

from __future__ import annotations

import logging

from ..device import bucket_runs
from .gate import SpecGate
from .ngram import NgramProposer
from .on_device import OnDeviceProposer
from .policy import SpecPolicy
from .speculator import Speculator

log = logging.getLogger(__name__)


def enable_speculation(config, engine, pairs, clock) -> None:
    """Build the engine's Speculator and enable it.

    Args:
      config: the EngineConfig (spec_mode not off); engine: the warmed StepEngine.
      pairs: the engine's (T, S) bucket pairs; clock: the start-up's StartupClock.
    """
    runner, spec_k = engine.runner, config.draft_tokens
    # proposals made on the device come with each step; prompt lookup on the host (a family
    # whose slots are fed their kept proposals again) from the tokens the host holds
    proposer = OnDeviceProposer() if runner.ahead else NgramProposer()
    with clock.phase("step timing"):
        bucket_runs.time_steps(runner, pairs)
    # proposing on the device runs in the step before the proposals' step
    fixed = runner.propose_time if runner.ahead else 0.0
    step_time = {t: runner.step_time[(t, s)] for t, s in pairs}
    # auto: with proposals on the device, K for every slot while the gate measures that this
    # serves faster than no speculation (speculation/gate.py says why); adaptive otherwise.
    gated = config.spec_policy == "auto" and runner.ahead
    always = config.spec_policy == "always" or gated
    policy = SpecPolicy(spec_k, step_time, proposal_fixed=fixed, always=always, fit=gated)
    gate = SpecGate() if gated else None
    engine.enable_speculation(Speculator(proposer, policy, config.spec_mode, gate))
    log.info(
        "speculation: %s, up to %d proposals per sequence (%s policy); step ms by bucket %s; "
        "proposing ms %.2f",
        config.spec_mode,
        spec_k,
        "always, gated" if gated else "always" if always else "adaptive",
        {t: round(v * 1e3, 2) for t, v in step_time.items()},
        fixed * 1e3,
    )
