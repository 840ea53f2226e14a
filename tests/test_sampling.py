"""On-device sampling: greedy, filters, seeds and penalties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from luce_jax.device.sampling import _filter, apply_penalties, named, needs_filter, sample
from luce_jax.host.slots import sampling_arrays
from luce_jax.sampling_params import SamplingParams

V = 50
_sample = jax.jit(sample, static_argnames="filtered")


def run(params, logits, counts=None, pmask=None, seeds=None, steps=None):
    R = len(params)
    counts = jnp.zeros((R, V), jnp.int32) if counts is None else counts
    pmask = jnp.zeros((R, V), bool) if pmask is None else pmask
    seeds = np.zeros(R, np.uint32) if seeds is None else np.asarray(seeds, np.uint32)
    steps = np.zeros(R, np.int32) if steps is None else np.asarray(steps, np.int32)
    floats, top_k = sampling_arrays(params)
    sp = {k: jnp.asarray(v) for k, v in named(floats, top_k).items()}
    # the variant the runner picks on the host
    tokens, _ = _sample(jnp.asarray(logits), counts, pmask, sp, seeds, steps,
                        filtered=needs_filter(floats, top_k))  # fmt: skip
    return np.asarray(tokens)


@pytest.fixture
def logits():
    return np.random.default_rng(0).standard_normal((8, V)).astype(np.float32) * 3


def test_top_k_1_equals_greedy(logits):
    greedy = run([SamplingParams(temperature=0)] * 8, logits)
    assert (greedy == logits.argmax(-1)).all()
    many = np.repeat(logits, 8, axis=0)
    topk1 = run([SamplingParams(temperature=1.5, top_k=1)] * 64, many, seeds=range(64))
    assert (topk1 == np.repeat(greedy, 8)).all()


def test_same_seed_reproduces_and_other_seeds_differ(logits):
    sp = [SamplingParams(temperature=1.0)] * 160
    many = np.tile(logits, (20, 1))
    steps = np.repeat(np.arange(20), 8)
    a = run(sp, many, seeds=[7] * 160, steps=steps)
    b = run(sp, many, seeds=[7] * 160, steps=steps)
    c = run(sp, many, seeds=[8] * 160, steps=steps)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_seeded_row_does_not_depend_on_its_neighbours(logits):
    alone = run([SamplingParams(temperature=1.0)], logits[:1], seeds=[3])
    mixed = run(
        [SamplingParams(temperature=1.0), SamplingParams(temperature=0.3, top_p=0.5)],
        logits[:2],
        seeds=[3, 99],
    )
    assert alone[0] == mixed[0]


def test_filters_keep_only_allowed_tokens(logits):
    row = logits[0]
    order = np.argsort(-row)
    top3 = set(order[:3].tolist())
    rows = np.repeat(row[None], 200, axis=0)

    def picks_of(sp):
        return set(run([sp] * 200, rows, seeds=range(200)).tolist())

    picks = picks_of(SamplingParams(top_k=3))
    assert picks <= top3 and len(picks) > 1
    probs = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    mass = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(mass, 0.6) + 1)].tolist())
    picks = picks_of(SamplingParams(top_p=0.6))
    assert picks <= nucleus
    allowed = set(np.nonzero(probs >= 0.2 * probs.max())[0].tolist())
    picks = picks_of(SamplingParams(min_p=0.2))
    assert picks <= allowed


def test_a_step_without_filters_or_penalties_samples_as_the_filtered_variant_does(logits):
    """The host skips the filters when no row asks (needs_filter), and neutral penalties
    always run: neither may change a draw."""
    rows = [SamplingParams(temperature=t) for t in (0.0, 0.7, 1.0, 1.3)] * 2
    floats, top_k = sampling_arrays(rows)
    assert not needs_filter(floats, top_k)
    assert needs_filter(*sampling_arrays(rows + [SamplingParams(temperature=1.0, top_k=5)]))
    assert not needs_filter(*sampling_arrays([SamplingParams(temperature=0, top_p=0.5)]))
    sp = {k: jnp.asarray(v) for k, v in named(floats, top_k).items()}
    args = (jnp.asarray(logits), jnp.zeros((8, V), jnp.int32), jnp.zeros((8, V), bool), sp,
            np.arange(8, dtype=np.uint32), np.zeros(8, np.int32))  # fmt: skip
    plain, lp_plain = _sample(*args, filtered=False)
    full, lp_full = _sample(*args, filtered=True)
    assert np.array_equal(plain, full)
    np.testing.assert_array_equal(lp_plain, lp_full)
    kept = penalized(logits, jnp.ones((8, V), jnp.int32), jnp.ones((8, V), bool))
    np.testing.assert_array_equal(kept, logits)  # neutral penalties: the logits, bit for bit


def penalized(logits, counts, pmask, **kw):
    sp = {k: jnp.asarray(v) for k, v in named(*sampling_arrays([SamplingParams(**kw)])).items()}
    return np.asarray(apply_penalties(jnp.asarray(logits), counts, pmask, sp))


def test_each_penalty_changes_exactly_its_logits():
    logits = np.array([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]], np.float32)
    counts = jnp.asarray([[2, 1, 0, 0, 0, 0]], jnp.int32)  # generated: token 0 twice, 1 once
    pmask = jnp.asarray([[False, False, True, True, False, False]])  # prompt: tokens 2, 3
    out = penalized(logits, counts, pmask, presence_penalty=0.5)
    np.testing.assert_allclose(out, [[1.5, -2.5, 1.0, -1.0, 0.5, 3.0]])
    out = penalized(logits, counts, pmask, frequency_penalty=0.5)
    np.testing.assert_allclose(out, [[1.0, -2.5, 1.0, -1.0, 0.5, 3.0]])
    out = penalized(logits, counts, pmask, repetition_penalty=2.0)
    np.testing.assert_allclose(out, [[1.0, -4.0, 0.5, -2.0, 0.5, 3.0]])


def test_penalty_changes_the_greedy_pick():
    logits = np.array([[3.0, 2.9] + [0.0] * (V - 2)], np.float32)
    counts = jnp.zeros((1, V), jnp.int32).at[0, 0].set(1)
    sp = SamplingParams(temperature=0, frequency_penalty=0.5)
    assert run([sp], logits, counts=counts)[0] == 1
    assert run([SamplingParams(temperature=0)], logits, counts=counts)[0] == 0


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def sorted_filter(row: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filters as usually written, over a sorted row: keep the top_k best, the smallest
    prefix whose probability reaches top_p (the first always; 1 keeps all), and min_p of the
    best's."""
    order = np.sort(row)[::-1]
    k = min(top_k, row.size) if top_k > 0 else row.size
    probs = np.exp(order - order[0])
    probs /= probs.sum()
    n_keep = max(int(((np.cumsum(probs) - probs) < top_p).sum()), 1) if top_p < 1 else k
    cut = max(order[k - 1], order[n_keep - 1])
    if min_p > 0:
        cut = max(cut, order[0] + np.log(min_p))
    return np.where(row >= cut, row, -np.inf)


@pytest.mark.parametrize("case", range(6))
def test_filters_keep_what_a_sorted_row_keeps(case):
    """The filters take each row's cut without sorting it (a bisection over the float values,
    so that a row split between devices is never gathered); they keep exactly the tokens the
    sort would, with tied logits, masked (-inf) tokens and a dominant token among the rows."""
    rng = np.random.default_rng(case)
    R = 64
    rows = (rng.standard_normal((R, V)) * rng.uniform(0.1, 8, (R, 1))).astype(np.float32)
    rows[::4] = np.round(rows[::4])  # many ties
    rows[1::4, rng.integers(0, V, 20)] = -np.inf  # a grammar's masked tokens
    rows[2::4, 0] = 40.0  # one token holds nearly all the mass
    params = [SamplingParams(temperature=1.0, top_k=int(rng.choice([0, 1, 3, 17, V, V + 5])),
                             top_p=float(rng.choice([1.0, 0.05, 0.5, 0.9, 0.999])),
                             min_p=float(rng.choice([0.0, 0.01, 0.3])))
              for _ in range(R)]  # fmt: skip
    floats, top_k = sampling_arrays(params)
    sp = {k: jnp.asarray(v) for k, v in named(floats, top_k).items()}
    got = np.asarray(jax.jit(_filter)(jnp.asarray(rows), sp))
    for r, p in enumerate(params):
        want = sorted_filter(rows[r].astype(np.float64), p.top_k, p.top_p, p.min_p)
        np.testing.assert_array_equal(np.isfinite(got[r]), np.isfinite(want), err_msg=str(p))
