"""The main job: without a GPU it says so and checks the NumPy path; with one, --quick runs."""
import subprocess
import sys

import pytest

from conftest import gpu_count


@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU the job benchmarks instead (test_quick_main_job)")
def test_main_job_without_gpu():
    r = subprocess.run([sys.executable, "-m", "cupykern"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "No CUDA GPU found" in r.stdout
    assert r.stdout.count(" ok") == 5 and "MISMATCH" not in r.stdout


@pytest.mark.gpu
def test_quick_main_job(tmp_path):
    import json

    from cupykern.__main__ import main

    out = tmp_path / "figures.json"
    assert main(["--quick", "--models", "l1norm,matmul_sum_max_mean_logsumexp", "--iters", "3",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["correct"] and r["ms"] > 0 for r in rows)
