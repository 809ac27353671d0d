"""compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over tests/sanitize_driver.py,
which calls every kernel family at small edge shapes and checks the results.

One case is one tool over one family in one dtype (and, for the normalize families, one
norm): 112 cases. The whole driver under one tool takes longer than the GPU machine's
10-minute call; split (the same driver arguments, run from a script), the longest, racecheck
of normalize's float32 and float64 L2 cluster kernels, took 318-343 s on an H200. `bash
.ci/gpu sanitizer` runs the cases side by side. initcheck's runs pass --initcheck: the
driver's tracked_products says why."""
import ast
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

DRIVER = pathlib.Path(__file__).with_name("sanitize_driver.py")
ROOT = DRIVER.parent.parent
DONE = "sanitize driver done"
# The clean-run summary each tool prints (compute-sanitizer 2025.x).
CLEAN = {"racecheck": r"RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)"}
CLEAN_DEFAULT = r"ERROR SUMMARY: 0 errors"
# The driver's --only, --dtypes and --kinds. Racecheck first: its cases are the longest.
TOOLS = ("racecheck", "memcheck", "initcheck", "synccheck")
GROUPS = ("normalize", "normalize_rows", "linear", "gemm_scale_batchnorm", "matmul_sum")
DTYPES = ("float16", "bfloat16", "float32", "float64")
NORMS = {"normalize": ("l1", "l2"), "normalize_rows": ("l1", "l2")}
PARTS = [(g, d, k) for g in GROUPS for d in DTYPES for k in NORMS.get(g, (None,))]
CASES = [(tool, *part) for tool in TOOLS for part in PARTS]
TIMEOUT = 1800  # seconds per sanitizer run
# `.ci/gpu sanitizer`, running the cases side by side, one pytest each, sets a deadline
# (a Unix time) that ends every run, and a folder where a part's passing plain run leaves
# a mark, so that the other three tools' cases of that part skip it.
DEADLINE = float(os.environ.get("SANITIZER_DEADLINE", "inf"))
PLAIN_MARKS = os.environ.get("SANITIZER_PLAIN_MARKS")


def _sanitizer():
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        path = pathlib.Path(home or "/nonexistent") / "bin" / "compute-sanitizer"
        if os.access(path, os.X_OK):
            return str(path)
    return None


def _run(cmd, timeout):
    """Run cmd from the repository root, for at most ``timeout`` seconds and not past
    DEADLINE; returns (exit code, stdout and stderr together)."""
    timeout = min(timeout, DEADLINE - time.time())
    if timeout <= 0:
        pytest.fail(f"timed out after 0 s (the deadline has passed): {' '.join(cmd)}")
    # The driver imports cupykern from this checkout, as pytest does.
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    # Its own process group, so a timeout also ends the Python child of the sanitizer.
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-6000:]}")
    return p.returncode, out


def _driver_args(group, dtype, norm, tool=None):
    """The driver's arguments for a case (``tool``'s: initcheck's vendor products, see the
    driver's tracked_products)."""
    return (["--only", group, "--dtypes", dtype] + ([] if norm is None else ["--kinds", norm])
            + (["--initcheck"] if tool == "initcheck" else []))


_plain_passed = set()


@pytest.fixture(scope="module")
def sanitizer():
    tool = _sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found on PATH, $CUDA_HOME/bin or /usr/local/cuda/bin")
    return tool


def _plain_run(args):
    """The same driver run without the sanitizer, once per part: it must itself pass, and
    it fills CuPy's kernel cache (NVRTC compiles under the sanitizer are slow)."""
    mark = PLAIN_MARKS and pathlib.Path(PLAIN_MARKS, "_".join(args).replace("-", ""))
    if tuple(args) in _plain_passed or (mark and mark.exists()):
        return
    rc, out = _run([sys.executable, str(DRIVER)] + args, timeout=900)
    assert rc == 0 and DONE in out, (
        f"the driver fails without the sanitizer (exit {rc}, {' '.join(args)}):\n{out[-6000:]}")
    _plain_passed.add(tuple(args))
    if mark:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()


@pytest.mark.long
@pytest.mark.gpu
@pytest.mark.parametrize("tool,group,dtype,norm", CASES,
                         ids=["-".join(filter(None, case)) for case in CASES])
def test_sanitizer_clean(sanitizer, tool, group, dtype, norm):
    args = _driver_args(group, dtype, norm, tool)
    _plain_run(args)
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
           sys.executable, str(DRIVER)] + args
    rc, out = _run(cmd, TIMEOUT)
    if "Device not supported" in out and rc != 99:  # e.g. a sandboxed runtime the
        # sanitizer cannot attach to (99: it found errors, which are judged)
        pytest.skip(f"compute-sanitizer cannot use this GPU:\n{out[-2000:]}")
    summary = CLEAN.get(tool, CLEAN_DEFAULT)
    assert rc == 0 and DONE in out and re.search(summary, out), (
        f"{tool} {' '.join(args)}: exit {rc} (99: the sanitizer found errors), expected "
        f"{summary!r} and {DONE!r}:\n{out[-8000:]}")


def test_cases_cover_the_whole_driver():
    """GPU-free: the cases name every family, dtype and norm the driver has, read from its source."""
    found, reads_kinds = {}, set()
    for node in ast.parse(DRIVER.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(n, ast.Name) and n.id == "KINDS" for n in ast.walk(node)):
            reads_kinds.add(node.name)
    groups = {k.value: v.id for k, v in zip(found["GROUPS"].keys, found["GROUPS"].values)}
    assert tuple(groups) == GROUPS
    assert tuple(e.attr for e in found["DTYPES"].elts) == DTYPES
    # The families whose function reads the norms take --kinds: a case per norm.
    assert {g for g, fn in groups.items() if fn in reads_kinds} == set(NORMS)
    assert all(norms == ast.literal_eval(found["KINDS"]) for norms in NORMS.values())


def test_deadline_ends_a_run(monkeypatch):
    """GPU-free: past `.ci/gpu sanitizer`'s deadline a run fails as timed out, unstarted."""
    monkeypatch.setattr(sys.modules[__name__], "DEADLINE", time.time() - 1)
    with pytest.raises(pytest.fail.Exception, match="timed out after 0 s"):
        _run([sys.executable, "-c", "raise SystemExit(3)"], timeout=60)


def test_plain_run_once_per_part_across_processes(monkeypatch, tmp_path):
    """GPU-free: a part's passing plain run leaves its mark; a later process (its own set
    empty) skips the run, another part does not."""
    this = sys.modules[__name__]
    calls = []
    monkeypatch.setattr(this, "_run", lambda cmd, timeout: (calls.append(cmd[2:]), (0, DONE))[1])
    monkeypatch.setattr(this, "PLAIN_MARKS", str(tmp_path))
    monkeypatch.setattr(this, "_plain_passed", set())
    part, other = _driver_args("normalize", "float32", "l2"), _driver_args("linear", "float32", None)
    _plain_run(part)
    monkeypatch.setattr(this, "_plain_passed", set())  # as in a new pytest process
    _plain_run(part)
    _plain_run(other)
    assert calls == [part, other]
