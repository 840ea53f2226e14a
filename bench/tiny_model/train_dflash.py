"""Train the embedded model's DFlash block drafter (luce_jax/models/dflash.py) on its hidden
states, the generated-text recipe of the head and draft (train_head.py, distill_draft.py).

1. Load the served main model (train_head.load_target) and tokenize the stdlib's train and
   held-out files as train.py splits them; cut --generated prompts of --prompt-tokens from the
   train text (and --held prompts from the held-out text) and continue each greedily by the
   served engine (luce_jax.LLM) for --continue tokens: the text a greedy request's verify rows
   check proposals against. (--generated-cache keeps them.)
2. Per batch of sequences: the target's residual streams at the drafter's target layers (no
   gradient), and per sequence --anchors positions a in the continuation; the drafter's
   context rows from the streams, and one block [x_a, MASK x (B - 1)] per anchor, each block
   attending to the context rows before a and to itself (dflash.block, with the attention
   masked so). Loss: cross entropy of block index i's logits (the target's tied lm_head)
   against x_{a+i}, the target's greedy token, weighted 0.8^(i-1) as DFlash weights the early
   positions that decide how far a block is kept.
3. Report, on the held-out continuations, how often block index i agrees with the target and
   the mean proposals kept per block (the leading ones that agree), then write the drafter as
   llama.cpp's dflash GGUF.

    python bench/tiny_model/train_dflash.py --model luce_jax/assets/luce-stdlib-main.gguf \\
        --out luce_jax/assets/luce-stdlib-dflash.gguf --generated 1200 --steps 1500
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
from model import hidden  # noqa: E402
from train import stdlib_files  # noqa: E402
from train_head import load_target, record, trainer  # noqa: E402

from luce_jax.loading.gguf import GGUFFile  # noqa: E402
from luce_jax.loading.tokenizer import GGUFTokenizer  # noqa: E402
from luce_jax.models import dflash  # noqa: E402

log = logging.getLogger("train_dflash")
MASK = "<|im_start|>"  # the mask token: never in the stdlib's text


def continuations(a, texts: list[str], tok, n: int, seed: int, cache: str) -> np.ndarray:
    """[n, prompt_tokens + continue] int32: prompts cut from the texts' tokens, each continued
    greedily by the served model (read from `cache` if it exists, else written there)."""
    if cache and Path(cache).exists():
        return np.load(cache)
    from luce_jax import LLM, SamplingParams

    ids = np.asarray([t for text in texts for t in tok.encode(text, add_special=False)], np.int32)
    starts = np.random.default_rng(seed).integers(0, len(ids) - a.prompt_tokens, n)
    prompts = [ids[s : s + a.prompt_tokens].tolist() for s in starts]
    # the served dtype (auto: bf16 on a GPU, float32 on CPU), so the text is the one served
    llm = LLM(model=a.model, max_concurrency=a.gen_concurrency,
              max_ctx=a.prompt_tokens + a.cont + 8)  # fmt: skip
    t0 = time.time()
    sp = SamplingParams(max_tokens=a.cont, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    llm.close()
    if any(o.error for o in outs):
        raise RuntimeError(f"a continuation failed: {next(o.error for o in outs if o.error)}")
    out = np.asarray([p + o.token_ids for p, o in zip(prompts, outs, strict=True)], np.int32)
    log.info("generated %d continuations in %.0f s", n, time.time() - t0)
    if cache:
        np.save(cache, out)
    return out


def make_loss(size, cfg: dflash.DFlashConfig, prompt: int, anchors: int):
    """loss(drafter params, target params, (sequences [Bt, S], anchor offsets [Bt, A])) ->
    (loss, (agreement per block index [B - 1], mean proposals kept per block))."""
    B, f32 = cfg.block_size, jnp.float32
    decay = 0.8 ** jnp.arange(B - 1)

    def one(p, embed, feats, seq, starts):
        """Block outputs [A, B, d] of one sequence: feats [S, n * d], starts [A]."""
        S = seq.shape[0]
        ctx = dflash.context_kv(p, cfg, feats, jnp.arange(S))
        toks = jnp.concatenate([seq[starts][:, None], jnp.full((anchors, B - 1), cfg.mask_token)],
                               1).reshape(-1)  # fmt: skip
        pos = (starts[:, None] + jnp.arange(B)).reshape(-1)
        blk = jnp.repeat(jnp.arange(anchors), B)
        see = jnp.concatenate([jnp.arange(S)[None] < jnp.repeat(starts, B)[:, None],
                               blk[:, None] == blk[None]], 1)  # [A*B, S + A*B]  # fmt: skip
        groups = cfg.heads // cfg.kv_heads

        def attend(li, q, k, v):
            keys = jnp.repeat(jnp.concatenate([ctx[li][0], k]), groups, axis=1)
            vals = jnp.repeat(jnp.concatenate([ctx[li][1], v]), groups, axis=1)
            w = jnp.einsum("thd,shd->hts", q, keys) * cfg.head_dim**-0.5
            w = jax.nn.softmax(jnp.where(see[None], w, -1e30), -1)
            return jnp.einsum("hts,shd->thd", w, vals)

        out = dflash.block(p, cfg, embed[toks].astype(f32), pos, attend)
        return out.reshape(anchors, B, -1)

    def loss(p, tp, batch):
        seqs, offs = batch
        streams = jax.lax.stop_gradient(hidden(tp, seqs, size, f32, cfg.target_layers))
        feats = jnp.moveaxis(streams, 0, 2).reshape(seqs.shape[0], seqs.shape[1], -1)
        starts = prompt + offs  # anchors in the continuation
        h = jax.vmap(one, (None, None, 0, 0, 0))(p, tp["embed"], feats, seqs, starts)
        logits = jnp.einsum("bajd,vd->bajv", h[:, :, 1:], tp["embed"].astype(f32))
        idx = (starts[..., None] + jnp.arange(1, B)).reshape(seqs.shape[0], -1)
        labels = jnp.take_along_axis(seqs, idx, 1).reshape(starts.shape + (B - 1,))
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]
        hit = jnp.argmax(logits, -1) == labels  # [Bt, A, B - 1]
        kept = jnp.sum(jnp.cumprod(hit, -1), -1)
        total = jnp.sum(jnp.mean(ce, (0, 1)) * decay) / jnp.sum(decay)
        return total, (jnp.mean(hit, (0, 1)), jnp.mean(kept))

    return loss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="the target's GGUF")
    ap.add_argument("--out", required=True, help="the drafter's GGUF")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=8, help="blocks per sequence")
    ap.add_argument("--block", type=int, default=5, help="B: proposals are B - 1")
    ap.add_argument("--layers", type=int, default=2, help="the drafter's decoder layers")
    ap.add_argument("--target-layers", type=int, nargs="+", default=[2, 5, 8])
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generated", type=int, default=1200)
    ap.add_argument("--held", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--continue", dest="cont", type=int, default=128)
    ap.add_argument("--generated-cache", default="", help=".npy of train continuations")
    ap.add_argument("--gen-concurrency", type=int, default=64)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    size, tp = load_target(a.model)
    tok = GGUFTokenizer.from_gguf(a.model)
    train_texts, held_texts = stdlib_files()
    data = continuations(a, train_texts, tok, a.generated, a.seed, a.generated_cache)
    held_cache = a.generated_cache.replace(".npy", "-held.npy") if a.generated_cache else ""
    held = continuations(a, held_texts, tok, a.held, a.seed + 1, held_cache)
    cfg = dflash.DFlashConfig(
        d=size.d, layers=a.layers, heads=size.heads, kv_heads=size.kv_heads,
        head_dim=size.head_dim, ffn=size.ffn, eps=size.eps, rope_base=size.rope_base,
        block_size=a.block, target_layers=tuple(a.target_layers),
        mask_token=tok.vocab.tokens.index(MASK),
    )  # fmt: skip
    p = dflash.init(cfg, jax.random.key(a.seed))
    loss_fn = make_loss(size, cfg, a.prompt_tokens, a.anchors)
    state, train_step, evaluate = trainer(loss_fn, p, tp, a.lr, a.steps, min(100, a.steps // 10))
    room = a.cont - a.block  # anchor offsets in the continuation, with a whole block after
    rng = np.random.default_rng(a.seed)

    def batch_of(seqs, rng):
        rows = rng.integers(0, len(seqs), a.batch)
        offs = np.stack([rng.choice(room, a.anchors, replace=False) for _ in rows])
        return jnp.asarray(seqs[rows]), jnp.asarray(offs, jnp.int32)

    held_batches = [batch_of(held, np.random.default_rng(a.seed + 7 + i)) for i in range(4)]

    def held_out(p):
        out = [evaluate(p, b) for b in held_batches]
        hits = np.mean([np.asarray(o[1][0]) for o in out], 0)
        return float(np.mean([o[0] for o in out])), hits, float(np.mean([o[1][1] for o in out]))

    t0 = time.time()
    for i in range(a.steps):
        p, state, loss, (hits, kept) = train_step(p, state, batch_of(data, rng))
        if (i + 1) % 100 == 0 or i == a.steps - 1:
            hl, hh, hk = held_out(p)
            log.info("step %d loss %.3f agreement %s kept %.2f | held-out loss %.3f agreement %s "
                     "kept %.2f of %d (%.0f s)", i + 1, float(loss), np.round(hits, 3),
                     float(kept), hl, np.round(hh, 3), hk, a.block - 1,
                     time.time() - t0)  # fmt: skip
    hl, hh, hk = held_out(p)
    dflash.save(a.out, cfg, jax.device_get(p), GGUFFile(a.model).metadata, Path(a.out).stem)
    stats = {
        "steps": a.steps, "batch": a.batch, "anchors": a.anchors, "block": a.block,
        "layers": a.layers, "target_layers": a.target_layers, "generated": a.generated,
        "held_out_loss": hl, "held_out_agreement": [round(float(x), 4) for x in hh],
        "held_out_kept_per_block": round(hk, 3), "train_seconds": round(time.time() - t0),
        "gguf_bytes": Path(a.out).stat().st_size, "command": " ".join(sys.argv),
    }  # fmt: skip
    record(a.out, "dflash", stats)


if __name__ == "__main__":
    main()
