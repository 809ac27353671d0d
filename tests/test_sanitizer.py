"""compute-sanitizer (memcheck, racecheck, initcheck, synccheck) over tests/sanitize_driver.py,
which calls every kernel family at small edge shapes and checks the results."""
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

DRIVER = pathlib.Path(__file__).with_name("sanitize_driver.py")
ROOT = DRIVER.parent.parent
DONE = "sanitize driver done"
# The clean-run summary each tool prints (compute-sanitizer 2025.x).
CLEAN = {"racecheck": r"RACECHECK SUMMARY: 0 hazards displayed \(0 errors, 0 warnings\)"}
CLEAN_DEFAULT = r"ERROR SUMMARY: 0 errors"
# racecheck is by far the slowest tool: one run per kernel family.
CASES = [("memcheck", None), ("initcheck", None), ("synccheck", None)] + [
    ("racecheck", g) for g in ("normalize", "normalize_rows", "linear", "gemm_scale_batchnorm",
                               "matmul_sum")]
TIMEOUT = 1800  # seconds per sanitizer run


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
    """Run cmd from the repository root; returns (exit code, stdout and stderr together)."""
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


@pytest.fixture(scope="module")
def sanitizer():
    """The compute-sanitizer binary, after one plain driver run: it fills CuPy's kernel cache
    (NVRTC compiles under the sanitizer are slow) and must itself pass."""
    tool = _sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found on PATH, $CUDA_HOME/bin or /usr/local/cuda/bin")
    rc, out = _run([sys.executable, str(DRIVER)], timeout=900)
    assert rc == 0 and DONE in out, f"the driver fails without the sanitizer (exit {rc}):\n{out[-6000:]}"
    return tool


@pytest.mark.parametrize("tool,only", CASES, ids=[t if g is None else f"{t}-{g}" for t, g in CASES])
def test_sanitizer_clean(sanitizer, tool, only):
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
           sys.executable, str(DRIVER)] + ([] if only is None else ["--only", only])
    rc, out = _run(cmd, TIMEOUT)
    if "Device not supported" in out:  # e.g. a sandboxed runtime the sanitizer cannot attach to
        pytest.skip(f"compute-sanitizer cannot use this GPU:\n{out[-2000:]}")
    summary = CLEAN.get(tool, CLEAN_DEFAULT)
    assert rc == 0 and DONE in out and re.search(summary, out), (
        f"{tool}{'' if only is None else ' --only ' + only}: exit {rc} (99: the sanitizer found "
        f"errors), expected {summary!r} and {DONE!r}:\n{out[-8000:]}")
