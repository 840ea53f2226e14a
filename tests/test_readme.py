"""The README stays true to the code: every engine flag documented, every file in its
architecture tree present, no links that leave the repository."""

import dataclasses
import re
from pathlib import Path

from luce_jax.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_engine_flag_has_a_row_in_the_flag_table():
    rows = [line for line in README.splitlines() if line.startswith("| `")]
    named = {n for line in rows for n in re.findall(r"`(\w+)`", line.split("|")[1])}
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in named]
    assert not missing
    (model_row,) = [line for line in rows if line.startswith("| `model` |")]
    assert "required" not in model_row  # it defaults to the embedded model


def test_the_architecture_tree_names_only_files_that_exist():
    tree = README.split("## Architecture", 1)[1].split("```", 2)[1]
    files = {p.name for p in ROOT.rglob("*.py")}
    named = set(re.findall(r"\b(\w+\.py)\b", tree))
    assert named and not named - files


def test_no_link_leaves_the_repository():
    assert not re.search(r"\.\./", README)
