"""notebooks/quickstart.ipynb runs top to bottom (its kernel is this interpreter, with its own SparkSession)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.spark
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow  # tens of seconds of Spark: CI runs it (SPARKQUEUE_SLOW=1)
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKQUEUE_QUICKSTART_ROOT", str(tmp_path / "ns"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # kernel "python3": jupyter_client starts it with sys.executable, i.e. this venv's interpreter.
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = {i: c.get("outputs", []) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    assert not any(o.get("output_type") == "error" for out in outputs.values() for o in out)
    text = "\n".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", "")) for out in outputs.values() for o in out)
    assert "(2000, 0)" in text  # accepted, and the repeats dropped by duplicate detection
    assert "lock_lost" in text
