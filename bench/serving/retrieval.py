"""Long-prompt retrieval: TTFT and throughput at about 1k, 4k, 16k and 32k prompt tokens.

Each prompt is a deterministic document: an access label in its first paragraph, filler
sentences (seeded) up to the target length, and a question about the label at the end. Per
length and per C (1 and 5): C concurrent streaming /v1/completions of distinct documents,
temperature 0. Reported: TTFT median, output tok/s and prompt+output tok/s over the wall time,
the decode rate over the output window (tokens after each stream's first, from the first
stream's first token to the last stream's end: what a reader sees once text flows), and how
many responses contain their label (meaningful only with a trained model; random
weights answer noise, so expect 0). With --server-cmd, each length gets a fresh server
started with {ctx} = the length plus the output room, and {ctx_total} = 5 * {ctx}.

    python bench/serving/retrieval.py --tokenizer model.gguf --lengths 1024 4096 \\
        --server-cmd "python -m luce_jax.serve --model model.gguf --max-ctx {ctx} --port {port}"
"""

from __future__ import annotations

import argparse
import asyncio
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

log = logging.getLogger("retrieval")

WORDS = (
    "river stone market lantern harbor meadow copper signal orchard ledger window valley "
    "engine garden bridge archive winter summer pattern circuit compass thunder silver "
    "morning evening northern southern quiet rapid gentle ancient modern hidden open"
).split()
QUESTION = (
    "\n\nQuestion: What is the access label given near the beginning of this document?\n"
    "Answer: The access label is"
)


def label_for(seed: int) -> str:
    r = random.Random(seed * 7919 + 1)
    return f"{r.choice(WORDS).upper()}-{r.randrange(1000, 10000)}"


def sentence(r: random.Random) -> str:
    words = [r.choice(WORDS) for _ in range(r.randrange(8, 16))]
    return " ".join(words).capitalize() + "."


def document(n_tokens: int, seed: int, count) -> tuple[str, str]:
    """(prompt, label): about n_tokens tokens by `count` (text -> token count), never more.

    Filler grows a paragraph at a time (token counts summed per paragraph, so a 32k-token
    document is tokenized about twice, not once per paragraph); the last paragraph is trimmed
    by sentences so the prompt lands just under the target.
    """
    r, label = random.Random(seed), label_for(seed)
    head = (
        f"Document {seed}. Operations notes.\n\nAccess label: {label}. "
        "Keep this label; it is asked for at the end.\n\n"
    )
    paragraphs: list[str] = []
    total = count(head) + count(QUESTION)
    while True:
        para = " ".join(sentence(r) for _ in range(8))
        n = count(para) + 1  # + the paragraph break
        if total + n > n_tokens:
            break
        paragraphs.append(para)
        total += n
    sentences = para.split(". ")
    while sentences:
        part = ". ".join(sentences)
        if total + count(part) + 1 <= n_tokens:
            paragraphs.append(part)
            break
        sentences.pop()
    text = head + "\n\n".join(paragraphs) + QUESTION
    while count(text) > n_tokens and paragraphs:  # merges across joins can differ by a token
        paragraphs.pop()
        text = head + "\n\n".join(paragraphs) + QUESTION
    return text, label


async def _batch(base: str, model: str | None, docs: list[tuple[str, str]], max_tokens: int):
    body = {
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    texts: list[list[str]] = [[] for _ in docs]
    async with httpx.AsyncClient(timeout=3600) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(
            *(
                one_request(
                    client, base + "/v1/completions", {**body, "prompt": p}, texts[i].append
                )
                for i, (p, _) in enumerate(docs)
            )
        )
        wall = time.perf_counter() - t0
    found = sum(lab in "".join(t) for (_, lab), t in zip(docs, texts, strict=True))
    return {
        "seconds": wall,
        "completion_tokens": sum(r["tokens"] for r in res),
        "prompt_tokens": sum(r["prompt_tokens"] for r in res),
        "ttft": [r["first"] - r["start"] for r in res],
        "window": (
            sum(r["tokens"] - 1 for r in res),
            max(r["end"] for r in res) - min(r["first"] for r in res),
        ),
        "found": found,
        "n": len(docs),
    }


def measure(base, model, length, cs, count, max_tokens) -> list[dict]:
    rows = []
    for C in cs:
        docs = [document(length, 1000 * length + C * 10 + i, count) for i in range(C)]
        b = asyncio.run(_batch(base, model, docs, max_tokens))
        rows.append(
            {
                "length": length,
                "C": C,
                "prompt_tokens_mean": b["prompt_tokens"] / C,
                "ttft_median_s": statistics.median(b["ttft"]),
                "ttft_max_s": max(b["ttft"]),
                "output_tok_s": b["completion_tokens"] / b["seconds"],
                "total_tok_s": (b["completion_tokens"] + b["prompt_tokens"]) / b["seconds"],
                "window_tok_s": b["window"][0] / max(b["window"][1], 1e-9),
                "found": b["found"],
                "n": b["n"],
                "seconds": b["seconds"],
            }
        )
        log.info("%s", rows[-1])
    return rows


def markdown(rows: list[dict], title: str) -> str:
    lines = [
        title,
        "",
        "| prompt tokens | C | TTFT median ms | TTFT max ms | output tok/s | prompt+output tok/s "
        "| decode tok/s (output window) | label found |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens_mean']:.0f} | {r['C']} | {r['ttft_median_s'] * 1e3:.0f} | "
            f"{r['ttft_max_s'] * 1e3:.0f} | {r['output_tok_s']:.1f} | {r['total_tok_s']:.0f} | "
            f"{r['window_tok_s']:.1f} | {r['found']}/{r['n']} |"
        )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="GGUF whose tokenizer sizes the prompts")
    ap.add_argument("--url")
    ap.add_argument("--server-cmd", help="command with {port}, {ctx} and/or {ctx_total}")
    ap.add_argument("--server-log", default=None)
    ap.add_argument("--model-name", default=None)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--title", default="long-prompt retrieval")
    ap.add_argument("--out", default=None, help="JSON path; .md is written beside it")
    a = ap.parse_args()
    if not (a.url or a.server_cmd):
        ap.error("--url or --server-cmd is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from luce_jax.loading.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_gguf(a.tokenizer)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special=False))

    rows = []
    for length in a.lengths:
        proc, base = None, a.url
        if a.server_cmd:
            port, ctx = free_port(), length + a.max_tokens + 64
            proc = start_server(
                a.server_cmd, port, a.start_timeout, a.server_log, ctx=ctx, ctx_total=5 * ctx
            )
            base = f"http://127.0.0.1:{port}"
        try:
            asyncio.run(_batch(base, a.model_name, [document(256, 0, count)], 4))  # warmup
            rows += measure(base, a.model_name, length, a.concurrency, count, a.max_tokens)
        finally:
            stop_server(proc)
    meta = run_meta()
    res = {
        "bench": "retrieval",
        **meta,
        "title": a.title,
        "max_tokens": a.max_tokens,
        "rows": rows,
    }
    md = markdown(rows, a.title) + "\n" + meta_line(meta) + "\n"
    write_result(res, md, a.out)


if __name__ == "__main__":
    main()
