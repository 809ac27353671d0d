"""Benchmark l1_normalize / l2_normalize: ``python -m cupykern.benchmarks.normalize [--quick]``.

Byte model: one read of x and one write of y (2 * x.nbytes), against the
same-run ceiling ``y.copy_(x)`` on the same tensor. Targets: <= 1.08x
copy time in every dtype at 32768x65535; at the small shapes, no slower than
PyTorch eager with host overhead included.
Training (float32, same shape): the backward reads x and dy and writes dx, so its
ceiling is 1.5x the copy time; targets <= 1.15x that ceiling, and forward + backward
>= 2.0x PyTorch eager.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import cupykern
from cupykern import normalize
from cupykern.benchmark import copy_ms, require_gpu, time_ms, torch

REF = {
    "l1": lambda x: x / torch.mean(torch.abs(x), dim=1, keepdim=True),
    "l2": lambda x: x / torch.norm(x, p=2, dim=1, keepdim=True),
}


def ours(kind, config=None):
    return lambda x: getattr(cupykern, f"{kind}_normalize")(x, config=config)


def big(shape, dtypes, iters):
    print(f"\n== {shape[0]}x{shape[1]}: ms (ratio to same-run copy time; lower is better)")
    print(f"{'kind':<4} {'dtype':<9} {'copy':>7} {'cupykern':>15} {'eager':>15} {'compile':>15} "
          f"{'x eager':>8} {'x comp':>7}")
    for dtype in dtypes:
        x = torch.rand(shape, device="cuda").to(dtype)
        copy = copy_ms(x, iters)
        for kind in REF:
            t = time_ms(lambda: ours(kind)(x), iters=iters)
            e = time_ms(lambda: REF[kind](x), iters=iters)
            c = time_ms(lambda f=torch.compile(REF[kind]): f(x), iters=iters)
            print(f"{kind:<4} {str(dtype)[6:]:<9} {copy:>7.3f} {t:>8.3f} ({t / copy:.2f}x) "
                  f"{e:>8.3f} ({e / copy:.2f}x) {c:>8.3f} ({c / copy:.2f}x) {e / t:>8.2f} {c / t:>7.2f}",
                  flush=True)
        del x
        torch.cuda.empty_cache()


def sweep(shape, dtype, iters):
    """Kernel configurations at the main shape (capacity >= a row's 16-byte vectors)."""
    x = torch.rand(shape, device="cuda").to(dtype)
    copy = copy_ms(x, iters)
    print(f"\n== config sweep, {shape[0]}x{shape[1]} {str(dtype)[6:]}, l2 (ratio to copy {copy:.3f} ms)")
    isz = x.element_size()
    nvec = shape[1] // (16 // isz)
    for cfg in normalize.CONFIGS[isz] + normalize.TUNING_CONFIGS[isz]:
        if cfg[0] * cfg[1] * cfg[2] >= nvec:
            t = time_ms(lambda: ours("l2", cfg)(x), iters=iters)
            pf = "" if len(cfg) < 4 or cfg[3] else ", no prefetch"
            print(f"  cluster {cfg[0]} x {cfg[1]} threads x {cfg[2]} vec{pf}: {t:.3f} ms ({t / copy:.3f}x)",
                  flush=True)
    del x


def training(shape, iters):
    """The fused backward against its ceiling, and forward + backward against eager."""
    print(f"\n== training, {shape[0]}x{shape[1]} float32: ms (backward: ratio to its ceiling, "
          "1.5x copy time; forward + backward: speedup)")
    x = torch.rand(shape, device="cuda")
    g = torch.rand_like(x)
    ceiling = 1.5 * copy_ms(x, iters)
    xr = x.requires_grad_()

    def step(f):
        return lambda: torch.autograd.grad(f(xr), xr, g)

    nvec = shape[1] // 4
    tables = normalize.BACKWARD_CONFIGS[4] + normalize.CONFIGS[4] + normalize.TUNING_CONFIGS[4]
    for cfg in dict.fromkeys(normalize._kernel_of(c) for c in tables):
        if cfg[0] * cfg[1] * cfg[2] >= nvec:
            b = time_ms(lambda: normalize.normalize_backward(x.detach(), g, 2, 1, cfg), iters=iters)
            pf = "" if cfg[3] else ", no prefetch"
            print(f"  l2 backward, cluster {cfg[0]} x {cfg[1]} threads x {cfg[2]} vec{pf}: {b:.3f} ms "
                  f"({b / ceiling:.3f}x ceiling)", flush=True)
    for kind in REF:
        p = normalize.P[kind]
        b = time_ms(lambda: normalize.normalize_backward(x.detach(), g, p, 1), iters=iters)
        t = time_ms(step(ours(kind)), iters=iters)
        e = time_ms(step(REF[kind]), iters=iters)
        c = time_ms(step(torch.compile(REF[kind])), iters=iters)
        print(f"{kind}: backward {b:.3f} ({b / ceiling:.3f}x ceiling {ceiling:.3f}); fwd+bwd "
              f"cupykern {t:.3f}, eager {e:.3f} ({e / t:.2f}x), compile {c:.3f} ({c / t:.2f}x)",
              flush=True)
    del x, g, xr
    torch.cuda.empty_cache()


def small(shapes, reps=200):
    """Per-call time including host overhead: CUDA events around `reps` back-to-back calls."""
    print("\n== small shapes, per call incl. host overhead (us): cupykern vs eager")
    for shape in shapes:
        x = torch.randn(shape, device="cuda")
        for kind in REF:
            res = []
            for f in (ours(kind), REF[kind]):
                for _ in range(20):
                    f(x)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(reps):
                    f(x)
                e.record()
                e.synchronize()
                res.append(s.elapsed_time(e) * 1e3 / reps)
            print(f"  {kind} {shape}: {res[0]:7.1f} vs eager {res[1]:7.1f}  ({res[1] / res[0]:.2f}x)")


_FIRST_CALL = """
import time, torch
x = torch.rand(16, 16384, device="cuda"); torch.cuda.synchronize()
t0 = time.perf_counter(); import cupykern; t1 = time.perf_counter()
cupykern.l1_normalize(x); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"import {t1 - t0:.3f} s, first call {t2 - t1:.3f} s")
"""


def compile_times():
    print("\n== NVRTC: cold (empty CuPy cache) and warm (disk cache) process start")
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUPY_CACHE_DIR=cache)
        for label in ("cold", "warm"):
            r = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True,
                               text=True)
            print(f"  {label}: {r.stdout.strip() or r.stderr[-500:]}")


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m cupykern.benchmarks.normalize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4096 rows instead of 32768")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    ap.add_argument("--training-only", action="store_true", help="only the training figures")
    args = ap.parse_args(argv)
    require_gpu()
    print(f"GPU: {torch.cuda.get_device_name()}")
    shape = (4096, 65535) if args.quick else (32768, 65535)
    if not args.training_only:
        compile_times()
        small([(16, 16384), (128, 4096)])
        sweep(shape, torch.float32, args.iters)
        sweep(shape, torch.float16, args.iters)
        big(shape, (torch.float32, torch.float16, torch.bfloat16), args.iters)
    training(shape, args.iters)


if __name__ == "__main__":
    main()
