"""The README as a new user meets it: short, its CPU snippet and commands run as written,
its links resolve, and its speed tables (and docs/performance.md's) are the ones
generated from the stored JSON in docs/results/. No GPU needed."""
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from cupykern.benchmark import summarize, sweep_row
from cupykern.benchmarks import tables

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_short():
    assert len(README.encode()) < 12_000


def test_tables_match_the_stored_json():
    assert tables.main(["--check"]) == 0, "run: python -m cupykern.benchmarks.tables"


def test_every_table_marker_is_closed_and_known():
    for doc in tables.DOCS:
        text = (ROOT / doc).read_text()
        opened = re.findall(r"<!-- table:([\w-]+) -->", text)
        assert opened and opened == re.findall(r"<!-- /table:([\w-]+) -->", text), doc
        for name in opened:
            tables.render(name, tables.load(ROOT / "docs" / "results"))  # KeyError if unknown


def test_the_cpu_snippet_runs_as_written(tmp_path):
    snippet = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    assert "\"cuda\"" not in snippet and not re.search(r"import cupy\b", snippet)
    r = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "ndarray (64, 1000) (64, 32)"


def test_ci_runs_the_readme_cpu_recipe_and_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    for line in ("EXTRAS=test", 'python -m pip install -e ".[$EXTRAS]" && python -m pytest'):
        assert line in README and line in ci, line


def test_links_to_files_and_sections_resolve():
    for doc in ("README.md", "docs/design.md", "docs/performance.md"):
        path = ROOT / doc
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if target.startswith("http"):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{doc}: {target}"
            if anchor:
                heads = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-")
                         for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                assert anchor in heads, f"{doc}: {target}"


def _sample_sweep():
    """A made-up sweep in the committed schema (for the renderer only; never stored)."""
    rows = [sweep_row("l2", (128, n), "float32", "forward", ms=0.01 * n / 1024, eager_ms=0.02 * n / 1024,
                      compile_ms=0.015 * n / 1024, ceiling_ms=0.009 * n / 1024, ceiling="copy")
            for n in (1024, 4096)]
    rows.append(sweep_row("l2", (4, 7), "float32", "forward", ms=0.012, eager_ms=0.009, compile_ms=0.02,
                          ceiling_ms=0.001, ceiling="copy"))
    meta = {"gpu": "Sample GPU", "torch": "0", "cupy": "0", "commit": "abc", "date": "2000-01-01",
            "command": "sample"}
    return {"meta": meta, "rows": rows, "summary": summarize(rows)}


def test_tables_regenerate_and_check_from_sweeps(tmp_path, capsys):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    shutil.copy(ROOT / "docs" / "results" / "main.json", tmp_path / "docs" / "results")
    (tmp_path / "docs" / "results" / "normalize_sweep.json").write_text(json.dumps(_sample_sweep()))
    blocks = "".join(f"<!-- table:{n} -->\nstale\n<!-- /table:{n} -->\n" for n in
                     ("main", "envelope", "envelope-full", "slower", "sweep-normalize", "sweep-gemm"))
    for doc in tables.DOCS:
        (tmp_path / doc).write_text("# doc\n" + blocks)
    assert tables.main(["--check"], root=tmp_path) == 1
    assert tables.main([], root=tmp_path) == 0
    assert tables.main(["--check"], root=tmp_path) == 0
    text = (tmp_path / "README.md").read_text()
    assert "| l2 | float32 | forward | 3 | 0.75 | 2.00 |" in text  # min and median x eager
    assert "| l2 | 3 | 0.75 | 2.00 | 1.50 | 1.50 | 1 |" in text  # per op, with the slower count
    assert "| l2 | 4x7 | float32 | forward |" in text  # the one point slower than eager
    assert "(no gemm_sweep.json yet)" in text and "stale" not in text
    main = json.loads((ROOT / "docs" / "results" / "main.json").read_text())
    assert f"| {main['rows'][0]['ms']:.3f} |" in text
    (tmp_path / "README.md").write_text(text.replace("| 3 | 0.75 | 2.00 | 1.50", "| 3 | 0.76 | 2.00 | 1.50"))
    assert tables.main(["--check"], root=tmp_path) == 1
    assert "README.md" in capsys.readouterr().err


def test_unknown_table_is_named():
    with pytest.raises(KeyError, match="bogus"):
        tables.render("bogus", {"main": [], "sweeps": {}})
