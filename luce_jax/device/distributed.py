"""Several processes (hosts) as one mesh: `jax.distributed`, and the step stream.

Every process runs the same SPMD step programs over the global mesh, each on its own devices.
Process 0 alone runs the scheduler (and the HTTP server); the others follow it: each program
process 0 launches while serving, it first sends to them (its kind, its bucket key and its
host inputs), and they launch the same program with the same inputs, in the same order. The
start-up (load, KV allocation, warmup, first runs) is the same code on every process and
needs no stream.

The stream is the key-value store of JAX's distributed runtime (the coordination service
`jax.distributed.initialize` starts on process 0), no transport of ours: message i is the
value of key `luce/step/i`, which the followers wait for. It is host to host, beside the
devices' work: process 0 sends step N + 1 while step N still runs, as the asynchronous loop
dispatches it. (A broadcast through the devices' collectives, `broadcast_one_to_all`, was a
device program queued after the step in flight: process 0 waited for each step to finish
before it launched the next.)
"""

from __future__ import annotations

import logging

import jax
import numpy as np

log = logging.getLogger(__name__)

FORWARD, SAMPLE, STOP = 1, 2, 3
HEADER = 16  # int32 header: kind, the number of arrays, their lengths, then the key
PREFIX = "luce/step/"
# Messages process 0 keeps in the store. It reads a step's outputs before it plans a step two
# later, and those outputs need every process's part of the step's collectives, so a
# follower is never more than a few messages behind the newest.
KEPT = 64
WAIT_MS = 60_000  # a follower's wait for the next message, renewed while the server idles


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    """Join the processes of one mesh (before any other use of jax in this process)."""
    # CPU devices of several processes reach each other through gloo (GPUs: NCCL)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    log.info("process %d of %d: %d of %d devices here", jax.process_index(), num_processes,
             jax.local_device_count(), jax.device_count())  # fmt: skip


def _client():
    from jax._src import distributed  # the runtime's client: jax.distributed has no public one

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the step stream needs jax.distributed.initialize first")
    return client


class StepStream:
    """What process 0 launches, sent to the other processes (`send` on process 0, `recv` on
    the others; both in program order)."""

    def __init__(self):
        self.client, self.seq = _client(), 0

    def send(self, kind: int, key: tuple[int, ...], arrays: list[np.ndarray]) -> None:
        """kind (FORWARD, SAMPLE, STOP), the program's key (ints) and its int32 host inputs."""
        head = np.zeros(HEADER, np.int32)
        head[:2] = kind, len(arrays)
        head[2 : 2 + len(arrays)] = [a.size for a in arrays]
        head[2 + len(arrays) : 2 + len(arrays) + len(key)] = key
        body = [np.ascontiguousarray(a, np.int32).ravel() for a in arrays]
        self.client.key_value_set_bytes(
            PREFIX + str(self.seq), np.concatenate([head, *body]).tobytes()
        )
        if self.seq >= KEPT:
            self.client.key_value_delete(PREFIX + str(self.seq - KEPT))
        self.seq += 1

    def recv(self) -> tuple[int, tuple[int, ...], list[np.ndarray]]:
        """The next (kind, key (zeros after it), arrays flattened) process 0 sent."""
        while True:
            try:
                blob = self.client.blocking_key_value_get_bytes(PREFIX + str(self.seq), WAIT_MS)
                break
            except jax.errors.JaxRuntimeError as e:  # the wait's deadline: the server idles
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        self.seq += 1
        msg = np.frombuffer(blob, np.int32)
        kind, n = int(msg[0]), int(msg[1])
        sizes = msg[2 : 2 + n]
        key = tuple(int(v) for v in msg[2 + n : HEADER])
        ends = HEADER + np.cumsum(sizes)
        return kind, key, [msg[e - s : e] for e, s in zip(ends, sizes, strict=True)]


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
