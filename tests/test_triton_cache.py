"""Each distinct Triton kernel compiles once per process and once per cache directory.

jaxlib's CUDA handler cannot run on CPU, so a counting handler stands in for it; what is
asserted is what the server relies on: repeated layers lower to one module, a module compiles
once, a restart reads it back, and a damaged entry is compiled again rather than used.
"""

import io
import json
import os

import jax
import jax.numpy as jnp
import pytest
from jax._src.lib import triton

from luce_jax.device import triton_cache
from pallas_kernels.ggml_blocks import FORMATS, QuantWeight
from pallas_kernels.quant_matmul import quant_matmul


class Result:
    def __init__(self, asm, smem_bytes):
        self.asm, self.smem_bytes = asm, smem_bytes


class CountingHandler:
    def __init__(self):
        self.calls = []

    def __call__(self, module, arch, warps, ctas, stages):
        self.calls.append((module, arch, warps, ctas, stages))
        return Result(f"// ptx {len(self.calls)} for {len(module)} bytes, {warps} warps", 512)


@pytest.fixture
def cuda_handler(monkeypatch):
    """A counting handler registered as CUDA's, removed (with any wrapper) afterwards."""
    handler = CountingHandler()
    monkeypatch.setitem(triton._compilation_handlers, "CUDA", handler)
    return handler


def compile_(module: bytes, warps=4):
    return triton.compile("cuda", module, "sm_90a", num_warps=warps, num_ctas=1, num_stages=2)


def test_a_module_compiles_once_per_process(cuda_handler):
    cache = triton_cache.install(None)
    assert triton_cache.installed() is cache and triton_cache.install(None) is cache
    first = compile_(b"module A")
    assert compile_(b"module A") == first and len(cuda_handler.calls) == 1
    assert first.asm.startswith("// ptx 1") and first.smem_bytes == 512
    compile_(b"module A", warps=8)  # other launch options are another kernel
    compile_(b"module B")
    assert len(cuda_handler.calls) == 3 and cache.compiled == 3


def test_a_restart_reads_compiled_modules_back(cuda_handler, tmp_path):
    triton_cache.install(str(tmp_path))
    first = compile_(b"module A")
    # a new process: a fresh wrapper over jaxlib's handler, the same directory
    later = triton_cache.TritonCompileCache(cuda_handler, str(tmp_path), triton_cache_version())
    assert later(b"module A", "sm_90a", 4, 1, 2) == first
    assert len(cuda_handler.calls) == 1 and later.from_disk == 1
    other = triton_cache.TritonCompileCache(cuda_handler, str(tmp_path), "another jaxlib")
    other(b"module A", "sm_90a", 4, 1, 2)  # another compiler's output is not reused
    assert len(cuda_handler.calls) == 2


def test_a_damaged_entry_is_compiled_again(cuda_handler, tmp_path, caplog):
    cache = triton_cache.install(str(tmp_path))
    first = compile_(b"module A")
    (entry,) = os.listdir(tmp_path)
    (tmp_path / entry).write_text('{"asm": "// torn')
    later = triton_cache.TritonCompileCache(cuda_handler, str(tmp_path), cache.version)
    assert later(b"module A", "sm_90a", 4, 1, 2).smem_bytes == first.smem_bytes
    assert len(cuda_handler.calls) == 2 and "ignoring Triton cache entry" in caplog.text
    assert json.loads((tmp_path / entry).read_text())["smem_bytes"] == 512  # rewritten whole


def test_no_handler_means_nothing_to_wrap(monkeypatch):
    monkeypatch.delitem(triton._compilation_handlers, "CUDA", raising=False)
    assert triton_cache.install(None) is None and triton_cache.installed() is None


def test_repeated_layers_lower_to_one_module(verified):
    """The premise of the cache: the same kernel at two call sites (two layers with equal
    shapes) lowers to byte-identical modules, so a model compiles it once, not per layer."""
    f = FORMATS["q4_k"]
    ws = [
        QuantWeight.from_rows(jnp.zeros((64, 512 // f.block * f.type_size), jnp.uint8), "q4_k")
        for _ in range(3)
    ]

    def layers(x, ws):
        for w in ws:
            x = quant_matmul(x, w, jnp.int32(1), interpret=False, out_dtype=jnp.bfloat16)
            x = jnp.concatenate([x] * 8, axis=1)
        return x

    x = jnp.zeros((8, 512), jnp.bfloat16)
    jax.jit(layers).trace(x, ws).lower(lowering_platforms=("cuda",))
    modules = set()
    for result in verified:
        buf = io.BytesIO()
        result.module.operation.write_bytecode(buf)
        modules.add(buf.getvalue())
    assert len(verified) == 3 and len(modules) == 1


def triton_cache_version():
    from jax._src.lib import version_str

    return version_str
