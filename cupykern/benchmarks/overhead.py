"""Host-overhead breakdown of one small l2_normalize call from torch (us per step).

``python -m cupykern.benchmarks.overhead``: where the per-call microseconds go,
next to PyTorch eager's host time for the same expression.
"""
import time

import torch

from cupykern import _array, _loader, normalize


def per_call_us(fn, n=2000):
    for _ in range(100):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    x = torch.randn(16, 16384, device="cuda")
    a = _array.operand(x, "x")
    y = torch.empty_like(x)
    d = _array.operand(y, "out")
    normalize.l2_normalize(x)
    expr = normalize._cluster_expr(2, "float32", normalize._pick_config(16384, "float32", 90))
    fn = _loader.function("normalize.cu", expr, 0)
    args = (_array.scalar(a.ptr, "ptr"), _array.scalar(d.ptr, "ptr")) + tuple(
        _array.scalar(v, "long long") for v in (16, 16384, 16384, 16384))
    steps = {
        "operand(x)": lambda: _array.operand(x, "x"),
        "torch.empty_like": lambda: torch.empty_like(x),
        "_array.empty": lambda: _array.empty(a, a.shape),
        "6 scalar()": lambda: tuple(_array.scalar(v, "long long") for v in (1, 2, 3, 4, 5, 6)),
        "stream_of": lambda: _array.stream_of(a),
        "loader.function": lambda: _loader.function("normalize.cu", expr, 0),
        "launch(fn, args)": lambda: _array.launch(a, fn, (16,), (512,), args),
        "l2_normalize total": lambda: normalize.l2_normalize(x),
        "eager torch (host)": lambda: x / torch.norm(x, p=2, dim=1, keepdim=True),
    }
    for name, f in steps.items():
        print(f"  {name:<22} {per_call_us(f):7.2f} us")
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
