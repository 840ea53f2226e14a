"""The engine thread: thread-safe submit/cancel, streams, and a failed step that spares others."""

import threading

from luce_jax.host.loop import EngineLoop
from luce_jax.host.scheduler import Scheduler
from luce_jax.sampling_params import SamplingParams

from fake_engine import FakeEngine


def collect():
    events, done = [], threading.Event()

    def on_event(ev):
        events.append(ev)
        if ev.final:
            done.set()

    return events, done, on_event


def test_submit_from_many_threads_and_cancel():
    eng = FakeEngine(slots=3, blocks=400, max_context=1000)
    loop = EngineLoop(Scheduler(eng)).start()
    try:
        results = []

        def client(i):
            events, done, cb = collect()
            loop.submit([1] * (i + 1), SamplingParams(max_tokens=5), cb)
            assert done.wait(10)
            results.append(events)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 8
        for events in results:
            assert sum(len(e.token_ids) for e in events) == 5
            assert events[-1].finish_reason == "length"
        events, done, cb = collect()
        r = loop.submit([1, 2], SamplingParams(max_tokens=900), cb)
        loop.cancel(r)
        assert done.wait(10)
        assert events[-1].finish_reason == "cancelled"
    finally:
        loop.stop()
    assert not eng.live_slots() and eng.pool.available == eng.pool.capacity
