"""Benchmark l1_normalize / l2_normalize: ``python -m cupykern.benchmarks.normalize [--quick]``,
or the envelope sweep ``--sweep [--quick] [--json PATH]`` (every row-length family, forward
and forward + backward, float32 and bfloat16, against PyTorch eager, torch.compile and the
same-run copy), or ``--tune`` (the dispatcher's alternatives at its boundaries).

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
import json
import os
import subprocess
import sys
import tempfile

import cupykern
from cupykern import normalize
from cupykern.benchmark import (SWEEP_SECONDS, compiled, copy_ms, graph_us, print_rows,
                                require_gpu, summarize, sweep_row, time_each, time_ms, torch,
                                write_sweep)

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


# ---- The envelope sweep (the envelope grid: every row-length family, and extra shapes).
GRID = ((1, 4194304), (3, 2000001), (2000000, 5), (524288, 16), (131072, 100), (65536, 512),
        (8192, 768), (1024, 1024), (300, 50000), (100000, 300), (2, 65535), (32768, 65535))
# (few long rows larger than L2: 8x4194304, 4x8388608 and 2x16777216 float32 are 128 MB)
EXTRA = ((262144, 7), (1048576, 32), (1, 1048576), (8, 4194304), (4, 8388608), (2, 16777216),
         (65536, 256))
QUICK = ((262144, 7), (2000000, 5), (1048576, 32), (65536, 256), (100000, 300), (1024, 1024),
         (2, 65535), (1, 1048576), (3, 2000001), (8, 4194304))
HUGE = (32768, 65535)  # 8.6 GB in float32: optional in quick mode (--huge)
BIG = 64 * 2**20  # from this many bytes of x, the copy-time targets apply
_DTYPES = ("float32", "bfloat16")


def _warm(point):
    """Compile (torch.compile, forward and forward + backward) one sweep point in a worker
    process, filling the on-disk compile caches the sweep then hits."""
    shape, dtype, kind = point
    x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))
    c = compiled(REF[kind])
    c(x)
    xr = x.requires_grad_()
    torch.autograd.grad(c(xr), xr, torch.ones_like(x))
    return point


def warm_compiles(points, workers):
    """torch.compile of every point's reference, ``workers`` processes at once (compiles are
    CPU-bound; the sweep's own compiles then load from the caches)."""
    import concurrent.futures
    import multiprocessing

    if workers < 2 or not points:
        return
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as ex:
        for _ in ex.map(_warm, points):
            pass


def sweep_shape(shape, dtype, iters, rows):
    """Forward, forward + backward (and, from BIG bytes, backward alone) of L1 and L2 at one
    shape and dtype: sweep rows with host time included (ours, eager and compiled timed in
    the same rounds, time_each) and, below BIG, the GPU time alone (graph_us)."""
    x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))
    g = torch.randn_like(x)
    big = x.numel() * x.element_size() >= BIG
    copy = copy_ms(x, iters)
    timed = lambda *fns: time_each(fns, iters=iters, seconds=SWEEP_SECONDS)  # noqa: E731
    for kind in REF:
        p = normalize.P[kind]
        f, e, c = ours(kind), REF[kind], compiled(REF[kind])
        extra = {}
        if not big:
            extra = {"graph_us": graph_us(lambda: f(x)), "eager_graph_us": graph_us(lambda: e(x))}
            try:
                extra["compile_graph_us"] = graph_us(lambda: c(x))
            except Exception:  # (a compiled function that does not capture: no figure)
                torch.cuda.synchronize()
        t, te, tc = timed(*(lambda fn=fn: fn(x) for fn in (f, e, c)))
        rows.append(sweep_row(f"{kind}_normalize", shape, dtype, "forward", t, te, tc, copy,
                              "copy", **extra))
        xr = x.detach().requires_grad_()
        t, te, tc = timed(*(lambda fn=fn: torch.autograd.grad(fn(xr), xr, g) for fn in (f, e, c)))
        rows.append(sweep_row(f"{kind}_normalize", shape, dtype, "forward+backward", t, te, tc,
                              2.5 * copy, "2.5x copy"))
        if big:  # the backward alone against its ceiling (reads x and dy, writes dx)
            ye = e(xr)
            t, te = timed(lambda: normalize.normalize_backward(x, g, p, 1),
                          lambda: torch.autograd.grad(ye, xr, g, retain_graph=True))
            rows.append(sweep_row(f"{kind}_normalize", shape, dtype, "backward", t, te, None,
                                  1.5 * copy, "1.5x copy"))
            del ye
        del xr
        print_rows(rows[-3 if big else -2:])
    del x, g
    torch.cuda.empty_cache()


def envelope(quick, huge, iters, json_path, workers, command, warm_only=False):
    shapes = QUICK if quick else GRID[:-1] + EXTRA
    if huge or not quick:
        shapes = shapes + (HUGE,)
    points = [(s, d, k) for s in shapes if s != HUGE for d in _DTYPES for k in REF]
    warm_compiles(points, workers)
    if warm_only:
        return
    rows = []
    for shape in shapes:
        for dtype in _DTYPES:
            sweep_shape(shape, dtype, iters, rows)
        if json_path:  # the rows so far (a cut-off run keeps them)
            with open(json_path, "w") as f:
                json.dump({"rows": rows}, f)
    print("\n== sweep (time_ms: host included; x ceil: ratio to the same-run ceiling)")
    print_rows(rows)
    summarize(rows)
    slow = [r for r in rows if r["x_eager"] < 1 or (r["x_compile"] or 2) < 1]
    print(f"\n{len(slow)} of {len(rows)} points under 1.0x eager or compile:")
    for r in slow:
        print(f"  {r['op']} {r['shape']} {r['dtype']} {r['mode']}: x eager {r['x_eager']:.2f}, "
              f"x compile {r['x_compile'] or float('nan'):.2f}; GPU us: ours {r.get('graph_us', float('nan')):.1f}, "
              f"eager {r.get('eager_graph_us', float('nan')):.1f}, compile "
              f"{r.get('compile_graph_us', float('nan')):.1f}")
    if json_path:
        write_sweep(json_path, rows, command)


# ---- The dispatcher's alternatives: GPU time (graph_us) and host-included time per
# configuration at shapes on either side of its boundaries.
_FEW_ROWS = ((-2,), (-3,)) + tuple((-2,) + c for c in normalize.RESIDENT_TUNING)
TUNE = (((262144, 7), "float32", ((0, 4, 2, 4, False), (0, 8, 1, 4, False), (0, 2, 4, 4, False))),
        ((2000000, 5), "bfloat16", ((0, 4, 2, 4, False), (0, 8, 1, 4, False), (0, 2, 4, 4, False))),
        ((524288, 16), "bfloat16", ((0, 2, 1, 8, True), (0, 2, 1, 2, True), (0, 4, 1, 4, True),
                                    (0, 4, 1, 8, True), (0, 8, 1, 4, True), (0, 8, 1, 8, True),
                                    (0, 8, 2, 4, False))),
        ((524288, 16), "float32", ((0, 4, 1, 4, True), (0, 4, 1, 2, True), (0, 4, 1, 8, True),
                                   (0, 8, 1, 4, True), (0, 8, 1, 8, True), (0, 16, 1, 2, True))),
        ((1048576, 32), "float32", ((0, 8, 1, 4, True), (0, 8, 1, 2, True), (0, 8, 1, 8, True),
                                    (0, 16, 1, 2, True), (0, 32, 1, 2, True))),
        ((1048576, 32), "bfloat16", ((0, 4, 1, 4, True), (0, 4, 1, 2, True))),
        ((131072, 100), "float32", ((0, 32, 1, 2, True), (0, 32, 2, 2, True))),
        ((65536, 256), "bfloat16", ((0, 32, 1, 2, True), (0, 32, 2, 2, True), (1, 128, 4))),
        ((100000, 300), "bfloat16", ((0, 32, 2, 2, True), (0, 32, 4, 1, True))),
        ((65536, 512), "float32", ((0, 32, 4, 1, True), (0, 32, 8, 1, True), (1, 128, 4))),
        ((8192, 768), "float32", ((0, 32, 8, 1, True), (1, 128, 4))),
        ((16384, 1024), "float32", ((0, 32, 8, 1, True), (1, 128, 4))),
        ((1, 262144), "float32", ((-1, 1024), (-2,))),
        ((1, 1048576), "float32", ((-1, 1024), (-1, 2048), (-1, 4096), (-2,))),
        ((1, 4194304), "float32", ((-1, 1024), (-1, 4096), (-2,))),
        ((4, 2097152), "bfloat16", ((-1, 1024), (-2,))),
        ((8, 1048576), "float32", ((-1, 1986), (-2,))),
        ((4, 4194304), "float32", ((-1, 3972),) + _FEW_ROWS),
        ((8, 4194304), "float32", ((-1, 7944), (-1, 32768)) + _FEW_ROWS),
        ((7, 3381554), "float32", ((-1, 5599),) + _FEW_ROWS),
        ((11, 2312175), "float32", ((-1, 6022),) + _FEW_ROWS),
        ((8, 4194304), "bfloat16", ((-1, 3972),) + _FEW_ROWS),
        ((4, 8388608), "float32", ((-1, 7944),) + _FEW_ROWS),
        ((16, 4194304), "float32", ((-1, 15888),) + _FEW_ROWS),
        ((1, 33554432), "float32", ((-1, 7944),) + _FEW_ROWS))


def tune(iters):
    print("\n== tuning: per configuration, GPU us (graph replay) and host-included us; "
          "backward GPU us")
    for shape, dtype, configs in TUNE:
        x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))
        g = torch.randn_like(x)
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        picked = normalize._route(shape[0], shape[1], dtype, 90, sm)
        copy = graph_us(lambda: x.clone())
        print(f"{shape} {dtype}: dispatcher {picked}, clone {copy:.1f} us")
        for cfg in configs:
            try:
                f = ours("l2", cfg)
                gu, tm = graph_us(lambda: f(x)), time_ms(lambda: f(x), iters=iters) * 1e3
                bu = (float("nan") if cfg[0] in (-2, -3) else  # (the few-rows kernels' forward)
                      graph_us(lambda: normalize.normalize_backward(x, g, 2, 1, cfg)))
                print(f"  {str(cfg):<24} fwd {gu:8.1f} us ({gu / copy:.2f}x clone), host incl. "
                      f"{tm:8.1f} us; bwd {bu:8.1f} us", flush=True)
            except Exception as exc:  # a config the row does not fit: say so, go on
                print(f"  {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
        del x, g
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m cupykern.benchmarks.normalize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4096 rows instead of 32768")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    ap.add_argument("--training-only", action="store_true", help="only the training figures")
    ap.add_argument("--sweep", action="store_true", help="the envelope sweep (the envelope grid: every row-length family)")
    ap.add_argument("--huge", action="store_true", help="with --sweep --quick: add 32768x65535")
    ap.add_argument("--json", metavar="PATH", help="with --sweep: write the rows as JSON")
    ap.add_argument("--workers", type=int, default=8,
                    help="with --sweep: processes compiling the torch.compile baselines first")
    ap.add_argument("--warm-only", action="store_true",
                    help="with --sweep: only compile the torch.compile baselines (fills the caches)")
    ap.add_argument("--tune", action="store_true", help="the dispatcher's alternatives")
    args = ap.parse_args(argv)
    require_gpu()
    print(f"GPU: {torch.cuda.get_device_name()}")
    if args.sweep or args.tune:
        if args.tune:
            tune(args.iters)
        if args.sweep:
            command = "python -m cupykern.benchmarks.normalize " + " ".join(sys.argv[1:] if argv is None else argv)
            envelope(args.quick, args.huge, args.iters, args.json, args.workers, command,
                     args.warm_only)
        return
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
