"""Compile each distinct Triton kernel once: per process, and once per cache directory.

Why: on CUDA, jaxlib (after 0.10.2) compiles a Pallas kernel's Triton module to PTX while
*lowering* the program that calls it, once per call site. Lowering runs before JAX's
persistent cache is consulted (the cache key is the lowered module), so that work is redone
for every layer of every bucket on every start. The 36 layers of an 8B model call the same
kernels with the same shapes and lower to byte-identical modules, and one quantized matmul
takes 2 to 8 s to reach PTX (bench/kernel_ptx.py on this project's kernels; the TTIR to PTX
passes, not ptxas, take the time). A Q4_K_M server spent 68 s on its first bucket.

`install` wraps the CUDA compilation handler that jaxlib registers: results are memoized by
the module's bytes, the target and the launch options (and jax's version), and written under
`<cache dir>/triton/` so a restart reads them back. PTX is text, so the cached result is
exactly what the handler returned. ROCm's handler returns a path to a temporary HSACO file,
so it is left alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import threading

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CompiledTriton:
    """What pallas_call's lowering reads from a compilation result (jax._src.lib.triton)."""

    asm: str
    smem_bytes: int
    hsaco_path: str = ""


class TritonCompileCache:
    """A compilation handler that remembers: handler(module, arch, warps, ctas, stages).

    Args:
      handler: the handler being wrapped (jaxlib's compile_triton_to_asm for CUDA).
      path: directory for results across processes, or None for this process only.
    """

    def __init__(self, handler, path: str | None, version: str = ""):
        self.handler, self.path, self.version = handler, path, version
        self.memory: dict[str, CompiledTriton] = {}
        self.compiled = self.from_disk = 0  # handler calls, and results read back from path
        self._lock = threading.Lock()
        if path:
            os.makedirs(path, exist_ok=True)

    def key(self, module: bytes, *options) -> str:
        h = hashlib.sha256(module)
        h.update(repr((self.version, *options)).encode())
        return h.hexdigest()

    def __call__(self, module: bytes, arch_name: str, num_warps, num_ctas, num_stages):
        key = self.key(module, arch_name, num_warps, num_ctas, num_stages)
        with self._lock:
            hit = self.memory.get(key)
        if hit is not None:
            return hit
        hit = self._read(key)
        if hit is None:
            r = self.handler(module, arch_name, num_warps, num_ctas, num_stages)
            hit = CompiledTriton(r.asm, int(r.smem_bytes), getattr(r, "hsaco_path", "") or "")
            self._write(key, hit)
            self.compiled += 1
        else:
            self.from_disk += 1
        with self._lock:
            self.memory[key] = hit
        return hit

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key + ".json")

    def _read(self, key: str) -> CompiledTriton | None:
        if not self.path or not os.path.exists(self._file(key)):
            return None
        try:
            with open(self._file(key)) as f:
                return CompiledTriton(**json.load(f))
        except (OSError, ValueError, TypeError) as e:  # a torn or foreign file: compile again
            log.warning("ignoring Triton cache entry %s: %s", self._file(key), e)
            return None

    def _write(self, key: str, result: CompiledTriton) -> None:
        if not self.path:
            return
        tmp = f"{self._file(key)}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(dataclasses.asdict(result), f)
            os.replace(tmp, self._file(key))  # readers see a whole file or none
        except OSError as e:
            log.warning("could not write the Triton cache entry %s: %s", self._file(key), e)


def installed(platform: str = "CUDA") -> TritonCompileCache | None:
    """The cache `install` put in place for `platform`, or None."""
    try:
        from jax._src.lib import triton
    except ImportError:  # pragma: no cover - jax without Triton support
        return None
    h = getattr(triton, "_compilation_handlers", {}).get(platform.upper())
    return h if isinstance(h, TritonCompileCache) else None


def install(path: str | None, platform: str = "CUDA") -> TritonCompileCache | None:
    """Wrap `platform`'s registered Triton compilation handler (once; later calls return it).

    Args:
      path: the persistent directory (JAX's cache dir + "/triton"), or None for memory only.
      platform: the handler's platform name as jaxlib registers it.
    Returns:
      The cache (its `compiled` and `from_disk` counts), or None where this jax has no such
      handler (CPU-only installs; jaxlib 0.10.2 and older, which hand the module to XLA).
    """
    try:
        from jax._src.lib import triton, version_str
    except ImportError:  # pragma: no cover - jax without Triton support
        return None
    handlers = getattr(triton, "_compilation_handlers", None)
    lock = getattr(triton, "_compilation_handlers_lock", None)
    if handlers is None or lock is None:
        log.info("this jax has no Triton compilation handlers to cache")
        return None
    with lock:
        current = handlers.get(platform.upper())
        if current is None or isinstance(current, TritonCompileCache):
            return current
        cache = TritonCompileCache(current, path, version_str)  # jaxlib's compiler made it
        handlers[platform.upper()] = cache
    log.info("Triton kernels compile once per module%s", f", cached in {path}" if path else "")
    return cache
