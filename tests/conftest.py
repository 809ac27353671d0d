"""GPU tests carry ``@pytest.mark.gpu`` and skip, with the reason, when no GPU (or no
CuPy, which runs our kernels) is present; the NVRTC compile checks carry
``@pytest.mark.nvrtc`` and skip, with the reason, without CuPy and NVRTC (the
``cuda12``/``cuda13`` extra). A CPU machine with only ``.[test]`` installed runs the rest.

``@pytest.mark.long`` tests (the all-arch compile checks, compute-sanitizer, the GPU fuzz
profile, the GPU distributed runs, the notebooks' execution) are left out of the default
run (setup.cfg: ``-m "not long"``): ``--long`` (or ``-m ""``) runs everything, ``-m long``
only them. The default run starts with the install smoke tests (tests/test_install.py)
and ends with the slowest files. ``@pytest.mark.slow(gib=N)`` GPU tests skip, with the
reason, when the GPU has less than N GiB free (24 when not given), after the caches of
both memory pools are emptied, and empty them again when done."""
import collections
import functools
import gc
import os
import pathlib
import sys

import pytest

# JAX (test_dlpack.py's producer) reserves 75% of the GPU at its first use and keeps it for
# the process: 105 of an H200's 140 GiB, which left the later large-memory tests skipping for
# want of memory. Allocating on demand keeps the one-process run whole.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

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


# The default run's order, by file: the install smoke tests first (a broken install fails
# in the first minute), then every other file in collection order, then these, slowest
# last (those with long tests after the rest).
FIRST = ("test_install.py",)
LAST = ("test_training.py", "test_main.py", "test_packaging.py", "test_notebook.py",
        "test_fuzz.py", "test_distributed.py", "test_compile.py", "test_sanitizer.py")
SLOW_GIB = 24  # free GPU memory a slow test needs unless its marker says (gib=N)


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="also run the @pytest.mark.long tests (compile checks for every "
                          "arch, compute-sanitizer, GPU fuzzing, distributed, notebooks)")


def pytest_configure(config):
    if config.getoption("long") and config.option.markexpr.strip() in ("not long", ""):
        config.option.markexpr = ""  # (setup.cfg's -m "not long" lifted; another -m stays)


def file_rank(item) -> int:
    name = pathlib.Path(str(item.fspath)).name
    if name in FIRST:
        return 0
    return 2 + LAST.index(name) if name in LAST else 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=file_rank)  # (stable: each file's tests keep their order)
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
    long = [i for i in terminalreporter.stats.get("deselected", []) if "long" in i.keywords]
    if long:
        terminalreporter.write_line(
            f"{len(long)} long tests not run (-m {terminalreporter.config.option.markexpr!r}): "
            "--long runs everything, -m long only them")


def free_gpu_memory() -> None:
    """Give cached GPU memory back to the device: what a failed test's traceback holds
    (pytest keeps the last one for post-mortem debugging), torch's caching allocator's
    and CuPy's default pool's unused blocks."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.cuda.Device().synchronize()
        cupy.get_default_memory_pool().free_all_blocks()


@pytest.fixture(autouse=True)
def _slow_memory(request):
    """A ``slow`` (large-memory) GPU test starts with the caches emptied, skips with the
    reason when too little GPU memory is free, and leaves the caches emptied."""
    marker = request.node.get_closest_marker("slow")
    if marker is None or not gpu_count():
        yield
        return
    need = marker.kwargs.get("gib", SLOW_GIB)
    free_gpu_memory()
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    if free < need * 2**30:
        pytest.skip(f"needs {need} GiB of free GPU memory; {free / 2**30:.1f} of "
                    f"{total / 2**30:.1f} GiB free")
    try:
        yield
    finally:
        free_gpu_memory()


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


@pytest.fixture
def our_kernels(request):
    """Our GEMM kernels at every shape (the dispatcher gives many small products to the
    vendor), for the GEMM test files (``pytestmark = usefixtures("our_kernels")``); a test
    of the dispatcher itself takes ``dispatched`` instead."""
    from cupykern import gemm_route
    if "dispatched" in request.fixturenames:
        yield
        return
    with gemm_route.forced_route(gemm_route.OURS):
        yield


@pytest.fixture
def dispatched():
    """Products go where cupykern.gemm_route.route says (see ``our_kernels``)."""


@pytest.fixture
def grad_bounds():
    """``set(bound)``: route's work bounds for calls that autograd records (both) set to
    ``bound``, every plan dropped (they hold routes); the bounds restored, and the plans
    dropped, after the test."""
    from cupykern import gemm_route
    keys = ("MISALIGNED_GRAD_MIN_WORK", "HIGHEST_GRAD_MIN_WORK")
    old = {k: gemm_route._ROUTE[k] for k in keys}

    def set_bound(bound):
        gemm_route._ROUTE.update(dict.fromkeys(keys, bound))
        gemm_route._drop_plans()
    yield set_bound
    gemm_route._ROUTE.update(old)
    gemm_route._drop_plans()
