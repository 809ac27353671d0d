"""One memory pool for CuPy and PyTorch.

CuPy keeps the blocks it frees in its own pool, which PyTorch's caching allocator cannot
reuse, and the reverse: a process that uses both can run out of memory with most of it
free in the other's cache. When the torch layer is imported and PyTorch sees a CUDA
device, CuPy's allocations (cupykern's, and by default every other CuPy allocation in
the process) come from PyTorch's caching allocator instead (:func:`use_torch_pool`):
freed by either library, a block can be reused by both, and ``torch.cuda.memory_stats``,
``torch.cuda.empty_cache`` and ``torch.cuda.set_per_process_memory_fraction`` cover
CuPy's memory too.

A block is allocated for CuPy's current stream on CuPy's current device, and PyTorch
reuses it only for that stream, as CuPy's own pool does.

Left as it is:

* a process that does not import ``cupykern.torch`` (CuPy-only) or has no CUDA device
  that PyTorch sees;
* an allocator the user has set (``cupy.cuda.set_allocator`` with anything other than
  CuPy's default pool's ``malloc``, or ``cupy.cuda.using_allocator``);
* CuPy's per-thread default stream (``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``): PyTorch
  would file every thread's blocks under the one per-thread stream handle;
* ``CUPYKERN_CUPY_POOL=cupy`` in the environment when ``cupykern.torch`` is imported.

:func:`use_cupy_pool` switches back to CuPy's own pool at any time (arrays allocated
before keep the allocator that made them), :func:`use_torch_pool` forward again, and
:func:`pool_in_use` says which is in use.
"""
from __future__ import annotations

import os
import sys

ENV = "CUPYKERN_CUPY_POOL"
CHOICES = ("torch", "cupy")

_allocator = None  # our cupy.cuda.memory.PythonFunctionAllocator, once made


def env_choice(environ=None) -> str:
    """The pool that ``CUPYKERN_CUPY_POOL`` asks for: "torch" (unset or empty: the
    default) or "cupy"; case and surrounding spaces ignored. ValueError otherwise."""
    value = (os.environ if environ is None else environ).get(ENV, "")
    choice = value.strip().lower() or "torch"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: expected 'torch' (CuPy allocates from PyTorch's "
                         "caching allocator, the default) or 'cupy' (CuPy's own memory pool)")
    return choice


def _cupy():
    import cupy

    return cupy


def _torch():
    import torch

    return torch


def _make_allocator(cupy, torch):
    """A ``PythonFunctionAllocator`` whose malloc and free are PyTorch's caching
    allocator's raw calls, bound once (default arguments: they also outlive the module's
    globals at interpreter exit). PyTorch's CUDA state is set up at the first allocation,
    not before (importing cupykern.torch creates no CUDA context)."""
    from ._compat import cuda_get_device as get_device, cuda_raw_alloc as raw_alloc
    from ._compat import cuda_raw_delete as raw_delete
    with_device = torch.cuda.device
    stream_ptr = getattr(cupy.cuda.stream, "get_current_stream_ptr", None)
    if not callable(stream_ptr):
        get_stream = cupy.cuda.get_current_stream

        def stream_ptr(get_stream=get_stream):
            return get_stream().ptr

    def malloc(size, device, raw_alloc=raw_alloc, get_device=get_device,
               stream_ptr=stream_ptr, with_device=with_device, ready=[]):  # noqa: B006
        """``size`` bytes on ``device`` (CuPy's current one) for CuPy's current stream."""
        if not ready:  # (the raw calls assume torch's CUDA state is set up)
            torch.cuda.init()
            ready.append(True)
        if device == get_device():
            return raw_alloc(size, stream_ptr())
        with with_device(device):  # (torch's idea of the current device lags CuPy's)
            return raw_alloc(size, stream_ptr())

    def free(ptr, device, raw_delete=raw_delete):
        raw_delete(ptr)  # (the allocator knows the block's device and stream)

    return cupy.cuda.memory.PythonFunctionAllocator(malloc, free)


def _is_default_pool(cupy, alloc) -> bool:
    return getattr(alloc, "__self__", None) is cupy.get_default_memory_pool()


def _is_ours(alloc) -> bool:
    return _allocator is not None and getattr(alloc, "__self__", None) is _allocator


def pool_in_use() -> str:
    """Which allocator CuPy uses in this thread: "torch" (PyTorch's caching allocator,
    through cupykern), "cupy" (CuPy's default memory pool) or "other" (one the user set);
    "cupy" also when CuPy is not imported yet and no choice has been made."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return "cupy"
    alloc = cupy.cuda.get_allocator()
    if _is_ours(alloc):
        return "torch"
    return "cupy" if _is_default_pool(cupy, alloc) else "other"


def use_torch_pool() -> None:
    """Make CuPy allocate from PyTorch's caching allocator in this process (replacing
    whatever allocator CuPy had), and give the blocks cached in CuPy's default pool back to
    the device. RuntimeError without a CUDA device that PyTorch sees or without CuPy."""
    global _allocator
    torch = _torch()
    if not torch.cuda.is_available():
        raise RuntimeError("use_torch_pool: PyTorch sees no CUDA device (a CPU build of "
                           "torch, or no GPU): CuPy keeps its own pool")
    try:
        cupy = _cupy()
    except ImportError as e:
        raise RuntimeError("use_torch_pool: CuPy is not installed (the cuda12/cuda13 "
                           "extra)") from e
    if _allocator is None:
        _allocator = _make_allocator(cupy, torch)
    cupy.cuda.set_allocator(_allocator.malloc)
    cupy.get_default_memory_pool().free_all_blocks()


def use_cupy_pool() -> None:
    """Make CuPy allocate from its own default memory pool again (CuPy's default). Arrays
    allocated from PyTorch's allocator before stay valid and go back to it when freed."""
    cupy = _cupy()
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


def install(environ=None) -> str:
    """What importing ``cupykern.torch`` does: PyTorch's caching allocator for CuPy
    (:func:`use_torch_pool`) unless ``CUPYKERN_CUPY_POOL=cupy``, PyTorch sees no CUDA
    device, CuPy is not installed, the user has set an allocator or CuPy's per-thread
    default stream is on. Returns what was done: "torch" (installed), or why not: "env",
    "no cuda", "no cupy", "user allocator", "per-thread stream"."""
    environ = os.environ if environ is None else environ
    if env_choice(environ) == "cupy":
        return "env"
    torch = _torch()
    if not torch.cuda.is_available():
        return "no cuda"
    if environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "0") not in ("", "0"):
        return "per-thread stream"
    try:
        cupy = _cupy()
    except ImportError:
        return "no cupy"
    alloc = cupy.cuda.get_allocator()
    if _is_ours(alloc):
        return "torch"
    if not _is_default_pool(cupy, alloc):
        return "user allocator"
    use_torch_pool()
    return "torch"


INSTALLED = install()  # (when cupykern.torch is imported)
