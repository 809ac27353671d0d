"""GEMM and GemmScaleBatchNorm benchmark: ``python -m cupykern.benchmarks.gemm`` (GPU only).

FLOP model: 2*M*N*K; ceiling: the same-run cuBLAS TF32 rate (a third of it for
3xTF32, which does three tensor-core products per output FLOP). Part 1 times
``cupykern.linear`` at 1024x8192 @ (8192x8192)^T in each precision against cuBLAS
through torch in the same run (TF32 off = SGEMM, TF32 on, bf16 inputs for "medium")
and prints the max |error| against a float64 GEMM.
Then linear's backward GEMMs (dx = dy @ W, dW = dy^T @ x; a transpose is read in place
or, where the product is big against it, copied first) at the same shape against
cuBLAS on the same views. Part 3 times GemmScaleBatchNorm (training mode, as the
model is normally called) at
both benchmark shapes, ours at the default precision ("highest") and at "high",
against PyTorch eager and torch.compile at float32 (the baseline of both targets)
and with TF32 allowed; "high" is checked against PyTorch float32 at 1e-2. Part 4 times
its training step (forward + backward) against eager and torch.compile, at float32
for "highest" and with TF32 for "high" (3 GEMMs: FLOP model 3 * 2*M*N*K), in training
mode and in eval mode: timed as every benchmark here (events around one step, host time
included), then by the GPU time of steps replayed from a CUDA graph (no host time: what
a captured training loop, or one whose host runs ahead, sees). Part 5 (``--part
small``) times small grids, where K is split over the SMs, by their GPU time in a CUDA
graph (no host time), against cuBLAS and, for GemmScaleBatchNorm's small shape,
PyTorch eager.

``--problems`` (instead of the parts) times float32 "highest" ``cupykern.matmul`` on the
problems of a peer matrix-multiplication benchmark and on a model's (attention's batched
products), against eager ``torch.matmul`` (SGEMM), with each one's error against float64.

``--sweep`` (instead of the parts) is the envelope: ``linear`` and ``matmul`` (ours as
the dispatcher routes them) against PyTorch eager and torch.compile at float32 "highest"
(PyTorch's is cuBLAS's SGEMM) and "high", bfloat16, float16 and float64 over the
envelope grid, each row with the same-run ceiling (tensor peak or copy bandwidth, whichever
bounds the shape), the route taken and the error against float64 of ours and PyTorch's;
then GemmScaleBatchNorm's forward and training step against eager. ``--json PATH``
writes the rows and the summary (min and median per op, dtype and mode).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import cupykern
from cupykern.benchmark import (SWEEP_SECONDS, compiled, copy_ms, graph_us, print_rows,
                                require_gpu, summarize, sweep_row, tflops, time_each, time_ms,
                                torch, write_sweep)


@contextlib.contextmanager
def matmul_precision(p):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(p)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def bench_gemm(m, n, k, iters):
    torch.manual_seed(0)
    x = torch.rand(m, k, device="cuda")
    w = torch.rand(n, k, device="cuda") / k
    ref64 = x.double() @ w.double().T
    flops = 2 * m * n * k
    print(f"\nGEMM {m}x{k} @ ({n}x{k})^T, float32, {flops / 1e9:.0f} GFLOP")
    print(f"{'precision':<9} {'cupykern ms':>11} {'TFLOP/s':>8} {'cuBLAS ms':>10} {'TFLOP/s':>8} "
          f"{'speedup':>8} {'max|err| ours':>14} {'cuBLAS':>9}")
    xb, wb = x.bfloat16(), w.bfloat16()
    rows = []
    for prec in ("highest", "high", "medium"):
        with matmul_precision(prec):
            ours = lambda: cupykern.linear(x, w, precision=prec)  # noqa: E731
            theirs = (lambda: xb @ wb.T) if prec == "medium" else (lambda: x @ w.T)
            t_ours, t_ref = time_ms(ours, iters=iters), time_ms(theirs, iters=iters)
            e_ours = (ours().double() - ref64).abs().max().item()
            e_ref = (theirs().double() - ref64).abs().max().item()
        rows.append((prec, t_ours, t_ref))
        print(f"{prec:<9} {t_ours:>11.3f} {tflops(flops, t_ours):>8.1f} {t_ref:>10.3f} "
              f"{tflops(flops, t_ref):>8.1f} {t_ref / t_ours:>7.2f}x {e_ours:>14.3e} {e_ref:>9.3e}")
    print(f"(max |ref64| = {ref64.abs().max().item():.1f}; cuBLAS 'medium' = bf16 inputs)")
    # Ceiling: the same-run cuBLAS TF32 rate stands in for the TF32 tensor-core peak;
    # 3xTF32 does three tensor-core products per output FLOP, so its ceiling is a third.
    t = {prec: (ours, ref) for prec, ours, ref in rows}
    peak = tflops(flops, t["high"][1])
    print(f"TF32 ceiling (cuBLAS TF32, same run) {peak:.0f} TFLOP/s: 'high' at "
          f"{100 * tflops(flops, t['high'][0]) / peak:.0f}%, 'highest' at "
          f"{100 * tflops(flops, t['highest'][0]) / (peak / 3):.0f}% of a third of it")
    return rows


def bench_backward(m, n, k, iters):
    """linear's backward GEMMs at the forward's shape, each operand read in place (the
    transposes are views): dx = dy @ W (W N-contiguous in the GEMM's terms) and
    dW = dy^T @ x (both operands transposed), against cuBLAS on the same views."""
    torch.manual_seed(0)
    x = torch.rand(m, k, device="cuda")
    w = torch.rand(n, k, device="cuda") / k
    dy = torch.randn(m, n, device="cuda")
    from cupykern.torch.gemm import mm_op as mm
    print(f"\nlinear backward GEMMs at {m}x{k} @ ({n}x{k})^T, float32 (FLOP model 2*M*N*K each)")
    print(f"{'product':<14} {'precision':<9} {'cupykern ms':>11} {'TFLOP/s':>8} {'cuBLAS ms':>10} "
          f"{'TFLOP/s':>8} {'speedup':>8} {'max|err| ours':>14} {'cuBLAS':>9}")
    flops = 2 * m * n * k
    for name, a, b in (("dx = dy @ W", dy, w), ("dW = dy^T @ x", dy.t(), x)):
        ref64 = a.double() @ b.double()
        for prec in ("highest", "high"):
            with matmul_precision(prec):
                t_ours = time_ms(lambda: mm(a, b, prec), iters=iters)
                t_ref = time_ms(lambda: a @ b, iters=iters)
                e_ours = (mm(a, b, prec).double() - ref64).abs().max().item()
                e_ref = ((a @ b).double() - ref64).abs().max().item()
            print(f"{name:<14} {prec:<9} {t_ours:>11.3f} {tflops(flops, t_ours):>8.1f} "
                  f"{t_ref:>10.3f} {tflops(flops, t_ref):>8.1f} {t_ref / t_ours:>7.2f}x "
                  f"{e_ours:>14.3e} {e_ref:>9.3e}")


def bench_model(case, iters):
    """Ours at "highest" (the default) and "high" against PyTorch at the default float32
    precision (the models' float32 baseline) and, for reference, PyTorch with TF32 allowed."""
    from cupykern.models import gemm_scale_batchnorm as model3

    torch.manual_seed(0)
    ref = model3.Model(*case.init_inputs).cuda()
    torch.manual_seed(0)
    new = model3.ModelNew(*case.init_inputs).cuda()
    comp = torch.compile(ref)  # shares ref's parameters
    x = case.make_inputs("cuda")[0]
    base = {}
    with torch.no_grad():
        for prec in ("highest", "high"):
            with matmul_precision(prec):
                comp(x)  # compile outside the timing
                base[prec] = (time_ms(lambda: ref(x), iters=iters), time_ms(lambda: comp(x), iters=iters))
        expect = ref(x)
    e32, c32 = base["highest"]
    e_tf, c_tf = base["high"]
    print(f"\nGemmScaleBatchNorm {case.label} (training mode), {case.flops / 1e9:.0f} GFLOP")
    print(f"PyTorch float32: eager {e32:.3f} ms, compile {c32:.3f} ms; "
          f"with TF32: eager {e_tf:.3f} ms, compile {c_tf:.3f} ms")
    print(f"{'precision':<9} {'cupykern ms':>11} {'TFLOP/s':>8} {'vs eager':>8} {'vs compile':>10} "
          f"{'vs TF32 eager':>13} {'vs TF32 compile':>15} {'max|diff|':>10}")
    for prec, tol in (("highest", 1e-4), ("high", 1e-2)):
        with matmul_precision(prec), torch.no_grad():
            out = new(x)
            t_new = time_ms(lambda: new(x), iters=iters)
        ok = torch.allclose(out, expect, atol=tol, rtol=tol)  # against PyTorch float32
        diff = (out - expect).abs().max().item()
        print(f"{prec:<9} {t_new:>11.3f} {tflops(case.flops, t_new):>8.1f} {e32 / t_new:>7.2f}x "
              f"{c32 / t_new:>9.2f}x {e_tf / t_new:>12.2f}x {c_tf / t_new:>14.2f}x {diff:>10.2e}"
              f" {'pass' if ok else 'FAIL'} {tol:g}")


def bench_training(case, iters):
    """A GemmScaleBatchNorm training step (forward + backward of out.backward(g), every
    parameter and x requiring grad) against PyTorch eager and torch.compile of the same
    step: ours "highest" against PyTorch float32, ours "high" against PyTorch TF32; with
    the model in training mode (batch statistics), then in eval mode (running ones)."""
    from cupykern.models import gemm_scale_batchnorm as model3

    torch.manual_seed(0)
    ref = model3.Model(*case.init_inputs).cuda()
    torch.manual_seed(0)
    new = model3.ModelNew(*case.init_inputs).cuda()
    comp = torch.compile(ref)
    x = case.make_inputs("cuda")[0].requires_grad_()
    g = torch.randn(x.shape[0], ref.gemm.out_features, device="cuda")
    models = (ref, new)

    def step(m):
        return lambda: m(x).backward(g)

    def clear():
        x.grad = None
        for m in models:
            for p in m.parameters():
                p.grad = None

    def graphed(m):  # a step with fresh gradients, as captured: GPU time alone
        def run():
            clear()
            step(m)()
        return run

    print(f"\nGemmScaleBatchNorm {case.label} training step (forward + backward), "
          f"{3 * case.flops / 1e9:.0f} GFLOP (three GEMMs); then the GPU time of the same "
          "steps replayed from a CUDA graph (no host time), ms")
    print(f"{'mode':<5} {'precision':<9} {'cupykern ms':>11} {'eager ms':>9} {'compile ms':>10} "
          f"{'vs eager':>8} {'vs compile':>10} {'max|dW diff|/max|dW|':>21} | {'graph: ours':>11} "
          f"{'eager':>6} {'compile':>7} {'vs eager':>8} {'vs compile':>10}")
    for mode, prec in (("train", "highest"), ("train", "high"), ("eval", "highest"), ("eval", "high")):
        new.load_state_dict(ref.state_dict())  # the same running statistics (eval mode)
        for m in models:
            m.train(mode == "train")
        with matmul_precision(prec):
            step(comp)()  # compile outside the timing
            t_e, t_c, t_n = (time_ms(step(m), iters=iters, setup=clear) for m in (ref, comp, new))
            clear()
            step(ref)()
            step(new)()
            rel = ((new.gemm.weight.grad - ref.gemm.weight.grad).abs().max()
                   / ref.gemm.weight.grad.abs().max()).item()
            # each twice, in mirrored order (clocks drift under minutes of load): the faster
            order = (ref, comp, new, new, comp, ref)
            times = [graph_us(graphed(m), calls=4) / 1e3 for m in order]
            g_e, g_c, g_n = (min(times[i], times[5 - i]) for i in range(3))
            clear()
        print(f"{mode:<5} {prec:<9} {t_n:>11.3f} {t_e:>9.3f} {t_c:>10.3f} {t_e / t_n:>7.2f}x "
              f"{t_c / t_n:>9.2f}x {rel:>21.2e} | {g_n:>11.3f} {g_e:>6.3f} {g_c:>7.3f} "
              f"{g_e / g_n:>7.2f}x {g_c / g_n:>9.2f}x")


def bench_small():
    """Small grids (a few output tiles, K split over the SMs): GPU time per call."""
    print("\nSmall grids, GPU us per call (CUDA graph, no host time), against cuBLAS:")
    print(f"{'x @ W^T':<22} {'precision':<9} {'ours us':>8} {'TFLOP/s':>8} {'cuBLAS us':>10} "
          f"{'speedup':>8}")
    for m, n, k in ((128, 512, 1024), (128, 1024, 4096), (512, 512, 8192), (1024, 512, 384)):
        torch.manual_seed(0)
        x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda") / k ** 0.5
        for prec in ("highest", "high"):
            with matmul_precision(prec):
                ours = graph_us(lambda: cupykern.linear(x, w, precision=prec))
                theirs = graph_us(lambda: x @ w.T)
            print(f"{f'{m}x{k} @ ({n}x{k})^T':<22} {prec:<9} {ours:>8.1f} "
                  f"{2 * m * n * k / ours / 1e6:>8.1f} {theirs:>10.1f} {theirs / ours:>7.2f}x")
    from cupykern.models import gemm_scale_batchnorm as model3

    torch.manual_seed(0)
    ours_m = model3.ModelNew(1024, 512, (512,)).cuda()
    torch.manual_seed(0)
    ref_m = model3.Model(1024, 512, (512,)).cuda()
    x = torch.randn(128, 1024, device="cuda")
    with torch.no_grad():
        for mode in ("train", "eval"):
            ours_m.train(mode == "train")
            ref_m.train(mode == "train")
            ours, eager = graph_us(lambda: ours_m(x)), graph_us(lambda: ref_m(x))
            print(f"GemmScaleBatchNorm 128x1024->512 {mode}: {ours:.1f} us, eager {eager:.1f} us, "
                  f"{eager / ours:.2f}x")


# The envelope grid, (M, K, N): x (M, K) @ W (N, K)^T for linear, a (M, K) @ b (K, N)
# for matmul; then matmul's batched (32, 512, 64) @ (32, 64, 512).
GRID = [(2048, 2048, 2048), (6144, 6144, 6144), (3000, 5000, 700), (512, 512, 512),
        (1536, 768, 3072), (16, 8192, 8192), (4, 2048, 2048), (1, 8192, 1024),
        (256, 12288, 4096), (8192, 2048, 64), (100000, 64, 64), (8192, 1024, 50257)]
BATCHED = ((32, 512, 64), (32, 64, 512))
# (dtype, precision): float32 at both of PyTorch's float32 matmul precisions, then the
# other dtypes (precision ignored)
MODES = [("float32", "highest"), ("float32", "high"), ("bfloat16", None), ("float16", None),
         ("float64", None)]


def _peaks(quick):
    """Same-run ceilings: cuBLAS's matrix rate per (dtype, precision) at a big square
    product (3xTF32 "highest": a third of the TF32 rate, the tensor-core work it does),
    and the device copy bandwidth (bytes/ms)."""
    n = 4096 if quick else 8192
    peaks = {}
    for dtype, prec in MODES[1:]:
        a = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
        with matmul_precision(prec or "highest"):
            peaks[dtype, prec] = 2 * n ** 3 / time_ms(lambda: a @ a, iters=5)
    peaks["float32", "highest"] = peaks["float32", "high"] / 3
    x = torch.empty(2 ** 28, dtype=torch.uint8, device="cuda")
    bw = 2 * x.nbytes / copy_ms(x, iters=5)
    return peaks, bw


def _operands(op, shape, dtype):
    """(our call's arguments, PyTorch's function, the float64 reference, the problem's
    M, K, N and batch) for one sweep point: fresh random data, weights scaled by
    1/sqrt(K)."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    if op == "matmul" and shape == BATCHED:
        (B, M, K), (_, _, N) = shape
        a = torch.randn(B, M, K, device="cuda", dtype=dt)
        b = (torch.randn(B, K, N, device="cuda") / K ** 0.5).to(dt)
        return (a, b), torch.matmul, a.double() @ b.double(), (M, K, N, B)
    M, K, N = shape
    x = torch.randn(M, K, device="cuda", dtype=dt)
    w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(dt)
    if op == "linear":
        b = torch.randn(N, device="cuda", dtype=dt)
        ref = torch.addmm(b.double(), x.double(), w.double().T)
        return (x, w, b), torch.nn.functional.linear, ref, (M, K, N, 1)
    wt = w.T.contiguous()
    return (x, wt), torch.matmul, x.double() @ wt.double(), (M, K, N, 1)


def _sweep_point(op, shape, dtype, prec, peaks, bw, iters, compile_, paths):
    """One row: ours (the dispatcher's choice), PyTorch eager and torch.compile at the same
    precision, host time included; the ceiling; each one's max error against float64
    over max |reference|; with ``paths`` (float32) also our kernel forced (ours_ms)."""
    from cupykern import gemm_route

    args, theirs, ref, (M, K, N, B) = _operands(op, shape, dtype)
    fn = getattr(cupykern, op)
    ours = lambda: fn(*args, precision=prec)  # noqa: E731
    with matmul_precision(prec or "highest"):
        eager = lambda: theirs(*args)  # noqa: E731
        fns = [ours, eager]
        if compile_:  # (timed in the same rounds: a big product's clocks drift by ~10%)
            torch.compiler.reset()  # (one code object for every point: under the recompile limit)
            comp = compiled(lambda *a: theirs(*a))
            comp(*args)
            fns.append(lambda: comp(*args))
        t_ours, t_eager, *t_comp = time_each(fns, iters=iters, seconds=SWEEP_SECONDS)
        t_comp = t_comp[0] if t_comp else None
        scale = ref.abs().max().item() or 1.0
        err = {k: ((f().double() - ref).abs().max().item() / scale) for k, f in
               (("err_ours", ours), ("err_torch", eager))}
        extra = {}
        if paths and dtype == "float32":
            with gemm_route.forced_route(gemm_route.OURS):
                extra["ours_ms"] = time_ms(ours, iters=iters)
                extra["err_ours_kernel"] = (ours().double() - ref).abs().max().item() / scale
        if prec == "highest":
            extra["x_sgemm"] = t_eager / t_ours  # PyTorch's "highest" is cuBLAS's SGEMM
        extra["route"] = _route_name(op, args, prec)  # (under the precision's TF32 switch)
    del ref
    isz = torch.finfo(getattr(torch, dtype)).bits // 8
    t_math = 2 * B * M * N * K / peaks[dtype, prec]
    t_bytes = isz * B * (M * K + K * N + M * N) / bw
    label = "x".join(map(str, (M, K, N))) + (f" b{B}" if B > 1 else "")
    return sweep_row(op, label, dtype, prec or "-", t_ours, t_eager, t_comp,
                     max(t_math, t_bytes), "tensor peak" if t_math >= t_bytes else "copy",
                     **err, **extra)


# GemmScaleBatchNorm's envelope (M, in, out) shapes: its forward and training step.
GSBN_GRID = [(64, 512, 512), (128, 1024, 512), (256, 4096, 4096), (2048, 2048, 2048),
             (8192, 1024, 1024), (1024, 8192, 8192), (16384, 4096, 4096)]


# GemmScaleBatchNorm's modes (dtype, precision): float32 at torch's "highest" / "high",
# float32 model and inputs under bfloat16 autocast (PyTorch's Linear then runs in bf16,
# BatchNorm in float32; ours keeps float32 with a TF32 GEMM, or runs PyTorch's own
# composition for big products: cupykern.torch.gemm_scale_batchnorm.AUTOCAST_VENDOR_WORK),
# and the model converted to each other dtype.
AUTOCAST = "bf16-autocast"
GSBN_MODES = [("float32", "highest"), ("float32", "high"), ("float32", AUTOCAST),
              *((dtype, None) for dtype, _ in MODES[2:])]


def _gsbn_point(kind, shape, dtype, prec, peaks, bw, iters):
    """GemmScaleBatchNorm (training mode) against the PyTorch model, eager: the forward
    (no grad) or a training step (forward + backward of every parameter and x), both
    models in ``dtype`` at float32 ``prec`` (or AUTOCAST); errors against the model run
    in float64 (forward output; step: dW)."""
    import copy

    from cupykern.models import gemm_scale_batchnorm as model3

    M, K, N = shape
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    ref = model3.Model(K, N, (N,)).cuda().to(dt)
    torch.manual_seed(0)
    new = model3.ModelNew(K, N, (N,)).cuda().to(dt)
    ref64 = copy.deepcopy(ref).double()
    x = torch.rand(M, K, device="cuda", dtype=dt, requires_grad=kind == "step")
    g = torch.randn(M, N, device="cuda", dtype=dt)
    x64 = x.detach().double().requires_grad_(kind == "step")
    models = (ref, new, ref64)
    region = (lambda: torch.autocast("cuda", torch.bfloat16)) if prec == AUTOCAST else contextlib.nullcontext

    def clear():
        x.grad = x64.grad = None
        for m in models:
            for p in m.parameters():
                p.grad = None

    def run(m, xi):
        if m is ref64:
            return m(xi)
        with region():
            return m(xi)

    with matmul_precision(prec if prec in ("highest", "high") else "highest"):
        if kind == "forward":
            with torch.no_grad():
                t_new, t_ref = time_each([lambda m=m: run(m, x) for m in (new, ref)], iters=iters,
                                         seconds=SWEEP_SECONDS)
                want = ref64(x64)
                err = {k: ((run(m, x).double() - want).abs().max() / want.abs().max()).item()
                       for k, m in (("err_ours", new), ("err_torch", ref))}
        else:
            t_new, t_ref = time_each([lambda m=m: run(m, x).backward(g) for m in (new, ref)],
                                     iters=iters, setup=clear, seconds=SWEEP_SECONDS)
            clear()
            for m, xi, gi in ((new, x, g), (ref, x, g), (ref64, x64, g.double())):
                run(m, xi).backward(gi)
            want = ref64.gemm.weight.grad
            err = {k: ((m.gemm.weight.grad.double() - want).abs().max() / want.abs().max()).item()
                   for k, m in (("err_ours", new), ("err_torch", ref))}
            clear()
    work = (1 if kind == "forward" else 3) * 2 * M * N * K
    t_math = work / peaks[dtype, "high" if prec == AUTOCAST else prec]
    isz = torch.finfo(dt).bits // 8
    t_bytes = isz * (M * K + N * K + M * N) * (1 if kind == "forward" else 3) / bw
    return sweep_row(f"gsbn {kind}", f"{M}x{K}->{N}", dtype, prec or "-", t_new, t_ref, None,
                     max(t_math, t_bytes), "tensor peak" if t_math >= t_bytes else "copy",
                     route=_gsbn_route(x, new.gemm.weight, prec, region, kind == "step"), **err)


def _gsbn_route(x, w, prec, region, grad):
    """How ours ran: "fused" (our GEMM and epilogue), "vendor+bn" (the vendor's GEMM, our
    BatchNorm passes) or "torch" (PyTorch's composition: big products under autocast), for
    the forward of a training step if ``grad``."""
    from cupykern import gemm_checks, gemm_route
    from cupykern._array import operand
    from cupykern.torch import gemm_scale_batchnorm as tgsbn

    with region():
        if tgsbn._autocast_vendor(x, w):
            return "torch"
    precision = prec if prec in gemm_checks.PRECISIONS else "high"
    vendor = gemm_route.fused_vendor(operand(x, "x"), operand(w, "w"), precision, grad=grad)
    return "vendor+bn" if vendor else "fused"


def _route_name(op, args, prec):
    """The dispatcher's choice for this call (first matrix of a stack)."""
    from cupykern import gemm, gemm_route
    from cupykern._array import operand

    a, b = args[0], args[1]
    if op == "linear":
        return gemm_route.route_of(operand(a, "x"), operand(b, "w"), prec or "highest")
    return gemm._matmul_route(operand(a, "a"), operand(b, "b"), prec or "highest")


def sweep(quick, json_path, paths, budget_s, ops, command):
    """The envelope sweep: linear and matmul over GRID and MODES (matmul also BATCHED),
    against PyTorch eager and (linear, without --quick) torch.compile; then
    GemmScaleBatchNorm's forward and training step over GSBN_GRID and GSBN_MODES against
    eager; ``ops``: which of the three to run; ``command``: the command line the JSON
    records."""
    peaks, bw = _peaks(quick)
    print(f"ceilings: copy {bw / 1e9:.2f} TB/s; " + ", ".join(
        f"{d} {p or ''} {r / 1e9:.0f} TFLOP/s" for (d, p), r in peaks.items()))
    iters = 5 if quick else 15
    start, rows = time.monotonic(), []
    points = [("linear", s) for s in GRID] + [("matmul", s) for s in GRID + [BATCHED]]
    todo = [(op, shape, dtype, prec) for op, shape in points for dtype, prec in MODES]
    todo += [(f"gsbn {kind}", shape, dtype, prec) for kind in ("forward", "step")
             for shape in GSBN_GRID for dtype, prec in GSBN_MODES]
    todo = [t for t in todo if t[0].split()[0] in ops]
    for i, (op, shape, dtype, prec) in enumerate(todo):
        if time.monotonic() - start > budget_s:
            print(f"(time budget of {budget_s} s spent: {len(todo) - i} points not run)")
            break
        if op.startswith("gsbn"):
            rows.append(_gsbn_point(op[5:], shape, dtype, prec, peaks, bw, iters))
        else:
            rows.append(_sweep_point(op, shape, dtype, prec, peaks, bw, iters,
                                     not quick and op == "linear", paths))
        r = rows[-1]
        print(f"{r['op']:<12} {r['shape']:<22} {r['dtype']:<9} {r['mode']:<8} {r['route']:<6} "
              f"ours {r['ms']:.4f} eager {r['eager_ms']:.4f} x{r['x_eager']:.2f}"
              + (f" comp x{r['x_compile']:.2f}" if r["x_compile"] else "")
              + f" ceil x{r['x_ceiling']:.2f} err {r['err_ours']:.1e}/{r['err_torch']:.1e}"
              + (f" kernel {r['ours_ms']:.4f} ({r['eager_ms'] / r['ours_ms']:.2f}x)"
                 if "ours_ms" in r else ""), flush=True)
        torch.cuda.empty_cache()
    print(f"\n{len(rows)} of {len(todo)} points in {time.monotonic() - start:.0f} s")
    print_rows(rows)
    if json_path:
        write_sweep(json_path, rows, command)
    else:
        summarize(rows)


# The off-grid survey's dtypes / precisions (as MODES) and its shapes' ranges (log-uniform
# M, K, N; at most SURVEY_MAX_WORK multiply-adds, float64 at most 2**31).
SURVEY_RANGES, SURVEY_MAX_WORK = ((1, 20000), (8, 8192), (8, 16384)), 2 ** 33
# Tall, narrow products the random shapes do not reach, for GemmScaleBatchNorm's training
# step: a million rows and more, N from 2 (the backward's row passes side by side).
SURVEY_TALL = ((4194305, 3, 2), (1000000, 32, 8), (200000, 64, 16), (100000, 64, 512))


def survey_shapes(seed: int, count: int = 40) -> list:
    """``count`` random (M, K, N) of the survey (:func:`survey`), reproducible by seed:
    off the grid, K and N mostly unaligned (three in four K are not a multiple of 4)."""
    import math
    import random

    rng = random.Random(seed)
    shapes = []
    while len(shapes) < count:
        M, K, N = (int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
                   for lo, hi in SURVEY_RANGES)
        if M * N * K <= SURVEY_MAX_WORK:
            shapes.append((M, K, N))
    return shapes


def survey(seed: int, below: float = 0.97) -> None:
    """GPU time alone (CUDA graphs of 50 calls, 10 of a training step), ours against
    eager, at random shapes: linear in every dtype / precision of MODES,
    GemmScaleBatchNorm's training-mode forward (25 of them, at least 2 rows) and its
    training step (those and SURVEY_TALL). Prints each point under ``below`` (linear's
    with its route), and the minimum and median per mode. (What a captured loop sees;
    the sweep's figures include host time.)"""
    from cupykern.models import gemm_scale_batchnorm as model3

    shapes = survey_shapes(seed)

    def report(what, ratios):
        ratios.sort()
        print(f"{what}: {len(ratios)} shapes, min {ratios[0]:.2f} median "
              f"{ratios[len(ratios) // 2]:.2f}", flush=True)

    _survey_linear(shapes, below, lambda ours, eager: (graph_us(ours), graph_us(eager)), "")
    for step in (False, True):
        what = "gsbn step" if step else "gsbn forward"
        for dt, prec in MODES[:3] + MODES[4:]:
            torch.backends.cuda.matmul.allow_tf32 = prec == "high"
            ratios = []
            for M, K, N in shapes[:25] + (list(SURVEY_TALL) if step else []):
                M, d = max(M, 2), getattr(torch, dt)
                if dt == "float64" and M * N * K > 2 ** 31:
                    continue
                torch.manual_seed(0)
                ref = model3.Model(K, N, (N,)).cuda().to(d)
                torch.manual_seed(0)
                new = model3.ModelNew(K, N, (N,)).cuda().to(d)
                x = torch.randn(M, K, device="cuda", dtype=d, requires_grad=step)
                if step:
                    g = torch.randn(M, N, device="cuda", dtype=d)
                    ours, eager = (graph_us(lambda m=m: m(x).backward(g), calls=10)
                                   for m in (new, ref))
                else:
                    with torch.no_grad():
                        ours, eager = graph_us(lambda: new(x)), graph_us(lambda: ref(x))
                ratios.append(eager / ours)
                if ratios[-1] < below:
                    print(f"{what} {M}x{K}->{N} {dt} {prec}: ours {ours:.1f} eager "
                          f"{eager:.1f} us ({ratios[-1]:.2f}x)", flush=True)
            report(f"{what} {dt} {prec}", ratios)


# (name, a shape, b shape): float32 "highest" problems of every kind a model or a peer
# benchmark has: square, stacks (batched, broadcast, 3-D and 4-D times a matrix),
# misaligned rows (K % 4), small and large K, tall-skinny, matrix-vector, attention.
PROBLEMS = [("square", (4096, 4096), (4096, 4096)),
            ("batched", (128, 512, 1024), (128, 1024, 2048)),
            ("3-D @ matrix", (16, 1024, 2048), (2048, 768)),
            ("4-D @ matrix", (8, 256, 512, 256), (256, 768)),
            ("large K", (256, 524288), (524288, 256)),
            ("irregular", (8205, 2949), (2949, 5921)),
            ("small K", (32768, 64), (64, 32768)),
            ("tall-skinny", (32768, 32), (32, 32768)),
            ("matrix-vector", (2048, 1048576), (1048576, 1)),
            ("attention QK^T", (96, 512, 64), (96, 64, 512)),
            ("attention PV", (96, 512, 512), (96, 512, 64))]


def survey_host(seed: int, below: float = 0.95) -> None:
    """Host time included (back-to-back calls between CUDA events, as a training loop sees
    them; :func:`cupykern.benchmarks.overhead.paired_us`: three rounds alternating with
    eager, the median), linear in every dtype / precision of MODES at :func:`survey`'s
    random shapes: each point under ``below`` with its route and both figures, then the
    minimum and median per mode."""
    from cupykern.benchmarks.overhead import paired_us, per_call_us

    def paired(ours, eager):  # (~5 ms a figure)
        n = max(10, min(500, int(5000 / max(per_call_us(eager, 10), 1.0))))
        return paired_us(ours, eager, n, reps=3)

    _survey_linear(survey_shapes(seed), below, paired, ", host included")


def _survey_linear(shapes, below, timed, label):
    """linear against eager at ``shapes`` in every dtype / precision of MODES, timed by
    ``timed(ours, eager) -> (ours us, eager us)``: each point under ``below`` with its
    route, then the minimum and median per mode (``label`` after the mode's name)."""
    import torch.nn.functional as F

    from cupykern import gemm_route
    from cupykern._array import operand

    for dt, prec in MODES:
        torch.set_float32_matmul_precision(prec or "highest")  # (TF32 switch: on for "high")
        ratios = []
        for M, K, N in shapes:
            if dt == "float64" and M * N * K > 2 ** 31:
                continue
            x, w, b = (torch.randn(*s, device="cuda", dtype=getattr(torch, dt))
                       for s in ((M, K), (N, K), (N,)))
            t_o, t_e = timed(lambda: cupykern.linear(x, w, b), lambda: F.linear(x, w, b))
            ratios.append(t_e / t_o)
            if ratios[-1] < below:
                route = gemm_route.route_of(operand(x, "x"), operand(w, "w"), prec or "highest")
                print(f"linear {M}x{K}x{N} {dt} {prec}: ours {t_o:.1f} eager {t_e:.1f} us "
                      f"({ratios[-1]:.2f}x) route {route}", flush=True)
        ratios.sort()
        print(f"linear {dt} {prec}{label}: {len(ratios)} shapes, min {ratios[0]:.2f} "
              f"median {ratios[len(ratios) // 2]:.2f}", flush=True)
    torch.set_float32_matmul_precision("highest")


def problems(iters: int) -> None:
    """:data:`PROBLEMS` against eager SGEMM: ms, ratio, route and error against float64
    (max |error| / max |a| @ |b|) of each."""
    from cupykern import gemm_route

    torch.manual_seed(0)
    print("\nfloat32 \"highest\": cupykern.matmul against eager torch.matmul (SGEMM), "
          "events around each call")
    with matmul_precision("highest"):
        for name, sa, sb in PROBLEMS:
            a, b = torch.randn(sa, device="cuda"), torch.randn(sb, device="cuda")
            ours, eager = time_each((lambda: cupykern.matmul(a, b), lambda: torch.matmul(a, b)),
                                    iters=iters)
            ref = torch.matmul(a.double(), b.double())
            mag = torch.matmul(a.double().abs(), b.double().abs()).max().item()
            errs = [(got.double() - ref).abs().max().item() / mag
                    for got in (torch.matmul(a, b), cupykern.matmul(a, b))]  # SGEMM, ours
            with gemm_route.forced_route(gemm_route.VENDOR):
                vendor = cupykern.matmul(a, b)
            route = "vendor" if torch.equal(vendor, cupykern.matmul(a, b)) else "ours"
            forced = ""
            if route == "vendor":  # what our kernel would give there
                with gemm_route.forced_route(gemm_route.OURS):
                    ms = time_each((lambda: cupykern.matmul(a, b),), iters=iters)[0]
                    err = (cupykern.matmul(a, b).double() - ref).abs().max().item() / mag
                forced = f"  (ours forced {ms:.3f} ms {eager / ms:.2f}x, error {err:.1e})"
            print(f"{name:15} {str(sa):20} @ {str(sb):18} ours {ours:8.3f} ms  eager "
                  f"{eager:8.3f} ms  {eager / ours:5.2f}x  {route:6}  error ours "
                  f"{errs[1]:.1e} SGEMM {errs[0]:.1e}{forced}", flush=True)
            del a, b, ref, vendor
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m cupykern.benchmarks.gemm", description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20, help="timed calls per figure")
    ap.add_argument("--part", choices=("all", "gemm", "backward", "model", "training", "small"),
                    default="all", help="the GEMM alone, linear's backward GEMMs, "
                    "GemmScaleBatchNorm's forward, its training step, small grids, or all")
    ap.add_argument("--sweep", action="store_true", help="the envelope sweep: linear and "
                    "matmul against PyTorch eager and torch.compile over the envelope grid, "
                    "every dtype and float32 precision (instead of --part)")
    ap.add_argument("--quick", action="store_true", help="--sweep: 5 timed calls, no "
                    "torch.compile")
    ap.add_argument("--json", metavar="PATH", help="--sweep: write the rows and summary here")
    ap.add_argument("--paths", action="store_true", help="--sweep: also time our float32 "
                    "kernel where the dispatcher picks the vendor (ours_ms)")
    ap.add_argument("--ops", default="linear,matmul,gsbn", help="--sweep: which ops "
                    "(comma-separated: linear, matmul, gsbn)")
    ap.add_argument("--budget", type=float, default=1e9, metavar="S",
                    help="--sweep: stop starting new points after S seconds")
    ap.add_argument("--problems", action="store_true", help="float32 \"highest\" matmul "
                    "on a peer benchmark's and a model's problems against eager SGEMM "
                    "(instead of --part)")
    ap.add_argument("--survey", type=int, metavar="SEED", help="the off-grid survey: GPU "
                    "time at 40 random shapes of this seed (instead of --part)")
    ap.add_argument("--host", action="store_true", help="--survey: linear with host time "
                    "included (calls back to back), against eager")
    args = ap.parse_args(argv)
    require_gpu()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if args.survey is not None:
        (survey_host if args.host else survey)(args.survey)
        return
    if args.problems:
        problems(args.iters)
        return
    if args.sweep:
        command = "python -m cupykern.benchmarks.gemm " + " ".join(
            sys.argv[1:] if argv is None else argv)
        sweep(args.quick, args.json, args.paths, args.budget, args.ops.split(","), command)
        return
    if args.part in ("all", "gemm"):
        bench_gemm(1024, 8192, 8192, args.iters)
    if args.part in ("all", "backward"):
        bench_backward(1024, 8192, 8192, args.iters)
    if args.part in ("all", "small"):
        bench_small()
    from cupykern.models import gemm_scale_batchnorm as model3

    for part, bench in (("model", bench_model), ("training", bench_training)):
        if args.part in ("all", part):
            for case in model3.CASES:
                if not case.quick:
                    bench(case, args.iters)


if __name__ == "__main__":
    main()
