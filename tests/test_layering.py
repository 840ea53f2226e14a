"""The layers docs/architecture.md draws, read from the source: which package may import which."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported(path: Path) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def modules(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def offenders(folder: str, banned) -> dict[str, list[str]]:
    out = {}
    for path in modules(folder):
        bad = sorted(m for m in imported(path) if banned(m))
        if bad:
            out[str(path.relative_to(ROOT))] = bad
    return out


def test_the_import_reader_sees_relative_and_absolute_imports(tmp_path):
    """The checks below can fail: the reader finds a host import however it is written."""
    got = imported(ROOT / "luce_jax" / "host" / "slots.py")
    assert "luce_jax.step_format.padding_inputs" in got and "numpy" in got
    assert "luce_jax.host.slots" in imported(ROOT / "luce_jax" / "host" / "engine.py")


@pytest.mark.parametrize(
    "folder, banned, why",
    [
        ("luce_jax/device", "luce_jax.host", "the device package imports nothing of the host's"),
        ("luce_jax/host", "jax", "host bookkeeping is pure Python and NumPy"),
        ("server", "jax", "the server never imports jax"),
        ("pallas_kernels", "luce_jax", "kernels stand alone"),
    ],
)
def test_a_layer_imports_nothing_it_must_not(folder, banned, why):
    bad = offenders(folder, lambda m: m == banned or m.startswith(banned + "."))
    assert not bad, f"{why}: {bad}"


def test_the_step_format_imports_only_numpy_and_the_standard_library():
    got = {m.split(".")[0] for m in imported(ROOT / "luce_jax" / "step_format.py")}
    assert got <= {"__future__", "dataclasses", "numpy"}, got


# (models/moe.py is the experts' FFN that families share, not a family)
FAMILY_MODULES = ("luce_jax.models.dense", "luce_jax.models.hybrid")


def names_a_family(path: Path) -> list[str]:
    """A family module imported, or a family's own config field read (`recurrent`: the
    hybrid family's layer pattern)."""
    out = sorted(m for m in imported(path) if m.startswith(FAMILY_MODULES))
    tree = ast.parse(path.read_text())
    out += [f"line {n.lineno}: .recurrent" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr == "recurrent"]  # fmt: skip
    return out


def test_no_module_outside_models_and_the_loader_names_a_family():
    """The runner, the builder, the engine, speculation and the loader read a model through
    models/family.py's capabilities only (the loader: the family's read_config and
    layer_params): a new family is a new module under models/."""
    inside = ("luce_jax/models/",)
    bad = {}
    for path in [*modules("luce_jax"), *modules("server")]:
        rel = str(path.relative_to(ROOT))
        if not rel.startswith(inside) and (found := names_a_family(path)):
            bad[rel] = found
    assert not bad, bad
    # and the check sees one where there is one
    assert names_a_family(ROOT / "luce_jax" / "models" / "hybrid.py")
