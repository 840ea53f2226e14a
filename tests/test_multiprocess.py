"""Two processes as one mesh (device/distributed.py): process 0 serves HTTP and plans every
step, process 1 follows its step stream, the model split over both processes' devices (two
CPU devices each, talking through gloo). Requests through the official client get what one
device serves, and process 1 ends when process 0 does."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from luce_jax import LLM, SamplingParams
from luce_jax.config import DEFAULT_DRAFT

# the last one repeats itself: prompt lookup proposes there
PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def push", "x = [1, 2",
           "a = 1\nb = 2\na = 1\nb = 2\na = 1\nb = 2\na = 1\n"]  # fmt: skip
FLAGS = ["--model", str(DEFAULT_DRAFT), "--max-concurrency", "2", "--max-ctx", "256",
         "--prefill-chunk", "32", "--prefill-token-budget", "32",
         "--compile-cache-dir", ""]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("spec", ["ngram"])
def test_two_processes_serve_one_devices_tokens(tmp_path, spec):
    """With speculation (prompt lookup): the plain steps, and the verify steps and their
    sampling, go through the stream alike, and greedy speculation keeps the tokens."""
    http, coordinator = free_port(), free_port()
    # two CPU devices a process (the suite's processes have four: conftest.py)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ["XLA_FLAGS"])
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": flags + " --xla_force_host_platform_device_count=2"}  # fmt: skip
    cmd = [sys.executable, "-m", "luce_jax.serve", *FLAGS, "--spec-mode", spec,
           "--tensor-parallel", "4", "--num-processes", "2", "--coordinator",
           f"127.0.0.1:{coordinator}"]  # fmt: skip
    logs = [tmp_path / f"process{i}.log" for i in (0, 1)]
    procs = [
        subprocess.Popen(cmd + ["--process-id", str(i)] + (["--port", str(http)] if i == 0 else []),
                         stdout=open(logs[i], "wb"), stderr=subprocess.STDOUT, env=env)
        for i in (0, 1)
    ]  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while True:
            for p, log in zip(procs, logs, strict=True):
                assert p.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{http}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none")

        def complete(prompt):
            r = client.completions.create(model="luce-stdlib-draft", prompt=prompt, max_tokens=12,
                                          temperature=0)  # fmt: skip
            return r.choices[0].text

        with ThreadPoolExecutor(2) as pool:  # two at a time: batched steps
            served = list(pool.map(complete, PROMPTS))
        metrics = httpx.get(f"http://127.0.0.1:{http}/metrics").text
        verified = re.search(r'^luce_spec_verify_rows_total\{mode="ngram"\} (\S+)', metrics, re.M)
        assert (spec == "off") == (verified is None), metrics[-2000:]
        assert spec == "off" or float(verified.group(1)) > 0  # verify steps went through
        procs[0].send_signal(signal.SIGINT)
        assert procs[0].wait(60) == 0, logs[0].read_text()[-3000:]
        assert procs[1].wait(60) == 0, logs[1].read_text()[-3000:]  # it followed to the end
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert "process 0 stopped after" in logs[1].read_text()
    llm = LLM(
        str(DEFAULT_DRAFT),
        max_concurrency=2,
        max_ctx=256,
        prefill_chunk=32,
        prefill_token_budget=32,
    )
    alone = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))]
    llm.close()
    assert served == alone


STREAM = """
import sys, threading, time
import jax, numpy as np
jax.distributed.initialize(sys.argv[1], num_processes=1, process_id=0)
from luce_jax.device import distributed as d
d.WAIT_MS, d.KEPT = 200, 4  # short waits and a short history: both paths run
sender, follower = d.StepStream(), d.StepStream()
sent = [(d.FORWARD, (8, 4), [np.arange(i, i + 5, dtype=np.int32)]) for i in range(6)]
sent.append((d.SAMPLE, (4, 4, 1, 0, 0), [np.full(12, -1, np.int32)]))
received = threading.Semaphore(0)  # released per message the follower has read
def send():
    time.sleep(0.7)  # the follower waits past three deadlines first
    for i, m in enumerate(sent):
        if i >= d.KEPT:  # as process 0 does, never past a follower by the messages it keeps
            received.acquire()  # (sent back to back on a loaded machine, one was deleted unread)
        sender.send(*m)
threading.Thread(target=send, daemon=True).start()
for kind, key, arrays in sent:
    got = follower.recv()
    received.release()
    assert got[0] == kind and got[1][: len(key)] == key, (got, key)
    assert all(np.array_equal(a, b) for a, b in zip(got[2], arrays, strict=True)), got
try:  # the oldest messages are gone
    sender.client.key_value_try_get_bytes(d.PREFIX + "0")
    sys.exit("message 0 kept")
except jax.errors.JaxRuntimeError:
    print("ok")
"""


def test_the_step_stream_delivers_in_order_past_idle_waits(tmp_path):
    """The step stream (JAX's distributed key-value store) gives a follower process 0's
    messages in order, their arrays intact, after the follower's waits ran out while nothing
    came (an idle server); process 0 keeps only the last few messages."""
    script = tmp_path / "stream.py"
    script.write_text(STREAM)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    try:
        out = subprocess.run([sys.executable, str(script), f"127.0.0.1:{free_port()}"],
                             env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the stream stalled: {e.stderr!r:.3000}") from None
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
