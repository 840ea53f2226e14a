"""On-device sampling from per-row parameters and per-request seeds.

Shapes: R logits rows, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .sampling_params import SamplingParams

__all__ = ["SamplingParams", "row_params", "apply_penalties", "sample"]


def row_params(params: list[SamplingParams | None], rows: int) -> dict[str, np.ndarray]:
    """Stack per-row parameters into [R] arrays (padding rows: greedy, no penalties)."""
    out = {
        "temperature": np.zeros(rows, np.float32),
        "top_p": np.ones(rows, np.float32),
        "top_k": np.zeros(rows, np.int32),
        "min_p": np.zeros(rows, np.float32),
        "presence": np.zeros(rows, np.float32),
        "frequency": np.zeros(rows, np.float32),
        "repetition": np.ones(rows, np.float32),
    }
    for i, p in enumerate(params):
        if p is None:
            continue
        out["temperature"][i] = p.temperature
        out["top_p"][i] = p.top_p
        out["top_k"][i] = p.top_k
        out["min_p"][i] = p.min_p
        out["presence"][i] = p.presence_penalty
        out["frequency"][i] = p.frequency_penalty
        out["repetition"][i] = p.repetition_penalty
    return out


def apply_penalties(logits, counts, prompt_mask, sp):
    """vLLM's penalties: repetition over prompt+output tokens, presence/frequency over output.

    Args:
      logits: [R, V] float32.
      counts: [R, V] int32 times each token was generated so far.
      prompt_mask: [R, V] bool tokens present in the prompt.
      sp: dict of [R] arrays (row_params).
    """
    seen = prompt_mask | (counts > 0)
    rep = sp["repetition"][:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sp["frequency"][:, None] * counts
    return logits - sp["presence"][:, None] * (counts > 0)


def _filter(logits, sp):
    """Mask logits outside top-k, top-p (nucleus) and min-p, per row."""
    V = logits.shape[-1]
    order = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    k = jnp.where(sp["top_k"] > 0, jnp.minimum(sp["top_k"], V), V)
    kth = jnp.take_along_axis(order, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(order, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.maximum(jnp.sum(before < sp["top_p"][:, None], axis=-1), 1)
    pth = jnp.take_along_axis(order, (n_keep - 1)[:, None], axis=-1)
    min_logit = order[:, :1] + jnp.log(jnp.maximum(sp["min_p"][:, None], 1e-30))
    cut = jnp.maximum(
        jnp.maximum(kth, pth), jnp.where(sp["min_p"][:, None] > 0, min_logit, -jnp.inf)
    )
    return jnp.where(logits >= cut, logits, -jnp.inf)


def sample(logits, counts, prompt_mask, sp, seeds, steps):
    """Pick one token per row.

    Args:
      logits: [R, V] float32.
      counts, prompt_mask: penalty state for each row's sequence ([R, V]).
      sp: dict of [R] parameter arrays (row_params).
      seeds: [R] uint32 per-request seed; steps: [R] int32 tokens generated so far. The noise
        depends only on (seed, step), so a seeded request reproduces whatever it is batched with.
    Returns:
      (tokens [R] int32, logprobs [R, V] float32 of the distribution sampled from).
    """
    penalize = jnp.any((sp["repetition"] != 1) | (sp["frequency"] != 0) | (sp["presence"] != 0))
    logits = jax.lax.cond(
        penalize, lambda x: apply_penalties(x, counts, prompt_mask, sp), lambda x: x, logits
    )
    greedy = sp["temperature"] == 0
    scaled = logits / jnp.where(greedy, 1.0, sp["temperature"])[:, None]
    needs = (sp["top_k"] > 0) | (sp["top_p"] < 1) | (sp["min_p"] > 0)
    scaled = jax.lax.cond(jnp.any(needs & ~greedy), lambda x: _filter(x, sp), lambda x: x, scaled)
    keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, steps)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],)))(keys)
    drawn = jnp.argmax(scaled + gumbel, axis=-1)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, jax.nn.log_softmax(jnp.where(greedy[:, None], logits, scaled), axis=-1)
