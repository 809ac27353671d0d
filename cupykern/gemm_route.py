"""The one routing table of GEMM products: whether a plain product (``linear``,
``matmul``) runs on our kernels or the vendor's (:func:`route`, each boundary with its
measurement), and whether a fused op's product does (:func:`fused_vendor`), with the
vendor's own forms of a product (:func:`padded_n`, :func:`padded_grad`,
:func:`bias_apart`)."""
from __future__ import annotations

import contextlib
from typing import NamedTuple

from . import _loader
from ._array import ITEMSIZE, Operand
from ._geometry import cdiv, vector_aligned
from .gemm_kernels import _choose, half_wgmma, layout, tile_config
from .gemm_operands import mm_plan, on_arrays, planned_operand, read_mode
from .gemm_vendor import vendor_matmul, vendor_of

# A fused op's backward GEMMs (plain products) follow the dispatcher below this batch
# (rows of its input), where it was measured (H200: GemmScaleBatchNorm 64x512->512 "highest"
# dx 19.9 us on ours against cuBLAS's 7.1, dW 10.5 / 3.8; 256x4096->4096 "high" dx 90 /
# 43), and stay ours from it on, where they were tuned against cuBLAS (1024x8192->8192
# "high" dW = dy^T @ x 1.31x cuBLAS TF32, dx 0.99x; 2048x2048->2048 "high" a tie).
FUSED_VENDOR_BATCH = 1024
# A fused op's float64 products stay ours up to these multiply-adds, by role (narrow ones
# aside: fused_vendor, _narrow): a cuBLAS call through torch costs these hosts 50-150 us
# (the profiler: aten::mm 42-77 us, aten::addmm 150 us), ours one launch. A forward alone
# hides that host time behind the GPU's work; a training step, host-bound up to ~2**31,
# does not. H100, one run, GemmScaleBatchNorm in float64 against eager, event-timed with
# host time, medians of 160 calls in alternating blocks, ours then on CUDA cores. Forward
# alone, the vendor's product / ours: 0.98 / 1.68x at 64x512->512 (2**24), 0.83 / 1.32x at
# 128x1024->512 (2**26), 0.94 / 0.48x at 256x1024->1024 (2**28: our GEMM 126 us against
# 64). Training step, all three products the vendor's / the forward's ours / all ours:
# 0.78 / 0.88 / 0.95x at 2**24, 0.78 / 0.80 / 0.96x at 2**26, 0.79 / 0.96 / 0.98x at
# 2**28, 0.76 / 0.94 / 0.87x at 512x2048->1024 (2**30), 0.96 / 0.87 / 0.45x at
# 256x4096->4096 (2**32), 1.12 / 0.72 / 0.37x at 2048^3. Ours now runs DMMA (gemm_dmma, 3x
# the CUDA cores, 0.35-0.72x cuBLAS's DGEMM); the same limits, rerun on an H200 (all ours
# / the limits / all the vendor's), measure within the runs' noise of each other: step
# 0.96-1.00 / 0.95-1.02 / 0.95-1.01x from 2**24 to 2**31. These are host-time limits: a
# plan made while a CUDA graph is captured takes the vendor's products (fused_vendor's
# ``captured``). H200, one run, 24 float64 forwards off narrow below 2**26 (20 of the
# survey's, 64x512->512, 128x1024->512, 256^3, 1024x64->64), ours / the vendor's against
# eager: GPU time (CUDA graphs) 0.67-1.28x (10 under 1.0: 53x2829->152 0.67x, 267x157->129
# 0.69x, 330x185->79 0.75x) / 1.10-1.64x; back to back with host 1.06-2.07x / 0.93-1.81x
# (5 under 1.0).
FUSED_F64_WORK = {"forward": 2 ** 26, "forward with grad": 2 ** 30, "backward": 2 ** 28}


def fused_vendor(a, b_nk, precision: str, batch: int | None = None, grad: bool = False,
                 captured: bool = False) -> bool:
    """Whether a fused op's GEMM of 2-D GPU Operands ``a`` (M, K) and ``b_nk`` (N, K) goes
    to the vendor: its forward product (``batch`` None; its statistics epilogue then is a
    pass of its own: gemm_scale_batchnorm's _vendor_statistics; ``grad``: a forward
    whose backward will run) or a backward product of an input of ``batch`` rows.
    float32 keeps ours where it was tuned against cuBLAS: the forward always
    (GemmScaleBatchNorm's fused forward 1.0-2.5x eager in the float32 sweep), the
    backward products from FUSED_VENDOR_BATCH rows on;
    except where Hopper would run them off wgmma (:func:`_off_wgmma`), a backward product
    would read its B transposed in place (:func:`_transposed_b`) or the product is
    narrow (:func:`_narrow`: any dtype); float64 keeps ours, narrow products aside, for
    products of at most FUSED_F64_WORK[role] multiply-adds (host time), unless ``captured``
    (a plan made while a CUDA graph is captured: no host time to save, and the vendor's
    DGEMM outruns our 128 x 128 DMMA tiles at those sizes; see FUSED_F64_WORK). A 16-bit
    forward keeps ours where it runs on Hopper's wgmma (the epilogue saves the vendor's z
    a pass and a launch).
    H200, GemmScaleBatchNorm in bf16 / f16, training step against eager, ours (wgmma) /
    the vendor's GEMM + our passes, one run: 0.99 / 0.83x and 1.04 / 0.91x at
    64x512->512, 1.06 / 0.89x and 1.10 / 0.89x at 2048^3, 1.11 / 0.93x and 1.05 / 0.98x
    at 1024x8192->8192, 1.18 / 1.08x and 1.20 / 1.09x at 16384x4096->4096; forward
    1.54-1.58x / 0.91-1.17x from 2048^3 to 8192x1024->1024, 0.91 / 0.95x and 0.97 /
    1.00x at 1024x8192->8192 (our wgmma's mainloop: 0.88x cuBLAS there), a tie below.
    Every other product follows :func:`route` at any size: GemmScaleBatchNorm (the model
    converted), ours against eager, H200, forward / training step: float64 (our CUDA
    cores, then, against the FP64 tensor cores) 256x4096->4096 0.44x / 0.89x, 2048^3
    0.50x / 0.36x; 16-bit on mma.sync against cuBLAS's wgmma 1024x8192->8192 0.32-0.37x /
    0.35-0.44x."""
    forward = batch is None  # (read in place: _ZProduct; a backward product's copies: mm_plan)
    if _narrow(a, b_nk, precision, forward):
        return route_of(a, b_nk, precision, in_place=forward) == VENDOR
    if a.dtype == "float64":
        role = "backward" if batch is not None else "forward with grad" if grad else "forward"
        if not captured and a.shape[0] * a.shape[1] * b_nk.shape[0] <= FUSED_F64_WORK[role]:
            return False
        return route_of(a, b_nk, precision) == VENDOR
    if (a.dtype == "float32" and (batch is None or batch >= FUSED_VENDOR_BATCH)
            and not _off_wgmma(a, b_nk, precision, forward)
            and not (batch is not None and _transposed_b(a, b_nk))):
        return False
    if batch is None and half_wgmma(a, b_nk, precision):
        return False
    return route_of(a, b_nk, precision, in_place=forward) == VENDOR


def _narrow(a, b_nk, precision: str, forward: bool) -> bool:
    """Whether the product ``a @ b_nk.T`` fills at most a quarter of our tile's columns
    (N <= BN / 4), or, for a ``forward`` product, of its rows (M <= BM / 4; the tile of
    the dtype, precision and arch, whatever the layout: ``a`` and ``b_nk`` may be
    operands that our GEMM would copy first): a fused op's product then follows
    :func:`route` too, the vendor's narrow
    kernels (GEMV, split K) outrunning our mostly empty tiles though the statistics take
    a pass of their own. H200, GemmScaleBatchNorm's forward against eager, GPU time
    (CUDA graphs), ours / the vendor's product: "high" (BN 256) N = 16 0.55 / 0.73x
    (200000x64), 0.63 / 0.82x (65536x256), 0.67 / 1.19x (8192x1024); N = 32 0.75 / 1.07x,
    0.65 / 1.13x (4096x4096); N = 64 0.87 / 1.11x, 0.66 / 0.99x; N = 128 a tie (1.29 /
    1.29x at 65536x256, 1.29 / 1.44x at 16384x1024). bf16 (BN 256): N = 16 0.39 / 0.74x,
    0.43 / 0.82x, 0.71 / 1.41x; N = 32 0.61 / 1.16x, 0.69 / 1.22x; N = 64 0.78 / 1.18x,
    0.80 / 1.37x; N = 128 1.32 / 1.42x, 1.06 / 1.24x. "highest" (BN 128): N = 16 0.60 /
    0.83x, 0.80 / 0.94x, 1.02 / 1.34x; N = 32 0.94 / 1.06x, 2.38 / 2.27x; N = 64 1.24 /
    1.01x, 1.20 / 1.04x (SGEMM slows down: ours). float64 (gemm_dmma, 128 x 128): M = 2
    0.56 / 1.35x (2x80->12458), 0.45 / 1.14x (2x12->38), 0.52 / 1.34x (2x3071->73); M = 8,
    9 0.55 / 1.18x, 0.46 / 1.42x; N = 21 0.73 / 1.51x (67x2467). A training step's
    dW = dz^T @ x at 200000x64->16 "high" (16 x 64 out of 200000 rows): 982 us on ours,
    the step 1.47 ms against the vendor's 0.61 and eager's 0.86."""
    cfg = tile_config(a.dtype, precision, a.device)
    return 4 * b_nk.shape[0] <= cfg["BN"] or (forward and 4 * a.shape[0] <= cfg["BM"])


def routed_mm_plan(a, b, precision: str, batch: int, captured: bool = False):
    """A fused op's backward product ``a @ b`` (its input of ``batch`` rows) as ``(run,
    vendor)``, ``run(a, b) -> array`` decided once: :func:`mm_plan` on ours, or the
    vendor's product (:func:`fused_vendor`; ``vendor`` True: it takes its operands in any
    layout). ``run`` is None where ours needs a general copy: the caller then computes it
    with :func:`matmul_core`. The vendor's choice holds for the library's float32 setting
    of now (:func:`vendor_state`: part of the caller's plan key) and ``captured``
    (:func:`float64_capture`, likewise)."""
    bt = Operand(b.obj, b.kind, b.dtype, b.shape[::-1], b.strides[::-1], b.ptr, b.device,
                 b.name, b.torch)
    if fused_vendor(a, bt, precision, batch, captured=captured):
        # (straight to the library, in its eager form: matmul_core's lookup and the
        # vendor's per-call choices would cost a small step ~15 us of host)
        (M, K), N = a.shape, b.shape[1]
        return vendor_matmul(a.kind, precision, (M, N, K, a.dtype, True)), True
    return on_arrays(mm_plan(a, b, precision)), False


# ---- The dispatcher of plain products (linear, matmul): our kernels or the vendor's.
# The fused ops (GemmScaleBatchNorm's statistics epilogue, the transposed stores, M4's
# plan) and mm (their backward GEMMs) keep our kernels; only a product nothing is fused
# into may go to the vendor library: cuBLAS through torch (F.linear / torch.matmul, on
# torch's current stream) for torch tensors, through CuPy for CuPy arrays.
OURS, VENDOR = "ours", "vendor"
# Dtypes the vendor path takes per kind: CuPy's bfloat16 GEMM is not relied on (ours).
_VENDOR_DTYPES = {"torch": ("float16", "bfloat16", "float32", "float64"),
                  "cupy": ("float16", "float32", "float64")}
# Boundaries of the table below (route's comments give the measurements behind them).
_ROUTE = {"HIGHEST_MIN_M": 64, "HIGHEST_MIN_N": 128, "HIGHEST_MIN_K": 128,
          "HIGHEST_SMALL_K_MIN_MN": 2 ** 26,
          "HIGHEST_MIN_WORK": 2 ** 30, "HIGHEST_MIN_WORK_CUPY": 2 ** 28,
          "STACK_MIN_WORK": 2 ** 29, "STACK_GRAD_MIN_WORK": 3 * 2 ** 31,
          "MISALIGNED_MIN_WORK": 2 ** 30, "HALF_MISALIGNED_MIN_K": 512,
          "MISALIGNED_GRAD_MIN_WORK": 2 ** 33, "HIGHEST_GRAD_MIN_WORK": 3 * 2 ** 31,
          "TF32_MISALIGNED_MIN_N": 1000,
          # the vendor path's own forms: padded_n, bias_apart
          "PADDED_N_MIN_WORK": 2 ** 32, "PADDED_N_MIN_M": 512,
          "PADDED_GRAD_MIN_WORK": 2 ** 34, "PADDED_GRAD_MIN_N": 64,
          "BIAS_APART_MIN_WORK": 2 ** 28, "BIAS_APART_MIN_K": 1024, "BIAS_APART_MIN_N": 64}


class GemmProblem(NamedTuple):
    """A plain product (M x K) @ (K x N) as the routing table reads it: ``dtype``, a
    checked ``precision`` (read for float32 only), the arrays' ``kind`` ("torch" /
    "cupy"), the GPU's compute capability ``cc``, ``aligned`` (Hopper would run ours on
    wgmma: :func:`route_of`), ``grad`` (a torch call that autograd records, in plain
    eager mode: the vendor's is then torch's own op and backward) and ``count`` (the
    products of a stack that ours runs on one launch: the bounds on work, which are the
    host's, count them all; those on M, N and K, the tiles', one product) and
    ``planned_stack`` (that stack reads both operands in place: planned once per call
    signature, a new output and one launch a call, gemm._stack_plan).
    """
    M: int
    N: int
    K: int
    dtype: str
    precision: str
    kind: str
    cc: int
    aligned: bool = True
    grad: bool = False
    count: int = 1
    planned_stack: bool = False


def route(p: GemmProblem) -> str:
    """OURS or VENDOR for the plain product ``p``. Each rule with its
    measurement: H200, one run, our kernel forced against the vendor (cuBLAS through
    torch; "highest": SGEMM), events around each call, host included, shapes as M x K x
    N."""
    if _FORCED[0] is not None:
        return _FORCED[0]
    M, N, K, dtype, precision, kind, cc, aligned, grad, count, planned_stack = p
    if dtype not in _VENDOR_DTYPES.get(kind, ()):
        return OURS  # (CuPy bfloat16)
    # Below sm_80 ours runs on CUDA cores only, as cuBLAS's SGEMM/DGEMM do, while cuBLAS
    # has Turing's fp16 tensor cores and tuned tiles (not measured: no sm_75 machine).
    if cc < 80:
        return VENDOR
    # float64: ours was a CUDA-core kernel (1x4096x4096 440 us against 35, 0.08x, a
    # matrix-vector product). On DMMA it still never wins against cuBLAS's DGEMM (mm, H200, one
    # run: 1x4096x4096 125 us against 41, 256x1024x1024 44.6 / 20.9, 2048^3 433 / 293,
    # 4096^3 3232 / 2319, 8192^3 26.2 / 18.1 ms; 40-42 TFLOP/s against 59-61), nor
    # against F.linear's addmm once its bias is added apart (bias_apart: 2048^3 418 us
    # against 316).
    if dtype == "float64":
        return VENDOR
    # float16 / bfloat16: ours was mma.sync, a third of cuBLAS's wgmma (1024x8192x8192 bf16
    # 560 us against 179, 0.32x). Ours on Hopper's wgmma (K-major aligned rows) still
    # never wins (H200, 2026-11-26, bf16, one run, three alternating medians each):
    # 1024x8192x8192 0.97x, 2048x8192x8192 0.95x, 512x8192x8192 0.98x, 1024x4096x16384
    # 0.86x, 8192^3 0.98x, 4096^3 0.92x, 16384x4096x4096 0.94x, 2048^3 0.94x; and few
    # tiles lose by far without split K (256x4096x4096 0.48x, 128x1024x512 0.41x).
    # Except where N leaves the output's rows off 16-byte alignment (N % 8): cuBLAS then
    # runs slower kernels (for some N and K slow enough that padded_n's copy is the vendor
    # path's best), while ours stores any row. Ours (wgmma, operands K-major in place) / the
    # vendor route, x eager, bf16 linear (2026-11-27, events around each call):
    # 256x4096x4100 1.81 / 0.86x, 2048x2048x2047 5.79 / 3.61x, 8192x1024x50257 5.70 /
    # 3.88x (against torch.compile, which pads the output's rows: 0.95 / 0.65x). A
    # misaligned K is not ours: its element loads run mma.sync (4096x4095x4096 0.39x), nor
    # is matmul's row-major b (copied first: 256x4096x4100 0.56x), nor a short K, where
    # the product is the output's stores (576x16x15101 bf16, GPU time from CUDA graphs:
    # ours 21.6 us against 18.2; the wins above have K >= 512).
    # Not below MISALIGNED_MIN_WORK, where a call is the host's: ours launches for ~40 us
    # of host time against F.linear's ~20 (events around each call had ours ahead there:
    # 1024x1024x1023 2.39x, 8192x4096x17 1.47x; H200, 2026-11-27, no grad, calls back to
    # back, ours / the vendor route x eager, linear bf16: 64x1024x1025 (2**26) 0.50 / 0.71x,
    # 128x1024x1025 0.63 / 0.98x, 333x776x555 0.59 / 0.95x, 256x1024x1025 0.62 / 0.99x,
    # 512x1024x1025 (2**29) 1.03 / 0.99x, 128x4096x1025 1.48 / 0.99x, 1024x1024x1025
    # (2**30) 1.30x; matmul bf16 512x1024x1025 0.67 / 0.84x, 1024x1024x1025 1.10x; the
    # same for TF32 below).
    # A call that autograd records (a training step: the forward on ours pays a Python
    # autograd node and its backward ops, whose products are the vendor's either way) is
    # the vendor's below MISALIGNED_GRAD_MIN_WORK (H200, steps back to back, the op / x
    # eager: bf16 linear 256x1024x1025 0.60x, 1024x1024x1025 0.64x, 2048x2048x2047 (just
    # under 2**33) 0.90-1.23x, 4096x2048x2047 1.07-1.41x; matmul 0.34-0.79x, then
    # 1.34-1.57x; TF32 linear 0.59-0.86x, then 1.01-1.19x; the vendor route 0.98-1.01x from 2**32).
    c, work = _ROUTE, M * N * K * count
    misaligned_ours = work >= c["MISALIGNED_MIN_WORK"] and (
        not grad or work >= c["MISALIGNED_GRAD_MIN_WORK"])
    if dtype != "float32":
        if (cc == 90 and aligned and N % 8 and K >= c["HALF_MISALIGNED_MIN_K"]
                and misaligned_ours):
            return OURS
        return VENDOR
    if precision == "highest":
        # The vendor's "highest" is SGEMM (exact fp32 products and sums). It takes what is
        # memory-bound or too small to fill the GPU, where 3xTF32's three tensor-core
        # products buy nothing and SGEMM runs as fast as the bytes allow:
        #  M < 64: 16x8192x8192 ours 262 us against 204 (0.78x); 64x4096x4096 ours 1.96x.
        #  N < 128: matmul 8192x2048x64 ours 74 us against 61 (0.82x; cuBLAS's NN kernel;
        #    linear's NT one 95 us: 1.29x, given up for one rule); 8192x4096x16 1.01x.
        #  K < 128: linear 100000x64x64 ours 44 us against 38 (0.85x); stacks of attention's
        #    (96, 512, 64) @ (96, 64, 512) 0.43x. Except outputs of HIGHEST_SMALL_K_MIN_MN
        #    elements or more, where the product is the output's stores, which ours makes at
        #    twice SGEMM's speed (H200, matmul, events around each call, ours / SGEMM:
        #    8192x64x8192 (2**26 outputs) 0.133 / 0.260 ms, 1.95x; 16384x{32,64,96}x16384
        #    1.95x, 2.08x, 2.28x; 4096x64x65536 2.11x; 32768x64x32768 1.99-2.16x,
        #    32768x32x32768 1.63-1.87x; untimed between 512^2 and 8192^2 outputs).
        #  fewer than HIGHEST_MIN_WORK multiply-adds, where a call is bound by the host's
        #    time (ours launches for 35-60 us of it, F.linear for 14-25): H200 and H100,
        #    2026-11-27, calls back to back, no grad, ours / the vendor route x eager:
        #    linear 256x1024x1024 (2**28) 0.49 / 0.85x, 333x1024x1000 1.12 / 0.99x; at
        #    2**29 0.57-1.66x (512x1024x1024: 0.57 on the H100's host, 1.03 on the H200's)
        #    / 0.86-0.99x; matmul 0.68-0.84x at 2**28, 0.58-1.00x at 2**29 / 0.82-0.98x;
        #    at 2**30 linear 1.10-1.75x, matmul 0.96-1.39x / 0.96-0.98x. (Events around
        #    each call had ours ahead from 2**28: 2.11x.) CuPy arrays from
        #    HIGHEST_MIN_WORK_CUPY: the vendor's path there (our wrapper, then cupy.matmul)
        #    costs 10-18 us a call over cupy's own, more than ours does (H200, x cupy's @,
        #    ours / the vendor route: 256x1024x1024 (2**28) 0.85-0.90 / 0.70-0.76x,
        #    512x1024x1024 1.21-1.30 / 0.96-0.97x, 1000^3 1.27-1.29 / 0.98x; 333x777x555
        #    0.63-0.64 / 0.68-0.73x).
        # Ours elsewhere: 2048^3 2.35x, 6144^3 2.52x, 3000x5000x700 1.33x, 256x12288x4096
        # 1.76x (matmul 1.35x), 8192x1024x50257 2.30x, 128x4096x4096 3.84x.
        # On Hopper, rows that wgmma cannot read leave ours on mma.sync's element loads,
        # slower than SGEMM (H200, linear, GPU time from CUDA graphs, ours / SGEMM, K % 4
        # rows read in place: 231x3650x4130 676 / 209 us, 296x305x6324 102 / 33,
        # 4099x5583x297 937 / 439, 748x1602x632 73 / 53): the vendor's (``aligned``
        # False). Rows of K % 4 (or off 16-byte boundaries) are copied first where copying
        # pays (gemm_operands._COPY_WORK: N >= 128 for x, M >= 128 for W) into 16-byte rows
        # of K rounded up to 4 (gemm_operands.padded_ld, the tiled copy kernel; a
        # transposed operand's copy too), and count as aligned where the kernel choice
        # then takes them on wgmma (route_of, _on_wgmma): those products follow the bounds
        # above as aligned ones do (H200, matmul 8205x2949x5921 with the copies, events
        # around each call: 2.60-2.67 ms against SGEMM's 6.51, 2.44-2.51x; the other
        # shapes above not yet timed with the copies).
        # A call that autograd records, below HIGHEST_GRAD_MIN_WORK: the vendor's (its
        # backward's two products on ours each pay the op's host time). H200, training
        # steps back to back, ours / the vendor route x eager: linear 256x1024x1025 0.49x,
        # 1024^3 0.63 / 0.91x, 1024x2048x1024 1.10 / 0.99x, 2048x2048x1024 (2**32) 1.13x,
        # 2048^3 1.98x; matmul 1024^3 0.41 / 0.89x, 1024x2048x1024 0.65 / 0.99x, 2**32
        # 1.22x, 2048^3 1.83x. On a slower host (2026-11-28, H200, F.linear 24-33 us a
        # call, ours forced / dispatched x eager) ours' step is the host's: ~490 us a step
        # at 1024x2048x1024 of 168 us GPU time (0.55x; matmul 0.60x), 2**32 0.88-1.09x
        # (matmul 0.83-0.99x): the vendor's below 2**33, where ours' step stays ahead
        # (2048^3: ~1100 us of eager GPU time against ours' ~340). Re-measured on the
        # plans' leaner host path (2026-12-02, H200, one run, linear / matmul steps, events
        # around each step, ours forced x eager): 1024^3 0.71 / 0.62x, 2048x1024x1024 0.72 /
        # 0.69x, 4096x768x768 0.75 / 0.78x, 1024x2048x2048 (2**32) 0.94 / 0.85x; BERT's QKV
        # 4096x768x2304 (2**32.75) 1.41 / 1.35x, 2048^3 1.37 / 1.52x, 4096x768x3072 1.32 /
        # 1.33x. So from 3 * 2**31 on, which takes a BERT-base encoder's QKV projections
        # (8 x 512 tokens, benchmarks.models, float32 "highest", same run): its step 50.6-51.3
        # ms at 2**33 (1.24-1.26x SGEMM's), 44.3 ms (1.43x) at 2**32, 43.7 ms (1.45x) at 2**31,
        # where its 768x768 projections (0.75x alone: a model's queue hides their host
        # time, a lone step does not) join.
        # A stack planned on one launch (``planned_stack``) from STACK_MIN_WORK, whatever its
        # K and N of at least HIGHEST_MIN_M: the other rules price ours' unplanned stacks and
        # a 2-D product's tiles, not attention's products, which its planned launch takes
        # at 1.2-2.2x SGEMM (H200, ours forced, planned, against eager's batched SGEMM,
        # events around each call, medians of 15, heads x T x d, QK^T / PV):
        # 12x1024x64 (2**29.6) 1.19 / 1.18x, 96x512x64 (2**30.6) 1.24 / 1.22x, 48x512x128
        # 1.29 / 1.41x, 96x1024x128 1.54 / 1.98x, 384x1024x128 1.57 / 2.17x; below it both
        # are host-bound: 12x128x64 0.73 / 0.68x, 48x256x64 0.87 / 0.82x, 96x256x64
        # (2**28.6) 1.00 / 0.69x. As routed, with q, k, v (batch, head) views of one
        # projection (two levels of strides), another H200 host: B x H x T x d 1x12x1024x64
        # 1.15 / 1.20x, 8x12x512x64 1.20 / 1.29x, 4x12x512x128 1.35 / 1.62x, 8x12x1024x128
        # 1.82 / 2.24x, error against float64 at or below SGEMM's. A recorded one from
        # STACK_GRAD_MIN_WORK, as 2-D products: a lone attention step (forward and
        # backward, cupykern.torch.attention's helper / plain torch, same H200, its
        # backward's q^T ds planned with q^T's copy, p^T g the vendor's) at 2**29:
        # 8x12x512x64 0.92x, 8x12x256x64 0.91x, 4x12x1024x64 1.17x; at 3 * 2**31 (torch's
        # products) 1.00x, 0.97x, 0.99x. (A BERT-base step, whose queue hides host time:
        # 43.2-44.4 ms at 2**29 against 44.4-45.5 at 3 * 2**31, SGEMM's 63.5.)
        if (planned_stack and aligned and min(M, N) >= c["HIGHEST_MIN_M"]
                and work >= c["STACK_GRAD_MIN_WORK" if grad else "STACK_MIN_WORK"]):
            return OURS
        small_k = K < c["HIGHEST_MIN_K"] and M * N < c["HIGHEST_SMALL_K_MIN_MN"]
        if (M < c["HIGHEST_MIN_M"] or N < c["HIGHEST_MIN_N"] or small_k
                or work < c["HIGHEST_MIN_WORK_CUPY" if kind == "cupy" else "HIGHEST_MIN_WORK"]
                or (cc == 90 and not aligned)
                or (grad and work < c["HIGHEST_GRAD_MIN_WORK"])):
            return VENDOR
        return OURS
    # "high" / "medium" (TF32): ours on Hopper's wgmma ties cuBLAS's TF32 where cuBLAS has
    # its aligned kernels (2048^3 1.01x, 6144^3 0.98x, 128x4096x4096 0.99x) and loses
    # elsewhere (1000^3 0.78x, 2048x1024x32000 0.88x, 1536x768x3072 0.74x, 8192x4096x16
    # 0.45x, matmul 256x12288x4096 0.42x): the vendor's. cuBLAS slows down where the rows
    # of N are not 16-byte aligned (N % 4): 4097x1000x3001 ours 2.69x, 8192x1024x50257
    # 2.71x (matmul 2.42x): ours there, for products of MISALIGNED_MIN_WORK as above
    # (linear 256x1024x1025 0.46 / 0.84x, 512x1024x1025 0.89 / 1.00x, 1024x512x1025 0.65 /
    # 0.93x, 1024x1024x1025 1.45x; matmul 0.57-0.91x through 2**29, 1024x1024x1025 1.18x).
    # K % 4 rows count as aligned after their padded copy, as for "highest" above (H200,
    # 2026-12-02, linear "high" with bias, GPU time from CUDA graphs, ours x F.linear:
    # 4097x1001x3001 1.79x, 2048x2046x2047 1.79x, 1500x3003x2001 2.06x, 2048x4098x1025
    # 1.45x, 16384x1030x1023 1.69x, 8192x1022x50257 2.13x; aligned K 2.25-2.88x). Not for
    # fewer than TF32_MISALIGNED_MIN_N columns, whose few tiles leave SMs idle: 4284x1530x198
    # 0.79x, 8000x769x333 0.97x (the wins above have N >= 1023; untimed between).
    if (cc == 90 and aligned and N % 4 and N >= c["TF32_MISALIGNED_MIN_N"]
            and misaligned_ours):
        return OURS
    return VENDOR


def vendor_any_layout(p: GemmProblem) -> bool:
    """Whether :func:`route` gives ``p`` to the vendor whatever its operands' layout and
    alignment, and ``p.grad`` False unless the caller's key holds whether autograd records
    the call (``grad`` only ever moves a product to the vendor): a plan of such a product
    holds for any call of its shapes, dtype and precision (the torch layer's shape-keyed
    plans, which read no strides)."""
    return all(route(p._replace(aligned=a)) == VENDOR for a in (True, False))


def padded_n(M: int, N: int, K: int, dtype: str) -> int:
    """How many columns the vendor's 16-bit product computes: N, or N rounded up to a
    multiple of 8 in a product of at least PADDED_N_MIN_WORK multiply-adds where cuBLAS runs slow
    kernels for the output's rows (an odd N with an even K; N % 4 == 2 with K % 8 == 0)
    and the padded product does not: the vendor path then pads W (or b) with zero rows,
    computes the padded product and copies its N columns out. Elsewhere the pad and the
    copy only slow cuBLAS's own kernel down. H200 bf16 linear, GPU time from CUDA graphs,
    F.linear / padded (us): padded 8192x1024x50257 9010 / 2263, 2048x2048x2047 190 / 41,
    1024x4096x4097 359 / 87, 2048x2050x2047 134 / 94, 1024x4096x4098 126 / 87; not
    (an odd K) 2048x2047x2047 137 / 157, 4099x5583x297 180 / 194, 1372x59x14086 49 / 98,
    35x3671x11870 100 / 204; (N % 4 == 2, K % 8 == 2) 231x3650x4130 56 / 97,
    2854x66x6810 39 / 88, 4525x234x2530 45 / 74; (N % 4 == 0) 256x4096x4100 53 / 56.
    Odd N with K % 8 of 2, 4 or 6 (K's rows off 16 bytes) pays too (2026-12-02, with bias):
    2048x2044x2047 158 / 93, 2048x2046x2047 131 / 92, 1024x4100x4097 300 / 186,
    8192x1020x50257 7357 / 4604, 4096x1030x1023 74 / 57, 3053x4158x85 59 / 47, 512x4092x1025
    86 / 64 (1.08-1.70x; 4.1-4.3x with K % 8 == 0 in the same run). Its pad and copy-out
    are four torch calls of host time, which calls back to back pay where the GPU work
    they save is small: bf16 3053x4158x85 (2**30) 168 us a call against F.linear's 60,
    8204x324x1435 (2**31) 159 / 102 (H200, the host-included survey): not below
    PADDED_N_MIN_WORK, where F.linear's own GPU time (74-300 us above) covers that host time.
    The pad copies b (K x N) while the product saves in proportion to M: not below
    PADDED_N_MIN_M rows (bf16 GemmScaleBatchNorm's dW at 12108x1961->57, 57x12108x1961:
    the copy 62.4 us against the product's 47.3 -> 25.0)."""
    slow = (N % 2 and K % 2 == 0) or (N % 4 == 2 and K % 8 == 0)
    if (dtype in ("float16", "bfloat16") and slow and M * N * K >= _ROUTE["PADDED_N_MIN_WORK"]
            and M >= _ROUTE["PADDED_N_MIN_M"]):
        return cdiv(N, 8) * 8
    return N


def padded_grad(M: int, N: int, K: int, dtype: str, precision: str) -> int:
    """How many columns linear's backward gives the gradient g (M x N) of an (M x K) @
    (K x N) forward: N, or N rounded up to whole 16-byte rows, where g's rows are off them
    and cuBLAS runs slow kernels for both products it reads g in (dx = g @ W sums over N,
    dW = g^T @ x reads g transposed): g is then copied once into rows of that stride, zeros
    past its N columns, and W padded with zero rows, so that dx sums over the padded N and
    dW reads g's columns in place. 16-bit and TF32 (SGEMM, "highest", runs alike either
    way: 0.94-1.00x, H200). H200, GPU time by events, eager's two products / padded (the
    copies included), us: bf16 2048x2048x2047 216 / 103, 4096x4096x4095 1864 / 553,
    8192x1024x50257 11868 / 4024; float16 alike; TF32 280 / 176, 2163 / 1189, 13785 /
    8799. Training steps (forward on ours, host included) x eager, without / with: bf16
    4096x4096x4095 1.48 / 3.36x, 8192x1024x50257 1.54 / 3.72x; "high" 1.25 / 2.00x and
    1.24 / 1.97x. Not below PADDED_GRAD_MIN_WORK multiply-adds, where the step is bound by
    the host's time, which the copies' three launches add to (bf16 1024x2048x1025 0.73 /
    0.34x, 2048x2048x2047 1.44 / 0.76x), nor for a few columns (512x4096x11: 31 / 82 us).
    The padded g is a second copy of g for the backward's time (bf16 8192x1024x50257:
    0.8 GB beside g's 0.8). Timed with the products on the vendor; where they run on ours
    (float32 "high" against torch's TF32 switch) the padding is not timed."""
    step, c = 16 // ITEMSIZE[dtype], _ROUTE
    tf32 = dtype == "float32" and precision != "highest"
    if ((dtype in ("float16", "bfloat16") or tf32) and N % step and N >= c["PADDED_GRAD_MIN_N"]
            and M * N * K >= c["PADDED_GRAD_MIN_WORK"]):
        return cdiv(N, step) * step
    return N


def bias_apart(M: int, N: int, K: int, dtype: str) -> bool:
    """Whether the vendor's linear adds the bias after its product (a GEMM, then one
    elementwise pass) rather than in cuBLAS's GEMM with a bias (torch's addmm): float64
    products of at least 2**28 multiply-adds, K >= 1024 and N >= 64, where addmm runs at about half
    the plain GEMM's rate (H200, one run, F.linear against mm + add_, us: 1024^3 79.4 /
    49.2, 2048^3 579 / 316, 4096^3 5128 / 2606, 3000x5000x700 716 / 395, 8192x2048x64
    84.6 / 61.1, 256x12288x4096 933 / 519; a tie at 256x1024x1024, 2**28: 25.9 / 25.5,
    and 4x2048x2048: 22.8 / 23.3). A short K makes the GEMM memory-bound, and the extra
    pass over the output then costs more than addmm loses (the sweep, 100000x64x64:
    67.3 us against 53.3), as does a few columns' N (13200x2843x8, GPU time from CUDA
    graphs: 120.0 us against 101.3)."""
    c = _ROUTE
    return (dtype == "float64" and M * N * K >= c["BIAS_APART_MIN_WORK"]
            and K >= c["BIAS_APART_MIN_K"] and N >= c["BIAS_APART_MIN_N"])


_FORCED = [None]  # forced_route's override


@contextlib.contextmanager
def forced_route(which):
    """Within it, :func:`route` answers ``which`` (OURS or VENDOR) for every product: the
    tests of our kernels at shapes the vendor would take, and the benchmark's timing of
    each path. Plans made outside (linear's, matmul's and those of :func:`register_plans`)
    are dropped on the way in and out."""
    if which not in (OURS, VENDOR):
        raise ValueError(f"which: expected {OURS!r} or {VENDOR!r}, got {which!r}")
    old = _FORCED[0]
    _FORCED[0] = which
    _drop_plans()
    try:
        yield
    finally:
        _FORCED[0] = old
        _drop_plans()


def register_plans(*caches: dict) -> None:
    """Plan caches (dicts) whose plans depend on :func:`route`: :func:`forced_route`
    drops them with linear's and matmul's own."""
    _ROUTED_CACHES.extend(caches)


_ROUTED_CACHES: list = []


def _drop_plans():
    for cache in _ROUTED_CACHES:
        cache.clear()


def route_of(ao, bo_nk, precision: str, grad: bool = False, count: int = 1,
             in_place: bool = False, planned_stack: bool = False) -> str:
    """:func:`route` for GPU Operands ``ao`` (M, K) and ``bo_nk`` (N, K) as the GEMM reads
    them (float32: ``aligned`` where Hopper runs ours on wgmma, :func:`_on_wgmma`, after
    the copies a plain product makes, or, ``in_place``, reading them as given: a fused
    op's forward), of a stack of ``count`` such products on one launch (``planned_stack``:
    as :class:`GemmProblem`'s)."""
    (M, K), N = ao.shape, bo_nk.shape[0]
    cc = _loader.device_cc(ao.device)
    aligned = True
    if ao.dtype != "float64" and cc == 90:
        work = M * N * K
        if ao.dtype == "float32":
            aligned = _on_wgmma(ao, bo_nk, precision, not in_place)
        else:  # 16-bit wgmma reads both in place, where _choose takes it
            aligned = (all(read_mode(o, work)[0] == "view" for o in (ao, bo_nk))
                       and half_wgmma(ao, bo_nk, precision))
    which = route(GemmProblem(M, N, K, ao.dtype, precision, ao.kind, cc, aligned, grad, count,
                              planned_stack))
    if which == VENDOR and not vendor_of(ao.kind).takes(ao.dtype, precision):
        return OURS
    return which


def _transposed_b(a, b_nk) -> bool:
    """Whether ours would read ``b_nk`` of ``a @ b_nk.T`` transposed in place (element
    loads, no TMA: a copy does not pay, :func:`read_mode`), as a fused op's dW = dz^T @ x
    does for fewer than _COPY_WORK output features: such a product follows :func:`route`
    too. H200, GemmScaleBatchNorm's training step "highest", dW alone, ours (3xTF32, split
    K) / eager's SGEMM: 200000x64->16 1452 / 50 us, 200000x64->64 1448 / 54, 12108x1961->57
    184 / 75."""
    lay = layout(b_nk)
    work = a.shape[0] * a.shape[1] * b_nk.shape[0]
    return lay is not None and lay[0] and read_mode(b_nk, work)[0] == "view"


def _off_wgmma(a, b_nk, precision: str, in_place: bool = False) -> bool:
    """Whether a Hopper GPU runs the float32 ``a @ b_nk.T`` off its wgmma kernels
    (:func:`_on_wgmma`; ``in_place``: a forward's operands, read as given, else a backward
    product's, after mm's copies): then a fused op's product follows :func:`route` too
    (H200, GemmScaleBatchNorm's forward, GPU time, ours on mma.sync / eager: 4099x5583->297
    "highest" 949 / 464 us, "high" 573 / 212; 296x305->6324 "highest" 117 / 54)."""
    return _loader.device_cc(a.device) == 90 and not _on_wgmma(a, b_nk, precision, not in_place)


def _on_wgmma(a, b_nk, precision: str, copies: bool = True) -> bool:
    """Whether ours runs the float32 ``a @ b_nk.T`` (2-D GPU Operands) on Hopper's wgmma,
    reading them after the copies :func:`read_mode` makes (``copies``: a plain product,
    linear / matmul / mm) or as given: both :func:`_wgmma_rows`, and where K % 4 != 0
    (rows of K in a 16-byte stride: the copies' :func:`padded_ld` rows), where the kernel
    choice takes them on wgmma (TMA reads such rows; its maps stop at K)."""
    work = a.shape[0] * a.shape[1] * b_nk.shape[0]
    ops = [planned_operand(o, work) if copies else o for o in (a, b_nk)]
    if not all(_wgmma_rows(o) for o in ops):
        return False
    return a.shape[1] % 4 == 0 or _choose(*ops, precision).cfg is tile_config(a.dtype, precision, a.device)


def _wgmma_rows(o) -> bool:
    """Whether Hopper's wgmma can read the float32 2-D Operand ``o`` as given: transposed
    (see :func:`route`), or K-contiguous rows that start and step on 16-byte boundaries
    (any K: whether rows of K % 4 are read so is the kernel choice's, :func:`_on_wgmma`)."""
    lay = layout(o)
    return lay is not None and (lay[0] or vector_aligned(o.ptr, lay[1], 0, 4))
