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
    assert len(README.encode()) < 13_500


def _bash_blocks(text: str) -> list:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def _commands(block: str) -> list:
    return [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _section(text: str, heading: str) -> str:
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_commands_stand_alone_in_a_fresh_shell():
    """No shell variable set in another block (or anywhere): each line runs as written."""
    for block in _bash_blocks(README):
        assert "$" not in block, block
    install = _commands(_bash_blocks(_section(README, "Install"))[0])
    assert install[0] == "python -m venv .venv && . .venv/bin/activate"
    two = _commands(_bash_blocks(_section(README, "The two commands"))[0])
    assert two == ["python -m cupykern", 'python -m pip install -e ".[test]" && python -m pytest']


def test_readme_gpu_check_prints_on_a_cpu_machine():
    check = re.search(r"`(nvidia-smi[^`]*)`", README.replace("\n", " ")).group(1)
    assert "2>/dev/null" in check and "|| echo" in check, check
    r = subprocess.run(["bash", "-c", check], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stderr == "" and r.stdout.strip(), (r.stdout, r.stderr)


def test_readme_states_normalize_default_axis():
    import inspect

    import cupykern
    for fn in (cupykern.l1_normalize, cupykern.l2_normalize):
        assert inspect.signature(fn).parameters["axis"].default == 1
    assert "`axis=1` by default" in README


def test_readme_lists_the_test_extra_as_it_is():
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    names = [ln.strip().split("[")[0] for ln in cfg["options.extras_require"]["test"].split("\n") if ln.strip()]
    extras = _section(README, "Install").lower()
    for name in names:
        assert name.lower() in extras, name


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


def test_ci_runs_the_readme_cpu_recipe_and_two_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    step1 = ci.split("# Step 2", 1)[0].splitlines()
    recipe = _bash_blocks(_section(README, "Install"))[0].split("# CPU only", 1)[1].split("\n", 1)[1]
    cpu = [ln for ln in _commands(recipe) if not ln.startswith("python -m pip install torch")]
    two = _commands(_bash_blocks(_section(README, "The two commands"))[0])
    assert cpu and two
    for line in cpu + two:
        assert line in step1, line


def test_links_to_files_and_sections_resolve():
    for doc in ("README.md", "docs/design.md", "docs/performance.md", "docs/history.md"):
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
