"""Both notebooks execute headlessly (nbclient). Without a GPU every GPU cell says it is
skipped; with one every cell runs and the benchmarks notebook draws its three plots."""
import pathlib

import pytest

from conftest import gpu_count

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
SKIPPED = "skipped: needs a CUDA GPU"


def _execute(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:  # every cell is valid Python, GPU cells included
        if cell.cell_type == "code":
            compile(cell.source, name, "exec")
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(cell):
    return "".join(o.get("text", "") for o in cell.outputs)


@pytest.mark.parametrize("name", ["quickstart.ipynb", "benchmarks.ipynb"])
def test_notebook_executes(name):
    cells = _execute(name)  # raises CellExecutionError on any error
    gpu_cells = [c for c in cells if SKIPPED in c.source]
    assert gpu_cells
    for c in gpu_cells:
        assert (SKIPPED in _text(c)) == (gpu_count() == 0), (c.source[:80], _text(c)[:300])
    if name == "quickstart.ipynb":
        out = "".join(_text(c) for c in cells)
        assert out.count("max |error|") >= 10 and "exit code 0" in out
    elif gpu_count():
        images = [o for c in cells for o in c.outputs if "image/png" in o.get("data", {})]
        assert len(images) == 3
