"""One memory pool (cupykern/torch/_pool.py): CuPy allocates from PyTorch's caching
allocator once the torch layer is imported. GPU-free: the switch's parsing and the install
rules, with stand-ins for CuPy and torch's raw calls. GPU: memory freed by either library
is reused by the other, the switch back to CuPy's pool, the stream a block is kept for,
and what importing does in fresh processes."""
import gc
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from cupykern.torch import _pool

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- GPU-free

@pytest.mark.parametrize("value, choice", [(None, "torch"), ("", "torch"), ("torch", "torch"),
                                           (" CuPy ", "cupy"), ("cupy", "cupy"),
                                           ("TORCH", "torch")])
def test_env_choice(value, choice):
    environ = {} if value is None else {_pool.ENV: value}
    assert _pool.env_choice(environ) == choice


@pytest.mark.parametrize("value", ["pytorch", "none", "0"])
def test_env_choice_refuses_other_values(value):
    with pytest.raises(ValueError, match=f"{_pool.ENV}='{value}'.*'torch'.*'cupy'"):
        _pool.env_choice({_pool.ENV: value})


class _FakePool:
    def __init__(self):
        self.freed = 0

    def malloc(self, size):
        return ("pool", size)

    def free_all_blocks(self):
        self.freed += 1


class _FakeFunctionAllocator:
    def __init__(self, malloc, free):
        self.malloc_func, self.free_func = malloc, free

    def malloc(self, size):
        return ("torch", size)


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in ``cupy`` module (allocator state, default pool, stream) and a CUDA
    torch: install() and the switches run their logic without a GPU."""
    pool = _FakePool()
    state = {"allocator": pool.malloc}
    cuda = types.SimpleNamespace(
        get_allocator=lambda: state["allocator"],
        set_allocator=lambda a: state.update(allocator=a),
        stream=types.SimpleNamespace(get_current_stream_ptr=lambda: 1234),
        memory=types.SimpleNamespace(PythonFunctionAllocator=_FakeFunctionAllocator))
    cupy = types.ModuleType("cupy")
    cupy.cuda, cupy.get_default_memory_pool = cuda, lambda: pool
    cupy.pool, cupy.state = pool, state
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(_pool, "_allocator", None)
    monkeypatch.setattr(_pool, "_make_allocator",
                        lambda cp, t: _FakeFunctionAllocator(None, None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return cupy


def test_install_puts_cupy_on_torchs_allocator(fake_cupy):
    assert _pool.pool_in_use() == "cupy"
    assert _pool.install({}) == "torch"
    assert _pool.pool_in_use() == "torch"
    assert fake_cupy.state["allocator"].__self__ is _pool._allocator
    assert fake_cupy.pool.freed == 1  # CuPy's cached blocks given back
    assert _pool.install({}) == "torch"  # again: nothing changes
    assert fake_cupy.pool.freed == 1


def test_switches(fake_cupy):
    _pool.use_torch_pool()
    assert _pool.pool_in_use() == "torch"
    _pool.use_cupy_pool()
    assert _pool.pool_in_use() == "cupy"
    assert fake_cupy.state["allocator"].__self__ is fake_cupy.pool
    _pool.use_torch_pool()
    assert _pool.pool_in_use() == "torch"


def test_install_leaves_a_users_allocator(fake_cupy):
    def mine(size):
        return ("mine", size)

    fake_cupy.state["allocator"] = mine
    assert _pool.install({}) == "user allocator"
    assert fake_cupy.state["allocator"] is mine
    assert _pool.pool_in_use() == "other"
    _pool.use_torch_pool()  # asked for: replaces it
    assert _pool.pool_in_use() == "torch"


@pytest.mark.parametrize("environ, why", [({_pool.ENV: "cupy"}, "env"),
                                          ({"CUPY_CUDA_PER_THREAD_DEFAULT_STREAM": "1"},
                                           "per-thread stream")])
def test_install_leaves_cupys_pool(fake_cupy, environ, why):
    assert _pool.install(environ) == why
    assert _pool.pool_in_use() == "cupy"


def test_install_without_cuda_or_cupy(fake_cupy, monkeypatch):
    def no_cupy():
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(_pool, "_cupy", no_cupy)
    assert _pool.install({}) == "no cupy"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _pool.install({}) == "no cuda"
    with pytest.raises(RuntimeError, match="no CUDA device"):
        _pool.use_torch_pool()


def test_env_is_read_before_cuda(monkeypatch):
    """CUPYKERN_CUPY_POOL=cupy: install() does not even ask torch about CUDA."""
    def fail():
        raise AssertionError("torch.cuda.is_available called")

    monkeypatch.setattr(torch.cuda, "is_available", fail)
    assert _pool.install({_pool.ENV: "cupy"}) == "env"


def test_installed_on_this_machine():
    """What importing cupykern.torch did here."""
    if os.environ.get(_pool.ENV, "").strip().lower() == "cupy":
        assert _pool.INSTALLED == "env"
    elif not torch.cuda.is_available():
        assert _pool.INSTALLED == "no cuda"
    else:
        assert _pool.INSTALLED in ("torch", "no cupy", "user allocator", "per-thread stream")


def test_the_allocators_calls(monkeypatch):
    """The malloc given to CuPy: torch's raw allocation for CuPy's current stream, through
    torch.cuda.device only when torch's current device is another; CUDA set up once;
    free: torch's raw delete."""
    calls = []
    from cupykern.torch import _compat
    monkeypatch.setattr(_compat, "cuda_raw_alloc", lambda size, stream: calls.append(
        ("alloc", size, stream)) or 4096)
    monkeypatch.setattr(_compat, "cuda_raw_delete", lambda ptr: calls.append(("delete", ptr)))
    monkeypatch.setattr(_compat, "cuda_get_device", lambda: 0)

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            calls.append(("device", self.index))

        def __exit__(self, *exc):
            calls.append(("device exit",))

    fake_torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(init=lambda: calls.append(("init",)), device=Device))
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        stream=types.SimpleNamespace(get_current_stream_ptr=lambda: 77),
        memory=types.SimpleNamespace(PythonFunctionAllocator=_FakeFunctionAllocator)))
    alloc = _pool._make_allocator(fake_cupy, fake_torch)
    assert calls == []  # nothing set up before the first allocation
    assert alloc.malloc_func(1000, 0) == 4096
    assert alloc.malloc_func(24, 0) == 4096
    assert alloc.malloc_func(8, 1) == 4096
    alloc.free_func(4096, 0)
    assert calls == [("init",), ("alloc", 1000, 77), ("alloc", 24, 77), ("device", 1),
                     ("alloc", 8, 77), ("device exit",), ("delete", 4096)]


# ---------------------------------------------------------------- GPU

def _empty_caches(cupy):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.fixture
def torch_pool():
    """CuPy on torch's allocator for the test (whatever the environment chose), the
    allocator it had put back after, both caches emptied before and after."""
    import cupy

    before = cupy.cuda.get_allocator()
    _empty_caches(cupy)
    _pool.use_torch_pool()
    try:
        yield cupy
    finally:
        _empty_caches(cupy)
        cupy.cuda.set_allocator(before)


def _segment(ptr):
    """torch's allocator's segment holding ``ptr`` (None when torch did not allocate it)."""
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    return None


@pytest.mark.gpu
def test_memory_freed_by_one_is_reused_by_the_other(torch_pool):
    """CuPy and torch take turns allocating one block of more than half the GPU's memory:
    each gets the block the other freed (the same address), with no out-of-memory error
    and no cudaMalloc retry; two such blocks would not fit."""
    cupy = torch_pool
    free, total = torch.cuda.mem_get_info()
    n = (total // 2 + 2**30) // 2**21 * 2**21  # more than half of the GPU, in 2 MiB
    if free < n + 2**30:
        pytest.skip(f"needs {(n + 2**30) / 2**30:.1f} GiB of free GPU memory, "
                    f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    stats = torch.cuda.memory_stats()
    base = torch.cuda.memory_allocated()
    ptrs = []
    for i in range(3):
        a = cupy.empty(n, dtype=cupy.uint8)
        a.fill(i)
        assert _segment(a.data.ptr) is not None  # torch's allocator made it
        assert torch.cuda.memory_allocated() >= base + n
        ptrs.append(a.data.ptr)
        del a
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        t.fill_(i)
        ptrs.append(t.data_ptr())
        del t
    assert len(set(ptrs)) == 1, [hex(p) for p in ptrs]
    after = torch.cuda.memory_stats()
    for key in ("num_alloc_retries", "num_ooms"):
        assert after.get(key, 0) == stats.get(key, 0), key
    assert torch.cuda.memory_allocated() < base + n


@pytest.mark.gpu
def test_use_cupy_pool_restores_cupys_own_pool(torch_pool):
    cupy = torch_pool
    from cupykern.torch import pool_in_use, use_cupy_pool, use_torch_pool

    pool, m = cupy.get_default_memory_pool(), 64 * 2**20
    kept = cupy.ones(m, dtype=cupy.uint8)  # from torch's allocator
    assert _segment(kept.data.ptr) is not None
    use_cupy_pool()
    assert pool_in_use() == "cupy"
    assert cupy.cuda.get_allocator().__self__ is pool
    allocated, used = torch.cuda.memory_allocated(), pool.used_bytes()
    a = cupy.ones(m, dtype=cupy.uint8)
    assert _segment(a.data.ptr) is None
    assert pool.used_bytes() >= used + m and torch.cuda.memory_allocated() == allocated
    del a
    assert pool.free_bytes() >= m  # kept by CuPy's pool, out of torch's reach
    del kept  # made by torch's allocator: goes back to it
    assert torch.cuda.memory_allocated() <= allocated - m
    use_torch_pool()
    assert pool_in_use() == "torch"
    assert pool.free_bytes() < m  # CuPy's cached blocks given back to the device
    b = cupy.ones(m, dtype=cupy.uint8)
    assert _segment(b.data.ptr) is not None and pool.used_bytes() == used
    assert int(b.sum()) == m


@pytest.mark.gpu
def test_an_allocation_on_a_side_stream_is_kept_for_that_stream(torch_pool):
    """A block CuPy allocates under a non-default stream (cupykern's outputs included) is
    torch's allocator's block of that stream: once freed, torch hands it out again on that
    stream."""
    cupy = torch_pool
    import cupykern

    s = cupy.cuda.Stream(non_blocking=True)
    n = 8 * 2**20
    with s:
        a = cupy.empty(n, dtype=cupy.uint8)
        a.fill(1)
        x = cupy.random.standard_normal((64, 4096), dtype=cupy.float32)
        y = cupykern.l1_normalize(x)
    seg = _segment(a.data.ptr)
    assert seg is not None and seg["stream"] == s.ptr
    assert _segment(y.data.ptr)["stream"] == s.ptr
    on_default = cupy.empty(n, dtype=cupy.uint8)
    assert _segment(on_default.data.ptr)["stream"] == cupy.cuda.get_current_stream().ptr
    s.synchronize()
    ptr = a.data.ptr
    del a
    with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
    assert t.data_ptr() == ptr
    del t, x, y, on_default


def _fresh(code, **env):
    """Run ``code`` in a new Python (this checkout first on its path); its stdout."""
    environ = {k: v for k, v in os.environ.items() if k != _pool.ENV}
    environ.update(env)
    path = (str(ROOT), os.environ.get("PYTHONPATH"))
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


@pytest.mark.gpu
def test_what_importing_does():
    """In fresh processes: importing cupykern.torch puts CuPy on torch's allocator;
    CUPYKERN_CUPY_POOL=cupy leaves CuPy's pool; an allocator the user set is left; a
    CuPy-only process (cupykern without torch) is unchanged."""
    report = "import cupykern.torch as ct; print(ct.pool_in_use(), ct._pool.INSTALLED)"
    assert _fresh("import cupy; " + report) == ["torch", "torch"]
    assert _fresh(report) == ["torch", "torch"]  # (cupy imported by the install)
    assert _fresh("import cupy; " + report, CUPYKERN_CUPY_POOL="cupy") == ["cupy", "env"]
    mine = ("import cupy; mine = cupy.cuda.MemoryPool(); cupy.cuda.set_allocator(mine.malloc); "
            + report + "; print(cupy.cuda.get_allocator().__self__ is mine)")
    assert _fresh(mine) == ["other", "user", "allocator", "True"]
    cupy_only = ("import sys, cupy, cupykern; "
                 "y = cupykern.l2_normalize(cupy.ones((4, 8), dtype=cupy.float32)); "
                 "print('torch' in sys.modules, "
                 "cupy.cuda.get_allocator().__self__ is cupy.get_default_memory_pool())")
    assert _fresh(cupy_only) == ["False", "True"]
