"""A started engine (`start_engine`): the engine thread over a built engine and the gauges the
server reads; and `follow`, the other processes of several, which launch what process 0 does.
Building the engine (load, compile, size the pool) is build.py's."""

from __future__ import annotations

from .build import load_engine
from .config import EngineConfig


class EngineHandle:
    """A started engine: tokenizer, engine, scheduler and the engine thread (`loop`), and the
    gauges the server reads. Reads are safe from any thread."""

    def __init__(self, tokenizer, engine, scheduler, loop):
        self.config, self.tokenizer, self.loop = engine.config, tokenizer, loop
        self.engine, self.scheduler = engine, scheduler
        self.vocab_size = engine.runner.cfg.vocab_size

    def running(self) -> int:
        return len(self.scheduler.running)

    def waiting(self) -> int:
        return self.loop.waiting()

    def blocks_used(self) -> int:
        return self.engine.pool.used

    def blocks_free(self) -> int:
        return self.engine.pool.available

    def compiles(self) -> int:
        return self.engine.runner.compiles

    def prefix_stats(self) -> dict:
        """Prompt tokens looked up in and found in the prefix cache, and blocks it holds."""
        e = self.engine
        return {"queries": e.prefix_queries, "hits": e.prefix_hits, "blocks": e.pool.cached}

    def spec_stats(self) -> dict | None:
        """Speculation totals (speculation.speculator.Speculator.stats), None when it is off."""
        spec = self.engine.spec
        return spec.stats() if spec is not None else None

    def close(self) -> None:
        self.loop.stop()
        self.finish()

    def finish(self) -> None:
        """After the engine thread has stopped: the processes that follow this one's steps
        stop, and the routing histogram is written where one is recorded."""
        runner = self.engine.runner
        runner.close()
        if runner.tally is not None:
            from .expert_stats import in_file_order, save

            counts = in_file_order(runner.tally.counts(runner.placement), runner.expert_orders)
            save(self.config.record_expert_stats, counts)


def start_engine(config: EngineConfig) -> EngineHandle:
    """Load, compile and start the engine thread (blocks until ready)."""
    from .host.loop import EngineLoop
    from .host.scheduler import Scheduler

    tokenizer, engine = load_engine(config)
    c = engine.config
    if c.num_processes > 1:  # the other processes launch every program this one launches
        from .device.distributed import StepStream

        engine.runner.stream = StepStream()
    scheduler = Scheduler(engine, tokenizer, c.max_queue, c.admission_coalesce_ms)
    return EngineHandle(tokenizer, engine, scheduler, EngineLoop(scheduler).start())


def follow(config: EngineConfig) -> None:
    """A process other than 0 of several: load and warm up as process 0 does, then launch the
    programs it launches, with its inputs, until it stops (device/distributed.py)."""
    from .device.distributed import follow_stream

    _, engine = load_engine(config)
    follow_stream(engine.runner)
