"""Write docs/flags.md from the server's argparse parser (`python docs/flags.py`); with
`--check`, exit 1 if the file is not what the parser makes (tests/test_readme.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Defaults as a user's shell has them: the cache folder under ~/.cache, not a test run's.
os.environ.pop("XDG_CACHE_HOME", None)
os.environ.pop("LUCE_COMPILE_CACHE_DIR", None)
from luce_jax.serve import build_parser  # noqa: E402

OUT = Path(__file__).with_name("flags.md")


def render() -> str:
    ap = build_parser()
    rows = []
    for a in ap._actions:
        if isinstance(a, argparse._HelpAction | argparse._VersionAction):
            continue
        flag = ", ".join(f"`{o}`" for o in a.option_strings)
        default = a.default
        if a.dest == "api_key" or default in (None, argparse.SUPPRESS):
            default = None  # from the environment, if anywhere
        else:
            default = f"`{str(default).replace(str(Path.home()), '~')}`"
        text = " ".join((a.help or "").split()).replace("|", "\\|")
        rows.append(f"| {flag} | {default or ''} | {text} |")
    return (
        "# Flags of `python -m luce_jax.serve`\n\n"
        "Made by `python docs/flags.py` from the server's parser (a test keeps it current). "
        "`--help` and `--version` as usual. Engine flags are EngineConfig's fields "
        "([serving.md](serving.md#flags-and-engine-configuration) says what each does, and "
        "`LLM(...)` takes the same names in snake_case); `--api-key` also reads "
        "`LUCE_API_KEY`.\n\n"
        "| flag | default | meaning |\n| --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == text else 1)
    OUT.write_text(text)
