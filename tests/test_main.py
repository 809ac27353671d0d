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
    assert r.stdout.count(" ok") == 6 and "MISMATCH" not in r.stdout
    checked = [line.split()[0] for line in r.stdout.splitlines() if line.endswith(" ok")]
    assert checked == ["l1_normalize", "l2_normalize", "linear", "matmul",
                       "matmul_sum_max_mean_logsumexp", "gemm_scale_batchnorm"], r.stdout
    assert "not apply" not in r.stdout  # no option given, none to name


@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU the job benchmarks instead (test_quick_main_job)")
@pytest.mark.parametrize("args, named", [(["--quick"], "--quick does not apply"),
                                         (["--iters", "3"], "--iters does not apply"),
                                         (["--quick", "--iters", "3"], "--quick and --iters do not apply")])
def test_main_job_without_gpu_names_the_timing_options_it_ignores(args, named):
    r = subprocess.run([sys.executable, "-m", "cupykern", "--models", "L1Norm", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if "not apply" in line]
    assert len(lines) == 1 and lines[0].startswith(named) and "without a GPU" in lines[0], r.stdout
    assert "l1_normalize" in r.stdout and "MISMATCH" not in r.stdout


def test_cpu_check_covers_matmul_in_numpy_semantics():
    from cupykern.__main__ import _cpu_check

    results = _cpu_check(["matmul_sum_max_mean_logsumexp"])
    assert list(results) == ["linear", "matmul", "matmul_sum_max_mean_logsumexp"]
    assert all(r["correct"] for r in results.values()), results


@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU the job benchmarks instead (test_quick_main_job)")
def test_main_job_json_without_gpu(tmp_path):
    import json

    out = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "cupykern", "--json", str(out), "--models", "L1Norm"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["gpu"] is None and data["reason"]
    assert list(data["cpu_check"]) == ["l1_normalize"] and data["cpu_check"]["l1_normalize"]["correct"]


@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU the job benchmarks instead (test_quick_main_job)")
def test_main_job_without_gpu_checks_the_models_asked_for():
    r = subprocess.run([sys.executable, "-m", "cupykern", "--models", "l2norm,GemmScaleBatchNorm"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    checked = [line.split()[0] for line in r.stdout.splitlines() if line.endswith(" ok")]
    assert checked == ["l2_normalize", "linear", "matmul", "gemm_scale_batchnorm"], r.stdout


@pytest.mark.parametrize("iters", ["0", "-3", "x"])
def test_iters_must_be_a_positive_whole_number(iters):
    r = subprocess.run([sys.executable, "-m", "cupykern", "--iters", iters], capture_output=True, text=True)
    assert r.returncode == 2 and "--iters" in r.stderr and ">= 1" in r.stderr, r.stderr


@pytest.mark.parametrize("models", ["bogus", "l1norm,nope", ""])
def test_unknown_model_is_an_error_listing_the_valid_ones(models):
    r = subprocess.run([sys.executable, "-m", "cupykern", "--models", models],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "--models" in r.stderr and "L1Norm" in r.stderr and "GemmScaleBatchNorm" in r.stderr


def test_model_names_in_either_spelling():
    from cupykern.models import NAMES, resolve

    assert resolve("L1Norm,l2norm,MATMULSUMMAXMEANLOGSUMEXP,GemmScaleBatchNorm") == list(NAMES)


@pytest.mark.parametrize("module", ["normalize", "gemm", "matmul_sum_max_mean_logsumexp", "overhead",
                                    "scale_out"])
def test_benchmarks_have_help_and_need_a_gpu(module):
    name = f"cupykern.benchmarks.{module}"
    r = subprocess.run([sys.executable, "-m", name, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: python -m {name}"), r.stdout + r.stderr
    if not gpu_count():
        r = subprocess.run([sys.executable, "-m", name], capture_output=True, text=True)
        assert r.returncode == 1 and "No CUDA GPU found" in r.stderr and "Traceback" not in r.stderr


_WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; "
                  "runpy.run_module(sys.argv.pop(1), run_name='__main__')")


@pytest.mark.parametrize("module", ["normalize", "gemm", "matmul_sum_max_mean_logsumexp", "overhead",
                                    "scale_out"])
def test_benchmarks_without_torch_help_then_say_what_to_install(module):
    name = f"cupykern.benchmarks.{module}"
    run = lambda *args: subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, name, *args],  # noqa: E731
                                       capture_output=True, text=True)
    r = run("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage:"), r.stderr
    r = run()
    assert r.returncode == 1 and "needs PyTorch" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.gpu
def test_quick_main_job(tmp_path):
    import json

    from cupykern.__main__ import main

    out = tmp_path / "figures.json"
    assert main(["--quick", "--models", "l1norm,matmul_sum_max_mean_logsumexp", "--iters", "3",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert rows and all(r["correct"] and r["ms"] > 0 for r in rows)
    assert data["meta"]["gpu"] == data["gpu"] and data["meta"]["command"].startswith("python -m cupykern")


def test_gemm_survey_shapes_are_reproducible_and_in_range():
    """GPU-free: the gemm benchmark's off-grid survey (--survey SEED) draws the same 40
    shapes for a seed, each in its ranges and work bound, K mostly unaligned."""
    pytest.importorskip("torch")
    from cupykern.benchmarks import gemm
    shapes = gemm.survey_shapes(7)
    assert shapes == gemm.survey_shapes(7) and shapes != gemm.survey_shapes(11)
    assert len(shapes) == 40 and shapes[:2] == [(25, 23, 1144), (2, 328, 130)]
    for dims in shapes:
        assert all(lo <= d <= hi for d, (lo, hi) in zip(dims, gemm.SURVEY_RANGES))
        assert dims[0] * dims[1] * dims[2] <= gemm.SURVEY_MAX_WORK
    assert sum(k % 4 != 0 for _, k, _ in shapes) > len(shapes) // 2
