"""Device state (params, KV arrays, per-slot penalty state) and the jitted, bucketed step.

Shapes: T tokens, S rows, V vocabulary, NB KV blocks, P block size, MB blocks per sequence.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .batch import lower
from .config import ModelConfig
from .models import dense
from .sampling import ROW_FIELDS, row_params, sample

log = logging.getLogger(__name__)

TOP_LOGPROBS = 20  # OpenAI's maximum; the step always returns this many (cheap next to V)


def enable_compile_cache(path: str | None) -> None:
    """Use JAX's persistent compilation cache so restarts skip recompiling the buckets."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class Runner:
    """Owns everything on the device and runs one step per call.

    The step is one jitted function per (T, S) bucket pair; KV and slot state are donated.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        num_blocks: int,
        block_size: int,
        max_slots: int,
        max_blocks_per_seq: int,
        kv_dtype,
        attention_fn=None,
    ):
        self.cfg = cfg
        self.params = params
        self.block_size = block_size
        self.max_slots = max_slots
        self.max_blocks = max_blocks_per_seq
        self.kv = dense.init_kv(cfg, num_blocks, block_size, kv_dtype)
        V = cfg.vocab_size
        # Penalty state per slot: output token counts and prompt membership ([S_max, V]).
        self.state = {
            "counts": jnp.zeros((max_slots, V), jnp.int32),
            "prompt_mask": jnp.zeros((max_slots, V), jnp.bool_),
        }
        self.compiles = 0  # incremented each time a step is traced (= compiled)
        self._attention = attention_fn
        self._step = jax.jit(self._step_fn, donate_argnums=(1, 2))

    def _step_fn(self, params, kv, state, batch, sp, seeds, steps, want_logprobs):
        """Args: params; kv and state (donated); batch (batch.lower arrays); sp ([S] per-row
        sampling params); seeds [S] uint32; steps [S] int32; want_logprobs bool scalar.
        Returns: (tokens [S], logprob [S], top ids [S, 20], top logprobs [S, 20], kv, state)."""
        self.compiles += 1  # Python side effect: runs only while tracing
        logits, kv = dense.forward(params, kv, batch, self.cfg, self._attention)
        oob = self.max_slots  # rows with slot -1 (padding) index past the end and are dropped
        slots = jnp.where(batch["slots"] < 0, oob, batch["slots"])
        starts = batch["positions"][batch["cu_q_lens"][:-1]]
        fresh = jnp.where((starts == 0) & (batch["slots"] >= 0), slots, oob)
        counts = state["counts"].at[fresh].set(0, mode="drop")
        pmask = state["prompt_mask"].at[fresh].set(False, mode="drop")
        # Every fed token counts as seen for the repetition penalty (prompt or earlier output).
        tok_slot = slots[batch["seg_ids"]]
        real_tok = jnp.arange(batch["tokens"].shape[0]) < batch["cu_q_lens"][-1]
        pmask = pmask.at[jnp.where(real_tok, tok_slot, oob), batch["tokens"]].set(True, mode="drop")
        row_slots = jnp.minimum(slots, oob - 1)
        tokens, logp = sample(logits, counts[row_slots], pmask[row_slots], sp, seeds, steps)
        add = batch["sample_mask"]
        counts = counts.at[slots, tokens].add(add, mode="drop")
        chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
        top_lp, top_ids = jax.lax.cond(
            want_logprobs,
            lambda x: tuple(jax.lax.top_k(x, TOP_LOGPROBS)),
            lambda x: (
                jnp.zeros((x.shape[0], TOP_LOGPROBS), x.dtype),
                jnp.zeros((x.shape[0], TOP_LOGPROBS), jnp.int32),
            ),
            logp,
        )
        return tokens, chosen, top_ids, top_lp, kv, {"counts": counts, "prompt_mask": pmask}

    def run(self, rows, t_bucket: int, s_bucket: int, sampling, seeds, steps):
        """Run one step.

        Args:
          rows: list of batch.Row.
          t_bucket, s_bucket: padded token and row counts (must be warmed buckets).
          sampling: per-row SamplingParams (None for rows that sample nothing).
          seeds, steps: per-row ints (see sampling.sample).
        Returns:
          dict of numpy arrays over the real rows: tokens, logprob, top_ids, top_logprobs.
        """
        batch = lower(rows, self.block_size, t_bucket, s_bucket, self.max_blocks)
        sp = row_params(sampling, s_bucket)
        seeds_a = np.zeros(s_bucket, np.uint32)
        steps_a = np.zeros(s_bucket, np.int32)
        seeds_a[: len(seeds)] = seeds
        steps_a[: len(steps)] = steps
        want = any(p is not None and p.logprobs is not None for p in sampling)
        out = self._step(
            self.params,
            self.kv,
            self.state,
            batch,
            {k: sp[k] for k in ROW_FIELDS},
            seeds_a,
            steps_a,
            np.bool_(want),
        )
        tokens, chosen, top_ids, top_lp, self.kv, self.state = out
        n = len(rows)
        res = {"tokens": np.asarray(tokens)[:n], "logprob": np.asarray(chosen)[:n]}
        if want:
            res["top_ids"] = np.asarray(top_ids)[:n]
            res["top_logprobs"] = np.asarray(top_lp)[:n]
        return res

    def warmup(self, pairs: list[tuple[int, int]]) -> None:
        """Compile every (T, S) bucket pair with an all-padding step (writes the sink only)."""
        for t, s in tqdm(pairs, desc="compiling step buckets", leave=False):
            self.run([], t, s, [], [], [])
            for x in (self.kv, self.state):
                jax.block_until_ready(x)
        log.info("compiled %d step buckets (%d traces)", len(pairs), self.compiles)
