"""GPU tests carry ``@pytest.mark.gpu`` and skip, with the reason, when no GPU is present."""
import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver, no device, no cupy
        return 0


def pytest_collection_modifyitems(config, items):
    if gpu_count():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none found): run the suite on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
