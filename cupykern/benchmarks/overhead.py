"""Host overhead per call: ``python -m cupykern.benchmarks.overhead`` (GPU machine only).

Small shapes, where the work is a few microseconds and the host decides the time.
Each figure is microseconds per call of ``n`` back-to-back calls between two CUDA
events on torch's current stream (so host time is included, as a training loop sees
it), next to the PyTorch expression it replaces in the same run: the median of five
measurements taken alternately with the baseline's. Only public API is
called, so the script measures any version of the package.

Targets: MatmulSumMaxMeanLogSumExp at 1024x8192->8192 with parameters that
require grad and grad mode on no slower than ``torch.mv(x, v)`` (one read of x, like
ours) and <= 20 us on an H200; L1/L2 at 16x16384 no slower than eager;
GemmScaleBatchNorm training at 128x1024->512 >= 1.0x eager.

The plain products below 2**30 multiply-adds (linear / matmul on the vendor's route:
PyTorch's or CuPy's own call behind our wrapper) show the wrapper's own host time: a
forward, a recorded forward and a training step on torch tensors, and CuPy calls against
CuPy's ``@``; ``extra`` is ours minus the baseline. The first two rows are the floors
any Python wrapper pays, and the last one a CuPy allocation through PyTorch's caching
allocator (cupykern's one memory pool) against CuPy's own pool.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

from cupykern.benchmark import require_gpu


def per_call_us(fn, n: int = 500) -> float:
    import torch

    for _ in range(50):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def paired_us(ours, base, n: int, reps: int = 5) -> tuple[float, float]:
    """Median microseconds per call of ``ours`` and ``base``, measured alternately ``reps``
    times: the host's speed drifts between and within runs, so only interleaved figures
    compare."""
    o, b = [], []
    for _ in range(reps):
        o.append(per_call_us(ours, n))
        b.append(per_call_us(base, n))
    return statistics.median(o), statistics.median(b)


def rows():
    """(label, ours, baseline name, baseline) for every measured call."""
    import torch
    from torch import nn

    import cupykern
    from cupykern import torch as ct

    yield from _floors()
    x = torch.randn(16, 16384, device="cuda")
    l1, l2 = ct.L1Norm(), ct.L2Norm()
    yield "L1Norm 16x16384", lambda: l1(x), "eager", lambda: x / x.abs().mean(1, keepdim=True)
    yield "L2Norm 16x16384", lambda: l2(x), "eager", lambda: x / x.norm(2, 1, keepdim=True)
    yield ("l2_normalize(tensor) 16x16384", lambda: cupykern.l2_normalize(x), "eager",
           lambda: x / x.norm(2, 1, keepdim=True))

    torch.manual_seed(0)
    m4 = ct.MatmulSumMaxMeanLogSumExp(8192, 8192).cuda()  # parameters require grad
    xm = torch.rand(1024, 8192, device="cuda")
    v = torch.rand(8192, device="cuda")
    with torch.no_grad():
        m4(xm)
    yield ("MatmulSum...LogSumExp 1024x8192->8192 (grad on)", lambda: m4(xm), "torch.mv(x, v)",
           lambda: torch.mv(xm, v))

    torch.manual_seed(0)
    gs = ct.GemmScaleBatchNorm(1024, 512, (512,)).cuda()
    xg = torch.randn(128, 1024, device="cuda")
    # eager: the reference model's ops on the same parameters and buffers
    yield ("GemmScaleBatchNorm 128x1024->512 train (grad on)", lambda: gs(xg), "eager",
           lambda: gs.bn(nn.functional.linear(xg, gs.gemm.weight, gs.gemm.bias) * gs.scale))
    w = torch.randn(512, 1024, device="cuda") / 32
    yield ("linear 128x1024->512", lambda: cupykern.linear(xg, w), "F.linear",
           lambda: nn.functional.linear(xg, w))
    yield from _plain_products()


def _floors():
    """What any Python wrapper costs: a function around torch.add, and an
    autograd.Function around a view (what a recorded call of ours needs at least)."""
    import torch

    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")

    def add(x, y):
        return torch.add(x, y)

    class View(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    c = a.clone().requires_grad_()
    yield "floor: Python function around torch.add", lambda: add(a, b), "torch.add", lambda: torch.add(a, b)
    yield ("floor: autograd.Function around a view", lambda: View.apply(c), "view",
           lambda: c.view_as(c))


def _small_linears():
    """The vendor-route linear calls at small shapes, each dtype, the Linear module, and a
    training step."""
    import torch
    from torch import nn

    import cupykern
    from cupykern import torch as ct

    def operands(m, k, n, dtype, grad=False):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype, requires_grad=grad)
        b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=grad)
        return x, w, b

    for (m, k, n), dtype in (((64, 1024, 1024), torch.bfloat16), ((64, 512, 512), torch.float32),
                             ((2 * 74, 2542, 2542), torch.float32), ((643, 31, 655), torch.float64)):
        x, w, b = operands(m, k, n, dtype)
        name = str(dtype).removeprefix("torch.")
        yield (f"linear {name} {m}x{k}->{n}", lambda x=x, w=w, b=b: cupykern.linear(x, w, b),
               "F.linear", lambda x=x, w=w, b=b: nn.functional.linear(x, w, b))
    x, w, b = operands(64, 512, 512, torch.float32, grad=True)
    theirs = nn.Linear(512, 512, device="cuda")
    ours = ct.Linear.from_linear(theirs)  # (the same parameters)
    yield ("Linear module 64x512->512 float32 (grad on)", lambda: ours(x), "nn.Linear",
           lambda: theirs(x))
    g = torch.randn(64, 512, device="cuda")
    yield ("linear float32 64x512->512 training step",
           lambda: cupykern.linear(x, w, b).backward(g), "eager step",
           lambda: nn.functional.linear(x, w, b).backward(g))


def _pool_rows():
    """A CuPy allocation through PyTorch's caching allocator (the one memory pool, once
    cupykern.torch is imported) against CuPy's own pool, in the same run."""
    import cupy

    from cupykern import torch as ct

    if ct.pool_in_use() != "torch":
        return
    set_allocator, theirs = cupy.cuda.set_allocator, cupy.get_default_memory_pool().malloc
    ours = cupy.cuda.get_allocator()  # (both rows pay the same switch, a thread-local)
    yield ("CuPy empty 1 MiB (the torch pool)",
           lambda: (set_allocator(ours), cupy.empty((256, 1024), cupy.float32)),
           "CuPy's pool", lambda: (set_allocator(theirs), cupy.empty((256, 1024), cupy.float32)))


def _plain_products():
    """Rows of plain products that the dispatcher gives to the vendor (torch's default
    float32 matmul precision, "highest", below HIGHEST_MIN_WORK; 16-bit)."""
    import torch
    from torch import nn

    import cupykern

    xb, wb, bb = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in
                  ((64, 512), (512, 512), (512,)))
    wb.requires_grad_()
    yield ("linear bf16 64x512->512 (grad on)", lambda: cupykern.linear(xb, wb, bb), "F.linear",
           lambda: nn.functional.linear(xb, wb, bb))
    gb = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    yield ("linear bf16 64x512->512 training step", lambda: cupykern.linear(xb, wb, bb).backward(gb),
           "eager step", lambda: nn.functional.linear(xb, wb, bb).backward(gb))
    x, w = torch.randn(256, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    yield ("linear float32 256x1024->1024 (2**28)", lambda: cupykern.linear(x, w), "F.linear",
           lambda: nn.functional.linear(x, w))
    a = torch.randn(333, 777, device="cuda", requires_grad=True)
    b = torch.randn(777, 555, device="cuda")
    yield ("matmul float32 333x777x555 (grad on)", lambda: cupykern.matmul(a, b), "torch.matmul",
           lambda: torch.matmul(a, b))
    import cupy

    xc, wc = cupy.asarray(x), cupy.asarray(w)
    yield ("CuPy linear float32 256x1024->1024", lambda: cupykern.linear(xc, wc), "CuPy x @ w.T",
           lambda: xc @ wc.T)
    ac, bc = cupy.asarray(a.detach()), cupy.asarray(b)
    yield ("CuPy matmul float32 333x777x555", lambda: cupykern.matmul(ac, bc), "CuPy a @ b",
           lambda: ac @ bc)
    yield from _small_linears()
    yield from _pool_rows()  # (last: it leaves whichever pool its baseline ran last)


def _step(forward, g, mode="highest"):
    """``forward()`` and its backward from ``g`` in ``mode``: float32 "highest" or "high"
    for both (the caller's setting restored after), or bf16 autocast around the forward
    over "highest". Each step sets its own state, ours and PyTorch's alike, so a row
    measures the same however the rows are run."""
    import torch  # (imported already: a dictionary read, alike on both sides)

    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if mode == "high" else "highest")
    try:
        with (torch.autocast("cuda", dtype=torch.bfloat16) if mode == "bf16 autocast"
              else contextlib.nullcontext()):
            out = forward()
        out.backward(g.to(out.dtype))
    finally:
        torch.set_float32_matmul_precision(old)


def step_targets():
    """Training steps (forward and backward, parameters requiring grad) at the shapes the
    host-time targets name, against the same PyTorch step on the same parameters: recorded
    linear steps (float32 "highest"), GemmScaleBatchNorm steps in float32 "highest" /
    "high" and under bf16 autocast (eager: the reference model's ops), L1Norm / L2Norm
    steps."""
    import torch
    from torch import nn

    import cupykern
    from cupykern import torch as ct

    F = nn.functional
    torch.manual_seed(0)
    for (m, k, n), dtype in (((64, 512, 512), torch.float32), ((2 * 74, 2542, 2542), torch.float32),
                             ((64, 1024, 1024), torch.bfloat16), ((643, 31, 655), torch.float64)):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype).div_(k ** 0.5).requires_grad_()
        b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(m, n, device="cuda", dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        yield (f"linear {name} {m}x{k}->{n} step",
               lambda x=x, w=w, b=b, g=g: _step(lambda: cupykern.linear(x, w, b), g),
               "eager step", lambda x=x, w=w, b=b, g=g: _step(lambda: F.linear(x, w, b), g))
    for mode in ("highest", "high", "bf16 autocast"):
        for m, k, n in ((64, 512, 512), (128, 1024, 512), (256, 256, 256)):
            gs = ct.GemmScaleBatchNorm(k, n, (n,)).cuda()
            x = torch.randn(m, k, device="cuda")
            g = torch.randn(m, n, device="cuda")
            yield (f"GemmScaleBatchNorm {m}x{k}->{n} {mode} step",
                   lambda gs=gs, x=x, g=g, mode=mode: _step(lambda: gs(x), g, mode), "eager step",
                   lambda gs=gs, x=x, g=g, mode=mode: _step(
                       lambda: gs.bn(F.linear(x, gs.gemm.weight, gs.gemm.bias) * gs.scale), g, mode))
    for rows, cols in ((128, 4096), (16, 16384)):
        x = torch.randn(rows, cols, device="cuda", requires_grad=True)
        g = torch.randn(rows, cols, device="cuda")
        for label, mod, ref in (("L1Norm", ct.L1Norm(), lambda x: x / x.abs().mean(1, keepdim=True)),
                                ("L2Norm", ct.L2Norm(), lambda x: x / x.norm(2, 1, keepdim=True))):
            yield (f"{label} {rows}x{cols} step", lambda mod=mod, x=x, g=g: mod(x).backward(g),
                   "eager step", lambda ref=ref, x=x, g=g: ref(x).backward(g))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cupykern.benchmarks.overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500, help="back-to-back calls per figure")
    ap.add_argument("--steps", action="store_true", help="instead of the calls: the training "
                    "steps of the host-time targets (linear, GemmScaleBatchNorm, L1/L2Norm)")
    args = ap.parse_args(argv)
    require_gpu()
    import torch

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'call':<50} {'ours us':>8} {'baseline':>16} {'us':>8} {'extra':>6} {'ratio':>6}")
    for label, ours, base_name, base in (step_targets() if args.steps else rows()):
        t_o, t_b = paired_us(ours, base, args.calls)
        print(f"{label:<50} {t_o:>8.1f} {base_name:>16} {t_b:>8.1f} {t_o - t_b:>+6.1f} "
              f"{t_b / t_o:>5.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
