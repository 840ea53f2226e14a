"""Where and from what a benchmark result came: date, commit, device, command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


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


def write_result(res: dict, md: str, out: str | None) -> None:
    """Print the markdown; with `out`, write the JSON there and the markdown beside it."""
    sys.stdout.write(md)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        with open(out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(md)
