"""ModelConfig (read from GGUF metadata) and the frozen, validated EngineConfig."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Weights: a float dtype dequantizes every GGUF tensor to it at load; quantized keeps the
# quantized ones (pallas_kernels/ggml_blocks.py FORMATS) in their blocks on the device, float
# tensors and activations in bfloat16 on GPU, float32 on CPU. auto keeps them quantized only when
# the dequantized weights would not fit (build.keep_quantized): the quantized matmuls still run
# slower than XLA's bf16 dot (H200, Qwen3-8B shapes, decode: Q8_0 at 0.33x to 0.41x its speed,
# Q4_K at 0.54x to 0.62x; bench/results/history/2026-11-30_quant_matmul_types_h200.md), so
# dequantizing is the faster choice wherever it fits.
DTYPES = ("auto", "quantized", "bfloat16", "float16", "float32")
FLOAT_CACHE_TYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
# q8_0 / q4_0: int8 or packed 4-bit values with an f16 scale per 32 (pallas_kernels/kv_cache.py).
CACHE_TYPES = ("auto", *FLOAT_CACHE_TYPES, "q8_0", "q4_0")
# auto: the Pallas kernel on GPU (1.47x to 1.85x the XLA path's decode tok/s at 4k-token
# contexts, C1 to C32, and 13x to 15x faster prefill on the H200:
# bench/results/engine_decode_4k_qwen3-8b-bf16.md); xla on CPU, where the kernel
# runs only in interpret mode.
ATTENTION_BACKENDS = ("auto", "pallas", "xla")
# Grouped expert matmuls of MoE models: auto is pallas on GPU (pallas_kernels/moe_grouping.py:
# 1.9x / 1.8x / 2.6x the decode tokens/s of jax.lax.ragged_dot at C1 / C8 / C32 on a
# Qwen3-30B-A3B-shaped file, 8x faster prefill, on the H200:
# bench/results/engine_decode_qwen3-30b-a3b-bf16.md); xla on CPU.
MOE_BACKENDS = ("auto", "pallas", "xla")
# Projections with quantized weights: pallas runs pallas_kernels/quant_matmul.py for steps of at
# most 64 tokens (faster than XLA's dequantize-then-dot there, slower above: models/linear.py)
# and pallas_kernels/dequantize.py then XLA's dot for larger steps; xla always dequantizes with
# XLA then dots. auto: pallas on GPU, xla on CPU.
QUANT_BACKENDS = ("auto", "pallas", "xla")
# What the Pallas kernel's decode-sized calls (1 or 2 live rows, and experts a pair at a time)
# dot the codes with: int8 rounds the activations to int8 per 32 values, as llama.cpp's q8_1,
# and takes four products a dp4a instruction (H200, one live row: Q4_K gate/up 54 -> 43 us, down
# 35 -> 26, Q8_0 gate/up 46 -> 42, at 78% of the copy bandwidth; Q6_K 80 -> 82;
# bench/results/history/2026-12-01_quant_matmul_int8_x_h200.md); float keeps them in float32. With
# int8, Q4_K's calls of more rows also dot int8 rows with int8 codes (backends.SERVED_INT8_DOTS).
QUANT_ACTIVATIONS = ("auto", "int8", "float")
# Speculative decoding: proposals from a draft model (--draft) or from prompt lookup (n-grams of
# the sequence itself), verified by the target in the same packed step as everything else.
SPEC_MODES = ("off", "ngram", "draft", "head", "mtp", "dflash")
# How many proposals a step verifies: adaptive (speculation/policy.py: by estimated acceptance
# and measured step cost, probing slots that stopped), always (K for every decoding slot, as
# vLLM does), auto (with proposals on the device: always, while speculation/gate.py measures it
# serving faster than no speculation, else none; with proposals from the host: adaptive). On
# the H200 the embedded pair ran 1.36x to 2.07x mode off at C1 to C32 with always, 0.86x to
# 1.41x with adaptive (bench/results/history/2026-12-03_speculative_embedded_h200.md), and prompt
# lookup 1.11x to 1.67x against 0.71x to 1.38x: the host bounds those steps, and warmup's
# step times, which the adaptive policy's costs start from, say little. A proposer that
# rarely agrees costs a step its verify tokens under always; the gate turns it off.
SPEC_POLICIES = ("auto", "adaptive", "always")
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder (llama / qwen2 / qwen3, and qwen3moe's experts)."""

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int  # H
    n_kv_heads: int  # K
    head_dim: int  # D
    ffn_dim: int
    rms_eps: float = 1e-6
    rope_base: float = 10000.0
    rope_dim: int = 0  # dimensions rotated; 0 = head_dim
    rope_neox: bool = True  # rotate halves (qwen) rather than adjacent pairs (llama in GGUF)
    rope_scaling: str = "none"  # none | linear
    rope_scaling_factor: float = 1.0
    qk_norm: bool = False
    attn_bias: bool = False
    tied_embeddings: bool = False
    context_length: int = 4096
    # Mixture of experts (qwen3moe); 0 experts = a dense FFN.
    n_experts: int = 0  # E
    n_experts_used: int = 0  # experts per token (top-k)
    expert_ffn_dim: int = 0
    expert_weights_norm: bool = False  # renormalize the top-k router weights to sum to 1
    expert_scoring: str = "softmax"  # router scores (pallas_kernels/moe_router.SCORINGS)
    expert_weights_scale: float = 1.0  # the routing weights' factor
    expert_groups: int = 1  # group-limited routing: experts in this many groups,
    expert_groups_used: int = 1  # of which this many best are eligible
    shared_expert_ffn_dim: int = 0  # qwen35moe: an always-on expert, gated by sigmoid
    swiglu_limit: float = 0.0  # the experts' SwiGLU clamp (pallas_kernels/swiglu.py; 0: none)
    attn_gate: bool = False  # full attention's query projection also yields a sigmoid gate
    # MTP blocks after the model's own (llama.cpp's nextn layers, models/mtp.py) whose params
    # are loaded: the file's nextn_predict_layers, set to 0 by the builder unless they propose
    mtp_layers: int = 0
    # The family's own fields (a frozen dataclass of its module's, from its read_config:
    # models/hybrid.HybridConfig, say); None for a family that has none.
    own: Any = None

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim


ASSETS = Path(__file__).resolve().parent / "assets"
# The embedded default model: trained by bench/tiny_model on the Python standard library.
DEFAULT_MODEL = ASSETS / "luce-stdlib-main.gguf"
DEFAULT_DRAFT = ASSETS / "luce-stdlib-draft.gguf"
DEFAULT_HEAD = ASSETS / "luce-stdlib-head.gguf"  # its draft head (bench/tiny_model/train_head.py)
# the modes that read a draft GGUF, and the embedded model's own (None: none ships; the DFlash
# drafter bench/tiny_model/train_dflash.py trains keeps fewer proposals than the head and the
# draft: docs/speculative.md)
DRAFT_FILES = {"draft": DEFAULT_DRAFT, "head": DEFAULT_HEAD, "dflash": None}


def default_compile_cache_dir() -> str:
    """LUCE_COMPILE_CACHE_DIR if set (one cache for several checkouts or a test run), else
    luce_jax/xla under XDG_CACHE_HOME or ~/.cache."""
    if os.environ.get("LUCE_COMPILE_CACHE_DIR"):
        return os.environ["LUCE_COMPILE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "luce_jax", "xla")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs; field names are the CLI flags in snake_case."""

    model: str | None = None  # None: the embedded default model
    model_name: str | None = None
    dtype: str = "auto"
    max_concurrency: int = 8
    max_ctx: int = 4096
    kv_pool_tokens: int = 0  # 0 = derive from free device memory
    kv_block_size: int = 16
    cache_type_k: str = "auto"  # auto: the weights' dtype
    cache_type_v: str = "auto"
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    quant_backend: str = "auto"
    # auto: int8, for dense and MoE models alike. MoE once kept float (each rounding of x was a
    # kernel more, and the host's CUDA graph update grew with them); with the norms and the GLU
    # rounding in their own kernels, int8 ran 30B-A3B Q4_K_M faster at C1, C2 and C8 on the
    # H100 (bench/results/history/2026-12-06_decode_ab_qwen3-30b-a3b-q4_k_m_h100.md)
    quant_activations: str = "auto"
    prefill_chunk: int = 512
    prefill_token_budget: int = 512
    max_concurrent_prefills: int = 4
    admission_coalesce_ms: float = 0.0
    max_queue: int = 256
    # steps of more tokens than this compile without CUDA graphs (0: every step uses them): a
    # warm prefix-cached request's prompt step waits 2.3 ms for its launch on the H200 host,
    # but launching its kernels one by one took 6.3-6.8 ms and warm TTFT stayed 22-23 ms
    # (bench/results/prefix_cuda_graph_max_tokens_h200.md), so graphs stay on by
    # default. (About 1.3 ms of that launch is its ~370 arguments, and keeping the graph's
    # temporaries at fixed addresses did not shorten it: ..._command_buffer_update_mode_h200.md.)
    cuda_graph_max_tokens: int = 0
    prefix_cache: bool = True  # share full KV blocks of equal prompt prefixes across requests
    chat_template_file: str | None = None
    spec_mode: str = "off"
    # draft GGUF (spec_mode=draft), draft head GGUF (head) or DFlash drafter GGUF (dflash);
    # None: the embedded model's
    draft: str | None = None
    draft_tokens: int = 4  # K: most proposals one sequence verifies per step
    spec_policy: str = "auto"  # SPEC_POLICIES
    # spec_mode=head: a row whose last 3 tokens occurred before takes prompt lookup's proposals
    # (device/head_proposer.py says why)
    head_lookup: bool = True
    # benchmarks only (refused without `benchmark`): every verify row keeps exactly min(N, K)
    # of its proposals, whatever they are, so speculation's whole cost can be measured on
    # random-weight files at any acceptance length (the tokens are not the model's); -1: off
    spec_synthetic_accept: int = -1
    benchmark: bool = False  # allow settings that serve other tokens than the model's
    compile_cache_dir: str | None = field(default_factory=default_compile_cache_dir)
    seed: int = 0
    # several devices (device/mesh.py): the model split over tensor_parallel of them; the
    # stacked experts split over their axis with expert_parallel equal to it (0: so on MoE
    # models), or over their FFN width with 1; devices: local device indices (None: the first)
    tensor_parallel: int = 1
    expert_parallel: int = 0
    devices: tuple[int, ...] | None = None
    # several hosts (device/distributed.py): jax.distributed's coordinator address of process
    # 0, the processes and this one's index; process 0 serves, the others follow its steps
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    # MoE routing histogram (expert_stats.py): written to record_expert_stats when the engine
    # stops; read from expert_placement to even the devices' shares of routed tokens
    record_expert_stats: str | None = None
    expert_placement: str | None = None

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {DTYPES}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if self.moe_backend not in MOE_BACKENDS:
            bad("moe_backend", f"must be one of {MOE_BACKENDS}")
        if self.quant_backend not in QUANT_BACKENDS:
            bad("quant_backend", f"must be one of {QUANT_BACKENDS}")
        if self.quant_activations not in QUANT_ACTIVATIONS:
            bad("quant_activations", f"must be one of {QUANT_ACTIVATIONS}")
        if self.spec_mode not in SPEC_MODES:
            bad("spec_mode", f"must be one of {SPEC_MODES}")
        if self.spec_policy not in SPEC_POLICIES:
            bad("spec_policy", f"must be one of {SPEC_POLICIES}")
        if self.draft is not None and not Path(self.draft).is_file():
            bad("draft", "no such file")
        if self.draft is not None and self.spec_mode not in DRAFT_FILES:
            bad("draft", f"is used only with spec_mode {' or '.join(map(repr, DRAFT_FILES))} "
                f"(not {self.spec_mode!r})")  # fmt: skip
        own_model = self.model is not None and Path(self.model) != DEFAULT_MODEL
        embedded = DRAFT_FILES.get(self.spec_mode, 0) is not None
        if self.spec_mode in DRAFT_FILES and self.draft is None and (own_model or not embedded):
            what = {"draft": "draft model", "head": "draft head", "dflash": "DFlash drafter"}
            whose = "with a model of your own" if own_model else "(the embedded model ships none)"
            bad("draft", f"spec_mode={self.spec_mode!r} {whose} needs a "
                f"{what[self.spec_mode]} GGUF")  # fmt: skip
        for name in ("cache_type_k", "cache_type_v"):
            if getattr(self, name) not in CACHE_TYPES:
                bad(name, f"must be one of {CACHE_TYPES}")
        for name in (
            "max_concurrency",
            "max_ctx",
            "kv_block_size",
            "prefill_chunk",
            "prefill_token_budget",
            "max_concurrent_prefills",
            "max_queue",
            "draft_tokens",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(name, "must be a positive integer")
        tp = self.tensor_parallel
        if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
            bad("tensor_parallel", "must be a positive integer")
        if self.expert_parallel not in (0, 1, tp):
            bad("expert_parallel", f"must be 0 (auto), 1 or tensor_parallel={tp}")
        if self.devices is not None:
            d = self.devices
            if not isinstance(d, tuple) or not all(isinstance(i, int) and i >= 0 for i in d):
                bad("devices", "must be a tuple of device indices >= 0")
            if len(set(d)) != len(d) or len(d) != tp:
                bad("devices", f"must name tensor_parallel={tp} distinct devices")
        n = self.num_processes
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            bad("num_processes", "must be a positive integer")
        if not isinstance(self.process_id, int) or not 0 <= self.process_id < n:
            bad("process_id", f"must be in 0..{n - 1} (num_processes={n})")
        if n > 1 and not (isinstance(self.coordinator, str) and ":" in self.coordinator):
            bad("coordinator", "must be host:port of process 0 with num_processes > 1")
        if self.expert_placement is not None and tp == 1:
            bad("expert_placement", "places experts over several devices; tensor_parallel=1")
        sa = self.spec_synthetic_accept
        if not isinstance(sa, int) or isinstance(sa, bool) or sa < -1:
            bad("spec_synthetic_accept", "must be an integer >= 0 (-1: off)")
        if sa >= 0 and not self.benchmark:
            bad("spec_synthetic_accept", "serves tokens the model did not choose: for "
                "benchmarks only (set benchmark)")  # fmt: skip
        if sa >= 0 and self.spec_mode == "off":
            bad("spec_synthetic_accept", "needs a spec_mode with proposals to keep")
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            bad("draft_tokens", f"must be at most {MAX_DRAFT_TOKENS}")
        if self.kv_block_size & (self.kv_block_size - 1):
            bad("kv_block_size", "must be a power of two")
        if not isinstance(self.kv_pool_tokens, int) or self.kv_pool_tokens < 0:
            bad("kv_pool_tokens", "must be an integer >= 0 (0 = auto)")
        if 0 < self.kv_pool_tokens < self.max_ctx:  # build.kv_pool_blocks' rule, before loading
            bad("kv_pool_tokens", f"must hold one max_ctx={self.max_ctx} sequence (or be 0)")
        c = self.cuda_graph_max_tokens
        if not isinstance(c, int) or isinstance(c, bool) or c < 0:
            bad("cuda_graph_max_tokens", "must be an integer >= 0 (0 = every step)")
        if not isinstance(self.prefix_cache, bool):
            bad("prefix_cache", "must be a bool")
        if self.admission_coalesce_ms < 0:
            bad("admission_coalesce_ms", "must be >= 0")
        if self.prefill_chunk > self.prefill_token_budget:
            bad("prefill_chunk", f"must be <= prefill_token_budget ({self.prefill_token_budget})")
        if self.model is not None and not Path(self.model).is_file():
            bad("model", "no such file")
        if self.chat_template_file is not None and not Path(self.chat_template_file).is_file():
            bad("chat_template_file", "no such file")

    def resolved(self, backend: str) -> EngineConfig:
        """Replace "auto" values for a backend: XLA's CPU backend emulates bfloat16 slowly, and
        the Pallas kernel runs on CPU only in interpret mode (and needs Triton: GPU)."""
        # auto / quantized: the dtype activations and float tensors take
        compute = "float32" if backend == "cpu" else "bfloat16"
        dtype = compute if self.dtype in ("auto", "quantized") else self.dtype
        short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]
        gpu = backend in ("gpu", "cuda", "rocm")
        attention, moe, quant = self.attention_backend, self.moe_backend, self.quant_backend
        auto = "pallas" if gpu else "xla"
        return self.replace(
            dtype=dtype,
            attention_backend=auto if attention == "auto" else attention,
            moe_backend=auto if moe == "auto" else moe,
            quant_backend=auto if quant == "auto" else quant,
            cache_type_k=short if self.cache_type_k == "auto" else self.cache_type_k,
            cache_type_v=short if self.cache_type_v == "auto" else self.cache_type_v,
            quant_activations="int8"
            if self.quant_activations == "auto"
            else self.quant_activations,
        )

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def draft_model(self) -> str:
        """The draft GGUF of spec_mode=draft, head or dflash (the embedded model's own beside
        the embedded model)."""
        return self.draft or str(DRAFT_FILES.get(self.spec_mode) or DEFAULT_DRAFT)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_ctx // self.kv_block_size)

    @property
    def step_span(self) -> int:
        """The most positions one step claims for a slot past the first it queries: a prompt
        slice, or a verify row (accepted proposals fed again, the token, K proposals, K more
        where the device may move the row on), then a device draft's K writes ahead
        (host/engine.py's dispatch). A sliding-window cache group holds its window plus this."""
        k = self.draft_tokens if self.spec_mode != "off" else 0
        return max(self.prefill_chunk, 3 * k + 1) + k
