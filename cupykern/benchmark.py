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


# Each sweep point times ours and PyTorch's interleaved for about this long in all
# (time_each's ``seconds``): a host-bound point gets hundreds of rounds, not the 15 of a
# big one. (Timed one function after another, 30 calls each, the normalize sweep's
# host-bound forward+backward points read 0.63-1.89x eager from run to run, H200.)
SWEEP_SECONDS = 0.4


def time_ms(fn, *, iters: int = 20, warmup: int = 3, flush: bool = True, setup=None,
            seconds: float = 0.0) -> float:
    """Median milliseconds of ``fn()`` on torch's current stream (L2 flushed and the
    untimed ``setup()`` run before each call; ``seconds`` as :func:`time_each`'s)."""
    return time_each((fn,), iters=iters, warmup=warmup, flush=flush, setup=setup,
                     seconds=seconds)[0]


def time_each(fns, *, iters: int = 20, warmup: int = 3, flush: bool = True, setup=None,
              seconds: float = 0.0) -> list:
    """:func:`time_ms` of each of ``fns``, their calls interleaved (one of each per
    round), so that every function meets the same drift of clocks and host load: what
    makes a comparison of host-bound calls (whose times swing by tens of percent between
    seconds on the GPU machines here) fair. ``seconds``: rounds for about that long in
    all, from ``iters`` up to 20 times as many, so that short host-bound calls get a
    median of hundreds of calls (on these hosts a small training step's median over 15
    rounds moved by 10-20% from one run to the next)."""
    import time

    import torch

    scratch = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") if flush else None
    rounds = []
    for _ in range(warmup):
        start = time.perf_counter()
        for fn in fns:
            if setup:
                setup()
            fn()
        torch.cuda.synchronize()
        rounds.append(time.perf_counter() - start)
    if seconds and rounds:  # (the fastest warm-up round: the first compiles and plans)
        iters = max(iters, min(20 * iters, int(seconds / max(min(rounds), 1e-6))))
    times = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            if setup:
                setup()
            if scratch is not None:
                scratch.zero_()  # evicts the 50-60 MB L2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end))
    return [statistics.median(ts) for ts in times]


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



# ---- Envelope sweeps (benchmarks' --sweep): one row schema, one summary, one JSON form,
# read back by the README's table generator.

def compiled(fn):
    """``torch.compile(fn)`` for one shape: each sweep point compiles its own, so that
    a sweep never reaches dynamo's recompile limit (past it dynamo runs eager)."""
    import torch as _torch

    return _torch.compile(fn, dynamic=False)


def sweep_row(op: str, shape, dtype, mode: str, ms: float, eager_ms: float,
              compile_ms: float | None = None, ceiling_ms: float | None = None,
              ceiling: str | None = None, **extra) -> dict:
    """One sweep point: our time and PyTorch's (eager, torch.compile) in ms, host time
    included, and ``ceiling_ms``, the same-run hardware floor named by ``ceiling``
    ("copy": the same bytes through ``copy_``; "tensor peak": FLOPs at the measured
    matrix rate). Ratios: x_eager = eager_ms / ms (> 1: we are faster), x_compile
    likewise, x_ceiling = ms / ceiling_ms (>= 1; 1 is the hardware's floor)."""
    shape = "x".join(str(s) for s in shape) if not isinstance(shape, str) else shape
    return {"op": op, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "mode": mode,
            "ms": ms, "eager_ms": eager_ms, "compile_ms": compile_ms,
            "x_eager": eager_ms / ms,
            "x_compile": None if compile_ms is None else compile_ms / ms,
            "ceiling": ceiling, "ceiling_ms": ceiling_ms,
            "x_ceiling": None if ceiling_ms is None else ms / ceiling_ms, **extra}


def print_rows(rows) -> None:
    """A table of sweep rows, one line each."""
    print(f"{'op':<12} {'shape':<22} {'dtype':<9} {'mode':<17} {'ms':>9} {'eager':>9} "
          f"{'compile':>9} {'x eager':>8} {'x comp':>7} {'x ceil':>7}")
    for r in rows:
        comp = "" if r["compile_ms"] is None else f"{r['compile_ms']:9.4f}"
        xc = "" if r["x_compile"] is None else f"{r['x_compile']:7.2f}"
        xl = "" if r["x_ceiling"] is None else f"{r['x_ceiling']:7.2f}"
        print(f"{r['op']:<12} {r['shape']:<22} {r['dtype']:<9} {r['mode']:<17} {r['ms']:9.4f} "
              f"{r['eager_ms']:9.4f} {comp:>9} {r['x_eager']:8.2f} {xc:>7} {xl:>7}", flush=True)


def summarize(rows) -> list[dict]:
    """Min and median of x_eager and x_compile per (op, dtype, mode), printed and returned."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["op"], r["dtype"], r["mode"]), []).append(r)
    out = []
    print(f"\n{'op':<12} {'dtype':<9} {'mode':<17} {'n':>3} {'min x eager':>12} {'median':>7} "
          f"{'min x comp':>11} {'median':>7}")
    for (op, dtype, mode), rs in groups.items():
        e = [r["x_eager"] for r in rs]
        c = [r["x_compile"] for r in rs if r["x_compile"] is not None]
        s = {"op": op, "dtype": dtype, "mode": mode, "n": len(rs),
             "min_x_eager": min(e), "median_x_eager": statistics.median(e),
             "min_x_compile": min(c) if c else None,
             "median_x_compile": statistics.median(c) if c else None}
        out.append(s)
        cm = "" if s["min_x_compile"] is None else f"{s['min_x_compile']:11.2f} {s['median_x_compile']:7.2f}"
        print(f"{op:<12} {dtype:<9} {mode:<17} {len(rs):>3} {s['min_x_eager']:12.2f} "
              f"{s['median_x_eager']:7.2f} {cm}")
    return out


def run_meta(command: str) -> dict:
    """Where a sweep ran: GPU, versions, commit (when run from a git checkout), date."""
    import datetime
    import subprocess

    import torch as _torch

    try:
        import cupy
        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"gpu": _torch.cuda.get_device_name() if _torch.cuda.is_available() else None,
            "torch": _torch.__version__, "cupy": cupy_version, "commit": commit,
            "date": datetime.date.today().isoformat(), "command": command}


def write_sweep(path: str, rows, command: str) -> None:
    """The sweep as JSON: {"meta": run_meta, "rows": [sweep_row...], "summary": summarize}."""
    import json

    with open(path, "w") as f:
        json.dump({"meta": run_meta(command), "rows": rows, "summary": summarize(rows)}, f,
                  indent=1)
