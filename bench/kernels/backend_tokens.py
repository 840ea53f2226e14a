"""Greedy tokens with the Pallas kernels against the jnp references, on the GPU.

The same random GGUF and prompts run with `attention_backend pallas` (for a hybrid file, the
gated delta kernel in each of its forms: `--chunks`) and `xla` (the jnp references); per prompt,
whether the tokens agree, and where they part the two logprobs on top at that token, so a near
tie (random weights make many) is told from a kernel bug.

    python bench/kernels/backend_tokens.py --model qwen35-small-q8_0.gguf --chunks 16 0 --out \
        tokens.json
"""

from __future__ import annotations

import argparse
import functools
import json
import logging

log = logging.getLogger("backend_tokens")

PROMPTS = ["def fibonacci(n):\n" * k for k in (1, 3, 9, 20)] + ["import os\n" * 40]


def run(model: str, backend: str, chunk: int | None, prompts, max_tokens: int) -> list:
    """Completions of `prompts` (greedy, logprobs 2) on a fresh engine; chunk: the gated delta
    kernel's form with the Pallas backend (None: its default)."""
    from luce_jax import LLM, SamplingParams, backends

    default = backends.gated_delta_fn
    if chunk is not None:
        from pallas_kernels.gated_delta import gated_delta_in_place

        pallas = functools.partial(gated_delta_in_place, chunk=chunk)
        backends.gated_delta_fn = lambda b: pallas if b == "pallas" else default(b)
    try:
        with LLM(model=model, attention_backend=backend, max_concurrency=4, max_ctx=1024,
                 prefill_chunk=64, prefill_token_budget=64, dtype="float32",
                 kv_pool_tokens=8192) as llm:  # fmt: skip
            sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
            return llm.generate(prompts, sp)
    finally:
        backends.gated_delta_fn = default


def compare(a: list, b: list) -> list[dict]:
    """Per prompt: same tokens, or the first differing index and each side's top two there."""
    rows = []
    for x, y in zip(a, b, strict=True):
        if x.token_ids == y.token_ids:
            rows.append({"same": True})
            continue
        pairs = zip(x.token_ids, y.token_ids, strict=True)  # both ignore EOS: same lengths
        j = next(i for i, (p, q) in enumerate(pairs) if p != q)
        top = {"pallas_top2": x.logprobs[j][1][:2], "xla_top2": y.logprobs[j][1][:2]}
        rows.append({"same": False, "first_difference": j, **top})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--chunks", type=int, nargs="*", default=[], help="gated delta forms to run")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ref = run(a.model, "xla", None, PROMPTS, a.max_tokens)
    report = {}
    for chunk in a.chunks or [None]:
        rows = compare(run(a.model, "pallas", chunk, PROMPTS, a.max_tokens), ref)
        report[f"chunk {chunk}"] = rows
        log.info("pallas (gated delta chunk %s) == xla for %d/%d prompts: %s", chunk,
                 sum(r["same"] for r in rows), len(rows), rows)  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"model": a.model, "max_tokens": a.max_tokens, "report": report}, f, indent=1)


if __name__ == "__main__":
    main()
