"""The loader's prefetch: every tensor prepared once, any order of asking, a bounded window."""

import threading
import time

import pytest

from luce_jax.loading.prefetch import Prefetch, load_order


def test_load_order_is_layer_by_layer_then_the_rest():
    names = ["token_embd.weight", "blk.1.ffn_up.weight", "blk.0.attn_q.weight", "output.weight",
             "blk.10.attn_k.weight", "blk.0.attn_k.weight", "blk.2.attn_q.weight"]  # fmt: skip
    order = [n for n, _ in load_order([(n, 1) for n in names])]
    assert order == [
        "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.1.ffn_up.weight",
        "blk.2.attn_q.weight", "blk.10.attn_k.weight", "token_embd.weight", "output.weight",
    ]  # fmt: skip


@pytest.mark.parametrize("ask", ["in order", "reversed", "interleaved"])
def test_every_value_comes_back_once_whatever_the_order_of_asking(ask):
    names = [f"t{i}" for i in range(40)]
    calls, lock = [], threading.Lock()
    pending_max = [0]

    def prepare(name):
        with lock:
            calls.append(name)
        time.sleep(0.002)
        return name.upper()

    fetch = Prefetch([(n, 10) for n in names], prepare, workers=3, ahead=30)
    asked = {
        "in order": names,
        "reversed": names[::-1],
        "interleaved": names[::2] + names[1::2],
    }[ask]
    with fetch:
        for n in asked:
            pending_max[0] = max(pending_max[0], fetch._pending)
            assert fetch.get(n) == n.upper()
    assert sorted(calls) == sorted(names)  # each prepared exactly once
    assert pending_max[0] <= 30  # never more than the window ahead of the asker


def test_an_error_reaches_the_asker_and_the_rest_still_load():
    def prepare(name):
        if name == "bad":
            raise ValueError("cannot hold 0 bytes")
        return name

    with Prefetch([("a", 1), ("bad", 1), ("c", 1)], prepare) as fetch:
        assert fetch.get("a") == "a"
        with pytest.raises(ValueError, match="cannot hold 0 bytes"):
            fetch.get("bad")
        assert fetch.get("c") == "c"


def test_a_tensor_larger_than_the_window_still_loads():
    with Prefetch([("small", 1), ("huge", 100), ("after", 1)], str.upper, ahead=10) as fetch:
        assert [fetch.get(n) for n in ("small", "huge", "after")] == ["SMALL", "HUGE", "AFTER"]


def test_close_stops_feeding_when_the_loader_gives_up():
    started = []

    def prepare(name):
        started.append(name)
        return name

    fetch = Prefetch([(f"t{i}", 10) for i in range(100)], prepare, workers=1, ahead=20)
    fetch.get("t0")
    fetch.close()  # returns: the feeder stops at the window, the pool drains
    assert len(started) < 100
