"""Compiled programs per bucket key: compile ahead, count compiles, warm up in parallel.

The step's forward pass and its sampling program (runner.py) each own one BucketPrograms. A
compile after warmup is a bug: `compiles` must not move while serving, and a miss is logged.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

import jax
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


def enable_compile_cache(path: str | None) -> None:
    """Use JAX's persistent compilation cache so restarts skip recompiling the buckets."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class BucketPrograms:
    """One executable per bucket key of a function: (T, S) for a step, more static arguments
    where a program has variants (the sampling's, runner.py).

    Args:
      traced: (*key) -> (function with the key bound, abstract arguments to lower it with).
      donate: argument positions donated to the program (only KV and per-slot device state).
      name: what the progress bar and the log call these programs.
      options: (*key) -> XLA compiler options for that key's program, or None (the defaults).
    """

    def __init__(
        self,
        traced: Callable[..., tuple],
        donate: tuple[int, ...],
        name: str,
        options: Callable[..., dict | None] | None = None,
    ):
        self.traced, self.donate, self.name = traced, donate, name
        self.options = options or (lambda *key: None)
        self.compiles = 0  # executables built; after warmup this must not move
        self._exec: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def compile(self, *key):
        """Build (or fetch from the persistent cache) the executable of one bucket key."""
        fn, args = self.traced(*key)
        lowered = jax.jit(fn, donate_argnums=self.donate).lower(*args)
        exe = lowered.compile(compiler_options=self.options(*key))
        with self._lock:
            self.compiles += 1
            self._exec[key] = exe
        return exe

    def __getitem__(self, key: tuple):
        exe = self._exec.get(key)
        if exe is None:
            log.warning("compiling %s for bucket %s while serving", self.name, key)
            exe = self.compile(*key)
        return exe

    def __contains__(self, key) -> bool:
        return key in self._exec

    def warmup(self, keys: list[tuple], workers: int | None = None) -> None:
        """Compile every bucket key ahead of serving (`compile_all`)."""
        compile_all([(self, keys)], workers)


def compile_all(
    groups: list[tuple[BucketPrograms, list[tuple]]], workers: int | None = None
) -> None:
    """Compile every key of every group ahead of serving, all in one thread pool: XLA compiles
    in C++ without the GIL, so the pool uses the host's cores, and one group's slow programs
    (the sampling's sort) compile beside another's rather than after them."""
    todo = [(p, k) for p, keys in groups for k in keys if k not in p._exec]
    # On CPU one at a time: the suite once hung for good with one thread in XLA's CPU compile and
    # another serializing its executable for the persistent cache (jax 0.10.2), and a CPU
    # compile already takes the host's cores.
    cpu = jax.default_backend() == "cpu"
    workers = workers or (1 if cpu else max(1, min(len(todo), os.cpu_count() or 2)))
    names = " and ".join(p.name for p, _ in groups)
    log.info("compiling %d %s programs", len(todo), names)
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(p.compile, *k) for p, k in todo]
        # a bar on a terminal only (disable=None): a log file or a notebook gets the plain
        # lines around it, not carriage-return frames
        bar = tqdm(as_completed(futures), total=len(futures), desc=f"compiling {names}",
                   leave=False, disable=None)  # fmt: skip
        for f in bar:
            f.result()
    for p, keys in groups:
        log.info("compiled %d %s buckets", len(keys), p.name)


# XLA forms a CUDA graph only from a run of at least this many kernels: far more than a step
# has, so the program launches its kernels one by one.
NO_GRAPHS = {"xla_gpu_graph_min_graph_size": 1 << 30}


def graph_options(max_tokens: int, T: int, S: int) -> dict | None:
    """Compiler options of step bucket (T, S): without CUDA graphs when max_tokens > 0 and the
    bucket holds more tokens. A graph saves a decode step its kernel launches, but is updated on
    the host before it runs; a prompt step's kernels run longer than they take to launch."""
    del S
    return dict(NO_GRAPHS) if 0 < max_tokens < T else None


def best_of_3(fn) -> float:
    """Seconds of the fastest of 3 calls, after one untimed call."""
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)
