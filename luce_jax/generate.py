"""`python -m luce_jax.generate --model M.gguf "prompt" ...`: offline generation from the shell."""

from __future__ import annotations

import argparse
import logging
import sys

from .llm import LLM
from .sampling_params import SamplingParams


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m luce_jax.generate", description=__doc__)
    ap.add_argument("prompts", nargs="+", help="prompt texts, generated together")
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument(
        "--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"]
    )
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        sp = SamplingParams(
            max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed
        )
        llm = LLM(
            model=a.model, dtype=a.dtype, max_ctx=a.max_ctx, max_concurrency=max(len(a.prompts), 1)
        )
    except ValueError as e:
        ap.error(str(e))
    prompts = a.prompts
    if a.chat:
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
        ]
    outs = llm.generate(prompts, sp)
    for i, out in enumerate(outs):
        if len(outs) > 1:  # one header line per output, so several stay apart
            sys.stdout.write(f"--- {i + 1}: {out.finish_reason} ---\n")
        sys.stdout.write(out.text + "\n")
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
