"""Device state (params, KV arrays, per-slot sampler state) and the jitted, bucketed step.

A step is two compiled programs per bucket: the forward pass (`launch_forward`: the model,
logits [R, V]) and its sampling (`launch_sample`: penalties, the grammar masks, sampling,
verification, logprobs). `launch` dispatches both. Split, the forward pass of a step with rows
under a grammar can run while the host still fills their masks from the last step's tokens
(host/engine.py), so a constrained request keeps the asynchronous loop. (DESIGN.md has one
jitted function per step; with it, constrained requests ran at 0.47x to 0.81x the throughput of
unconstrained ones on the H200, and split at 1.02x to 1.47x:
bench/results/structured_qwen3-8b-bf16.md.) The forward pass also does the fed-token
bookkeeping (the penalties' seen mask, the tokens verification reads), so the sampling program
reads no [T] array and one serves every bucket of a row width. A step's inputs go up in one
buffer (device/step_io.py); outputs start copying to the host at launch and `fetch` waits for
them. JAX dispatches asynchronously, so launches return while the device computes. Shapes:
T tokens, S rows, R logits rows, K proposals, V vocabulary, NB KV blocks, P block size, MB
blocks per sequence.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..models.family import XLA, Kernels, family_of
from ..step_format import GroupShape, layout_size, step_layout, unpack
from . import proposals, sampling
from .distributed import FORWARD, STOP
from .mesh import OneDevice, Placement, abstract_arg
from .programs import BucketPrograms, compile_all, graph_options
from .sample_program import SampleProgram
from .sharded_kernels import shard_kernels
from .step_io import Forward, Launched, outputs, sample_size, upload

log = logging.getLogger(__name__)


class Runner(SampleProgram):
    """Owns everything on the device and runs the model step.

    The step is one jitted function per (T, S) bucket pair; KV and slot state are donated.

    Args:
      cfg, params: the model (loading.params.load_params).
      spaces: the block space of each of the family's cache groups (step_format.GroupShape:
        the host's pool hands out the same blocks); max_slots: S_max.
      kv_types: (k, v) cache types (a dtype, or "q8_0" / "q4_0").
      kernels: the ops' implementations (models.family.Kernels, backends.kernels).
      max_proposals: K, the most speculative proposals a verify row carries (0: no
        speculation, one logits row per row).
      graph_max_tokens: step buckets of more tokens compile without CUDA graphs
        (graph_options; 0: all use them).
      head: (draft_head.HeadConfig, params) of a draft head (families that run it on the
        device; device/head_proposer.py): every sampling program that proposes runs it for K tokens
        per sampled row, for the slot's next verify row, and keeps them on the device with
        the proposals each row kept (device/proposals.py); a later step's verify rows read
        both, so the host never waits for them (speculation/on_device.py).
      head_lookup: the head takes prompt lookup's proposals where a row's text repeats.
      draft: (ModelConfig, params, kv_types, quant_matmul) of a draft model with the
        target's vocabulary, run on the device (families that run it there): every forward pass also
        feeds it the step's tokens, into its own caches on the target's block ids, and the
        sampling programs that propose run its K decode steps after verification, keeping
        the proposals as a head's (device/draft_model.py).
      ngram: prompt lookup on the device (device/ngram_lookup.py): a token
        cache on the target's block ids, proposals found in it.
      mtp: the (k, v) cache types of the model's MTP block (params["mtp"], models/mtp.py),
        run on the device as a draft model is, on the target's hidden states
        (device/mtp_proposer.py); None: no MTP.
      dflash: (dflash.DFlashConfig, params, kv_types) of a DFlash block drafter on the
        target's hidden states, run on the device (device/dflash_proposer.py), or None.
      placement: where the arrays live on several devices (device/mesh.py), or None (one).
      synthetic_accept: benchmarks only (EngineConfig.spec_synthetic_accept): every verify row
        keeps exactly min(N, its proposals); -1: the model's rule.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: dict,
        spaces: Sequence[GroupShape],
        max_slots: int,
        kv_types,
        kernels: Kernels = XLA,
        max_proposals: int = 0,
        graph_max_tokens: int = 0,
        head=None,
        draft=None,
        ngram: bool = False,
        head_lookup: bool = False,
        mtp=None,
        dflash=None,
        placement: Placement | None = None,
        synthetic_accept: int = -1,
    ):
        if placement is not None:  # the attention kernels run on each device's heads
            kernels = shard_kernels(kernels, cfg, placement)
        self.cfg, self.family, self.kernels = cfg, family_of(cfg), kernels
        self.synthetic_accept = synthetic_accept
        self.spaces = tuple(spaces)
        block_size = spaces[0].block_size
        # self.draft: the proposer (a draft head, a draft model or the lookup), whose caches
        # (if any) mirror the pool
        self.draft = proposals.proposer(cfg, self.family, kernels, max_proposals, block_size,
                                        head, draft, ngram, head_lookup, mtp, dflash,
                                        max_slots)  # fmt: skip
        self.ahead = self.draft is not None  # proposals kept on the device
        # a proposer's caches and a row's catch-up (sampling.catch_up) follow group 0 alone
        assert not self.ahead or len(self.spaces) == 1, "device proposers need one cache group"
        # Positions past a sampled row's last token that its draft decodes write: the host
        # claims blocks for them (host/engine.py).
        self.writes_ahead = self.draft.writes_ahead if self.draft is not None else 0
        self.k = max_proposals
        # where the arrays live: on one device, OneDevice's methods leave them as they are
        self.placement = placement or OneDevice()
        self.block_size = block_size
        self.max_slots = max_slots
        self.max_blocks = spaces[0].max_blocks
        family = self.family

        def allocate():
            kv = family.init_caches(cfg, self.spaces, *kv_types)
            state = sampling.init_state(max_slots, cfg.vocab_size)
            model_state = family.init_slot_state(cfg, max_slots, max_proposals * self.ahead)
            if model_state is not None:  # the family's per-slot state rides with the sampler's
                state["model"] = model_state
            if self.ahead:  # per slot: proposals kept by its last row, and the next ones
                state.update(proposals.init(max_slots, max_proposals))
            dkv = self.draft.init_kv(self.spaces[0]) if self.draft is not None else None
            return kv, state, dkv

        # Abstract params (loading.params.abstract_params): compile now, `materialize` later.
        abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        # the shardings of (kv, state, draft kv) and of params
        allocate, self._held = self.placement.allocator(allocate, params)
        self._allocate = allocate
        self.params = self.placement.place(params, self._held[1])
        self.kv, self.state, self.draft_kv = jax.eval_shape(allocate) if abstract else allocate()
        if abstract:
            self.kv, self.state, self.draft_kv = self.placement.abstract(
                (self.kv, self.state, self.draft_kv), self._held[0]
            )
        # set by bucket_runs.time_steps: seconds per bucket, and what proposing adds to a step
        self.step_time: dict[tuple[int, int], float] = {}
        self.propose_time = 0.0
        # Device arrays of the last step's model statistics (MoE: expert_counts [L_moe, E]);
        # never fetched unless asked (trace.StepTracer), so they cost the step no sync.
        self.last_stats: dict = {}
        self.tally = None  # device/expert_tally.py's, where the routing is recorded
        self.expert_orders = None  # [L_moe, E] the experts' stored order, or None (file order)
        self.programs = BucketPrograms(
            self.step_function, donate=(1, 2, 3, 4), name="step",
            options=functools.partial(graph_options, graph_max_tokens),
        )  # fmt: skip
        # keyed by (R, S, filtered, logprobs, propose): the sampling program reads no [T] array,
        # and the host picks its variant (sampling.py says why it is no lax.cond)
        self.sample_programs = BucketPrograms(self.sample_function, donate=(2, 3), name="sampling")
        self._open: dict[int, jax.Array] = {}  # S -> all-allowed masks [S, words]
        # process 0 of several: each program it launches is sent to the others (serving only:
        # the start-up is the same on every process); set by build.py
        self.stream = None

    def materialize(self, params: dict) -> None:
        """Take the loaded params of a runner built (and warmed up) with their abstract_params,
        and allocate the KV pool and slot state: after the weights, so the pool never shares
        the device with the loader's transient buffers."""
        shape = functools.partial(jax.tree.map, lambda x: (x.shape, jnp.dtype(x.dtype)))
        assert shape(params) == shape(self.params), "params differ from those compiled for"
        self.params = self.placement.place(params, self._held[1])
        self.kv, self.state, self.draft_kv = self._allocate()

    def _keep(self, x, which: int):
        """Inside a program: x (kv 0, draft kv 2) where it was, or replicated (which -1)."""
        held = None if which < 0 else self._held[0][which]
        return self.placement.constrain(x, held)

    @property
    def compiles(self) -> int:
        return self.programs.compiles + self.sample_programs.compiles

    def logit_width(self, T: int, S: int) -> int:
        """Logits rows R of bucket (T, S): one per row, and room for every row's proposals."""
        return S if self.k == 0 else min(T, S * (self.k + 1))

    def layout(self, T: int, S: int):
        extra = tuple(g.max_blocks for g in self.spaces[1:])
        return step_layout(T, S, self.logit_width(T, S), self.max_blocks, extra)

    def _step_fn(self, params, kv, model_state, prompt_mask, dkv, last, ahead, dparams, ints, *,
                 T: int, S: int):  # fmt: skip
        """One model forward pass and the fed-token bookkeeping; T, S static.

        Args: params; kv, model_state (the family's per-slot state, else None),
          prompt_mask [S_max, V] (the tokens each slot has seen) and dkv (self.draft's caches,
          else None), all four donated; last [S_max]: each slot's last sampled token, fed to
          its decode row; ahead: with proposals kept on the device, their state
          (device/proposals.py; read), else None; dparams: a draft model's params, else None;
          ints: int32, packed per `layout`, then the sampling's (step_io.upload).
        Returns: (logits float32 [R, V], row tokens int32 [R, K + 1] (sampling.mark_fed's),
          kv, model_state, prompt_mask, dkv, model stats (the family's forward's), what the
          sampling program's proposing reads (Forward.reads), and the sampling's inputs).
        """
        layout = self.layout(T, S)
        batch = unpack(ints, layout)
        batch["tokens"] = sampling.feed(batch, {"last": last, **(ahead or {})})
        if ahead is not None:
            off = proposals.offsets(ahead["acc"], batch)
            batch = sampling.catch_up(batch, off, self.block_size)
            # per row, the proposals its slot's last sampled row kept (a "replay" family's)
            batch["kept"] = ahead["acc"][jnp.clip(batch["slots"], 0, self.max_slots - 1)]
        hidden = self.draft.hidden_layers if self.draft is not None else ()
        logits, kv, model_state, stats = self.family.forward(
            params, kv, model_state, batch, self.cfg, self.kernels, hidden
        )
        with jax.named_scope("sampling"):
            prompt_mask, row_tokens = sampling.mark_fed(prompt_mask, batch, self.k)
        reads = stats.pop("hidden", None)
        if self.draft is not None:  # a draft's KV or the lookup's tokens of every token fed
            with jax.named_scope("draft"):
                dkv, reads = self.draft.feed(dparams, dkv, batch, reads)
        # every step leaves its state where it found it: the sampler's replicated, the
        # family's too but for a Gated DeltaNet model's split by head (Placement.slot_state)
        kv, dkv = self._keep(kv, 0), self._keep(dkv, 2)
        held = self._held[0][1]
        model_state = self.placement.constrain(model_state, held and held.get("model"))
        prompt_mask = self._keep(prompt_mask, -1)
        # computed split by vocabulary (the lm_head's columns stay where they are), and left so
        logits = self.placement.constrain(logits, -1)
        out = (logits.astype(jnp.float32), row_tokens, kv, model_state, prompt_mask, dkv, stats)
        return out + (reads, ints[layout_size(layout) :])

    def _ahead(self, state: dict):
        """The proposals' device state a forward pass reads (None: none on the device)."""
        return proposals.of(state) if self.ahead else None

    def _dparams(self):
        """The draft's params, where its part of the forward pass reads them (else None)."""
        if self.draft is None or not self.draft.feeds_params:
            return None
        return self.draft.propose_bufs(self.params)

    def step_function(self, T: int, S: int):
        """The forward pass of bucket (T, S) and abstract arguments to trace or lower it with."""
        n = layout_size(self.layout(T, S)) + sample_size(self.logit_width(T, S), S)
        ints = abstract_arg(self.placement, (n,), jnp.int32)
        st = self.state
        args = (self.params, self.kv, st.get("model"), st["prompt_mask"], self.draft_kv,
                st["last"], self._ahead(st), self._dparams(), ints)  # fmt: skip
        return functools.partial(self._step_fn, T=T, S=S), args

    def executable(self, T: int, S: int):
        """The compiled forward pass of a warmed bucket (for cost analysis and HLO text)."""
        return self.programs[(T, S)]

    def launch(self, b: dict[str, np.ndarray], T: int, S: int) -> Launched:
        """Dispatch one step, forward pass and sampling, and start copying its outputs to the
        host; does not wait.

        Args:
          b: step_format.lower's arrays for bucket (T, S, logit_width) and SlotTable.row_inputs'
            (and "allow", the grammar masks, where a row samples under one).
        """
        return self.launch_sample(self.launch_forward(b, T, S), b)

    def launch_forward(self, b: dict[str, np.ndarray], T: int, S: int) -> Forward:
        """Dispatch a step's forward pass; its sampling waits for launch_sample."""
        ints = upload(b, self.layout(T, S), self.logit_width(T, S), S)
        if self.stream is not None:  # the other processes launch it too
            self.stream.send(FORWARD, (T, S), [ints])
        return self.forward(ints, T, S)

    def forward(self, ints: np.ndarray, T: int, S: int) -> Forward:
        """launch_forward's program on its uploaded int32 buffer."""
        ints = self.placement.host_input(ints)
        st = self.state
        out = self.programs[(T, S)](
            self.params, self.kv, st.get("model"), st["prompt_mask"], self.draft_kv, st["last"],
            self._ahead(st), self._dparams(), ints,
        )  # fmt: skip
        logits, row_tokens, self.kv, model_state, st["prompt_mask"], self.draft_kv = out[:6]
        self.last_stats = out[6]
        if self.tally is not None:
            self.tally.add(self.last_stats)
        if model_state is not None:
            st["model"] = model_state
        return Forward(logits, row_tokens, self.logit_width(T, S), S, out[8], out[7])

    def close(self) -> None:
        """After the last step: the processes that follow this one's stream stop, and the
        device arrays (weights, KV caches, per-slot state) are let go, so an engine started
        next in this process sizes its KV pool from the memory they held (the pool takes
        what is free at start-up) even while this runner is still referenced."""
        if self.stream is not None:
            self.stream.send(STOP, (), [])
            self.stream = None
        self.params, self.kv, self.draft_kv, self.state = None, None, None, {}

    def fetch(self, launched: Launched) -> dict[str, np.ndarray]:
        """Wait for a launched step's outputs (step_io.outputs)."""
        return outputs(launched)

    def warmup(self, pairs: list[tuple[int, int]]) -> None:
        """Compile every (T, S) bucket pair's forward pass and sampling."""
        compile_all([(self.programs, pairs), (self.sample_programs, self.sample_buckets(pairs))])
        for S in sorted({s for _, s in pairs}):
            self._open_mask(S)

    @property
    def on_accelerator(self) -> bool:
        """Whether the step programs run on a GPU (where first runs are worth doing at start-up:
        on CPU a run per bucket costs seconds of a 2-core start and saves nothing measured)."""
        return jax.default_backend() != "cpu"
