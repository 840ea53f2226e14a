"""Speculation for a built engine: its proposer, the policy's step costs (measured now), the
gate; called by luce_jax/build.py once every bucket is compiled and the weights are in."""

from __future__ import annotations

import logging

from ..device import bucket_runs
from .draft import DraftProposer
from .draft_runner import DraftRunner
from .gate import SpecGate
from .ngram import NgramProposer
from .on_device import OnDeviceProposer
from .policy import SpecPolicy
from .speculator import Speculator

log = logging.getLogger(__name__)


def enable_speculation(config, engine, draft, runner_for, pairs, clock) -> None:
    """Build the engine's Speculator and enable it.

    Args:
      config: the EngineConfig (spec_mode not off); engine: the warmed StepEngine.
      draft: (ModelConfig, params) of a draft model run on the host (hybrid targets), else
        None (no draft, or one inside the target's step).
      runner_for: (runner class, model config, params, **kw) -> a runner on the engine's pool.
      pairs: the engine's (T, S) bucket pairs; clock: the start-up's StartupClock.
    """
    runner, mc, spec_k = engine.runner, engine.runner.cfg, config.draft_tokens
    per_depth = fixed = 0.0
    if runner.ahead:  # proposals come with each step: no program of their own
        proposer = OnDeviceProposer()
    elif draft is None:
        proposer = NgramProposer()
    else:
        d_runner = runner_for(DraftRunner, *draft, depth=spec_k, vocab=mc.vocab_size)
        with clock.phase("draft compile and timing"):
            d_runner.warmup(pairs)
        proposer = DraftProposer(
            d_runner,
            config.max_concurrency,
            engine.token_buckets,
            engine.rows_for,
            config.prefill_chunk,
            engine.slots,
        )
        # The draft program's cost, linear in depth: t(d) = fixed + d * per_depth.
        t1, tk = d_runner.propose_time[1], d_runner.propose_time[spec_k]
        per_depth = max(tk - t1, 0.0) / max(spec_k - 1, 1)
        fixed = max(t1 - per_depth, 0.0)
    with clock.phase("step timing"):
        bucket_runs.time_steps(runner, pairs)
    if runner.ahead:  # proposing runs in the step before the proposals' step
        fixed = runner.propose_time
    step_time = {t: runner.step_time[(t, s)] for t, s in pairs}
    # auto: with proposals on the device, K for every slot while the gate measures that this
    # serves faster than no speculation (speculation/gate.py says why); adaptive otherwise.
    gated = config.spec_policy == "auto" and runner.ahead
    always = config.spec_policy == "always" or gated
    policy = SpecPolicy(spec_k, step_time, proposal_time=per_depth, proposal_fixed=fixed,
                        always=always, fit=gated)  # fmt: skip
    gate = SpecGate() if gated else None
    engine.enable_speculation(Speculator(proposer, policy, config.spec_mode, gate))
    log.info(
        "speculation: %s, up to %d proposals per sequence (%s policy); step ms by bucket %s; "
        "draft ms %.2f + %.2f per proposal",
        config.spec_mode,
        spec_k,
        "always, gated" if gated else "always" if always else "adaptive",
        {t: round(v * 1e3, 2) for t, v in step_time.items()},
        fixed * 1e3,
        per_depth * 1e3,
    )
