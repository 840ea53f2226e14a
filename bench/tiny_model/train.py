"""Train the embedded default models on the running interpreter's standard library source.

1. Split the stdlib's .py files into train / held-out by a hash of their path (5% held out).
2. Train a byte-level BPE tokenizer (HF tokenizers; qwen2 pre-tokenizer so that the GGUF
   tokenizer rebuilds it exactly) of 8192 tokens, ChatML specials included.
3. Train the `main` (~16M) and `draft` (~2M) qwen3-architecture models with optax AdamW,
   reproducibly from --seed; report held-out loss and perplexity.
4. Export both as GGUF (Q8_0) and write metrics.json.

    python bench/tiny_model/train.py --out-dir luce_jax/assets --steps 2000
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
import optax
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).parent))
from export import write_gguf  # noqa: E402
from model import SIZES, Size, init, loss_fn  # noqa: E402

from luce_jax.loading.pretokenizers import SPLITS  # noqa: E402  (the GGUF tokenizer rebuilds it)

log = logging.getLogger("train")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def stdlib_files() -> tuple[list[str], list[str]]:
    """(train, held-out) texts of the stdlib's .py files, split by path hash."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if "site-packages" in rel or "dist-packages" in rel:
            continue
        try:
            text = p.read_text("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        h = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100
        (held if h < 5 else train).append(text)
    return train, held


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLITS["qwen2"][0]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIALS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def build_vocab(tok: Tokenizer, vocab_size: int) -> dict:
    """tokens / types / merges for GGUF; specials appended after the BPE vocabulary."""
    model = json.loads(tok.to_str())["model"]
    inv = {i: t for t, i in model["vocab"].items()}
    tokens = [inv[i] for i in range(len(inv))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [1] * len(tokens)
    while len(tokens) < vocab_size - len(SPECIALS):  # pad if the trainer stopped short
        tokens.append(f"<|unused{len(tokens)}|>")
        types.append(5)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "eos_id": tokens.index("<|endoftext|>"),
    }


def encode_all(tok: Tokenizer, texts: list[str], eos: int) -> np.ndarray:
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(data) - seq - 1, batch)
        yield np.stack([data[s : s + seq + 1] for s in starts])


def train_model(name: str, size: Size, data: np.ndarray, held: np.ndarray, args) -> tuple:
    key = jax.random.key(args.seed)
    params = init(size, key)
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps, args.lr * 0.1)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1)
    )
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, size)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    eval_loss = jax.jit(lambda p, b: loss_fn(p, b, size))
    rng = np.random.default_rng(args.seed)
    held_rng = np.random.default_rng(args.seed + 1)
    held_batches = [next(batches(held, args.batch, args.seq, held_rng)) for _ in range(8)]
    it = batches(data, args.batch, args.seq, rng)
    t0, losses = time.time(), []
    # Early stopping on the held-out files: 2.7M tokens of stdlib overfit a 15M model within
    # a few epochs (train loss 0.27 against held-out 2.96 after 1500 steps, measured).
    best = (float("inf"), params, 0)
    for i in range(args.steps):
        params, state, loss = step(params, state, next(it))
        if (i + 1) % 100 == 0 or i == args.steps - 1:
            losses.append(float(loss))
            held_loss = float(np.mean([eval_loss(params, b) for b in held_batches]))
            if held_loss < best[0]:
                best = (held_loss, params, i + 1)
            log.info(
                "%s step %d loss %.3f held-out %.3f (%.0f s)",
                name,
                i + 1,
                float(loss),
                held_loss,
                time.time() - t0,
            )
    held_loss, params, best_step = best
    stats = {
        "params": size.n_params(),
        "steps": args.steps,
        "best_step": best_step,
        "train_loss": losses[-1],
        "held_out_loss": held_loss,
        "held_out_ppl": float(np.exp(held_loss)),
        "train_seconds": time.time() - t0,
        "tokens_seen": args.steps * args.batch * args.seq,
    }
    log.info("%s: %s", name, stats)
    return jax.device_get(params), stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--draft-steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", nargs="+", default=["main", "draft"])
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_texts, held_texts = stdlib_files()
    log.info("%d train files, %d held-out files", len(train_texts), len(held_texts))
    vocab_size = SIZES["main"].vocab
    tok = train_tokenizer(train_texts, vocab_size)
    vocab = build_vocab(tok, vocab_size)
    data = encode_all(tok, train_texts, vocab["eos_id"])
    held = encode_all(tok, held_texts, vocab["eos_id"])
    log.info("%d train tokens, %d held-out tokens", len(data), len(held))
    metrics = {
        "python": sys.version.split()[0],
        "device": jax.devices()[0].device_kind,
        "train_tokens": int(len(data)),
        "held_out_tokens": int(len(held)),
        "seed": a.seed,
        "command": " ".join(sys.argv),
    }
    for name in a.sizes:
        steps = a.steps if name == "main" else a.draft_steps
        params, stats = train_model(
            name, SIZES[name], data, held, argparse.Namespace(**{**vars(a), "steps": steps})
        )
        path = out / f"luce-stdlib-{name}.gguf"
        write_gguf(str(path), f"luce-stdlib-{name}", SIZES[name], params, vocab)
        stats["gguf_bytes"] = path.stat().st_size
        metrics[name] = stats
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
