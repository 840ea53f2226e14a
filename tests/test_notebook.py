"""notebooks/inspect_steps.ipynb runs top to bottom on CPU and shows what it promises."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "inspect_steps.ipynb"


def test_inspect_steps_notebook_executes(monkeypatch, compile_cache):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    text = "\n".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "step slots" in text and "compiles:" in text and "prefill tokens" in text
    assert "jaxpr lines" in text and "ENTRY" in text
    assert ".xplane.pb" in text  # the profiler wrote a trace
    for mode in ("draft", "head"):
        assert f"{mode}: same tokens as without speculation: True" in text
    assert "proposed" in text
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the timeline plot is missing"
