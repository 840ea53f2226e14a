"""The speculative acceptance rule: greedy exactness, and the target's distribution by test.

Statistical test: V = 4 tokens, K = 2 proposals, fixed target distributions p_0, p_1, p_2 per
position (a target whose tokens are independent of history) and a different proposal
distribution q drawn from per trial. Over N = 40000 trials (fixed seed, so the test is
deterministic) the first emitted token must follow p_0, the second (in trials that kept the
first proposal) p_1, and the bonus token (trials that kept both) p_2. Each is a chi-square
goodness-of-fit test with 3 degrees of freedom at alpha = 1e-3 (critical value 16.27). Power: a
rule whose token distribution is off by total variation delta from p has noncentrality at least
N (2 delta)^2 (Cauchy-Schwarz), 64 for delta = 0.02 on the first token, which such a test
rejects with probability above 0.99. A wrong rule (after a rejection, draw from p rather than
the residual; its first token follows (0.30, 0.28, 0.28, 0.14) here instead of p_0) is run
through the same test and must be rejected, so the test can fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from luce_jax.acceptance import accept

CHI2_CRIT = 16.27  # chi-square, 3 dof, alpha 1e-3
P = np.array([[0.5, 0.2, 0.2, 0.1], [0.1, 0.1, 0.3, 0.5], [0.25, 0.25, 0.4, 0.1]], np.float32)
Q = np.array([[0.1, 0.3, 0.3, 0.3], [0.4, 0.4, 0.1, 0.1]], np.float32)


def chi2(samples, probs):
    counts = np.bincount(samples, minlength=len(probs))
    expected = len(samples) * probs
    return float(((counts - expected) ** 2 / expected).sum())


def one_hot(idx, V):
    return np.eye(V, dtype=np.float32)[idx]


def test_greedy_keeps_proposals_up_to_the_first_miss_and_emits_the_argmax():
    V, K = 6, 3
    argmax = np.array([[2, 4, 1, 5], [0, 0, 3, 3], [1, 2, 3, 4], [5, 5, 5, 5]])  # [R, K+1]
    draft = np.array([[2, 4, 0], [1, 0, 3], [1, 2, 3], [5, 5, 5]], np.int32)
    n = np.array([3, 3, 3, 2], np.int32)  # row 3 proposes 2: its third proposal is ignored
    p = one_hot(argmax, V)
    q = one_hot(draft, V)
    u = np.asarray(jax.random.uniform(jax.random.key(0), (4, K)))
    acc, nxt = accept(p, q, draft, n, u, jax.random.key(1))
    assert np.asarray(acc).tolist() == [2, 0, 3, 2]
    # the target's argmax where the first proposal missed, or the bonus after all were kept
    assert np.asarray(nxt).tolist() == [1, 0, 4, 5]


def simulate(rule, N=40000, seed=0):
    """Emitted tokens of N independent speculation steps with proposals drawn from Q."""
    k = jax.random.split(jax.random.key(seed), 3)
    draft = jax.random.categorical(k[0], jnp.log(Q), shape=(N, 2)).astype(jnp.int32)
    u = jax.random.uniform(k[1], (N, 2))
    p = jnp.broadcast_to(P, (N, 3, 4))
    q = jnp.broadcast_to(Q, (N, 2, 4))
    acc, nxt = rule(p, q, draft, jnp.full((N,), 2, jnp.int32), u, k[2])
    acc, nxt, draft = np.asarray(acc), np.asarray(nxt), np.asarray(draft)
    first = np.where(acc >= 1, draft[:, 0], nxt)
    second = np.where(acc >= 2, draft[:, 1], nxt)[acc >= 1]
    bonus = nxt[acc == 2]
    return first, second, bonus


def target_not_residual(p, q, draft, n, u, key):
    """A plausible bug: after a rejection, draw from p instead of the residual max(p - q, 0)."""
    acc, _ = accept(p, q, draft, n, u, key)
    at = p[jnp.arange(p.shape[0]), acc]
    return acc, jax.random.categorical(key, jnp.log(at), axis=-1)


def test_emitted_tokens_follow_the_target_distribution():
    first, second, bonus = simulate(accept)
    assert len(second) > 10000 and len(bonus) > 3000  # enough trials reach each position
    assert chi2(first, P[0]) < CHI2_CRIT
    assert chi2(second, P[1]) < CHI2_CRIT
    assert chi2(bonus, P[2]) < CHI2_CRIT


def test_the_distribution_test_rejects_a_rule_that_skips_the_residual():
    first, _, _ = simulate(target_not_residual)
    assert chi2(first, P[0]) > CHI2_CRIT


@pytest.mark.parametrize("seed", [1, 2])
def test_one_hot_proposals_with_sampling_also_follow_the_target(seed):
    """Prompt lookup proposes deterministically: q one-hot at the proposal."""
    N = 40000
    k = jax.random.split(jax.random.key(seed), 2)
    draft = jnp.full((N, 2), 3, jnp.int32)
    p = jnp.broadcast_to(P, (N, 3, 4))
    acc, nxt = accept(
        p, jax.nn.one_hot(draft, 4), draft, jnp.full((N,), 2, jnp.int32),
        jax.random.uniform(k[0], (N, 2)), k[1],
    )  # fmt: skip
    first = np.where(np.asarray(acc) >= 1, 3, np.asarray(nxt))
    assert chi2(first, P[0]) < CHI2_CRIT
