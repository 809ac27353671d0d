"""The quickstart notebook is valid and its NumPy cell runs without a GPU."""
import json
import pathlib

import numpy as np

NB = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_notebook_cells_compile_and_numpy_cell_runs():
    cells = [c for c in json.loads(NB.read_text())["cells"] if c["cell_type"] == "code"]
    sources = ["".join(c["source"]) for c in cells]
    for s in sources:
        compile(s, str(NB), "exec")
    ns = {}
    exec(sources[0].rsplit("\n", 1)[0] + "\nres = cupykern.l1_normalize(x)", ns)
    x = ns["x"]
    np.testing.assert_allclose(ns["res"], x / np.abs(x).mean(axis=1, keepdims=True), rtol=1e-6)
