"""Where a kernel's warps wait, from Nsight Compute's per-instruction source page.

Reads `ncu -i report.ncu-rep --page source --print-source sass --csv` (plain or gzipped) and
prints, per kernel of at least --min-lines SASS lines: the stall samples summed per reason, the
instructions with the most samples (and each one's main reason), and the executed warp
instructions by opcode.

    ncu --clock-control none --set full -k regex:_kernel -o rep python3 case.py
    ncu -i rep.ncu-rep --page source --print-source sass --csv | gzip > src.csv.gz
    python bench/kernels/ncu_stalls.py src.csv.gz --top 16
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip

SAMPLES = "Warp Stall Sampling (All Samples)"


def kernels(path: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(kernel name, header, instruction rows) per kernel section of the CSV."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    out, cur = [], None
    for r in rows:
        if r and r[0] == "Kernel Name":
            cur = [r[1], None, []]
            out.append(cur)
        elif r and r[0] == "Address" and cur is not None:
            cur[1] = r
        elif cur is not None and cur[1] is not None and len(r) > 5:
            cur[2].append(r)
    return [tuple(k) for k in out]


def report(name: str, header: list[str], ins: list[list[str]], top: int) -> list[str]:
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    n = lambda r, h: int(r[col[h]] or 0)  # noqa: E731
    total = collections.Counter({h: sum(n(r, h) for r in ins) for h in reasons})
    all_samples = sum(total.values()) or 1
    lines = [f"{name}: {len(ins)} SASS lines, {all_samples} stall samples"]
    lines += [f"  {h[6:]:16s} {v:7d} {v / all_samples:6.1%}" for h, v in total.most_common(10)]
    for r in sorted(ins, key=lambda r: -n(r, SAMPLES))[:top]:
        main = max(reasons, key=lambda h: n(r, h))[6:]
        lines.append(f"  {r[0][-5:]} {n(r, SAMPLES):6d} {main:14s} {r[1].strip()[:72]}")
    ops = collections.Counter()
    for r in ins:
        words = r[1].split()
        op = words[1] if words[0].startswith("@") else words[0]
        ops[op.split(".")[0]] += n(r, "Instructions Executed")
    executed = sum(ops.values()) or 1
    mix = ", ".join(f"{o} {v / executed:.1%}" for o, v in ops.most_common(14))
    lines.append(f"  executed warp instructions {executed}: {mix}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("csv", help="ncu's source page as CSV, optionally gzipped")
    ap.add_argument("--top", type=int, default=25, help="instructions listed per kernel")
    ap.add_argument("--min-lines", type=int, default=200, help="skip smaller kernels")
    a = ap.parse_args()
    for name, header, ins in kernels(a.csv):
        if len(ins) >= a.min_lines:
            print("\n".join(report(name, header, ins, a.top)))


if __name__ == "__main__":
    main()
