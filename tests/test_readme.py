"""The README and docs/ stay true to the code: every flag they name exists, every link
resolves inside the repository, every engine field is documented, the architecture tree names
files that exist, docs/flags.md is what the parser makes, and bench/results/ keeps one record a
table, indexed, with nothing pointing at a superseded run."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

from luce_jax.config import EngineConfig
from luce_jax.serve import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "bench" / "results"
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "bench" / "README.md",
    RESULTS / "README.md",
    RESULTS / "history" / "README.md",
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_a_front_door():
    """At most ~250 lines: the two commands first, then what it serves and the results."""
    lines = README.splitlines()
    assert len(lines) <= 250
    assert "pip install -e . && python -m luce_jax.serve" in "\n".join(lines[:6])
    assert "## What it serves" in README and "## Results" in README


def test_every_link_resolves_inside_the_repository():
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path = target.split("#", 1)[0]
            if not path:  # a link within the page
                continue
            resolved = (page.parent / path).resolve()
            assert resolved.is_relative_to(ROOT), (page.name, target)
            assert resolved.exists(), (page.name, target)


def test_every_flag_the_readme_and_the_serving_pages_name_exists():
    """The pages about running the server name only its flags (the benchmark and design pages
    also name llama-server's and the scripts')."""
    flags = {o for a in build_parser()._actions for o in a.option_strings}
    for name in ("README.md", "docs/serving.md", "docs/flags.md"):
        text = re.sub(r"`[^`]*bench/[^`]*`", "", (ROOT / name).read_text())  # scripts' flags
        named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", text))
        assert named - {"--index-url"} <= flags, (name, named - flags)


def test_every_engine_field_has_a_row_in_the_configuration_table():
    text = (ROOT / "docs" / "serving.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    named = {n for line in rows for n in re.findall(r"`(\w+)`", line.split("|")[1])}
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in named]
    assert not missing
    (model_row,) = [line for line in rows if line.startswith("| `model` |")]
    assert "required" not in model_row  # it defaults to the embedded model


def test_the_architecture_tree_names_only_files_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text.split("```", 2)[1]
    files = {p.name for p in ROOT.rglob("*.py")}
    named = set(re.findall(r"\b(\w+\.py)\b", tree))
    assert named and not named - files


def test_the_flags_page_is_what_the_parser_makes():
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "flags.py"), "--check"], timeout=120)
    assert r.returncode == 0, "docs/flags.md is stale: run python docs/flags.py"


def _tracked_text() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    keep = (".py", ".md", ".sh", ".ipynb", ".html", ".toml")
    return [
        ROOT / f
        for f in out.split()
        if f.endswith(keep) and (not f.startswith("bench/results/") or f.endswith("README.md"))
    ]


def test_the_results_index_lists_every_record():
    """bench/results/README.md links each current record (`<table>.json/.md/.png`) once; the
    dated runs live in history/."""
    records = {p.name.split(".", 1)[0] for p in RESULTS.iterdir() if p.is_file()} - {"README"}
    index = (RESULTS / "README.md").read_text()
    linked = {Path(t).name.split(".", 1)[0] for t in LINK.findall(index) if "/" not in t}
    assert records and records == linked
    assert not [r for r in records if re.match(r"20\d\d-\d\d-\d\d_", r)]


def test_nothing_points_at_a_superseded_result():
    """A dated result file is named only through history/ (a table's current record has no date
    in its name), and every result a file names exists."""
    named = re.compile(r"(history/)?(20\d\d-\d\d-\d\d_[\w.\-]*\w)")
    for f in _tracked_text():
        text = f.read_text(errors="replace")
        for m in named.finditer(text) if f.parent.name != "history" else ():
            if m.group(1):
                continue
            run = m.group(2).split(".", 1)[0].rstrip("_*")
            assert not list((RESULTS / "history").glob(run + "*")), (f.relative_to(ROOT), m[0])
        for m in re.finditer(r"bench/results/([\w./\-]*\.(?:md|json|png|txt))", text):
            assert (RESULTS / m.group(1)).exists(), (f.relative_to(ROOT), m.group(0))


def test_the_bench_guide_names_every_script():
    """bench/README.md says which script answers which question: every script is in it."""
    bench = ROOT / "bench"
    guide = (bench / "README.md").read_text()
    scripts = [
        p.relative_to(bench).as_posix()
        for p in bench.rglob("*")
        if p.suffix in (".py", ".sh") and "results" not in p.parts
    ]
    assert len(scripts) > 30
    assert [s for s in scripts if f"`{s}`" not in guide] == []
