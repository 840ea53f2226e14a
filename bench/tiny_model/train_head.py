"""Train the embedded model's draft head (luce_jax/models/draft_head.py) on its hidden states.

1. Load the served main model from its GGUF (Q8_0 dequantized: the weights the server runs),
   and tokenize the stdlib's train / held-out files as train.py splits them. With
   --generated N, the training text is the target's own continuations instead: N prompts cut
   from the train files, each continued greedily by the served engine (luce_jax.LLM), which
   is the text a greedy request's verify rows check proposals against.
2. Per batch: the target's last-layer residual stream H and its next-token distributions,
   then the head unrolled K steps with the data's tokens: step j's feature at position t
   should be H at t + j, and its logits the target's distribution there (soft cross entropy,
   plus a smooth-L1 pull on the feature as in EAGLE).
3. Report, on held-out text, how often proposal j is the target's greedy token at every
   depth (and the expected proposals kept per verify row), then write the head as GGUF.

    python bench/tiny_model/train_head.py --model luce_jax/assets/luce-stdlib-main.gguf \\
        --out luce_jax/assets/luce-stdlib-head.gguf --steps 3000 --batch 32 --generated 20000 \\
        --generated-cache gen.npy

(the shipped head; `--generated-cache` keeps the continuations for distill_draft.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).parent))
from model import Size, hidden, unembed  # noqa: E402
from train import batches, stdlib_files  # noqa: E402

from luce_jax.loading.gguf import GGUFFile  # noqa: E402
from luce_jax.loading.tokenizer import GGUFTokenizer  # noqa: E402
from luce_jax.models import draft_head  # noqa: E402

log = logging.getLogger("train_head")
_NAMES = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
          "ffn_gate": "wg", "ffn_up": "wu", "ffn_down": "wd", "attn_norm": "attn_norm",
          "ffn_norm": "ffn_norm", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}  # fmt: skip


def load_target(path: str) -> tuple[Size, dict]:
    """The qwen3 GGUF's Size and params in model.py's layout (matrices [in, out], float32)."""
    from gguf.quants import dequantize

    f = GGUFFile(path)
    md = f.metadata
    a = md["general.architecture"]

    def t(name):
        info = f.tensors[name]
        return dequantize(np.asarray(f.raw(name)), info.qtype).reshape(info.shape)

    size = Size(
        vocab=len(md["tokenizer.ggml.tokens"]),
        d=md[f"{a}.embedding_length"],
        layers=md[f"{a}.block_count"],
        heads=md[f"{a}.attention.head_count"],
        kv_heads=md[f"{a}.attention.head_count_kv"],
        head_dim=md[f"{a}.attention.key_length"],
        ffn=md[f"{a}.feed_forward_length"],
        rope_base=md[f"{a}.rope.freq_base"],
        eps=md[f"{a}.attention.layer_norm_rms_epsilon"],
    )
    layers = []
    for i in range(size.layers):
        lp = {}
        for theirs, ours in _NAMES.items():
            x = t(f"blk.{i}.{theirs}.weight")
            lp[ours] = jnp.asarray(x.T if x.ndim == 2 else x)
        layers.append(lp)
    params = {"embed": jnp.asarray(t("token_embd.weight")),
              "final_norm": jnp.asarray(t("output_norm.weight")), "layers": layers}  # fmt: skip
    return size, params


def generate(a, data: np.ndarray, span: int) -> np.ndarray:
    """The target's greedy continuations of a.generated prompts of a.prompt_tokens tokens cut
    from `data`, each as prompt + continuation (span tokens, cut at end of text), concatenated
    with an end-of-text token between them. With a.generated_cache, read from that .npy file
    if it exists, else written there (so the head and the draft learn the same text)."""
    from luce_jax import LLM, SamplingParams

    cache = Path(a.generated_cache) if a.generated_cache else None
    if cache is not None and cache.exists():
        out = np.load(cache)
        log.info("read %d generated tokens from %s", len(out), cache)
        return out
    rng = np.random.default_rng(a.seed + 2)
    starts = rng.integers(0, len(data) - a.prompt_tokens, a.generated)
    prompts = [data[s : s + a.prompt_tokens].tolist() for s in starts]
    llm = LLM(model=a.model, max_concurrency=128, max_ctx=span + 8, dtype="float32")
    t0 = time.time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=span - a.prompt_tokens, temperature=0))
    llm.close()
    failed = [o.error for o in outs if o.error]
    if failed:  # a prompt without its continuation would be trained on silently
        raise RuntimeError(f"{len(failed)} of {len(outs)} continuations failed: {failed[0]}")
    eos = int(data[-1])  # encode() ends every file with it
    seqs = [p + o.token_ids + [eos] for p, o in zip(prompts, outs, strict=True)]
    n = sum(len(o.token_ids) for o in outs)
    log.info("generated %d tokens in %.0f s", n, time.time() - t0)
    out = np.asarray([t for s in seqs for t in s], np.int32)
    if cache is not None:
        np.save(cache, out)
    return out


def trainer(loss_fn, params, tp, lr: float, steps: int, warmup: int):
    """AdamW with warmup and cosine decay over loss_fn(params, target params tp, batch) ->
    (loss, aux): (optimizer state, jitted train_step(params, state, batch) -> (params, state,
    loss, aux), jitted evaluate(params, batch) -> (loss, aux))."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))

    @jax.jit
    def train_step(params, state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tp, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, aux

    return opt.init(params), train_step, jax.jit(lambda p, b: loss_fn(p, tp, b))


def record(out: str, key: str, stats: dict) -> None:
    """Log a trained model's stats and keep them as `key` in the metrics.json beside it (the
    models' own training metrics), where there is one."""
    log.info("%s", stats)
    metrics = Path(out).with_name("metrics.json")
    if metrics.exists():
        m = json.loads(metrics.read_text())
        m[key] = stats
        metrics.write_text(json.dumps(m, indent=1))


def add_generated_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--generated",
        type=int,
        default=0,
        help="train on the target's greedy continuations of this many prompts",
    )
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--generated-cache", default="", help=".npy file of generated text to reuse")


def make_loss(size: Size, cfg: draft_head.HeadConfig, depth: int, feature_weight: float):
    """loss(head params, target params, tokens [B, L + depth + 1]) -> (loss, per-depth greedy
    agreement [depth], per-depth chained agreement [depth])."""
    f32 = jnp.float32

    def loss(hp, tp, tokens):
        L = tokens.shape[1] - depth - 1
        H = jax.lax.stop_gradient(hidden(tp, tokens[:, :-1], size, f32))  # [B, L + depth, d]
        target = jax.lax.stop_gradient(unembed(tp, H, size, f32))  # [B, L + depth, V]
        scale = jnp.sqrt(jnp.mean(H * H)) + 1e-6
        f, total = H[:, :L], 0.0
        hits, chain = [], jnp.ones(f.shape[:2], bool)
        for j in range(1, depth + 1):
            f = draft_head.step(hp, f, tp["embed"][tokens[:, j : L + j]], cfg.eps)
            logits = unembed(tp, f, size, f32)
            p = jax.nn.softmax(target[:, j : L + j], -1)
            ce = -jnp.mean(jnp.sum(p * jax.nn.log_softmax(logits, -1), -1))
            feat = jnp.mean(optax.huber_loss((f - H[:, j : L + j]) / scale, delta=1.0))
            total = total + ce + feature_weight * feat
            hit = jnp.argmax(logits, -1) == jnp.argmax(target[:, j : L + j], -1)
            chain = chain & hit
            hits.append(jnp.mean(hit))
        return total / depth, (jnp.stack(hits), jnp.mean(chain))

    return loss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="the target's GGUF")
    ap.add_argument("--out", required=True, help="the head's GGUF")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4, help="K the head is trained to propose")
    ap.add_argument("--ffn", type=int, default=0, help="head ffn width (default: the target's)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--feature-weight", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    add_generated_args(ap)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    size, tp = load_target(a.model)
    tok = GGUFTokenizer.from_gguf(a.model)
    eos = tok.vocab.tokens.index("<|endoftext|>")
    train_texts, held_texts = stdlib_files()

    def encode(texts):
        ids = []
        for text in texts:
            ids.extend(tok.encode(text, add_special=False))
            ids.append(eos)
        return np.asarray(ids, np.int32)

    data, held = encode(train_texts), encode(held_texts)
    log.info("%d train tokens, %d held-out tokens", len(data), len(held))
    if a.generated:
        data = generate(a, data, a.seq + a.depth + 1)
    cfg = draft_head.HeadConfig(d=size.d, ffn=a.ffn or size.ffn, eps=size.eps)
    hp = draft_head.init(cfg, jax.random.key(a.seed))
    loss_fn = make_loss(size, cfg, a.depth, a.feature_weight)
    state, train_step, evaluate = trainer(loss_fn, hp, tp, a.lr, a.steps, min(50, a.steps // 4))
    span = a.seq + a.depth
    held_rng = np.random.default_rng(a.seed + 1)
    held_batches = [next(batches(held, a.batch, span, held_rng)) for _ in range(4)]
    it = batches(data, a.batch, span, np.random.default_rng(a.seed))

    def held_out(hp):
        out = [evaluate(hp, b) for b in held_batches]
        hits = np.mean([np.asarray(o[1][0]) for o in out], 0)
        return float(np.mean([o[0] for o in out])), hits, float(np.mean([o[1][1] for o in out]))

    t0 = time.time()
    for i in range(a.steps):
        hp, state, loss, (hits, _) = train_step(hp, state, next(it))
        if (i + 1) % 50 == 0 or i == a.steps - 1:
            hl, hh, chain = held_out(hp)
            log.info("step %d loss %.3f greedy agreement %s | held-out loss %.3f agreement %s "
                     "all %d kept %.3f (%.0f s)", i + 1, float(loss), np.round(hits, 3), hl,
                     np.round(hh, 3), a.depth, chain, time.time() - t0)  # fmt: skip
    hl, hh, chain = held_out(hp)
    # Expected proposals kept per verify row if agreement at depth j were independent of the
    # depths before it given they agreed: sum over j of prod_{i <= j} (conditional rates).
    draft_head.save(a.out, cfg, jax.device_get(hp), size.vocab, Path(a.model).stem)
    stats = {
        "steps": a.steps, "batch": a.batch, "seq": a.seq, "depth": a.depth, "ffn": cfg.ffn,
        "held_out_loss": hl, "held_out_greedy_agreement": [round(float(x), 4) for x in hh],
        "held_out_all_depths_agree": round(chain, 4), "train_seconds": round(time.time() - t0),
        "gguf_bytes": Path(a.out).stat().st_size, "command": " ".join(sys.argv),
    }  # fmt: skip
    record(a.out, "head", stats)


if __name__ == "__main__":
    main()
