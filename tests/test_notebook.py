"""Both notebooks execute headlessly (nbclient): without a GPU every GPU cell says it is
skipped; with one every cell runs. The envelope plots read stored sweep JSON, so they
draw anywhere. And the outputs stored in the notebooks tell the truth: they name the
run that produced them, come from the current code (the fingerprint of
cupykern._provenance), and show no local paths.

To re-make the stored outputs on a GPU machine from the final tree (then commit them):

    OUT=/tmp/nb bash .ci/gpu notebooks && cp /tmp/nb/*.ipynb notebooks/
"""
import json
import pathlib
import re

import pytest

from conftest import gpu_count
from cupykern import _provenance
from cupykern.benchmark import summarize, sweep_row

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["quickstart.ipynb", "benchmarks.ipynb"]
SKIPPED = "skipped: needs a CUDA GPU"
RERUN = "re-execute on a GPU: OUT=/tmp/nb bash .ci/gpu notebooks && cp /tmp/nb/*.ipynb notebooks/"


def _execute(name):
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:  # every cell is valid Python, GPU cells included
        if cell.cell_type == "code":
            compile(cell.source, name, "exec")
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(cell):
    return "".join("".join(o.get("text", "")) for o in cell["outputs"])


def _images(cells):
    return [o for c in cells for o in c["outputs"] if "image/png" in o.get("data", {})]


@pytest.mark.long
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes(name):
    cells = _execute(name)  # raises CellExecutionError on any error
    assert "fingerprint: " + _provenance.fingerprint(NOTEBOOKS / name) in _text(cells[0])
    gpu_cells = [c for c in cells if SKIPPED in c.source]
    assert gpu_cells
    for c in gpu_cells:
        assert (SKIPPED in _text(c)) == (gpu_count() == 0), (c.source[:80], _text(c)[:300])
    if name == "quickstart.ipynb":
        out = "".join(_text(c) for c in cells)
        assert out.count("max |error|") >= 10 and "exit code 0" in out
    else:
        sweeps = list((NOTEBOOKS.parent / "docs" / "results").glob("*_sweep.json"))
        # 3 measured here on a GPU; the envelope and (with a row op's sweep) bandwidth plots
        assert 0 <= len(_images(cells)) - 3 * bool(gpu_count()) - bool(sweeps) <= bool(sweeps)


def _sample_sweep():
    """A made-up sweep in the committed schema, to draw the envelope plots from (never stored)."""
    rows = [sweep_row("l2", (128, n), "float32", "forward", ms=0.011 * n / 1024, eager_ms=0.02 * n / 1024,
                      compile_ms=0.015 * n / 1024, ceiling_ms=0.01 * n / 1024, ceiling="copy")
            for n in (1024, 4096, 16384)]
    rows.append(sweep_row("l2", (128, 4096), "float32", "backward", ms=0.1, eager_ms=0.3, compile_ms=None,
                          ceiling_ms=0.06, ceiling="1.5x copy"))
    rows.append(sweep_row("linear", "1024x8192x8192", "float32", "high", ms=0.33, eager_ms=0.32,
                          compile_ms=None, ceiling_ms=0.3, ceiling="tensor peak"))
    meta = {"gpu": "Sample GPU", "torch": "0", "cupy": "0", "commit": "sample", "date": "2000-01-01",
            "command": "sample"}
    return {"meta": meta, "rows": rows, "summary": summarize(rows)}


@pytest.mark.skipif(gpu_count() > 0, reason="checked on CPUs (on a GPU the notebook's measurements "
                    "would run a second time; test_notebook_executes plots the stored sweeps)")
def test_envelope_plots_draw_from_sweep_json(tmp_path, monkeypatch):
    (tmp_path / "sample_sweep.json").write_text(json.dumps(_sample_sweep()))
    monkeypatch.setenv("CUPYKERN_RESULTS", str(tmp_path))
    cells = _execute("benchmarks.ipynb")
    envelope, bandwidth = cells[-2:]
    assert len(_images([envelope])) == 1 and len(_images([bandwidth])) == 1
    assert "sample: Sample GPU" in _text(envelope)
    assert "1 of 5 points slower than eager or compile" in _text(envelope)
    assert "linear 1024x8192x8192 float32 high: x eager 0.97" in _text(envelope)


@pytest.mark.parametrize("name", NAMES)
def test_stored_outputs_come_from_this_tree(name):
    """The stored outputs name their GPU and versions and were made by the current code:
    the fingerprint they print is the tree's (cupykern's sources, kernels, code cells)."""
    nb = json.loads((NOTEBOOKS / name).read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["outputs"] for c in cells), f"{name}: cells without stored output; {RERUN}"
    first = _text(cells[0])
    assert re.search(r"^GPU: .+", first, re.M)
    assert re.search(r"^python .*torch .*cupy .*cupykern ", first, re.M)
    stored = re.search(r"^fingerprint: (\w+)", first, re.M)
    assert stored, f"{name}: no fingerprint in the first cell's output; {RERUN}"
    assert stored.group(1) == _provenance.fingerprint(NOTEBOOKS / name), (
        f"{name}: stored outputs come from other code than this tree's; {RERUN}")


# Absolute paths of a machine (interpreters, virtual environments, home directories).
_LOCAL = re.compile(r"(/(home|root|opt|usr|tmp|work|Users)/|site-packages|\.venv|[A-Z]:\\\\)")


@pytest.mark.parametrize("name", NAMES)
def test_stored_outputs_show_no_local_paths(name):
    nb = json.loads((NOTEBOOKS / name).read_text())
    for c in nb["cells"]:
        for o in c.get("outputs", []):
            text = "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
            text += "".join(o.get("traceback", []))
            assert not _LOCAL.search(text), (name, text[:300])
