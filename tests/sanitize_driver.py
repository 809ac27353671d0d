"""Every cupykern kernel family at small edge shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tests/sanitize_driver.py [--only GROUP ...]

GROUP is one of normalize, normalize_rows, linear, gemm_scale_batchnorm, matmul_sum (racecheck is slow: run the groups
separately); under initcheck, add --initcheck (see tracked_products). Every result is
checked loosely against a float64 reference, so a run under the sanitizer also proves
that the kernels ran and computed the right thing; the script exits 1 on a wrong result
and prints "sanitize driver done" when all is well.
Shapes are tiny (a few rows, N, K <= 300) except the rows of the two-pass normalize kernel.
"""
import argparse
import contextlib
import copy
import sys
from unittest import mock

import cupy
import torch

import cupykern
from cupykern.matmul_sum_max_mean_logsumexp import _zlim
from cupykern import normalize as nz
from cupykern.gemm_vendor import vendor_linear
from cupykern.torch import GemmScaleBatchNorm, L1Norm, L2Norm, MatmulSumMaxMeanLogSumExp
from support import bn_factor, gsbn_torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CUPY_DTYPES = (torch.float16, torch.float32, torch.float64)  # CuPy has no bfloat16
PRECISIONS = ("highest", "high", "medium")
NAME = {d: str(d).removeprefix("torch.") for d in DTYPES}
KINDS = ("l1", "l2")  # normalize's
_failures: list[str] = []
_checks = [0]


def tol(dtype, precision="highest"):
    """Loose relative tolerance: catches wrong indexing, not rounding differences."""
    if dtype == torch.float64:
        return 1e-9
    if dtype == torch.float32:
        return 1e-4 if precision == "highest" else 1e-2  # TF32 / bf16 operands
    return 1e-2 if dtype == torch.float16 else 2e-2


def randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def dev(t, dtype, lib="torch"):
    """A CPU tensor as a GPU array of ``dtype``: a torch CUDA tensor or a CuPy array."""
    t = t.to(dtype)
    return cupy.asarray(t.numpy()) if lib == "cupy" else t.cuda()


def host(a):
    """A GPU array's exact values as a CPU float64 tensor (references start from these)."""
    if isinstance(a, cupy.ndarray):
        return torch.from_numpy(cupy.asnumpy(a)).double()
    return a.detach().cpu().double()


def check(name, got, want, rtol, bound=None):
    """``got`` (GPU) against the float64 reference ``want``: same shape, same nan / +inf /
    -inf positions, and ``|got - want| <= rtol * bound`` on finite entries (``bound``
    broadcasts; default max|want|)."""
    _checks[0] += 1
    g = host(got)
    if g.shape != want.shape:
        _failures.append(f"{name}: shape {tuple(g.shape)}, expected {tuple(want.shape)}")
        return
    fin = torch.isfinite(want)
    # nan_to_num maps nan -> 0 and +-inf -> +-max, so this compares the special values too
    if not (torch.equal(fin, torch.isfinite(g)) and torch.equal(g[~fin].nan_to_num(), want[~fin].nan_to_num())):
        _failures.append(f"{name}: nan/inf positions differ from the reference")
        return
    if bound is None:
        bound = want[fin].abs().max() if fin.any() else torch.tensor(0.0)
    bound = torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64), want.shape)
    err = (g - want).abs()
    bad = fin & ~(err <= rtol * bound)
    if bad.any():
        _failures.append(f"{name}: {int(bad.sum())} of {want.numel()} values off, worst error "
                         f"{err[bad].max().item():.3g} (allowed {rtol:g} x bound)")


# ---------------------------------------------------------------- normalize

def norm_ref(x, kind, dim=1):
    d = x.abs().mean(dim, keepdim=True) if kind == "l1" else x.square().sum(dim, keepdim=True).sqrt()
    return x / d


def grad_ref(x, g, kind):
    """(dx of norm_ref at x for the gradient g, its error scale max|g / d|), float64."""
    xr = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(norm_ref(xr, kind), xr, g)
    d = x.abs().mean(1, keepdim=True) if kind == "l1" else x.norm(2, 1, keepdim=True)
    return dx, (g / d).abs().max()


def run_normalize():
    devp = cupy.cuda.Device()
    clusters = int(devp.compute_capability) >= 90
    sms = devp.attributes["MultiProcessorCount"]
    for dtype in DTYPES:
        isz = dtype.itemsize
        per_vec = 16 // isz
        configs = [c for c in nz.CONFIGS[isz] if c[0] == 1 or clusters]
        bconfigs = [c for c in nz.BACKWARD_CONFIGS[isz] if c[0] == 1 or clusters]
        for kind in KINDS:
            t, fn = tol(dtype), getattr(cupykern, f"{kind}_normalize")
            tag = f"{kind} {NAME[dtype]}"
            # Cluster kernel, every config: rows of 1 and 7 (head/tail scalars only), 1001
            # (odd: rows 1, 2 start off 16-byte boundaries) and nearly the config's capacity
            # (every CTA of the cluster holds data).
            for cfg in configs:
                cap = cfg[0] * cfg[1] * cfg[2]  # 16-byte vectors per row
                for ncols in (1, 7, 1001, cap * per_vec - 3):
                    if ncols // per_vec > cap:
                        continue
                    x = dev(randn(3, ncols, seed=ncols), dtype)
                    check(f"{tag} config {cfg} ncols {ncols}",
                          fn(x, config=cfg), norm_ref(host(x), kind), t)
            for cfg in bconfigs:
                cap = cfg[0] * cfg[1] * cfg[2]
                for ncols in (1, 7, 1001, cap * per_vec - 3):
                    if ncols // per_vec > cap:
                        continue
                    x = dev(randn(3, ncols, seed=ncols), dtype)
                    gy = dev(randn(3, ncols, seed=ncols + 1), dtype)
                    dx, scale = grad_ref(host(x), host(gy), kind)
                    check(f"{tag} backward config {cfg} ncols {ncols}",
                          nz.normalize_backward(x, gy, nz.P[kind], 1, cfg), dx, t, scale)
            if kind == "l2":
                # 12 * SMs rows: each of the 4 * SMs clusters walks 3 rows, so the
                # prefetch buffers and the double-buffered partial sums are reused.
                x = dev(randn(12 * sms, 40, seed=3), dtype)
                for cfg in configs:
                    check(f"{tag} config {cfg} many rows",
                          fn(x, config=cfg), norm_ref(host(x), kind), t)
                gy = dev(randn(12 * sms, 40, seed=4), dtype)
                dx, scale = grad_ref(host(x), host(gy), "l2")
                for cfg in bconfigs:
                    check(f"{tag} backward config {cfg} many rows",
                          nz.normalize_backward(x, gy, 2, 1, cfg), dx, t, scale)
            # A dy that is no row view aligned like x: copied by the plan, then the kernel
            # (rows one element off, the stride-0 gradient of y.sum(), a transposed view).
            x = dev(randn(5, 1000, seed=12), dtype)
            gys = {"offset": dev(randn(5, 1001, seed=13), dtype)[:, 1:],
                   "expanded": torch.ones((), dtype=dtype, device="cuda").expand(5, 1000),
                   "transposed": dev(randn(1000, 5, seed=14), dtype).t()}
            for what, gy in gys.items():
                dx, scale = grad_ref(host(x), host(gy), kind)
                for i in range(2):  # (planned, then the plan's replay)
                    check(f"{tag} backward dy {what} {i}",
                          nz.normalize_backward(x, gy, nz.P[kind], 1), dx, t, scale)
            # Rows longer than any cluster holds: the chunked two-pass kernels (aligned, then
            # offset).
            x = dev(randn(3, 300_001, seed=4), dtype)
            check(f"{tag} two-pass", fn(x), norm_ref(host(x), kind), t)
            x = dev(randn(2, 300_002, seed=5), dtype)[:, 1:]
            check(f"{tag} two-pass offset rows", fn(x), norm_ref(host(x), kind), t)
            # Public paths: cached plan (twice), offset rows, another axis, 3-D, out=.
            x = dev(randn(5, 1000, seed=6), dtype)
            for i in range(2):
                check(f"{tag} plan call {i}", fn(x), norm_ref(host(x), kind), t)
            xs = dev(randn(5, 1002, seed=7), dtype)[:, 1:]
            check(f"{tag} offset rows", fn(xs), norm_ref(host(xs), kind), t)
            check(f"{tag} axis 0", fn(x, axis=0), norm_ref(host(x), kind, 0), t)
            x3 = dev(randn(2, 3, 130, seed=8), dtype)
            check(f"{tag} 3-D axis -1", fn(x3, axis=-1), norm_ref(host(x3), kind, -1), t)
            xi = x.clone()
            want = norm_ref(host(xi), kind)
            check(f"{tag} out=x (in place)", fn(xi, out=xi), want, t)
            out = torch.empty(5, 1002, dtype=dtype, device="cuda")[:, 1:]  # offset like xs: direct
            check(f"{tag} out= offset rows", fn(xs, out=out), norm_ref(host(xs), kind), t)
            out = torch.empty(5, 1001, dtype=dtype, device="cuda")  # offset unlike xs: copied
            check(f"{tag} out= other alignment", fn(xs, out=out), norm_ref(host(xs), kind), t)
            if dtype in CUPY_DTYPES:
                xc = dev(randn(5, 1001, seed=9), dtype, "cupy")
                check(f"{tag} cupy", fn(xc), norm_ref(host(xc), kind), t)
                xc = dev(randn(5, 1002, seed=10), dtype, "cupy")[:, 1:]
                outc = cupy.empty((5, 1002), dtype=xc.dtype)[:, 1:]
                check(f"{tag} cupy offset rows out=", fn(xc, out=outc), norm_ref(host(xc), kind), t)
            print(f"normalize {tag}: {_checks[0]} checks so far", flush=True)  # (a slow tool's progress)
    for mod, kind in ((L1Norm(), "l1"), (L2Norm(), "l2")):
        for dtype in (torch.float32, torch.bfloat16):
            x = dev(randn(4, 777, seed=11), dtype)
            check(f"{type(mod).__name__} {NAME[dtype]}", mod(x), norm_ref(host(x), kind), tol(dtype))


def run_normalize_rows():
    """The short-row, chunked and few-rows kernel families (forward and fused backward)
    with forced configurations: chunks of 3 vectors (a partial last
    chunk), the few-rows kernel's chunks from a few vectors to more than the chip holds,
    and every short-row configuration at its capacity and shorter rows, on rows of odd
    lengths (head and tail scalars differ row to row)."""
    for dtype in DTYPES:
        isz = dtype.itemsize
        per_vec = 16 // isz
        for kind in KINDS:
            t, fn = tol(dtype), getattr(cupykern, f"{kind}_normalize")
            tag = f"{kind} {NAME[dtype]}"
            for ncols in (5, 1001):
                x = dev(randn(3, ncols, seed=12), dtype)
                gy = dev(randn(3, ncols, seed=13), dtype)
                check(f"{tag} chunks of 3 ncols {ncols}", fn(x, config=(-1, 3)),
                      norm_ref(host(x), kind), t)
                check(f"{tag} few rows ncols {ncols}", fn(x, config=(-2,)),
                      norm_ref(host(x), kind), t)
                check(f"{tag} pipelined rows ncols {ncols}", fn(x, config=(-3,)),
                      norm_ref(host(x), kind), t)
                dx, scale = grad_ref(host(x), host(gy), kind)
                check(f"{tag} backward chunks of 3 ncols {ncols}",
                      nz.normalize_backward(x, gy, nz.P[kind], 1, (-1, 3)), dx, t, scale)
                check(f"{tag} backward few rows ncols {ncols}",
                      nz.normalize_backward(x, gy, nz.P[kind], 1, (-2,)), dx, t, scale)
            # the few-rows kernel, a CTA a row: chunks held in registers and shared memory,
            # and longer than the chip holds (the rest re-read); the backward holds dy too
            smem = (cupykern._loader.max_shared_per_block(0) - 1024) // 16
            for table, arrays in ((nz.RESIDENT, 1), (nz.RESIDENT_BACKWARD, 2)):
                threads, regs, _ = table[isz]
                for vectors in (regs * threads + 1000,
                                (regs + smem // arrays // threads) * threads + 1000):
                    shape = (cupykern._loader.sm_count(0), per_vec * vectors + 3)
                    x = dev(randn(*shape, seed=16), dtype)
                    if arrays == 1:
                        check(f"{tag} few rows {vectors} vectors", fn(x, config=(-2,)),
                              norm_ref(host(x), kind), t)
                        continue
                    gy = dev(randn(*shape, seed=17), dtype)
                    dx, scale = grad_ref(host(x), host(gy), kind)
                    check(f"{tag} backward few rows {vectors} vectors",
                          nz.normalize_backward(x, gy, nz.P[kind], 1, (-2,)), dx, t, scale)
            # the pipelined few-rows kernel: three rows of a little more than the SMs'
            # registers (on 132 SMs, float32: two row groups of 66 CTAs, one walking two
            # rows), three rows past the SMs' banks (one group of every CTA, a bank reused,
            # the rest re-read), and 100 rows of 2.5 banks (34 groups of 3 CTAs, 32 walking
            # three rows: banks reused in every group)
            threads, regs, _ = nz.PIPELINED[isz]
            sms = cupykern._loader.sm_count(0)
            bank = (regs + smem // 2 // threads) * threads
            for vectors in (regs * threads + 100, bank + 100):
                x = dev(randn(3, per_vec * vectors * sms + 3, seed=18), dtype)
                check(f"{tag} pipelined rows of {vectors} vectors an SM", fn(x, config=(-3,)),
                      norm_ref(host(x), kind), t)
            x = dev(randn(100, per_vec * bank * 5 // 2 + 3, seed=19), dtype)
            check(f"{tag} pipelined row groups", fn(x, config=(-3,)), norm_ref(host(x), kind), t)
            # a row count that leaves the last step part empty
            for cfg in nz._short_table(isz):
                g, units, rows, vec = cfg
                per_unit = per_vec if vec else 1
                cap = g * units * per_unit
                for ncols in sorted({1, 7, cap - 1, cap}):  # (cap - 1: rows off 16 bytes)
                    if (ncols // per_unit if vec else ncols) > g * units:
                        continue
                    shape = ((256 // g) * rows + 3, ncols)
                    x = dev(randn(*shape, seed=14), dtype)
                    gy = dev(randn(*shape, seed=15), dtype)
                    check(f"{tag} short {cfg} ncols {ncols}", fn(x, config=(0,) + cfg),
                          norm_ref(host(x), kind), t)
                    dx, scale = grad_ref(host(x), host(gy), kind)
                    check(f"{tag} backward short {cfg} ncols {ncols}",
                          nz.normalize_backward(x, gy, nz.P[kind], 1, (0,) + cfg), dx, t, scale)


# ---------------------------------------------------------------- linear

def check_linear(name, got, x, w, b, rtol):
    """Against x @ w.T + b, error bounded by the sum of |terms| (cancellation-proof)."""
    x, w = host(x), host(w)
    b = host(b) if b is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    check(name, got, x @ w.T + b, rtol, x.abs() @ w.abs().T + b.abs())


def run_linear():
    """Our kernels at these small shapes (the dispatcher gives most of them to cuBLAS, whose
    kernels are not ours to check); then matmul's stacks: of our 2-D GEMM per matrix, and
    on one launch (Hopper: the matrix in the grid; partial tiles, a stride-0 b)."""
    with cupykern.gemm_route.forced_route(cupykern.gemm_route.OURS):
        _run_linear()
        # a broadcast stack: b's transpose copied once, one launch per matrix at its offsets;
        # then a stack whose matrices lie one stride apart (b broadcast: stride 0; on Hopper
        # b's row-major matrix read in place by the swapped product, stored transposed)
        stacks = (((3, 1, 37, 50), (2, 50, 23)), ((3, 70, 64), (1, 64, 140)))
        for prec in ("highest", "high"):
            for i, (sa, sb) in enumerate(stacks):
                a = dev(randn(*sa, seed=12 + 2 * i), torch.float32)
                b = dev(randn(*sb, seed=13 + 2 * i), torch.float32)
                want = (host(a) @ host(b))
                check(f"matmul stack {sa} @ {sb} float32 {prec}", cupykern.matmul(a, b, precision=prec),
                      want, tol(torch.float32, prec), host(a).abs() @ host(b).abs())
            # rows of K % 4, copied into 16-byte rows (zeros past K) that Hopper's TMA reads
            x, w = dev(randn(130, 301, seed=20), torch.float32), dev(randn(140, 301, seed=21), torch.float32)
            check_linear(f"linear K % 4 float32 {prec}", cupykern.linear(x, w, precision=prec), x, w,
                         None, tol(torch.float32, prec))


def _run_linear():
    # (M, N, K): partial 128-row and 128/256-column tiles with 16-byte aligned rows (wgmma
    # on Hopper for float32 "highest"/"high"), K split in two chunks (float32 / float64,
    # added by splitk_reduce), the first of more K slices than pipeline stages (each
    # stage is refilled); 16-byte aligned 16-bit rows of a long K (TMA and wgmma on Hopper,
    # K split over float32 slabs); odd sizes (unaligned mma.sync path); 1 x 1 x 1.
    shapes = ((130, 264, 300), (130, 264, 2112), (37, 23, 50), (1, 1, 1))
    for dtype in DTYPES:
        for prec in PRECISIONS if dtype == torch.float32 else ("highest",):
            t, tag = tol(dtype, prec), f"linear {NAME[dtype]} {prec}"
            for m, n, k in shapes:
                x, w, b = (dev(randn(*s, seed=i), dtype) for i, s in enumerate(((m, k), (n, k), (n,))))
                check_linear(f"{tag} {m}x{n}x{k}", cupykern.linear(x, w, b, precision=prec), x, w, b, t)
                check_linear(f"{tag} {m}x{n}x{k} no bias", cupykern.linear(x, w, precision=prec), x, w, None, t)
            # Column slices: rows start 2 or 4 bytes past a 16-byte boundary (row stride K + 1).
            x, w = dev(randn(64, 65, seed=3), dtype)[:, 1:], dev(randn(40, 65, seed=4), dtype)[:, 1:]
            check_linear(f"{tag} offset rows", cupykern.linear(x, w, precision=prec), x, w, None, t)
            # Batched x (..., K); out= contiguous (written directly) and a permuted view (copied).
            x, w, b = dev(randn(2, 5, 24, seed=5), dtype), dev(randn(8, 24, seed=6), dtype), dev(randn(8, seed=7), dtype)
            for out in (torch.empty(2, 5, 8, dtype=dtype, device="cuda"),
                        torch.empty(8, 5, 2, dtype=dtype, device="cuda").permute(2, 1, 0)):
                got = cupykern.linear(x, w, b, precision=prec, out=out)
                if got is not out:
                    _failures.append(f"{tag} out=: did not return out")
                check_linear(f"{tag} 3-D out= contiguous={out.is_contiguous()}", got, x, w, b, t)
    for dtype in CUPY_DTYPES:
        for m, n, k in shapes[:2]:
            x, w, b = (dev(randn(*s, seed=i), dtype, "cupy") for i, s in enumerate(((m, k), (n, k), (n,))))
            check_linear(f"linear cupy {NAME[dtype]} {m}x{n}x{k}", cupykern.linear(x, w, b), x, w, b, tol(dtype))
    # mm with transposed operands read in place (M, N < 128 against K > 128: too small to
    # be worth a copy) and copied (M, N = 200, 150), every layout pair, several stages'
    # refills.
    for dtype, (m, n) in ((d, s) for d in DTYPES for s in ((100, 120), (200, 150))):
        for prec in PRECISIONS if dtype == torch.float32 else ("highest",):
            a, b = dev(randn(m, 300, seed=8), dtype), dev(randn(300, n, seed=9), dtype)
            for ta in (False, True):
                for tb in (False, True):
                    av = a.t().contiguous().t() if ta else a
                    bv = b.t().contiguous().t() if tb else b
                    check_linear(f"mm {NAME[dtype]} {prec} {m}x{n} transposed a={ta} b={tb}",
                                 torch.ops.cupykern.mm(av, bv, prec), a, b.t(), None, tol(dtype, prec))
    # dx = dy @ W, W row-major: on Hopper float32 the product runs swapped, reading W in
    # place and storing W^T dy^T transposed (34 row tiles of W^T: K not split); a partial
    # last tile, a column slice of W whose output rows are not 16-byte aligned, and 140
    # tiles (300 rows of dy): more than an H100's or H200's SMs, so that persistent CTAs
    # take a second tile while their first one's stores drain.
    for rows, n, cols in ((130, 4228, 4228), (130, 4229, 4232), (300, 8955, 8960)):
        dy = dev(randn(rows, 160, seed=10), torch.float32)
        w = dev(randn(160, cols, seed=11), torch.float32)[:, :n]
        for prec in ("highest", "high"):
            check_linear(f"mm float32 {prec} dy @ W {rows}x{n}", torch.ops.cupykern.mm(dy, w, prec),
                         dy, w.t(), None, tol(torch.float32, prec))
    # the same with one tile of W^T and K split in 16 chunks: slabs of the transposed store
    dy, w = dev(randn(130, 2048, seed=14), torch.float32), dev(randn(2048, 40, seed=15), torch.float32)
    for prec in ("highest", "high"):
        check_linear(f"mm float32 {prec} dy @ W split K", torch.ops.cupykern.mm(dy, w, prec),
                     dy, w.t(), None, tol(torch.float32, prec))


# ---------------------------------------------------------------- gemm_scale_batchnorm

def bn_params(n, k, dtype, lib="torch", seed=0):
    """weight, bias, scale, bn_weight, bn_bias, running_mean, running_var (nn.Linear-sized W)."""
    cpu = (randn(n, k, seed=seed) / k ** 0.5, 0.1 * randn(n, seed=seed + 1), randn(n, seed=seed + 2),
           randn(n, seed=seed + 3), randn(n, seed=seed + 4), 0.1 * randn(n, seed=seed + 5),
           randn(n, seed=seed + 6).abs() + 0.5)
    return [dev(v, dtype, lib) for v in cpu]


def bn_ref(x, w, b, s, g, be, rm, rv, training, momentum, eps, nbt):
    """float64 (out, new running_mean, new running_var) as nn.BatchNorm1d computes them
    (support's reference on host copies; ``nbt``: num_batches_tracked before the call)."""
    rm, rv = (None if v is None else host(v) for v in (rm, rv))
    factor = bn_factor(momentum, nbt + 1) if nbt is not None else (momentum or 0.0)
    out = gsbn_torch(*(None if v is None else host(v) for v in (x, w, b, s, g, be)), rm, rv,
                     training, factor, eps)
    return out, rm, rv


def check_bn(name, x, params, rtol, training=True, stats=True, momentum=0.1,
             nbt=None, affine=True, precision=None):
    w, b, s, g, be, rm, rv = params
    if not affine:
        b = g = be = None
    if not stats:
        rm = rv = None
    nbt0 = None if nbt is None else int(host(nbt))
    want, want_rm, want_rv = bn_ref(x, w, b, s, g, be, rm, rv, training, momentum, 1e-5, nbt0)
    got = cupykern.gemm_scale_batchnorm(x, w, b, s, g, be, rm, rv, nbt, training=training,
                                        momentum=momentum, eps=1e-5, precision=precision)
    check(name, got, want, rtol)
    if rm is not None:
        check(f"{name} running_mean", rm, want_rm, rtol)
        check(f"{name} running_var", rv, want_rv, rtol)
    if nbt is not None and int(host(nbt)) != nbt0 + 1:
        _failures.append(f"{name}: num_batches_tracked {int(host(nbt))}, expected {nbt0 + 1}")


def run_gemm_scale_batchnorm():
    # (M, N, K): aligned rows and refilled pipeline stages, with K split in two chunks
    # (float32 / float64: the partial statistics then come from splitk_reduce's 32-row
    # tiles) and unsplit (two 128-row tiles of the GEMM epilogue's statistics, both
    # wgmma modes); odd sizes; batch of 2.
    shapes = ((130, 136, 300), (130, 136, 200), (37, 23, 50), (2, 5, 3))
    for dtype in DTYPES:
        for prec in PRECISIONS if dtype == torch.float32 else ("highest",):
            t, tag = tol(dtype, prec), f"gemm_bn {NAME[dtype]} {prec}"
            for m, n, k in shapes:
                x, p = dev(randn(m, k, seed=1), dtype), bn_params(n, k, dtype)
                sh = f"{tag} {m}x{n}x{k}"
                check_bn(f"{sh} train", x, p, t, precision=prec)
                check_bn(f"{sh} train, no running stats, no bias/affine", x, p, t, stats=False,
                         affine=False, precision=prec)
                nbt = torch.tensor(2, dtype=torch.int64, device="cuda")
                check_bn(f"{sh} train, momentum None", x, p, t, momentum=None, nbt=nbt, precision=prec)
                check_bn(f"{sh} eval", x, p, t, training=False, precision=prec)
            x = dev(randn(64, 65, seed=2), dtype)[:, 1:]  # offset rows
            check_bn(f"{tag} offset rows train", x, bn_params(40, 64, dtype), t, precision=prec)
            check_bn(f"{tag} offset rows eval", x, bn_params(40, 64, dtype), t, training=False, precision=prec)
    for dtype in CUPY_DTYPES:
        x, p = dev(randn(37, 50, seed=3), dtype, "cupy"), bn_params(23, 50, dtype, "cupy")
        nbt = cupy.array(0, dtype=cupy.int64)
        check_bn(f"gemm_bn cupy {NAME[dtype]} train", x, p, tol(dtype), momentum=None, nbt=nbt)
        check_bn(f"gemm_bn cupy {NAME[dtype]} eval", x, p, tol(dtype), training=False)
    # The module (torch's default precision, "highest") against its float64 CPU twin.
    for k, n, scale_shape in ((72, 136, (136,)), (50, 23, (1,))):
        torch.manual_seed(0)
        mod = GemmScaleBatchNorm(k, n, scale_shape).cuda()
        ref = copy.deepcopy(mod).cpu().double()
        x = dev(randn(37, k, seed=4), torch.float32)
        with torch.no_grad():
            for mode in ("train", "eval"):
                mod.train(mode == "train")
                ref.train(mode == "train")
                name = f"GemmScaleBatchNorm {k}x{n} scale {scale_shape} {mode}"
                check(name, mod(x), ref(host(x)), 1e-4)
                check(f"{name} running_var", mod.bn.running_var, ref.bn.running_var, 1e-4)
        if mod.bn.num_batches_tracked.item() != 1:
            _failures.append("GemmScaleBatchNorm: num_batches_tracked not incremented")
    # The fused backward in both modes (column sums, dz and its transpose, dx and dW GEMMs)
    # against float64 autograd: its passes in one launch (bn_grad_fused, up to 512 rows;
    # float64: four warps a block) and in three (600 rows); 200 rows: dz^T's 16-byte
    # stores, then a chunk's tail; 2100 rows: the forward's and the backward's column
    # reductions over their tiles in chunks of threads (stats.cuh's combine_chunks).
    f32, f64 = torch.float32, torch.float64
    check_bn_backward([((130, 200, 136), True, f32), ((37, 50, 23), True, f32),
                       ((200, 72, 130), True, f32), ((130, 200, 136), False, f32),
                       ((37, 50, 23), False, f32), ((600, 40, 136), True, f32),
                       ((600, 40, 136), False, f32), ((150, 30, 40), True, f64),
                       ((2100, 40, 14), True, f32), ((2100, 40, 14), False, f32)])
    # Row passes whose blocks loop over the tiles past their grid's y (MAX_GRID_Y: a few
    # million rows), here past 2 rows of blocks: bn_column_stats and bn_apply (the vendor's
    # narrow product), bn_grad_partials and bn_grad_dz (three launches), bn_train_apply.
    core = sys.modules["cupykern.gemm_scale_batchnorm"]
    back = sys.modules["cupykern.gemm_scale_batchnorm_backward"]
    with fresh_plans(core, mock.patch.object(core, "grid_rows", lambda tiles: min(tiles, 2)),
                     mock.patch.object(back, "grid_rows", lambda tiles: min(tiles, 2)),
                     mock.patch.object(core, "_ROW_STATS_FROM", 0),
                     mock.patch.dict(core._GRAD_FUSED, ROWS=0)):
        check_bn_backward([((2100, 40, 14), True, f32), ((2100, 40, 14), False, f32),
                           ((700, 30, 200), True, f32)], "looping grid ")
    # Coefficient merges in more chunks than WIDE_CHUNKS (a narrow N's few blocks: _chunks),
    # here with runs of one tile: at 8192x40->14 the forward's 256 tiles of 32 rows
    # (bn_train_coef) in 256 chunks, 8 levels of combine_chunks' tree; at 16384x40->100
    # the forward's 128 tiles in 128 chunks and the backward's 256 tiles of 64 rows in 256
    # (bn_grad_coef; bn_grad_eval_coef in eval mode).
    with fresh_plans(core, mock.patch.dict(core._CHUNKED, MIN_RUN=1)):
        check_bn_backward([((8192, 40, 14), True, f32), ((16384, 40, 100), True, f32),
                           ((16384, 40, 100), False, f32)], "many chunks ")


@contextlib.contextmanager
def fresh_plans(core, *patches):
    """Within it, ``patches`` (``mock.patch`` objects) apply to GemmScaleBatchNorm's
    module ``core`` and its plans are made anew; both undone on the way out."""
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        back = sys.modules["cupykern.gemm_scale_batchnorm_backward"]
        core._plans.clear()
        back._backward_plans.clear()
        try:
            yield
        finally:
            core._plans.clear()
            back._backward_plans.clear()


def check_bn_backward(cases, tag=""):
    """GemmScaleBatchNorm's output and gradients at ``cases`` ((m, k, n), training, dtype)
    against its float64 CPU twin."""
    for (m, k, n), training, dtype in cases:
        torch.manual_seed(1)
        mod = GemmScaleBatchNorm(k, n, (n,)).cuda().to(dtype).train(training)
        mod.bn.running_var.uniform_(0.5, 1.5)
        ref = copy.deepcopy(mod).cpu().double()
        x, g = dev(randn(m, k, seed=5), dtype), dev(randn(m, n, seed=6), dtype)
        xr = host(x).requires_grad_()
        x.requires_grad_()
        out = mod(x)
        want = ref(xr)
        out.backward(g)
        want.backward(host(g))
        name = f"GemmScaleBatchNorm {tag}backward {m}x{k}->{n} {NAME[dtype]} training={training}"
        check(f"{name} output", out, want.detach(), 1e-4)
        check(f"{name} x", x.grad, xr.grad, 1e-4)
        params = list(zip(mod.named_parameters(), ref.named_parameters()))
        biggest = max(pr.grad.abs().max().item() for _, (_, pr) in params)
        for (pname, p), (_, pr) in params:
            # (gemm.bias: 0 in training mode, up to rounding; each side holds rounding noise
            # of the other gradients' size: 1.1e-12 against float64's ~1e-17 at 16384 rows)
            floor = biggest if training and pname == "gemm.bias" else 1e-8
            check(f"{name} {pname}", p.grad, pr.grad, 1e-4, max(pr.grad.abs().max().item(), floor))


# ---------------------------------------------------------------- matmul_sum

def msum_ref(x, w, b):
    """(x @ w.T + b).sum(1, keepdim=True) in float64 and its error bound (sum of |terms|)."""
    x, w = host(x), host(w)
    b = host(b) if b is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    return (x @ w.T + b).sum(1, keepdim=True), (x.abs() @ w.abs().T + b.abs()).sum(1, keepdim=True)


def msum_input(bsz, k, dtype, n, wmax, special_rows, seed):
    """CPU x with inf / nan / -inf / one huge element in ``special_rows`` (each such row fails
    the fast-path overflow bound and is computed the literal way), when K is large enough
    that the huge element cannot overflow the literal sum."""
    x = randn(bsz, k, seed=seed)
    if k >= 32:
        r_inf, r_nan, r_ninf, r_big = special_rows
        x[r_inf, 3], x[r_nan, 5], x[r_ninf, 0] = float("inf"), float("nan"), -float("inf")
        x[r_big, 1] = 2 * _zlim(NAME[dtype], n) / (k * wmax)  # bound ~ 2x the limit
    return x


def check_msum(name, x, w, b, rtol, plan=None):
    want, bound = msum_ref(x, w, b)
    check(name, cupykern.matmul_sum_max_mean_logsumexp(x, w, b, plan=plan), want, rtol, bound)


def run_matmul_sum():
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    # (B, N, K): several 64-row weight chunks with 16-byte vectors; odd K (scalar loads);
    # 1 x 1 x 1; then batches that make matmul_sum_rows take 4 and 2 rows per block.
    shapes = ((5, 300, 256), (7, 130, 77), (3, 1, 1), (4 * sms + 3, 50, 64), (2 * sms + 1, 40, 96))
    for lib, dtypes in (("torch", DTYPES), ("cupy", CUPY_DTYPES)):
        for dtype in dtypes:
            t = tol(dtype)
            for bsz, n, k in shapes:
                tag = f"matmul_sum {lib} {NAME[dtype]} {bsz}x{n}x{k}"
                w, b = dev(randn(n, k, seed=1), dtype, lib), dev(randn(n, seed=2), dtype, lib)
                wmax = host(w).abs().max().item()
                x = dev(msum_input(bsz, k, dtype, n, wmax, (1, 2, 3, min(6, bsz - 1)), 3), dtype, lib)
                plan = cupykern.prepare_matmul_sum(w, b)
                check(f"{tag} plan wsum", plan.wsum, host(w).sum(0), t, host(w).abs().sum(0))
                check_msum(f"{tag} plan", x, w, b, t, plan)
                check_msum(f"{tag} no plan, no bias", x, w, None, t)
            # Column slices of x and W: unaligned rows take the scalar-load kernels.
            w, b = dev(randn(300, 257, seed=4), dtype, lib)[:, 1:], dev(randn(300, seed=5), dtype, lib)
            x = msum_input(6, 256, dtype, 300, host(w).abs().max().item(), (0, 1, 2, 5), 6)
            x = dev(torch.cat([torch.zeros(6, 1), x], 1), dtype, lib)[:, 1:]
            check_msum(f"matmul_sum {lib} {NAME[dtype]} offset rows", x, w, b, t,
                       cupykern.prepare_matmul_sum(w, b))
    torch.manual_seed(0)
    mod = MatmulSumMaxMeanLogSumExp(256, 300).cuda()
    x = dev(randn(9, 256, seed=7), torch.float32)
    with torch.no_grad():
        want, bound = msum_ref(x, mod.linear.weight, mod.linear.bias)
        check("MatmulSumMaxMeanLogSumExp", mod(x), want, tol(torch.float32), bound)


def tracked_products(kind, precision, problem):
    """GemmScaleBatchNorm's vendor product (``gemm_vendor.vendor_linear``'s stand-in under
    initcheck): x @ weight.T + bias in float64 by torch's elementwise and reduction
    kernels, rounded to x's dtype. initcheck does not see the stores of cuBLAS's Hopper
    kernels that write through TMA: every read of their output, torch's own copy kernel's
    too, counts as uninitialized (H200, a bf16 64x64 @ (40x64)^T F.linear read by
    ``z.float()``: 2,560 errors, every element; the same product of a misaligned view,
    which cuBLAS computes by another kernel: none). The pass over z that follows
    (the column statistics, the BatchNorm passes) is ours and stays checked."""
    if kind != "torch":
        return vendor_linear(kind, precision, problem)

    def run(x, weight, bias):
        z = (x.double()[:, None, :] * weight.double()[None, :, :]).sum(-1)
        return (z if bias is None else z + bias.double()).to(x.dtype)

    return run


GROUPS = {"normalize": run_normalize, "normalize_rows": run_normalize_rows, "linear": run_linear,
          "gemm_scale_batchnorm": run_gemm_scale_batchnorm, "matmul_sum": run_matmul_sum}


def main():
    global DTYPES, CUPY_DTYPES, KINDS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0].rstrip(":"))
    ap.add_argument("--only", nargs="+", choices=list(GROUPS), default=list(GROUPS),
                    help="run only these kernel families")
    ap.add_argument("--dtypes", nargs="+", choices=list(NAME.values()), default=list(NAME.values()),
                    help="run only these dtypes (a slow tool's run, split over processes)")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS,
                    help="normalize, normalize_rows: run only these norms")
    ap.add_argument("--initcheck", action="store_true",
                    help="GemmScaleBatchNorm's vendor products without cuBLAS, whose TMA "
                         "stores initcheck does not see (tracked_products)")
    args = ap.parse_args()
    if args.initcheck:
        sys.modules["cupykern.gemm_scale_batchnorm"].vendor_linear = tracked_products
    KINDS = tuple(args.kinds)
    DTYPES = tuple(d for d in DTYPES if NAME[d] in args.dtypes)
    CUPY_DTYPES = tuple(d for d in CUPY_DTYPES if d in DTYPES)
    for group in args.only:
        GROUPS[group]()
        print(f"{group}: {_checks[0]} checks so far", flush=True)
    torch.cuda.synchronize()
    if _failures:
        print(f"{len(_failures)} of {_checks[0]} checks FAILED:", *_failures, sep="\n")
        sys.exit(1)
    print("sanitize driver done")


if __name__ == "__main__":
    main()
