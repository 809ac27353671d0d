"""Timing as the project judges it: CUDA events around the call on the current
stream, L2 flushed between calls, the median of many calls (a host hiccup in one call
moves a mean, not the median); and the hardware ceilings
(device copy bandwidth, cuBLAS GEMM rates) measured in the same run."""
from __future__ import annotations

import statistics
import sys


def torch_or_exit():
    """The torch module, or exit with a message saying what to install."""
    try:
        import torch
    except ImportError:
        sys.exit("This benchmark needs PyTorch and a CUDA GPU: install the torch build for "
                 "your CUDA driver (see the README's install recipes).")
    return torch


class _LazyTorch:
    """``torch``, imported on first use (exiting with :func:`torch_or_exit`'s message
    without it), so that benchmark modules import, and answer ``--help``, without it."""

    def __getattr__(self, name):
        return getattr(torch_or_exit(), name)


torch = _LazyTorch()


def require_gpu() -> None:
    """Exit with a clear message unless a CUDA GPU is present (after --help was handled)."""
    if not torch_or_exit().cuda.is_available():
        sys.exit("No CUDA GPU found (torch.cuda.is_available() is False): this benchmark "
                 "needs one. `python -m cupykern` checks the CPU path without a GPU.")


def time_ms(fn, *, iters: int = 20, warmup: int = 3, flush: bool = True, setup=None) -> float:
    """Median milliseconds of ``fn()`` on torch's current stream (L2 flushed and the
    untimed ``setup()`` run before each call)."""
    import torch

    scratch = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") if flush else None
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(iters):
        if setup:
            setup()
        if scratch is not None:
            scratch.zero_()  # evicts the 50-60 MB L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_us(fn, *, calls: int = 50, reps: int = 5) -> float:
    """GPU microseconds per call of ``fn()``: ``calls`` calls captured in one CUDA graph,
    replayed ``reps`` times, the median (no host time: what a captured or compiled
    training loop sees of a small call)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (plans, compiles) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_ms(x, iters: int = 20) -> float:
    """Same-run ceiling for a memory-bound op on ``x``: ``y.copy_(x)`` (read + write)."""
    import torch

    y = torch.empty_like(x)
    t = time_ms(lambda: y.copy_(x), iters=iters)
    del y
    return t


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def tflops(flops: float, ms: float) -> float:
    return flops / ms / 1e9

