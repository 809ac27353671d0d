"""GPU tests carry ``@pytest.mark.gpu`` and skip, with the reason, when no GPU (or no
CuPy, which runs our kernels) is present; the NVRTC compile checks carry
``@pytest.mark.nvrtc`` and skip, with the reason, without CuPy and NVRTC (the
``cuda12``/``cuda13`` extra). A CPU machine with only ``.[test]`` installed runs the rest."""
import collections
import functools

import pytest

EXTRA = "the cuda12/cuda13 extra"


@functools.lru_cache(maxsize=None)
def _cupy_missing() -> str:
    """Why CuPy cannot be imported, or "" when it can."""
    try:
        import cupy  # noqa: F401
    except ImportError as e:
        return f"{e.name or 'CuPy'} is not installed: {EXTRA}"
    return ""


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """CUDA GPUs our kernels can run on: 0 without CuPy, a driver or a device."""
    if _cupy_missing():
        return 0
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver, no device
        return 0


@functools.lru_cache(maxsize=None)
def nvrtc_missing() -> str:
    """Why NVRTC (through CuPy) cannot compile here, or "" when it can (no GPU needed)."""
    if _cupy_missing():
        return _cupy_missing()
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - the NVRTC library is absent or broken
        return f"NVRTC is not usable, {type(e).__name__}: {e}; {EXTRA}"
    return ""


def pytest_collection_modifyitems(config, items):
    skips = {}
    if not gpu_count():
        why = _cupy_missing() or "none found: run the suite on the GPU machine"
        skips["gpu"] = pytest.mark.skip(reason=f"needs a CUDA GPU ({why})")
    if nvrtc_missing():
        skips["nvrtc"] = pytest.mark.skip(reason=f"needs NVRTC ({nvrtc_missing()})")
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """Why tests were skipped, one line per reason with its count, always shown (pytest's
    own ``-rs`` prints a line per test function: hundreds on a CPU machine)."""
    counts, files = collections.Counter(), collections.defaultdict(set)
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        counts[reason] += 1
        files[reason].add(rep.nodeid.split("::")[0])
    if counts:
        terminalreporter.section("skip reasons", sep="-")
    for reason, n in counts.most_common():
        k = len(files[reason])
        terminalreporter.write_line(f"{n:5d} skipped: {reason} ({k} file{'s' * (k > 1)})")


@pytest.fixture
def as_sm75(monkeypatch):
    """Run the ops as on a Turing GPU (compute capability 7.5: no mma.sync, no clusters)
    on whatever GPU is present, with fresh launch plans (a plan does not record the
    capability it was made for: on a real device that never changes)."""
    import sys

    from cupykern import _loader

    monkeypatch.setattr(_loader, "device_cc", lambda device: 75)
    for stem in ("normalize", "gemm", "gemm_scale_batchnorm", "matmul_sum_max_mean_logsumexp"):
        monkeypatch.setattr(sys.modules[f"cupykern.{stem}"], "_plans", {})
