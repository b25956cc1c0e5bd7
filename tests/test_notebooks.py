"""The notebooks in ``notebooks/`` run end to end, and are committed without outputs.

Each notebook is executed with nbclient in a fresh ``python3`` kernel whose working
directory is ``notebooks/`` and whose environment has ``KARULA_NOTEBOOK_SMALL=1`` (the
notebooks' small-size switch: fewer clients, rounds and grid points). A cell that raises
fails the test with the cell's traceback. Every notebook must also draw at least one
figure, so a notebook whose plotting silently stopped working does not pass.
"""

from __future__ import annotations

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = (
    "01_quickstart.ipynb",
    "02_projection_and_t.ipynb",
    "03_femnist.ipynb",
    "04_your_own_data_and_method.ipynb",
)
CELL_TIMEOUT_S = 300  # per cell; the whole small notebook takes well under a minute


def _read(name: str):
    path = NOTEBOOK_DIR / name
    assert path.is_file(), f"missing notebook {path}"
    return nbformat.read(path, as_version=4)


def test_all_notebooks_listed():
    """Every notebook in the folder is covered by this module."""
    found = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
    assert found == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name):
    nb = _read(name)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name} has no code cells"
    for i, cell in enumerate(code):
        assert cell.outputs == [], f"{name}: code cell {i} has stored outputs"
        assert cell.execution_count is None, f"{name}: code cell {i} has an execution count"


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, monkeypatch):
    nb = _read(name)
    # The kernel inherits this process's environment (JAX_PLATFORMS=cpu from conftest).
    monkeypatch.setenv("KARULA_NOTEBOOK_SMALL", "1")
    # The inline backend renders figures to PNG outputs without a display, whatever
    # MPLBACKEND the caller has set (Agg would drop the figures silently).
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} drew no figure"
