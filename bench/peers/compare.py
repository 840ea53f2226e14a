"""Ratio tables and a plot from two bench/serving/concurrency.py results measured in the same call.

    python bench/peers/compare.py --ours ours.json --peer llama.json --peer-name llama-server \
        --model q8b.gguf --bandwidth-gbs 3346 --ctx 400 --meta "H200, 2026-11-29, commit abc" \
        --out bench/results/compare_qwen3-8b-bf16.json

Per C: both servers' total and output-window tok/s (medians with [min-max]), ours / peer for
each, TTFT medians and their ratio, and the decode roofline at the bandwidth measured in the
same call (bench/roofline.py), for the weights as stored in the file and as held in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from meta import archive  # noqa: E402
from roofline import decode_step, model_bytes  # noqa: E402


def ratios(ours: dict, peer: dict) -> list[dict]:
    """Per C present in both: medians, ranges and ours/peer ratios."""
    by_c = {r["C"]: r for r in peer["summary"]}
    rows = []
    for o in ours["summary"]:
        p = by_c.get(o["C"])
        if p is None:
            continue
        row = {"C": o["C"]}
        for k in ("total_tok_s", "window_tok_s", "ttft_median_s"):
            row[k] = {"ours": o[k], "peer": p[k], "ratio": o[k]["median"] / p[k]["median"]}
        rows.append(row)
    return rows


def _fmt(d: dict, scale: float = 1.0) -> str:
    return f"{d['median'] * scale:.0f} [{d['min'] * scale:.0f}-{d['max'] * scale:.0f}]"


def markdown(rows: list[dict], peer_name: str, title: str, roof: dict | None,
             ours_holds: str = "bf16") -> str:  # fmt: skip
    """The table; `ours_holds` ("bf16" or "file"): the weights our server held, which its
    roofline column counts (the peer always holds the file's)."""
    head = (
        f"| C | ours total tok/s | {peer_name} total tok/s | ratio | ours window tok/s | "
        f"{peer_name} window tok/s | ratio | ours TTFT ms | {peer_name} TTFT ms |"
    )
    sep = "| --- " * 9 + "|"
    if roof:  # output-window tok/s against the roofline of the weights each server held
        head += f" roofline tok/s (file / bf16) | of roofline (ours on {ours_holds} / peer) |"
        sep += " --- | --- |"
    lines = [title, "", head, sep]
    for r in rows:
        t, w, f = r["total_tok_s"], r["window_tok_s"], r["ttft_median_s"]
        line = (
            f"| {r['C']} | {_fmt(t['ours'])} | {_fmt(t['peer'])} | **{t['ratio']:.2f}x** | "
            f"{_fmt(w['ours'])} | {_fmt(w['peer'])} | {w['ratio']:.2f}x | "
            f"{_fmt(f['ours'], 1e3)} | {_fmt(f['peer'], 1e3)} |"
        )
        if roof:
            rf = roof[r["C"]]
            line += (
                f" {rf['file']:.0f} / {rf['held']:.0f} | "
                f"{w['ours']['median'] / rf['held' if ours_holds == 'bf16' else 'file']:.0%} / "
                f"{w['peer']['median'] / rf['file']:.0%} |"
            )
        lines.append(line)
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], peer_name: str, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [r["C"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    for who, label in (("ours", "luce_jax"), ("peer", peer_name)):
        med = [r["total_tok_s"][who]["median"] for r in rows]
        err = [
            [m - r["total_tok_s"][who]["min"] for m, r in zip(med, rows, strict=True)],
            [r["total_tok_s"][who]["max"] - m for m, r in zip(med, rows, strict=True)],
        ]
        ax.errorbar(cs, med, yerr=err, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("total tok/s")
    ax.legend()
    ax.set_title("throughput")
    bx.bar([str(c) for c in cs], [r["total_tok_s"]["ratio"] for r in rows], color="tab:green")
    bx.axhline(1.0, color="k", lw=0.8)
    bx.set_xlabel("concurrent requests")
    bx.set_ylabel(f"luce_jax / {peer_name}")
    bx.set_title("ratio (total tok/s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ours")
    ap.add_argument("--peer")
    ap.add_argument("--render", help="re-render the .md and .png of an earlier --out JSON")
    ap.add_argument("--peer-name", default="llama-server")
    ap.add_argument("--title", default="luce_jax against llama-server")
    ap.add_argument("--meta", default="", help="a line under the title: device, date, commit")
    ap.add_argument("--model", help="GGUF for the roofline column")
    ap.add_argument("--bandwidth-gbs", type=float, help="copy bandwidth measured in the call")
    ap.add_argument("--ctx", type=int, default=512, help="mean context for the roofline")
    ap.add_argument("--out", help="JSON path; .md and .png beside it")
    ap.add_argument("--ours-holds", choices=["bf16", "file"], default=None,
                    help="the weights our server held (file: kept quantized, --dtype "
                    "quantized); default bf16, or an earlier JSON's with --render")  # fmt: skip
    a = ap.parse_args()
    if a.render:
        with open(a.render) as f:
            old = json.load(f)
        roof = {int(c): v for c, v in (old["roofline"] or {}).items()} or None
        title = f"{old['title']}\n\n{old['meta']}" if old["meta"] else old["title"]
        stem = a.render.rsplit(".", 1)[0]
        old["ours_holds"] = a.ours_holds or old.get("ours_holds", "bf16")
        with open(a.render, "w") as f:
            json.dump(old, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(markdown(old["rows"], a.peer_name, title, roof, old["ours_holds"]))
        plot(old["rows"], a.peer_name, old["title"], stem + ".png")
        return
    if not (a.ours and a.peer and a.out):
        ap.error("--ours, --peer and --out are required (or --render)")
    with open(a.ours) as f:
        ours = json.load(f)
    with open(a.peer) as f:
        peer = json.load(f)
    rows = ratios(ours, peer)
    roof = None
    if a.model and a.bandwidth_gbs:
        m, bw = model_bytes(a.model), a.bandwidth_gbs * 1e9
        roof = {
            r["C"]: {
                "file": decode_step(m, r["C"], a.ctx).tok_s(r["C"], bw),
                "held": decode_step(m, r["C"], a.ctx, 16).tok_s(r["C"], bw),
            }
            for r in rows
        }
    title = f"{a.title}\n\n{a.meta}" if a.meta else a.title
    holds = a.ours_holds or "bf16"
    md = markdown(rows, a.peer_name, title, roof, holds)
    sys.stdout.write(md)
    stem = a.out.rsplit(".", 1)[0]
    archive(a.out)
    with open(a.out, "w") as f:
        json.dump(
            {
                "bench": "compare",
                "title": a.title,
                "meta": a.meta,
                "command": " ".join(sys.argv),
                "ours": ours,
                "peer": peer,
                "rows": rows,
                "roofline": roof,
                "ours_holds": holds,
                "bandwidth_GB_s": a.bandwidth_gbs,
            },
            f,
            indent=1,
        )
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(rows, a.peer_name, a.title, stem + ".png")


if __name__ == "__main__":
    main()
