"""Device state (params, KV arrays, per-slot penalty state) and the jitted, bucketed step.

The step samples and verifies speculative proposals (a draft model runs on draft_runner.py's
subclass). Shapes: T tokens, S rows, R logits rows, K proposals, V vocabulary, NB KV blocks,
P block size, MB blocks per sequence.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from .batch import lower
from .config import ModelConfig
from .models import dense
from .sampling import row_params, sample

log = logging.getLogger(__name__)

TOP_LOGPROBS = 20  # OpenAI's maximum; the step always returns this many (cheap next to V)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")


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
        kv_types,
        attention_fn=None,
        grouped_matmul_fn=None,
        max_proposals: int = 0,
    ):
        """Args: max_proposals: K, the most speculative proposals a verify row carries (0: no
        speculation, one logits row per row)."""
        self.cfg = cfg
        self.k = max_proposals
        self.params = params
        self.block_size = block_size
        self.max_slots = max_slots
        self.max_blocks = max_blocks_per_seq
        self.kv = dense.init_kv(cfg, num_blocks, block_size, *kv_types)
        V = cfg.vocab_size
        # Penalty state per slot: output token counts and prompt membership ([S_max, V]).
        self.state = {
            "counts": jnp.zeros((max_slots, V), jnp.int32),
            "prompt_mask": jnp.zeros((max_slots, V), jnp.bool_),
        }
        self.compiles = 0  # executables built; after warmup this must not move
        self.step_time: dict[tuple[int, int], float] = {}  # seconds per bucket, from warmup
        # Device arrays of the last step's model statistics (MoE: expert_counts [L_moe, E]);
        # never fetched unless asked (trace.StepTracer), so they cost the step no sync.
        self.last_stats: dict = {}
        self._attention = attention_fn
        self._grouped_matmul = grouped_matmul_fn
        self._exec: dict[tuple[int, int], object] = {}
        self._lock = threading.Lock()

    donate = (1, 2)  # KV and slot state: the step's only donated arguments

    # -- host <-> device packing: one int32 and one float32 buffer per step --------------------
    def logit_width(self, T: int, S: int) -> int:
        """Logits rows R of bucket (T, S): one per row, and room for every row's proposals."""
        return S if self.k == 0 else min(T, S * (self.k + 1))

    # -- host <-> device packing: one int32 and one float32 buffer per step --------------------
    def _int_layout(self, T: int, S: int) -> list[tuple[str, tuple[int, ...]]]:
        R = self.logit_width(T, S)
        return [
            ("tokens", (T,)),
            ("positions", (T,)),
            ("seg_ids", (T,)),
            ("write_idx", (T,)),
            ("block_tables", (S, self.max_blocks)),
            ("kv_lens", (S,)),
            ("cu_q_lens", (S + 1,)),
            ("slots", (S,)),
            ("sample_mask", (S,)),
            ("n_draft", (S,)),
            ("logit_start", (S,)),
            ("top_k", (S,)),
            ("seeds", (S,)),
            ("steps", (S,)),
            ("logit_rows", (R,)),
            ("logit_seg", (R,)),
            ("logit_off", (R,)),
            ("want_logprobs", (1,)),
        ]

    def _unpack(self, ints, floats, T: int, S: int, layout=None) -> tuple[dict, dict]:
        arrays, off = {}, 0
        for name, shape in layout or self._int_layout(T, S):
            n = int(np.prod(shape))
            arrays[name] = ints[off : off + n].reshape(shape)
            off += n
        sp = {k: floats[i] for i, k in enumerate(FLOAT_FIELDS)}
        sp["top_k"] = arrays.pop("top_k")
        return arrays, sp

    def _step_fn(self, params, kv, state, ints, floats, *, T: int, S: int):
        """One model step, sampling, and verification of speculative proposals; T, S static.

        Every logits row samples with its segment's parameters and noise (seed, step + offset),
        and with penalties that count the proposals before it as output. A verify row keeps
        its leading proposals while each equals the token sampled at the position before it.
        Proposals are deterministic (prompt lookup, a greedy draft), so this is the standard
        rejection rule with a one-hot proposal distribution: proposal x survives with
        probability p(x), and after a rejection the sampled token is p conditioned on not x,
        the residual. The output is distributed as the target's, token for token the same as
        without speculation for the same seed.

        Args: params; kv and state (donated); ints: int32 [N] packed per _int_layout; floats:
          float32 [6, S] sampling parameters (FLOAT_FIELDS).
        Returns: (packed int32 [2R + S]: sampled token per logits row, its bitcast float32
          logprob, and proposals accepted per row; top ids [R, 20], top logprobs [R, 20], kv,
          state, model stats (dense.forward's)).
        """
        batch, sp = self._unpack(ints, floats, T, S)
        logits, kv, stats = dense.forward(
            params, kv, batch, self.cfg, self._attention, self._grouped_matmul
        )
        with jax.named_scope("sampling"):  # penalty state, sampling, verification, logprobs
            oob = self.max_slots  # rows with slot -1 (padding) index past the end and are dropped
            slots = jnp.where(batch["slots"] < 0, oob, batch["slots"])
            starts = batch["positions"][batch["cu_q_lens"][:-1]]
            fresh = jnp.where((starts == 0) & (batch["slots"] >= 0), slots, oob)
            counts = state["counts"].at[fresh].set(0, mode="drop")
            pmask = state["prompt_mask"].at[fresh].set(False, mode="drop")
            # Fed tokens count as seen for the repetition penalty (prompt or earlier output),
            # except proposals: those count below, for the positions after them only.
            seg_ids, cu = batch["seg_ids"], batch["cu_q_lens"]
            tok_slot = slots[seg_ids]
            proposal = jnp.arange(T) >= cu[1:][seg_ids] - batch["n_draft"][seg_ids]
            real_tok = (jnp.arange(T) < cu[-1]) & ~proposal
            pmask = pmask.at[jnp.where(real_tok, tok_slot, oob), batch["tokens"]].set(
                True, mode="drop"
            )
            seg, off = batch["logit_seg"], batch["logit_off"]  # [R]
            R = seg.shape[0]
            row_slots = jnp.minimum(slots, oob - 1)[seg]
            row_counts = counts[row_slots]
            for m in range(self.k):  # proposals 1..off precede the logits row at offset off
                t = batch["tokens"][jnp.maximum(batch["logit_rows"] - m, 0)]
                row_counts = row_counts.at[jnp.arange(R), t].add((m < off).astype(jnp.int32))
            row_sp = {k: v[seg] for k, v in sp.items()}
            seeds = jax.lax.bitcast_convert_type(batch["seeds"], jnp.uint32)[seg]
            steps = batch["steps"][seg] + jnp.maximum(off, 0)
            tokens, logp = sample(logits, row_counts, pmask[row_slots], row_sp, seeds, steps)
            # Verification: the first proposal unequal to the token sampled before it.
            n_draft = batch["n_draft"][seg]
            nxt = batch["tokens"][jnp.minimum(batch["logit_rows"] + 1, T - 1)]
            miss = (off >= 0) & (off < n_draft) & (tokens != nxt)
            first_miss = jax.ops.segment_min(jnp.where(miss, off, T), seg, num_segments=S)
            accepted = jnp.minimum(first_miss, batch["n_draft"])  # [S]
            emitted = (off >= 0) & (off <= accepted[seg]) & (batch["sample_mask"][seg] > 0)
            counts = counts.at[jnp.where(emitted, slots[seg], oob), tokens].add(1, mode="drop")
            chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
            top_lp, top_ids = jax.lax.cond(
                batch["want_logprobs"][0] > 0,
                lambda x: tuple(jax.lax.top_k(x, TOP_LOGPROBS)),
                lambda x: (
                    jnp.zeros((x.shape[0], TOP_LOGPROBS), x.dtype),
                    jnp.zeros((x.shape[0], TOP_LOGPROBS), jnp.int32),
                ),
                logp,
            )
        packed = jnp.concatenate(
            [tokens, jax.lax.bitcast_convert_type(chosen, jnp.int32), accepted.astype(jnp.int32)]
        )
        return packed, top_ids, top_lp, kv, {"counts": counts, "prompt_mask": pmask}, stats

    def _abstract_inputs(self, S: int, layout) -> tuple:
        """Abstract (ints, floats) of a program whose int32 buffer follows `layout`."""
        n_int = sum(int(np.prod(shape)) for _, shape in layout)
        return (
            jax.ShapeDtypeStruct((n_int,), jnp.int32),
            jax.ShapeDtypeStruct((len(FLOAT_FIELDS), S), jnp.float32),
        )

    def step_function(self, T: int, S: int):
        """The step for bucket (T, S) and abstract arguments to trace or lower it with."""
        ints, floats = self._abstract_inputs(S, self._int_layout(T, S))
        args = (self.params, self.kv, self.state, ints, floats)
        return functools.partial(self._step_fn, T=T, S=S), args

    def executable(self, T: int, S: int):
        """The compiled executable of a warmed bucket (for cost analysis and HLO text)."""
        return self._exec[(T, S)]

    def _compile(self, T: int, S: int):
        """Build (or fetch from the persistent cache) the executable for one bucket pair."""
        fn, args = self.step_function(T, S)
        exe = jax.jit(fn, donate_argnums=self.donate).lower(*args).compile()
        with self._lock:
            self.compiles += 1
            self._exec[(T, S)] = exe
        return exe

    def run(self, rows, tables, t_bucket: int, s_bucket: int, sampling, seeds, steps):
        """Run one step.

        Args:
          rows: list of batch.Row (verify rows carry their proposals).
          tables: int32 [slots, MB] block tables indexed by Row.slot (KVPool.block_array).
          t_bucket, s_bucket: padded token and row counts (a warmed bucket pair).
          sampling: per-row SamplingParams (None for rows that sample nothing).
          seeds, steps: per-row ints (see sampling.sample).
        Returns:
          dict of numpy arrays: per logits row (row i's are logit_start[i] ..
          logit_start[i] + draft): tokens, logprob, and top_ids / top_logprobs when any row
          asked for logprobs; per row: accepted (proposals kept), logit_start.
        """
        T, S = t_bucket, s_bucket
        b, ints, floats, want = self._pack(rows, tables, T, S, sampling, seeds, steps)
        exe = self._executable(T, S)
        packed, top_ids, top_lp, self.kv, self.state, self.last_stats = exe(
            self.params, self.kv, self.state, ints, floats
        )
        n = len(rows)
        n_logits = n + sum(r.draft for r in rows)
        R = len(b["logit_rows"])
        packed = np.asarray(packed)
        res = {
            "tokens": packed[:n_logits],
            "logprob": packed[R : R + n_logits].view(np.float32),
            "accepted": packed[2 * R : 2 * R + n],
            "logit_start": b["logit_start"][:n],
        }
        if want:
            res["top_ids"] = np.asarray(top_ids)[:n_logits]
            res["top_logprobs"] = np.asarray(top_lp)[:n_logits]
        return res

    def _executable(self, T: int, S: int):
        exe = self._exec.get((T, S))
        if exe is None:
            log.warning("compiling bucket T=%d S=%d while serving (missed at warmup)", T, S)
            exe = self._compile(T, S)
        return exe

    def _pack(self, rows, tables, T: int, S: int, sampling, seeds, steps):
        """Lower rows and pack the step's int32 and float32 inputs (host side)."""
        b = lower(rows, tables, self.block_size, T, S, self.logit_width(T, S))
        sp = row_params(sampling, S)
        b["top_k"] = sp["top_k"]
        b["seeds"] = np.zeros(S, np.uint32)
        b["seeds"][: len(seeds)] = seeds
        b["seeds"] = b["seeds"].view(np.int32)
        b["steps"] = np.zeros(S, np.int32)
        b["steps"][: len(steps)] = steps
        want = any(p is not None and p.logprobs is not None for p in sampling)
        b["want_logprobs"] = np.array([want], np.int32)
        ints = np.concatenate([b[name].ravel() for name, _ in self._int_layout(T, S)])
        floats = np.stack([sp[k] for k in FLOAT_FIELDS])
        return b, ints, floats, want

    def warmup(self, pairs: list[tuple[int, int]], workers: int | None = None) -> None:
        """Compile every (T, S) bucket pair ahead of serving, several at once.

        XLA compiles in C++ without the GIL, so a thread pool uses the host's cores; each
        executable is then run once on an all-padding batch (which writes the sink only).
        """
        todo = [p for p in pairs if p not in self._exec]
        workers = workers or max(1, min(len(todo), (os.cpu_count() or 2)))
        with ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(self._compile, t, s) for t, s in todo]
            for f in tqdm(
                as_completed(futures),
                total=len(futures),
                desc="compiling step buckets",
                leave=False,
            ):
                f.result()
        self._time(pairs, np.zeros((1, self.max_blocks), np.int32))
        jax.block_until_ready((self.kv, self.state))
        log.info("compiled %d step buckets", len(pairs))

    def _time(self, pairs, empty) -> None:
        """Step times for the policy of speculation: all-padding runs read every weight, as
        a real step does."""
        for t, s in pairs:
            self.step_time[(t, s)] = best_of_3(
                lambda t=t, s=s: self.run([], empty, t, s, [], [], [])
            )


def best_of_3(fn) -> float:
    """Seconds of the fastest of 3 calls, after one untimed call."""
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
