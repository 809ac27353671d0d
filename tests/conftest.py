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
