"""Several processes (hosts) as one mesh: `jax.distributed`, and the step stream.

Every process runs the same SPMD step programs over the global mesh, each on its own devices.
Process 0 alone runs the scheduler (and the HTTP server); the others follow it: each program
process 0 launches while serving, it first sends to them (its kind, its bucket key and its
host inputs), and they launch the same program with the same inputs, in the same order. The
stream is JAX's own collectives (`multihost_utils.broadcast_one_to_all`, over NCCL or, on
CPUs, gloo), no transport of ours. The start-up (load, KV allocation, warmup, first runs) is
the same code on every process and needs no stream.

A broadcast is a device program after the step's: process 0 waits for a step to finish
before it launches the next, so a step stream costs the asynchronous loop's overlap.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

log = logging.getLogger(__name__)

FORWARD, SAMPLE, STOP = 1, 2, 3
HEADER = 16  # int32 header: kind, the number of arrays, their lengths, then the key


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the processes of one mesh (before any other use of jax in this process)."""
    # CPU devices of several processes reach each other through gloo (GPUs: NCCL)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    log.info("process %d of %d: %d of %d devices here", jax.process_index(), num_processes,
             jax.local_device_count(), jax.device_count())  # fmt: skip


def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


class StepStream:
    """What process 0 launches, sent to the other processes (`send` on process 0, `recv` on
    the others; both in program order)."""

    def send(self, kind: int, key: tuple[int, ...], arrays: list[np.ndarray]) -> None:
        """kind (FORWARD, SAMPLE, STOP), the program's key (ints) and its int32 host inputs."""
        head = np.zeros(HEADER, np.int32)
        head[:2] = kind, len(arrays)
        head[2 : 2 + len(arrays)] = [a.size for a in arrays]
        head[2 + len(arrays) : 2 + len(arrays) + len(key)] = key
        _broadcast(head)
        for a in arrays:
            _broadcast(np.ascontiguousarray(a, np.int32).ravel())

    def recv(self) -> tuple[int, tuple[int, ...], list[np.ndarray]]:
        """The next (kind, key (zeros after it), arrays flattened) process 0 sent."""
        head = _broadcast(np.zeros(HEADER, np.int32))
        kind, n = int(head[0]), int(head[1])
        sizes = head[2 : 2 + n]
        key = tuple(int(v) for v in head[2 + n :])
        return kind, key, [_broadcast(np.zeros(int(s), np.int32)) for s in sizes]


def follow_stream(runner) -> None:
    """Launch what process 0's stream says, on `runner` (device/runner.py), until STOP."""
    stream, fwd, steps = StepStream(), None, 0
    while True:
        kind, key, arrays = stream.recv()
        if kind == STOP:
            log.info("process 0 stopped after %d steps", steps)
            return
        if kind == FORWARD:
            fwd = runner.forward(arrays[0], *key[:2])
            steps += 1
        else:  # SAMPLE: (R, S, filtered, logprobs, propose) and the grammar masks, if any
            variant = (key[0], key[1], *(bool(v) for v in key[2:5]))
            allow = arrays[0].reshape(key[1], -1) if arrays else None
            runner.sample(fwd, variant, allow)
