"""Soak: many requests at a fixed concurrency, some clients leaving mid-request; then leaks.

N requests with C in flight at a time against an OpenAI-compatible server (ours: /metrics),
mixed: completions and chat, streamed or not, prompt lengths from a few words to
`--max-prompt-words`, max_tokens from 1 to `--max-tokens`. A share `--disconnect` of the clients
leave at a random point (a stream after a random number of chunks, a plain request after a
random delay). Afterwards, once the server is idle: 5xx count, KV blocks and slots still held
(must be 0), step programs compiled after warmup (must be 0), and latency percentiles of the
requests that ran to the end.

    python bench/serving/soak.py --server-cmd "python -m luce_jax.serve --port {port}" \
        --requests 10000 --concurrency 64 --out bench/results/soak_qwen3-8b_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time

import httpx

log = logging.getLogger("soak")
WORDS = ("the cat sat on a mat while def return import class value list of numbers and some "
         "text about rivers mountains code python function loop").split()  # fmt: skip


def metrics(base: str) -> dict[str, float]:
    """luce_* gauges and counters from /metrics, by name (labels dropped, values summed)."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("luce_"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def plan(n: int, seed: int, max_words: int, max_tokens: int, disconnect: float) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = int(rng.choice([rng.uniform(1, 20), rng.uniform(20, max_words)]))
        prompt = " ".join(rng.choice(WORDS) for _ in range(max(1, words)))
        out.append(
            dict(
                i=i,
                chat=rng.random() < 0.5,
                stream=rng.random() < 0.5,
                prompt=prompt,
                max_tokens=rng.randint(1, max_tokens),
                leave=rng.random() < disconnect,
                leave_after=rng.randint(0, max_tokens),  # chunks (stream) or ms (plain)
            )
        )
    return out


async def one(client: httpx.AsyncClient, r: dict) -> dict:
    body = {"max_tokens": r["max_tokens"], "temperature": 0.7, "seed": r["i"],
            "stream": r["stream"]}  # fmt: skip
    if r["chat"]:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": r["prompt"]}]
    else:
        path, body["prompt"] = "/v1/completions", r["prompt"]
    t0 = time.perf_counter()
    try:
        if r["stream"]:
            async with client.stream("POST", path, json=body) as resp:
                chunks = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if r["leave"] and chunks > r["leave_after"]:
                            return dict(status=resp.status_code, left=True)
                status = resp.status_code
        elif r["leave"]:
            task = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(r["leave_after"] / 1000)
            if not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return dict(status=None, left=True)
            status = task.result().status_code
        else:
            status = (await client.post(path, json=body)).status_code
    except httpx.HTTPError as e:
        return dict(status=None, error=type(e).__name__, left=r["leave"])
    return dict(status=status, left=False, seconds=time.perf_counter() - t0)


async def drive(base: str, reqs: list[dict], concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

        async def bounded(r):
            async with sem:
                return await one(client, r)

        return await asyncio.gather(*(bounded(r) for r in reqs))


def wait_idle(base: str, timeout: float = 60) -> dict[str, float]:
    """Metrics once no request runs or waits (or at the timeout)."""
    deadline = time.time() + timeout
    while True:
        m = metrics(base)
        if (m.get("luce_requests_running", 0) == 0 and m.get("luce_requests_waiting", 0) == 0) or (
            time.time() > deadline
        ):
            return m
        time.sleep(0.2)


def soak(base: str, n: int, concurrency: int, seed: int = 0, max_words: int = 300,
         max_tokens: int = 32, disconnect: float = 0.3) -> dict:  # fmt: skip
    """Run the soak against a server at `base`; the summary dict (see the module docstring)."""
    before = metrics(base)
    reqs = plan(n, seed, max_words, max_tokens, disconnect)
    t0 = time.perf_counter()
    results = asyncio.run(drive(base, reqs, concurrency))
    wall = time.perf_counter() - t0
    after = wait_idle(base)
    codes: dict[str, int] = {}
    for res in results:
        key = str(res["status"]) if res["status"] is not None else res.get("error", "left")
        codes[key] = codes.get(key, 0) + 1
    done = sorted(res["seconds"] for res in results if "seconds" in res)
    q = statistics.quantiles(done, n=100) if len(done) > 1 else [0.0] * 99
    return {
        "requests": n,
        "concurrency": concurrency,
        "disconnected": sum(1 for res in results if res.get("left")),
        "status_counts": codes,
        "server_errors": sum(v for k, v in codes.items() if k.startswith("5")),
        "kv_blocks_used_after": after.get("luce_kv_blocks_used", -1),
        "running_after": after.get("luce_requests_running", -1),
        "compiles_during": after.get("luce_compiles", 0) - before.get("luce_compiles", 0),
        "latency_p50_s": q[49],
        "latency_p99_s": q[98],
        "wall_s": wall,
    }


def main():
    from concurrency import free_port, start_server, stop_server
    from meta import meta_line, run_meta, write_result

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--server-cmd", help="command with {port}; else --base-url")
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-words", type=int, default=600)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--server-log", default=None)
    ap.add_argument("--title", default="soak")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    proc, base = None, a.base_url
    if a.server_cmd:
        port = free_port()
        proc = start_server(a.server_cmd, port, a.start_timeout, a.server_log)
        base = f"http://127.0.0.1:{port}"
    try:
        s = soak(base, a.requests, a.concurrency, max_words=a.max_prompt_words,
                 max_tokens=a.max_tokens, disconnect=a.disconnect)  # fmt: skip
    finally:
        if proc is not None:
            stop_server(proc)
    log.info("%s", json.dumps(s))
    meta = run_meta()
    md = [
        a.title, "",
        "Status counts: HTTP status, or `left` for a plain request cancelled before its answer "
        "(a stream that left mid-way counts its 200).", "",
        "| requests | C | disconnected | 5xx | status counts | KV blocks held after | slots held "
        "after | compiles while serving | p50 s | p99 s | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {s['requests']} | {s['concurrency']} | {s['disconnected']} | {s['server_errors']} | "
        f"{s['status_counts']} | {s['kv_blocks_used_after']:.0f} | {s['running_after']:.0f} | "
        f"{s['compiles_during']:.0f} | {s['latency_p50_s']:.2f} | {s['latency_p99_s']:.2f} | "
        f"{s['wall_s']:.0f} |",
        "", meta_line(meta),
    ]  # fmt: skip
    write_result({"bench": "soak", **meta, **s}, "\n".join(md) + "\n", a.out)
    leaks = s["server_errors"] or s["kv_blocks_used_after"] or s["running_after"]
    raise SystemExit(1 if leaks or s["compiles_during"] else 0)


if __name__ == "__main__":
    main()
