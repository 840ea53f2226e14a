"""Distil the embedded draft model from the main model on the main model's own greedy text.

The draft of `--spec-mode draft` is trained from scratch on stdlib source by train.py; what its
proposals are checked against is the main model's greedy continuations, not that source. This
fine-tunes it toward them:

1. Load the main (target) and draft models from their GGUFs (Q8_0 dequantized, float32).
2. Generate (or read from --generated-cache) the target's greedy continuations of N prompts
   cut from the train files (train_head.generate: the same text the head learns from).
3. Per batch: the target's next-token distributions over the generated text, and the draft's
   soft cross entropy against them (knowledge distillation), with AdamW.
4. Report, on held-out continuations, how often the draft's argmax is the target's (before
   and after), then write the draft as GGUF with the main model's tokenizer.

    python bench/tiny_model/distill_draft.py --target luce_jax/assets/luce-stdlib-main.gguf \\
        --draft luce_jax/assets/luce-stdlib-draft.gguf --out luce-stdlib-draft.gguf \\
        --generated 10000 --generated-cache gen.npy
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from export import write_gguf  # noqa: E402
from model import hidden, unembed  # noqa: E402
from train import batches, stdlib_files  # noqa: E402
from train_head import add_generated_args, generate, load_target, record, trainer  # noqa: E402

from luce_jax.loading.gguf import GGUFFile  # noqa: E402
from luce_jax.loading.tokenizer import GGUFTokenizer  # noqa: E402

log = logging.getLogger("distill_draft")


def vocab_of(path: str) -> dict:
    """export.write_gguf's vocab dict (tokens, types, merges, eos id) read back from a GGUF."""
    md = GGUFFile(path).metadata
    return {
        "tokens": list(md["tokenizer.ggml.tokens"]),
        "types": [int(t) for t in md["tokenizer.ggml.token_type"]],
        "merges": list(md["tokenizer.ggml.merges"]),
        "eos_id": int(md["tokenizer.ggml.eos_token_id"]),
    }


def make_loss(tsize, dsize):
    """loss(draft params, target params, tokens [B, L + 1]) -> (soft cross entropy against
    the target's next-token distributions, fraction of positions where the argmaxes agree)."""
    f32 = jnp.float32

    def loss(dp, tp, tokens):
        x = tokens[:, :-1]
        target = jax.lax.stop_gradient(unembed(tp, hidden(tp, x, tsize, f32), tsize, f32))
        logits = unembed(dp, hidden(dp, x, dsize), dsize)
        p = jax.nn.softmax(target, -1)
        ce = -jnp.mean(jnp.sum(p * jax.nn.log_softmax(logits, -1), -1))
        agree = jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(target, -1))
        return ce, agree

    return loss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", required=True, help="the main model's GGUF")
    ap.add_argument("--draft", required=True, help="the draft's GGUF to start from")
    ap.add_argument("--out", required=True, help="the distilled draft's GGUF")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    add_generated_args(ap)
    a = ap.parse_args()
    if not a.generated and not a.generated_cache:
        ap.error("--generated N or --generated-cache: the target's text is what it learns")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    a.model = a.target  # train_head.generate serves a.model
    tsize, tp = load_target(a.target)
    dsize, dp = load_target(a.draft)
    tok = GGUFTokenizer.from_gguf(a.target)
    eos = tok.vocab.tokens.index("<|endoftext|>")
    ids = []
    for text in stdlib_files()[0]:
        ids.extend(tok.encode(text, add_special=False))
        ids.append(eos)
    gen = generate(a, np.asarray(ids, np.int32), a.seq + 1)
    cut = int(len(gen) * 0.95)  # the last 5% of the continuations are held out
    data, held = gen[:cut], gen[cut:]
    loss_fn = make_loss(tsize, dsize)
    state, train_step, evaluate = trainer(loss_fn, dp, tp, a.lr, a.steps, min(100, a.steps // 4))
    held_rng = np.random.default_rng(a.seed + 1)
    held_batches = [next(batches(held, a.batch, a.seq, held_rng)) for _ in range(4)]

    def held_out(dp):
        out = [evaluate(dp, b) for b in held_batches]
        return float(np.mean([o[0] for o in out])), float(np.mean([o[1] for o in out]))

    before = held_out(dp)
    log.info("held-out before: loss %.3f greedy agreement %.3f", *before)
    it = batches(data, a.batch, a.seq, np.random.default_rng(a.seed))
    t0 = time.time()
    for i in range(a.steps):
        dp, state, loss, agree = train_step(dp, state, next(it))
        if (i + 1) % 100 == 0 or i == a.steps - 1:
            hl, ha = held_out(dp)
            msg = "step %d loss %.3f agreement %.3f | held-out loss %.3f agreement %.3f (%.0f s)"
            log.info(msg, i + 1, float(loss), float(agree), hl, ha, time.time() - t0)
    hl, ha = held_out(dp)
    write_gguf(a.out, "luce-stdlib-draft", dsize, jax.device_get(dp), vocab_of(a.target))
    stats = {
        "steps": a.steps, "batch": a.batch, "seq": a.seq, "generated_tokens": int(len(gen)),
        "held_out_before": {"loss": round(before[0], 4), "greedy_agreement": round(before[1], 4)},
        "held_out_loss": round(hl, 4), "held_out_greedy_agreement": round(ha, 4),
        "train_seconds": round(time.time() - t0), "gguf_bytes": Path(a.out).stat().st_size,
        "command": " ".join(sys.argv),
    }  # fmt: skip
    record(a.out, "draft_distilled", stats)


if __name__ == "__main__":
    main()
