"""SlotTable: per-slot progress and the persistent arrays a step's row inputs come from."""

import numpy as np
import pytest

from luce_jax.host.slots import SlotTable
from luce_jax.sampling_params import SamplingParams
from luce_jax.step_format import FLOAT_FIELDS, NEUTRAL


def test_row_inputs_gather_each_slots_own_parameters_and_pad_neutrally():
    t = SlotTable(4, seed=3)
    a = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, repetition_penalty=1.2, seed=2**32 - 1)
    b = SamplingParams(temperature=0.0, min_p=0.1, presence_penalty=0.3, logprobs=2)
    t.claim(2, [1, 2, 3], a)
    t.claim(0, [4], b)
    t.generated[2] = 5
    rows = np.array([2, 0, 2], np.int32)
    sample = np.array([True, True, False])  # the last row: a prompt slice that does not finish
    got = t.row_inputs(rows, np.array([9, 0, 3], np.int32), sample, S=4)
    want_a = [0.7, 0.9, 0.0, 0.0, 0.0, 1.2]
    want_b = [0.0, 1.0, 0.1, 0.3, 0.0, 1.0]
    np.testing.assert_allclose(got["floats"][:, 0], want_a, rtol=1e-6)
    np.testing.assert_allclose(got["floats"][:, 1], want_b, rtol=1e-6)
    for col in (2, 3):  # a row that samples nothing, and padding: greedy, no penalties
        np.testing.assert_array_equal(got["floats"][:, col], NEUTRAL)
    assert got["floats"].shape == (len(FLOAT_FIELDS), 4)
    assert got["top_k"].tolist() == [5, 0, 0, 0]
    assert got["seeds"].view(np.uint32)[0] == 2**32 - 1  # the seed's bits survive int32
    assert got["steps"].tolist() == [5, 0, 5, 0]
    assert got["want_logprobs"].tolist() == [1]  # b samples and asked for logprobs
    assert t.row_inputs(rows[:1], rows[:1], sample[:1], S=2)["want_logprobs"].tolist() == [0]


def test_a_slots_first_row_is_fresh_wherever_its_prefill_starts():
    """The device resets a slot's sampler state (penalty counts, prompt mask) on the row marked
    fresh: the first prompt slice, at 0 or after a prefix the cache supplied, and no other."""
    t = SlotTable(3)
    t.claim(0, list(range(40)), SamplingParams())
    t.claim(1, list(range(40)), SamplingParams(), cached=32)
    t.claim(2, list(range(40)), SamplingParams(), cached=16)
    t.generated[2] = 1  # slot 2 finished its prompt: its rows decode from position 40
    rows = np.array([0, 1, 2, 0], np.int32)
    starts = np.array([0, 32, 40, 16], np.int32)
    got = t.row_inputs(rows, starts, np.ones(4, bool), S=8)["fresh"]
    assert got.tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    t.release(0)
    with pytest.raises(AssertionError):
        t.claim(0, [1, 2], SamplingParams(), cached=2)  # the last prompt token is always computed


def test_progress_counts_dispatched_steps_and_release_marks_their_rows_stale():
    t = SlotTable(2)
    assert t.lowest_free() == 0
    t.claim(0, [7, 8, 9], SamplingParams(max_tokens=2))
    assert t.lowest_free() == 1 and t.prefill_left(0) == 3 and not t.decoding(0)
    t.prefilled[0] = 3
    t.generated[0] = 1  # the step that completes the prompt samples the first token
    assert t.decoding(0) and t.can_decode(0) and t.kv_len(np.array([0])).tolist() == [3]
    t.generated[0] = 2
    assert not t.can_decode(0)  # max_tokens reached by dispatched steps: plan no more
    epoch = t.epoch[0]
    t.release(0)
    assert not t.live(0) and t.epoch[0] == epoch + 1 and t.lowest_free() == 0
    t.claim(0, [1], SamplingParams())
    assert t.prefilled[0] == t.generated[0] == 0 and t.prefill_left(0) == 1


def test_requests_without_a_seed_get_distinct_reproducible_seeds():
    def seeds(table_seed):
        t = SlotTable(3, seed=table_seed)
        for s in range(3):
            t.claim(s, [1], SamplingParams())
        return t.seeds.tolist()

    assert seeds(0) == seeds(0) and len(set(seeds(0))) == 3 and seeds(0) != seeds(1)
