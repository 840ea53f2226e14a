"""Where and from what a benchmark result came: date, commit, device, command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

RECORD_SUFFIXES = (".json", ".md", ".png", ".txt")
RESULTS = Path(__file__).resolve().parent / "results"


def _out(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run_meta() -> dict:
    """date, commit (LUCE_COMMIT where the tree has no .git, as on the device), GPU, command."""
    gpu = _out(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    return {
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("LUCE_COMMIT") or _out(["git", "rev-parse", "--short", "HEAD"]),
        "device": gpu.splitlines()[0] if gpu else "no NVIDIA GPU (CPU)",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


def meta_line(m: dict) -> str:
    return f"{m['device']}, {m['date']}, commit {m['commit'] or '?'}. Command: `{m['command']}`"


def archive(out: str) -> None:
    """Before a run writes the record `results/<table>.json`, move the record it replaces (json,
    md, png) into `results/history/` under its date, `DATE_<table>` (bench/results/README.md):
    the folder keeps one current record per table and every earlier one."""
    stem = Path(out).with_suffix("")
    if stem.parent.name != "results":
        return
    old = [p for p in stem.parent.glob(stem.name + ".*") if p.suffix in RECORD_SUFFIXES]
    if not old:
        return
    date = time.strftime("%Y-%m-%d", time.localtime(min(p.stat().st_mtime for p in old)))
    js = stem.with_suffix(".json")
    if js.exists():
        try:
            date = json.loads(js.read_text()).get("date") or date
        except (ValueError, AttributeError):
            pass
    history = stem.parent / "history"
    history.mkdir(exist_ok=True)
    name = f"{date}_{stem.name}"
    n = 1
    while any((history / (name + p.suffix)).exists() for p in old):
        n += 1
        name = f"{date}_{stem.name}_{n}"
    for p in old:
        p.rename(history / (name + p.suffix))


def write_partial(res, out: str | None) -> None:
    """What a run has measured so far, as JSON at `out`.partial (with `out`), for a run a time
    limit may stop; write_result removes it once the whole run is written."""
    if out:
        Path(out + ".partial").write_text(json.dumps(res))


def write_result(res: dict, md: str, out: str | None) -> None:
    """Print the markdown; with `out`, write the JSON there and the markdown beside it (a record
    already there moves to history/ first; a partial file of the run is removed)."""
    sys.stdout.write(md)
    if out:
        archive(out)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        with open(out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(md)
        Path(out + ".partial").unlink(missing_ok=True)


def keep(paths: list[str], results: Path = RESULTS) -> None:
    """Copy runs brought back from the device into `results` as the current records of their
    tables (each file keeps its name, `<table>.json|md|png`); the records they replace move to
    history/ first."""
    for stem in dict.fromkeys(str(Path(p).with_suffix("")) for p in paths):
        archive(str(results / (Path(stem).name + ".json")))
        for p in Path(stem).parent.glob(Path(stem).name + ".*"):
            if p.suffix in RECORD_SUFFIXES:
                shutil.copy(p, results / p.name)


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "keep":
        sys.exit("usage: python bench/meta.py keep RESULT.json [...]")
    keep(sys.argv[2:])
