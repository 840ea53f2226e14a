"""Host cost of structured output: filling the token bitmasks of a step's constrained rows.

While a constrained request runs, the engine collects each step before planning the next
(host/grammar.py), so this time is spent with the device idle. Rows are advanced through a
JSON document of the schema, each at its own position, and each step fills every row's mask
(xgrammar's batch matcher, its threads in parallel) and accepts one token per row.

    python bench/serving/grammar_masks.py --vocab ggml-vocab-qwen2.gguf --rows 1 8 32 --out \
        masks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from luce_jax.host.grammar import Grammars
from luce_jax.loading.tokenizer import GGUFTokenizer
from luce_jax.sampling_params import SamplingParams

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from meta import meta_line, run_meta, write_result  # noqa: E402


def run(tok, schema: dict, rows: int, steps: int) -> dict:
    g = Grammars(tok.token_bytes, tok.eog_ids, tok.vocab_size)
    sp = SamplingParams(json_schema=schema)
    doc = json.dumps([{"name": f"item{i}", "kind": "function", "line": 10 + i, "public": True,
                       "args": ["a", "b"]} for i in range(200)])  # fmt: skip
    ids = tok.encode(doc, add_special=False)
    for s in range(rows):
        g.start(s, sp)
        g.accept(s, ids[: 5 * s])  # rows at different places in the document
    slots, sample = np.arange(rows, dtype=np.int32), np.ones(rows, bool)
    times = []
    for k in range(steps):
        t = time.perf_counter()
        g.masks(slots, sample, rows)
        times.append(time.perf_counter() - t)
        for s in range(rows):
            g.accept(s, [ids[5 * s + k]])
    ms = statistics.median(times) * 1e3
    return {"rows": rows, "median_ms": ms, "per_row_us": ms * 1e3 / rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vocab", required=True, help="a GGUF with the tokenizer")
    ap.add_argument("--schema", default="bench/serving/schemas/records.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tok = GGUFTokenizer.from_gguf(a.vocab)
    with open(a.schema) as f:
        schema = json.load(f)
    res = [run(tok, schema, r, a.steps) for r in a.rows]
    meta = run_meta()
    lines = [
        f"Token bitmask fill per step, vocabulary of {tok.vocab_size}, schema {a.schema}, "
        f"median of {a.steps} steps.",
        "",
        "| rows | ms per step | us per row |",
        "| --- | --- | --- |",
        *(f"| {r['rows']} | {r['median_ms']:.2f} | {r['per_row_us']:.0f} |" for r in res),
        "",
        meta_line(meta),
    ]
    write_result({"bench": "grammar_masks", **meta, "rows": res}, "\n".join(lines) + "\n", a.out)


if __name__ == "__main__":
    main()
