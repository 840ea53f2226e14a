"""Scheduler policy against a fake SeqEngine: FIFO, admission, budgets, cancellation, failures."""

from hypothesis import given, settings
from hypothesis import strategies as st

from luce_jax.host.request import Request
from luce_jax.host.scheduler import QueueFull, Scheduler
from luce_jax.sampling_params import SamplingParams

from fake_engine import FakeEngine


def req(n_prompt, max_tokens=4):
    return Request(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def drain(sched, limit=500):
    for _ in range(limit):
        if sched.idle:
            return
        sched.step()
    raise AssertionError("scheduler did not drain")


def test_fifo_admission_and_head_of_line_blocking():
    eng = FakeEngine(slots=4, blocks=10, block_size=4)  # 40 tokens of KV
    sched = Scheduler(eng)
    big, small1, small2 = req(20, 12), req(2, 2), req(2, 2)  # big needs 8 blocks
    first = req(6, 4)  # 3 blocks
    for r in (first, big, small1, small2):
        sched.add(r)
    sched.step()
    # first admitted; big (8 blocks) does not fit beside it (7 left) -> nobody behind it jumps
    assert first.phase != "queued" and big.phase == "queued"
    assert small1.phase == "queued" and small2.phase == "queued"
    admitted_at = {}
    for step in range(200):
        for r in (first, big, small1, small2):
            if r.phase != "queued":
                admitted_at.setdefault(r.id, step)
        if sched.idle:
            break
        sched.step()
    assert [r.phase for r in (first, big, small1, small2)] == ["finished"] * 4
    # admission is in arrival order: the small ones never overtook the big one
    order = sorted((first, big, small1, small2), key=lambda r: admitted_at[r.id])
    assert order[:2] == [first, big]
    assert admitted_at[big.id] <= admitted_at[small1.id] <= admitted_at[small2.id]


def test_admission_needs_a_slot_and_blocks():
    eng = FakeEngine(slots=2, blocks=100)
    sched = Scheduler(eng)
    rs = [req(3) for _ in range(3)]
    for r in rs:
        sched.add(r)
    sched.step()
    assert [r.phase for r in rs[:2]] != ["queued", "queued"] and rs[2].phase == "queued"
    eng2 = FakeEngine(slots=4, blocks=3, block_size=4)  # 12 tokens
    sched2 = Scheduler(eng2)
    a, b = req(4, 4), req(4, 4)  # 2 blocks each
    sched2.add(a)
    sched2.add(b)
    sched2.step()
    assert a.phase != "queued" and b.phase == "queued"
    drain(sched2)
    assert b.phase == "finished"


def test_freed_slot_is_reused_at_once():
    eng = FakeEngine(slots=1, blocks=100)
    sched = Scheduler(eng)
    a, b = req(2, 1), req(2, 1)
    sched.add(a)
    sched.add(b)
    sched.step()  # a: prefill completes, its first token (= max_tokens) is sampled
    sched.step()  # nothing to plan (a reached max_tokens): collect it -> finished, slot free
    assert a.phase == "finished" and a.slot == 0 and b.phase == "queued"
    sched.step()  # the very next step admits b into the freed slot
    assert b.slot == 0 and b.phase == "running"
    drain(sched)
    assert b.phase == "finished"


def test_budgets_are_honoured_and_prefilling_slots_never_decode():
    eng = FakeEngine(slots=4, chunk=5, budget=12, max_prefills=2, blocks=200)
    sched = Scheduler(eng)
    for n in (17, 9, 30, 4):
        sched.add(req(n, 6))
    drain(sched)
    for plan in eng.plans:
        assert len(plan.prefills) <= 2
        assert all(n <= 5 for _, n in plan.prefills)
        assert sum(n for _, n in plan.prefills) + len(plan.decode) <= 12
        decoding = set(plan.decode)
        assert not decoding & {s for s, _ in plan.prefills}


def test_cancel_in_every_phase_frees_everything_before_the_next_plan():
    eng = FakeEngine(slots=2, chunk=4, blocks=100)
    sched = Scheduler(eng)
    decoding, prefilling, queued = req(2, 50), req(40, 5), req(3)
    for r in (decoding, prefilling, queued):
        sched.add(r)
    sched.step()
    sched.step()
    assert sched.decoding(decoding) and not sched.decoding(prefilling)
    assert prefilling.phase == "running" and queued.phase == "queued"
    delivered = [len(r.output_ids) for r in (decoding, prefilling, queued)]
    for r in (decoding, prefilling, queued):
        sched.cancel(r)
        assert r.phase == "cancelled" and r.finish_reason == "cancelled"
    assert not eng.live_slots() and eng.pool.available == eng.pool.capacity
    eng.pool.check()
    assert not sched.running and not sched.queue
    sched.step()  # collects the step still in flight; its tokens go to nobody
    assert [len(r.output_ids) for r in (decoding, prefilling, queued)] == delivered
    assert sched.idle and not sched.step()


def test_failed_step_fails_only_its_requests_and_the_scheduler_goes_on():
    eng = FakeEngine(slots=4, blocks=100, fail_on=lambda p: any(n == 7 for _, n in p.prefills))
    sched = Scheduler(eng)
    ok, bad = req(3, 3), req(7, 3)
    sched.add(ok)
    sched.step()
    sched.add(bad)
    sched.step()  # bad's prefill is in this plan along with ok's decode: both fail
    assert bad.phase == "failed" and "injected" in bad.error
    later = req(4, 2)
    sched.add(later)
    drain(sched)
    assert later.phase == "finished"
    assert eng.pool.available == eng.pool.capacity


def test_queue_limit():
    sched = Scheduler(FakeEngine(), max_queue=2)
    sched.add(req(1))
    sched.add(req(1))
    try:
        sched.add(req(1))
        raise AssertionError("expected QueueFull")
    except QueueFull as e:
        assert "2" in str(e)


def test_coalesce_window_waits_after_idle():
    eng = FakeEngine()
    sched = Scheduler(eng, coalesce_ms=50)
    r = req(2)
    sched.add(r)
    assert not sched.step(now=r.arrival + 0.01) and r.phase == "queued"
    assert sched.step(now=r.arrival + 0.06) and r.phase != "queued"


def test_too_long_fails_at_once_without_blocking_the_queue():
    eng = FakeEngine(max_context=16)
    sched = Scheduler(eng)
    long, short = req(20), req(2)
    sched.add(long)
    sched.add(short)
    sched.step()
    assert long.phase == "failed" and short.phase != "queued"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 15),  # arrival step
            st.integers(1, 40),  # prompt length
            st.integers(1, 12),  # max_tokens
            st.one_of(st.none(), st.integers(0, 20)),  # cancel at step
        ),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 4),
    st.integers(6, 40),
)
def test_property_no_leaks_disjoint_tables_pool_full_when_idle(reqs, slots, blocks):
    eng = FakeEngine(slots=slots, blocks=blocks, block_size=4, max_context=64)
    sched = Scheduler(eng)
    made = [(a, req(n, m), c) for a, n, m, c in reqs]
    for step in range(400):
        for a, r, c in made:
            if a == step:
                sched.add(r)
            if c == step and (r in sched.queue or r.slot >= 0):
                sched.cancel(r)
        sched.step()
        eng.pool.check()
        assert set(eng.pool.tables) == eng.live_slots() == set(sched.running)
        assert len(sched.running) <= slots
        if step > 15 and sched.idle:
            break
    assert sched.idle
    assert all(r.done for _, r, _ in made)
    assert eng.pool.available == eng.pool.capacity and not eng.pool.tables


def test_step_n_plus_1_is_dispatched_before_step_n_is_collected():
    """With overlap the host plans and dispatches the next step while the last one runs: a
    step's tokens arrive one scheduler step later. Without it (speculation), at once."""
    for overlap, lag in ((True, 1), (False, 0)):
        eng = FakeEngine(slots=2, blocks=100, overlap=overlap)
        sched = Scheduler(eng)
        r = req(3, 4)
        sched.add(r)
        delivered = []
        while r.phase != "finished":
            sched.step()
            delivered.append(len(r.output_ids))
            if r.phase == "running":
                assert eng.in_flight == lag
        # one prompt step, then one decode step per token after the first
        assert delivered == [0] * lag + [1, 2, 3, 4]
        assert len(eng.plans) == 4


def test_a_step_that_fails_on_the_device_fails_only_its_requests():
    """The failure surfaces when the step is collected, after the next step was dispatched:
    the failed step's requests fail and the next step's rows for them are dropped; a request
    that joined in that next step, and later ones, finish."""
    eng = FakeEngine(
        slots=4, blocks=100, fail_collect_on=lambda p: any(n == 7 for _, n in p.prefills)
    )
    sched = Scheduler(eng)
    ok, bad, joined, later = req(3, 6), req(7, 3), req(2, 3), req(4, 2)
    sched.add(ok)
    sched.step()
    sched.add(bad)
    sched.step()  # dispatches ok's decode row and bad's prefill: the step that will fail
    sched.add(joined)
    sched.step()  # dispatches joined's prefill, then collects the failed step
    assert bad.phase == "failed" and "injected device failure" in bad.error
    assert ok.phase == "failed" and joined.phase == "running"
    sched.add(later)
    drain(sched)
    assert joined.phase == "finished" and joined.output_ids == [101, 102, 103]
    assert later.phase == "finished" and len(later.output_ids) == 2
    assert eng.pool.available == eng.pool.capacity and not eng.live_slots()
