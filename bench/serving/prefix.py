"""Prefix reuse: TTFT cold and warm, and tok/s, for an agent loop and a multi-turn chat.

Workloads (raw /v1/completions text, so every request's prefix is byte-for-byte the last one's;
temperature 0, ignore_eos, streamed), at each C:
  agent: a shared system+tools prefix of about --prefix-tokens tokens and a unique suffix of
    100-300 tokens per request. Cold: one wave of C requests whose prefixes were never sent
    (each its own). Warm: the shared prefix is sent once, then --waves waves of C requests
    with it.
  chat: C conversations of --turns turns after a 1000-token system prompt of their own; each
    turn's prompt is the previous prompt, its answer and a new user turn of 40-80 tokens.
    Cold: turn 1; warm: turns 2 and later.
Reported per workload and C: TTFT median cold and warm, their ratio, and output tok/s (output
tokens over the warm waves' wall time).

    python bench/serving/prefix.py --tokenizer m.gguf --server ours="python -m luce_jax.serve \\
        --model m.gguf --max-ctx {ctx} --port {port}" --out ours.json
    python bench/serving/prefix.py --merge ours.json llama.json --out prefix.json  # ratios
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from concurrency import free_port, one_request, start_server, stop_server

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from meta import meta_line, run_meta, write_result  # noqa: E402
from retrieval import sentence  # noqa: E402

log = logging.getLogger("prefix")


def text_of(n_tokens: int, seed: int, count, head: str = "") -> str:
    """Seeded filler sentences after `head`, about n_tokens tokens by `count` (never more)."""
    r, parts, total = random.Random(seed), [head], count(head)
    while True:
        s = " " + sentence(r)
        n = count(s)
        if total + n > n_tokens:
            return "".join(parts)
        parts.append(s)
        total += n


def system_prefix(n_tokens: int, seed: int, count) -> str:
    return text_of(n_tokens, seed, count, f"System ({seed}). You are an agent with these tools:")


async def _wave(base, body, prompts, sinks=None) -> list[dict]:
    async with httpx.AsyncClient(timeout=3600) as client:
        url = base + "/v1/completions"
        return await asyncio.gather(
            *(
                one_request(client, url, {**body, "prompt": p}, sinks[i].append if sinks else None)
                for i, p in enumerate(prompts)
            )
        )


def run_wave(base, body, prompts, sinks=None) -> tuple[list[dict], float]:
    """C concurrent streamed requests; `sinks`: a list per prompt that receives its text."""
    t0 = time.perf_counter()
    res = asyncio.run(_wave(base, body, prompts, sinks))
    return res, time.perf_counter() - t0


def agent(base, body, C, count, prefix_tokens, waves, seed) -> dict:
    r = random.Random(seed)

    def suffix(i):
        return text_of(r.randrange(100, 300), seed * 1000 + i, count, "\n\nTask:")

    cold, _ = run_wave(
        base,
        body,
        [system_prefix(prefix_tokens, seed + 1 + c, count) + suffix(c) for c in range(C)],
    )
    shared = system_prefix(prefix_tokens, seed, count)
    run_wave(base, body, [shared + suffix(-1)])  # the prefix is sent once
    warm, seconds, tokens = [], 0.0, 0
    for w in range(waves):
        res, dt = run_wave(base, body, [shared + suffix(C * (w + 1) + c) for c in range(C)])
        warm += res
        seconds += dt
        tokens += sum(x["tokens"] for x in res)
    return summary("agent", C, cold, warm, tokens / seconds)


def chat(base, body, C, count, turns, seed) -> dict:
    convs = [system_prefix(1000, seed + c, count) for c in range(C)]
    cold, warm, seconds, tokens = [], [], 0.0, 0
    for t in range(turns):
        n = [random.Random(seed * 31 + t * 7 + c).randrange(40, 80) for c in range(C)]
        prompts = [
            conv + text_of(n[c], seed * 977 + t * 13 + c, count, "\nUser:") + "\nAssistant:"
            for c, conv in enumerate(convs)
        ]
        texts: list[list[str]] = [[] for _ in range(C)]
        res, dt = run_wave(base, body, prompts, texts)
        if t == 0:
            cold += res
        else:
            warm += res
            seconds += dt
            tokens += sum(x["tokens"] for x in res)
        convs = [p + "".join(tx) for p, tx in zip(prompts, texts, strict=True)]
    return summary("chat", C, cold, warm, tokens / seconds)


def summary(workload, C, cold, warm, tok_s) -> dict:
    c = statistics.median(x["first"] - x["start"] for x in cold)
    w = statistics.median(x["first"] - x["start"] for x in warm)
    return {
        "workload": workload,
        "C": C,
        "prompt_tokens_warm": statistics.mean(x["prompt_tokens"] for x in warm),
        "ttft_cold_ms": c * 1e3,
        "ttft_warm_ms": w * 1e3,
        "cold_over_warm": c / w,
        "output_tok_s": tok_s,
    }


def markdown(runs: dict[str, list[dict]], title: str) -> str:
    names = list(runs)
    head = "| workload | C | prompt tokens (warm) |"
    for n in names:
        head += f" {n}: TTFT cold ms | warm ms | cold/warm | tok/s |"
    if len(names) == 2:
        head += f" warm TTFT {names[1]}/{names[0]} | tok/s {names[0]}/{names[1]} |"
    lines = [title, "", head, "|" + " --- |" * (head.count("|") - 1)]
    for i, row in enumerate(runs[names[0]]):
        line = f"| {row['workload']} | {row['C']} | {row['prompt_tokens_warm']:.0f} |"
        for n in names:
            x = runs[n][i]
            line += (
                f" {x['ttft_cold_ms']:.0f} | {x['ttft_warm_ms']:.0f} | "
                f"{x['cold_over_warm']:.1f}x | {x['output_tok_s']:.0f} |"
            )
        if len(names) == 2:
            a, b = runs[names[0]][i], runs[names[1]][i]
            line += (
                f" **{b['ttft_warm_ms'] / a['ttft_warm_ms']:.2f}x** |"
                f" **{a['output_tok_s'] / b['output_tok_s']:.2f}x** |"
            )
        lines.append(line)
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokenizer", help="GGUF whose tokenizer sizes the texts")
    ap.add_argument(
        "--server",
        action="append",
        default=[],
        help="NAME=command with {port} "
        "and {ctx} (per-request context) / {ctx_total} (5 x ctx), started in turn",
    )
    ap.add_argument("--merge", nargs="+", help="JSON results of earlier runs to put side by side")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--prefix-tokens", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--server-log", default=None)
    ap.add_argument("--title", default="prefix reuse")
    ap.add_argument("--out", default=None, help="JSON path; .md is written beside it")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    meta = run_meta()
    if a.merge:
        parts = [json.load(open(p)) for p in a.merge]
        runs = {k: v for p in parts for k, v in p["runs"].items()}
        meta["sources"] = [
            {"file": f, **{k: p[k] for k in ("date", "commit", "command")}}
            for f, p in zip(a.merge, parts, strict=True)
        ]
    else:
        if not (a.tokenizer and a.server):
            ap.error("--tokenizer and --server are required (or --merge)")
        from luce_jax.loading.tokenizer import GGUFTokenizer

        tok = GGUFTokenizer.from_gguf(a.tokenizer)

        def count(text: str) -> int:
            return len(tok.encode(text, add_special=False))

        body = {
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "cache_prompt": True,  # llama-server's prompt cache
            "stream_options": {"include_usage": True},
        }
        ctx = max(a.prefix_tokens + 400, 1100 + a.turns * (80 + a.max_tokens + 8)) + a.max_tokens
        runs = {}
        for spec in a.server:
            name, cmd = spec.split("=", 1)
            port = free_port()
            proc = start_server(
                cmd, port, a.start_timeout, a.server_log, ctx=ctx, ctx_total=5 * ctx
            )
            base = f"http://127.0.0.1:{port}"
            try:
                run_wave(base, body, ["warmup " * 50])
                rows = []
                for C in a.concurrency:
                    rows.append(agent(base, body, C, count, a.prefix_tokens, a.waves, 100 + C))
                    log.info("%s %s", name, rows[-1])
                    rows.append(chat(base, body, C, count, a.turns, 200 + C))
                    log.info("%s %s", name, rows[-1])
                runs[name] = rows
            finally:
                stop_server(proc)
    res = {"bench": "prefix", **meta, "title": a.title, "runs": runs}
    md = markdown(runs, a.title) + "\n" + meta_line(meta) + "\n"
    write_result(res, md, a.out)


if __name__ == "__main__":
    main()
