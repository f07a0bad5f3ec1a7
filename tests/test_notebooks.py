"""The notebooks run top to bottom in a fresh kernel, draw pictures, and write nothing into the repo."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tools.lab.recipes import WORK_ENV

pytestmark = pytest.mark.slow  # end to end: trains, serves or runs notebooks

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def test_there_are_notebooks():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear outputs before saving"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """One working directory for all notebooks, so 03 reuses the run 02 trained (as a user's would)."""
    return tmp_path_factory.mktemp("notebooks")


# In file order: 02 trains the runs that 03 then reads.
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_draws(path, work, monkeypatch):
    monkeypatch.setenv(WORK_ENV, str(work))  # the kernel inherits it: files go there, not into the repo
    before = sorted(os.listdir(NOTEBOOKS_DIR))
    nb = nbformat.read(path, as_version=4)
    # Raises CellExecutionError, with the failing cell and traceback, if any cell fails.
    NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS_DIR)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no picture"
    assert sorted(os.listdir(NOTEBOOKS_DIR)) == before
