"""One builder for the Python API and the server: EngineConfig -> a loaded, warmed engine
(`load_engine`); engine_handle.py starts its scheduler and engine thread."""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from .config import DEFAULT_MODEL, FLOAT_CACHE_TYPES, EngineConfig
from .draft_files import load_proposers, mtp_config
from .kv_sizing import kv_spaces
from .startup import StartupClock

log = logging.getLogger(__name__)

# dtype=auto dequantizes only while the dequantized weights take at most this share of device
# memory, which leaves the rest for the KV pool; beyond it they stay quantized.
DEQUANTIZED_WEIGHTS_FRACTION = 0.6


def load_engine(config: EngineConfig):
    """Load the GGUF, size the KV pool, build the engine and compile every step bucket.

    Returns:
      (GGUFTokenizer, StepEngine), ready to be driven by a Scheduler.
    """
    with StartupClock() as clock:
        tokenizer, engine = _load(config, clock)
    log.info("%s", clock.summary())
    return tokenizer, engine


def _load(config: EngineConfig, clock: StartupClock):
    """load_engine's steps, each timed as a phase of `clock`."""
    import jax

    if config.num_processes > 1 and not jax.distributed.is_initialized():
        from .device.distributed import initialize

        initialize(config.coordinator, config.num_processes, config.process_id)

    from .backends import kernels, quant_matmul_fn
    from .device import bucket_runs
    from .device.programs import enable_compile_cache
    from .device.runner import Runner
    from .host.engine import StepEngine
    from .host.grammar import Grammars
    from .loading.gguf import model_config, open_gguf
    from .loading.params import abstract_params, load_params, weight_bytes
    from .loading.tokenizer import GGUFTokenizer, GGUFVocab
    from .models.family import family_of
    from .speculation.build import enable_speculation

    with clock.phase("model file, device and tokenizer"):
        f = open_gguf(config.model or DEFAULT_MODEL)
        quantized = keep_quantized(config.dtype, f, jax.local_devices()[0])
        config = config.resolved(jax.default_backend())
        enable_compile_cache(config.compile_cache_dir)
        template = None
        if config.chat_template_file:
            with open(config.chat_template_file) as fh:
                template = fh.read()
        vocab = GGUFVocab.from_metadata(f.metadata)
        tokenizer = GGUFTokenizer(vocab, template)
    # The weights load on a thread while the step compiles from their shapes: on the H200 a
    # warm start of the 8B-shaped bf16 file spent 3.1 s loading, then 3.3 s compiling.
    with clock.phase("weight shapes"):
        file_cfg = mtp_config(config, model_config(f.metadata))
        mc, shapes = abstract_params(f, file_cfg, config.dtype, quantized)
    config = fit_to_model(config, mc)
    family = family_of(mc)
    groups = kv_cache_types(config, mc)[1]
    if not family.prefix_cacheable or not all(g.shareable for g in groups):
        config = prefix_cache_off(config, family)
    # every proposer runs on the device, inside the step; prompt lookup also on the host, for a
    # family whose slots are fed their kept proposals again ("refeed": the host must know them)
    if config.spec_mode not in ("off", "ngram", *family.device_proposers):
        raise ValueError(
            f"spec_mode={config.spec_mode!r}: runs on the device, inside the step, which the "
            f"{family.name} family's models do not take (spec_mode 'ngram' does)"
        )
    draft, head, dflash, kv_bytes = load_proposers(config, mc, vocab, quantized, groups[0], clock)
    groups[0] = dataclasses.replace(groups[0], bytes_per_token=groups[0].bytes_per_token + kv_bytes)
    placement = _placement(config, mc, shapes)
    device = jax.local_devices()[0] if placement is None else placement.first_local_device
    # one device's share of the weights (the draft's whole): the pool is sized for each alike
    target = weight_bytes(shapes) if placement is None else placement.device_bytes(shapes)
    weights = target + (weight_bytes(draft[1]) if draft else 0)
    if placement is not None and mc.n_kv_heads % placement.n == 0:  # Placement.caches' split
        groups = [dataclasses.replace(g, bytes_per_token=g.bytes_per_token / placement.n)
                  for g in groups]  # fmt: skip
    spaces = kv_spaces(config, groups, device, state_bytes(mc, config), weights)
    # started after the pool is sized: a load in progress would move the allocator's figures
    orders, moe_layers = None, sum("router" in lp for lp in shapes["layers"])
    if config.expert_placement:
        from .expert_stats import placement_orders

        orders = placement_orders(config.expert_placement, mc, moe_layers, placement)
    loading = _in_background(load_params, f, file_cfg, config.dtype, quantized, False, placement,
                             orders)  # fmt: skip
    for g, s in zip(groups, spaces, strict=True):
        per_block = s.block_size * s.tokens_per_entry
        log.info(
            "KV pool, %s group: %d blocks of %d tokens (%.2f GiB)",
            g.kind,
            s.num_blocks - 1,
            per_block,
            s.num_blocks * per_block * g.bytes_per_token / 2**30,
        )

    def runner_for(cls, model_cfg, model_params, **kw):
        return cls(
            model_cfg,
            model_params,
            spaces,
            config.max_concurrency,
            kv_cache_types(config, model_cfg)[0],
            kernels(config),
            **kw,
        )

    spec_k = config.draft_tokens if config.spec_mode != "off" else 0
    # Proposers run on the device, in the target's step (device/proposals.py); prompt lookup
    # runs on the host for a family that takes no device proposer.
    on_device = None
    if draft is not None:
        dcfg, dparams = draft
        qm = quant_matmul_fn(config.quant_backend, config.quant_activations)
        on_device = (dcfg, dparams, kv_cache_types(config, dcfg)[0], qm)
    runner = runner_for(
        Runner, mc, shapes, max_proposals=spec_k, graph_max_tokens=config.cuda_graph_max_tokens,
        head=head, draft=on_device, head_lookup=config.head_lookup,
        ngram=config.spec_mode == "ngram" and "ngram" in family.device_proposers,
        mtp=kv_cache_types(config, mc)[0] if config.spec_mode == "mtp" else None,
        dflash=dflash,
        placement=placement, synthetic_accept=config.spec_synthetic_accept,
    )  # fmt: skip
    runner.expert_orders = orders
    if config.record_expert_stats:
        if not mc.n_experts:
            raise ValueError(f"record_expert_stats={config.record_expert_stats!r}: no experts")
        from .device.expert_tally import ExpertTally

        runner.tally = ExpertTally(moe_layers, mc.n_experts)
    engine = StepEngine(config, runner, one_row=quantized and config.quant_backend == "pallas")
    # structured output: xgrammar loads on the first request that asks for it
    engine.grammars = Grammars(tokenizer.token_bytes, tokenizer.eog_ids, mc.vocab_size)
    pairs = engine.bucket_pairs()
    with clock.phase("compile", f"{len(pairs)} buckets"):
        runner.warmup(pairs)
    with clock.phase("weights"):  # the wait for them after the compile
        seconds, (_, params) = loading.result()
        runner.materialize(params)
    clock.notes["weights"] = f"loaded in {seconds:.1f} s beside the compile"
    # With speculation, time_steps (below) runs every bucket anyway, its first run untimed.
    if runner.on_accelerator and not spec_k:
        with clock.phase("first runs", f"{len(pairs)} buckets"):
            bucket_runs.first_runs(runner, pairs)
    log.info(
        "weights: %.2f GiB on the device, %.2fx the file's tensors (%s)",
        weight_bytes(params) / 2**30,
        weight_bytes(params) / sum(t.nbytes for t in f.tensors.values()),
        "quantized tensors kept in their GGUF blocks" if quantized else f"as {config.dtype}",
    )
    if config.spec_mode == "off":
        return tokenizer, engine
    enable_speculation(config, engine, pairs, clock)
    return tokenizer, engine


def _placement(config: EngineConfig, mc, shapes):
    """Where the step's arrays live on several devices (device/mesh.py), or None for one."""
    from .device.mesh import Placement, make_mesh
    from .models.fused_layout import delta_split

    mesh = make_mesh(config.devices, config.tensor_parallel)
    if mesh is None:
        return None
    ep = config.expert_parallel or config.tensor_parallel
    expert_parallel = ep > 1 and mc.n_experts > 0
    # split by E, the experts run per device (device/sharded_kernels.py); split by width, only
    # XLA's grouped matmul is partitioned (a Pallas kernel would gather them each step)
    split_experts = expert_parallel or config.moe_backend != "pallas"
    # a Gated DeltaNet model's layers split by head where every one of them can
    n, layers = mesh.devices.size, [lp for lp in shapes.get("layers", ()) if "w_in" in lp]
    delta = bool(layers) and all(delta_split(lp, mc, n) for lp in layers)
    placement = Placement(mesh, expert_parallel, split_experts,
                          cfg=mc if delta else None)  # fmt: skip
    log.info("%d devices: %s", placement.n, ", ".join(str(d) for d in mesh.devices.flat))
    return placement


def _in_background(fn, *args):
    """fn(*args) on its own thread: a future of (seconds it took, its result)."""

    def timed():
        t = time.perf_counter()
        out = fn(*args)
        return time.perf_counter() - t, out

    pool = ThreadPoolExecutor(1, thread_name_prefix="weights")
    future = pool.submit(timed)
    pool.shutdown(wait=False)
    return future


def keep_quantized(dtype: str, f, device) -> bool:
    """Whether quantized tensors stay in their blocks: always for dtype=quantized, never for a
    float dtype, and for auto when the weights dequantized to 2 bytes a value would take more
    than DEQUANTIZED_WEIGHTS_FRACTION of the device's memory (on CPU, which reports none: no).

    auto prefers dequantized weights where they fit because they are still faster: on the H200
    the 8B q8_0 file kept quantized served 182 / 344 / 537 / 1106 tok/s at C1 / C2 / C4 / C8
    (bench/results/history/2026-12-01_compare_qwen3-8b-q8_0.md), dequantized 193 / 379 / 737 / 1422
    (history/2026-11-30_compare_qwen3-8b-q8_0.md)."""
    from gguf import GGML_QUANT_SIZES

    if dtype != "auto":
        return dtype == "quantized"
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return False
    dequantized = 0
    for t in f.tensors.values():
        block, size = GGML_QUANT_SIZES[t.qtype]
        values = t.nbytes // size * block
        dequantized += values * 2 if block > 1 else t.nbytes  # float tensors stay as they are
    keep = dequantized > DEQUANTIZED_WEIGHTS_FRACTION * stats["bytes_limit"]
    log.info(
        "dtype auto: dequantized weights would take %.1f GiB of %.1f GiB; %s",
        dequantized / 2**30,
        stats["bytes_limit"] / 2**30,
        "keeping quantized tensors quantized" if keep else "dequantizing (faster where it fits)",
    )
    return keep


def kv_cache_types(config: EngineConfig, mc):
    """The runner's (k, v) cache types and the family's cache groups (models.family.CacheGroup,
    each with the KV bytes one token takes over its layers).

    Float types become dtypes; q8_0 / q4_0 stay names (pallas_kernels/kv_cache.py) and count their
    scales, so kv_pool_tokens=0 fits about 1.9x (q8_0) or 3.6x (q4_0) the bf16 tokens.
    """
    import jax.numpy as jnp

    from pallas_kernels import kv_cache

    names = (config.cache_type_k, config.cache_type_v)
    quantized = [n for n in names if n in kv_cache.QUANT_TYPES]
    if quantized and mc.head_dim % kv_cache.GROUP:
        raise ValueError(
            f"cache_type_k={names[0]!r}, cache_type_v={names[1]!r}: quantized KV needs a head "
            f"dim divisible by {kv_cache.GROUP}; the model's is {mc.head_dim}"
        )
    from .models.family import family_of

    types = tuple(jnp.dtype(FLOAT_CACHE_TYPES[n]) if n in FLOAT_CACHE_TYPES else n for n in names)
    per_entry = mc.kv_size * sum(kv_cache.bytes_per_value(t) for t in types)  # one layer's
    return types, family_of(mc).cache_groups(mc, per_entry)


def state_bytes(mc, config: EngineConfig) -> int:
    """Device bytes of the model family's per-slot state (its init_slot_state's arrays, sized
    without allocating them); 0 for a family that keeps none."""
    import functools

    import jax

    from .models.family import family_of

    family = family_of(mc)
    # proposals kept on the device (a replaying family stores its verify rows' inputs)
    k = config.draft_tokens if config.spec_mode in family.device_proposers else 0
    init = functools.partial(family.init_slot_state, mc, config.max_concurrency, k)
    shapes = jax.eval_shape(init)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def prefix_cache_off(config: EngineConfig, family) -> EngineConfig:
    """The prefix cache shares full KV blocks only: a family whose slots hold other state after
    their blocks (a recurrent state, say), or whose caches keep only a window or compressed
    entries, is served without it."""
    if config.prefix_cache:
        log.info("prefix cache off: the %s family's caches cannot be shared", family.name)
    return config.replace(prefix_cache=False)


def fit_to_model(config: EngineConfig, mc) -> EngineConfig:
    """Clamp max_ctx to the model's context length (RoPE past it is untrained): a warning when
    the max_ctx was asked for, a note when it is the default (every start of the embedded
    model, whose context is 2048, would warn otherwise)."""
    if config.max_ctx <= mc.context_length:
        return config
    asked = config.max_ctx != EngineConfig.max_ctx
    log.log(
        logging.WARNING if asked else logging.INFO,
        "max_ctx %d exceeds the model's context length %d; using %d",
        config.max_ctx,
        mc.context_length,
        mc.context_length,
    )
    return config.replace(max_ctx=mc.context_length)
