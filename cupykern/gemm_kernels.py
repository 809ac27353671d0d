"""Our GEMM kernels: the catalogue of their instantiations (launch constants named once,
each kernel taking them as template parameters), the choice of kernel for a product
(:func:`gemm_kernel`), its split K and its launches (:func:`gemm_call`, :func:`gemm`).

A product is ``a @ b.T`` of 2-D Operands ``a`` (M, K) and ``b`` (N, K) as :func:`layout`
reads them in place. float32 follows PyTorch's precision names (3xTF32 for "highest",
TF32 for "high"; see :mod:`cupykern.gemm`); float16 / bfloat16 run on the tensor cores
with float32 sums; float64 on the FP64 tensor cores (DMMA) where the GPU has them. On
Hopper, K-major 16-byte aligned rows run on wgmma (sm_90a), everything else on mma.sync
(sm_80+); below sm_80 every dtype runs on the CUDA-core kernel.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _loader, _tma
from ._array import CTYPE, ITEMSIZE, data_ptr, empty, launch_all, scalar
from ._geometry import MAX_GRID_Y, acc_dtype, cdiv, row_stride, vector_aligned

# Kernel files, one per variant (kernels_cu/gemm.cuh: what they share): the CUDA-core
# kernel and the passes, mma.sync (sm_80+), wgmma (Hopper), float64's mma.sync (DMMA)
_FILE, _MMA_FILE, _WGMMA_FILE, _DMMA_FILE = "gemm.cu", "gemm_mma.cu", "gemm_wgmma.cu", "gemm_dmma.cu"
_MODE = {"highest": 0, "high": 1, "medium": 2}
_HALF = 3  # float16 / bfloat16 tensor-core mode
# Launch constants, named here once; each kernel takes them as template parameters and
# static_asserts what its code relies on (kernels_cu/gemm_mma.cu, gemm_wgmma.cu).
# gemm_mma (sm_80+): 128x128 tiles, 8 warps, STAGES K slices of 128 bytes per row, each
# smem row padded by 16 bytes (ldmatrix / cp.async conflict-free).
_MMA = {"BM": 128, "BN": 128, "THREADS": 256, "STAGES": 4}
_MMA["SMEM"] = _MMA["STAGES"] * (_MMA["BM"] + _MMA["BN"]) * (128 + 16)
# gemm_wgmma (Hopper: float32 "highest"/"high" with 16-byte aligned rows; float16 /
# bfloat16 (_HALF) with K-major, 16-byte aligned rows, by TMA): per mode, stages of K
# slices of KS elements (one 128-byte swizzled row: 32 floats or 64 halves) of A and B
# (3xTF32 also B's remainders), 3 mbarriers per stage, 1 KB alignment slack; a producer
# warpgroup and two consumer warpgroups. 16-bit takes TF32's constants: a slice is the
# same bytes, and its 4 m64n256k16 wgmma do twice the work of TF32's 4 m64n256k8 at twice
# the tensor cores' rate.
_WGMMA = {}
for _m, _bn in ((0, 128), (1, 256), (_HALF, 256)):
    # BOX: rows per bulk tensor copy (TMA) of a K slice; H100 "high", x cuBLAS TF32 (same
    # run, medians of 5): 64 rows 0.96 / 0.93 / 1.00 at 1024x8192x8192 / 16384x4096x4096 /
    # 8192^3, 128 rows 0.97 / 0.89 / 0.96, 32 rows 0.97 / 0.89 / 1.01, cp.async 0.95 / 0.92 / 0.91.
    _c = _WGMMA[_m] = {"BM": 128, "BN": _bn, "THREADS": 384, "STAGES": 4, "BOX": 64,
                       "KS": 64 if _m == _HALF else 32}
    # CLUSTER: CTAs of two consecutive M tiles (same N tile) load half of each B slice
    # each, multicast to both (TF32 with TMA, where the M tiles pair up): TF32 at 128 x 256
    # tiles reads ~10 TB/s of operands from L2; H100 "high" with half of B read (the
    # probe for this), 1024x8192 x 8192x8192: forward 0.358 -> 0.336 ms, dx 0.342 ->
    # 0.311, dW 0.393 -> 0.365. 3xTF32 does three times the math per byte: one CTA.
    # 16-bit reads operands at TF32's rate of bytes per tensor-core second: clusters too
    # (H200, graph-timed, two runs each, CL 1 / 2 in us: 1024x8192x8192 191 / 206,
    # 8192^3 1680 / 1655, 16384x4096x4096 865 / 865, 4096^3 206 / 221: within the runs'
    # +-7% spread, so kept as TF32's).
    _c["CLUSTER"] = 1 if _m == 0 else 2
    _stage = _c["BM"] * 128 + _bn * 128 + (_bn * 128 if _m == 0 else 0)
    _c["SMEM"] = _c["STAGES"] * (_stage + 3 * 8) + 1024
# 16-bit products split K (float slabs, see _SPLIT) where their tiles fill at most a
# quarter of the SMs as float32's do, and, with K >= SPLIT_FILL_K, at most 1 / SPLIT_FILL.
# H200 bf16, graph-timed us, split / unsplit (cuBLAS), a quarter: 256x4096x4096 (M x K x
# N) 23.2 / 42.2 (14.4), 128x1024x512 9.3 / 13.6 (3.8), 64x8192x8192 45.9 / 78.2 (36.2),
# 1024^3 13.7 / 14.1 (5.4); from a quarter to half: 512x4096x4096 34.1 / 43.4 (23.6),
# 256x8192x8192 59.0 / 86.7 (51.9), 1024x4096x2048 33.2 / 43.2 (23.4), 512x2048x4096
# 25.9 / 27.2 (13.6), but K <= 1024 lost: 2048x1024x1024 17.9 / 14.5, 1000x520x1030 16.3
# / 13.4, 640x1024x2048 15.0 / 14.7 (the slabs' round trip outweighs short chunks).
_WGMMA[_HALF].update(SPLIT_FILL=2, SPLIT_FILL_K=2048)
# 3xTF32 (three tensor-core products per K slice: a tile's mainloop is long against the
# slabs' round trip) splits a 2-D product's K wherever two chunks of its tiles fit on the
# SMs (tiles at most half of them) from MATRIX_SPLIT_FILL_K on. H200, float32 "highest",
# GPU time from CUDA graphs, linear / a^T @ b (dW's transposed read), in us, split at a
# quarter / at a half (M x K x N, tiles): 768x4096x768 (36) 144.7 / 55.6 and 151.6 /
# 68.3, 1024x4096x1024 (64) 139.0 / 78.5, 896x2048x896 (49) 76.5 / 44.2, 640x3072x1152
# (45) 112.6 / 60.8, 1024x2048x1024 (64) 76.9 / 45.1; error against float64 no larger
# (shorter sums). Calls back to back (host included, x SGEMM, quarter -> half):
# 768x4096x768 0.82 -> 2.02x, 1024x2048x1024 1.29 -> 2.15x, 1024x4096x1024 1.33 ->
# 2.29x. A shorter K saves less GPU time than a call's extra launch and workspace may
# cost the host: 768^3 (36) 31.5 / 16.9, 1024^3 (64) 40.7 / 26.8, 1024x512x1024 22.7 /
# 17.9, 1024x256x1024 13.8 / 13.5; back to back 1024^3 1.41 -> 1.75x but 768x1024x1024
# 1.18 -> 0.97x (one run). A stack keeps the quarter (:func:`_batched`: its one launch).
_WGMMA[0].update(MATRIX_SPLIT_FILL=2, MATRIX_SPLIT_FILL_K=2048)
# The element type gemm_wgmma's tensor maps declare, per (dtype, mode). TF32: the copy engine
# rounds each fp32 element to TF32 (to nearest) on its way to shared memory, as cuBLAS's
# TF32 GEMM does, where the tensor core fed raw fp32 bits would truncate them (2.7x
# cuBLAS's error on mixed-sign data); 3xTF32 splits the raw fp32 bits itself.
_MAP_DTYPE = {("float32", 0): _tma.FLOAT32, ("float32", 1): _tma.TFLOAT32,
              ("float16", _HALF): _tma.FLOAT16, ("bfloat16", _HALF): _tma.BFLOAT16}
_SIMPLE = {"TILE": 64, "THREADS": 256}  # CUDA-core kernel: 16x16 threads, 4x4 outputs each
# gemm_dmma (float64 on the FP64 tensor cores): 128x128 tiles, 8 warps of 64x32, STAGES
# K slices of BK doubles per row, each smem row padded by 8 doubles (conflict-free
# 16-byte fragment loads); 147 KB fits sm_80's 163 KB.
_DMMA = {"BM": 128, "BN": 128, "THREADS": 256, "STAGES": 3, "BK": 16}
_DMMA["SMEM"] = _DMMA["STAGES"] * (_DMMA["BM"] + _DMMA["BN"]) * (_DMMA["BK"] + 8) * 8
# Its split K takes chunks down to one ALIGN (32 doubles): a DMMA tile does 4x an fp32
# tile's work per K. H100, GemmScaleBatchNorm's float64 forward, graph-timed us, ours /
# eager, chunks of at least 128 / 64 / 32: 64x512->512 26.0 / 21.2 / 19.5 (21.7),
# 128x1024->512 31.2 / 27.0 / 27.1 (27.0).
_DMMA["SPLIT_MIN_K"] = 32
# The GPUs with FP64 tensor cores (A100, H100 / H200, B200); the others' float64 rate is a
# sliver of their float32 one, and DMMA no faster than their CUDA cores.
_DMMA_CCS = (80, 90, 100)
_TRANSPOSE = {"TILE": 32, "THREADS": 256}  # transposed operand copies: 32x32 tiles, 8 warps
# Split K (float32 / float64, and 16-bit on gemm_wgmma; kernels_cu/gemm.cuh): a grid of
# few tiles takes up to MAX K chunks (of a length of at least MIN_K, or the kernel's
# SPLIT_MIN_K, a multiple of the kernel's K slice: ALIGN, the float32 kernels' slice, or
# gemm_wgmma's KS; the last chunk may be shorter) when it would fill at most 1 / FILL of
# the SMs (gemm_wgmma's 16-bit mode with a long K: its SPLIT_FILL; 3xTF32's 2-D products
# with a long K: its MATRIX_SPLIT_FILL);
# splitk_reduce adds the slabs in blocks of COLS columns (a warp) by THREADS / COLS groups
# of ROWS rows (its M tile for the partial statistics: BM rows). Measured on H100
# (128x1024 @ 1024x512, 3xTF32): 40.5 us unsplit, 16.0 us with 8 rows per thread, 14.2
# with 4; 16-row tiles of statistics made GSBN's merge longer. From LONG_K on, chunks are
# long whatever their count: up to one CTA per SM (H200, float32 "highest", (256, 524288)
# @ (524288, 256), 4 tiles: 16 chunks on 64 SMs 1.512 ms against SGEMM's 1.317).
_SPLIT = {"MAX": 16, "LONG_K": 65536, "MIN_K": 128, "ALIGN": 32, "FILL": 4, "THREADS": 256, "ROWS": 4, "COLS": 32}
_SPLIT["BM"] = _SPLIT["THREADS"] // _SPLIT["COLS"] * _SPLIT["ROWS"]
assert all(_WGMMA[m]["KS"] == _SPLIT["ALIGN"] for m in (0, 1))
PART_ROWS = 4  # partial statistics per M tile and column: mean, M2, min, max (stats.cuh)


def _cbool(v: bool) -> str:
    return "true" if v else "false"


def _mma_expr(dtype: str, mode: int, aligned: bool, ta: bool = False, tb: bool = False) -> str:
    c = _MMA
    return (f"gemm_mma<{CTYPE[dtype]}, {mode}, {_cbool(aligned)}, {_cbool(ta)}, {_cbool(tb)}, "
            f"{c['BM']}, {c['BN']}, {c['THREADS']}, {c['STAGES']}, {c['SMEM']}>")


def _wgmma_expr(dtype: str, mode: int, ta: bool = False, tb: bool = False, tma: bool = False,
                tc: bool = False, cl: int = 1) -> str:
    c = _WGMMA[mode]
    return (f"gemm_wgmma<{CTYPE[dtype]}, {mode}, {_cbool(ta)}, {_cbool(tb)}, {_cbool(tc)}, "
            f"{c['BOX'] if tma else 0}, {cl}, {c['BM']}, {c['BN']}, {c['THREADS']}, {c['STAGES']}, "
            f"{c['SMEM']}, {c['KS']}>")


def _dmma_expr(ta: bool, tb: bool, aligned: bool) -> str:
    c = _DMMA
    return (f"gemm_dmma<{_cbool(ta)}, {_cbool(tb)}, {_cbool(aligned)}, {c['BM']}, {c['BN']}, "
            f"{c['THREADS']}, {c['STAGES']}, {c['BK']}, {c['SMEM']}>")


def _simple_expr(dtype: str, ta: bool = False, tb: bool = False) -> str:
    return (f"gemm_simple<{CTYPE[dtype]}, {_cbool(ta)}, {_cbool(tb)}, {_SIMPLE['TILE']}, "
            f"{_SIMPLE['THREADS']}>")


def _transpose_expr(dtype: str) -> str:
    """transpose_copy (kernels_cu/gemm.cu): a transposed or strided operand into rows of a
    chosen stride, zero-padded (:func:`transpose_kernel`)."""
    return f"transpose_copy<{CTYPE[dtype]}, {_TRANSPOSE['TILE']}, {_TRANSPOSE['THREADS']}>"


def _reduce_expr(dtype: str, slabs: str | None = None) -> str:
    """splitk_reduce for ``dtype`` over slabs of ``slabs`` (default: the dtype itself)."""
    return (f"splitk_reduce<{CTYPE[dtype]}, {CTYPE[slabs or dtype]}, {_SPLIT['THREADS']}, "
            f"{_SPLIT['ROWS']}, {_SPLIT['COLS']}>")


# mma.sync / cp.async need sm_80 (below it every dtype takes gemm_simple); wgmma is
# sm_90a only.
# Operand layouts (A, B transposed): the forward's NT, and the backward's dx = dy @ W (B
# transposed) and dW = dy^T @ x (both); ALIGNED concerns the K-contiguous operands only.
_LAYOUTS = [(ta, tb, al) for ta in (False, True) for tb in (False, True)
            for al in ((False,) if ta and tb else (True, False))]
_MMA_DTYPES = [("float32", m) for m in _MODE.values()] + [(d, _HALF) for d in ("float16", "bfloat16")]
_loader.register(_MMA_FILE, [_mma_expr(d, m, al, ta, tb) for d, m in _MMA_DTYPES
                         for ta, tb, al in _LAYOUTS], min_cc=80)
_TRANSPOSES = [(ta, tb) for ta in (False, True) for tb in (False, True)]
_loader.register(_FILE, [_simple_expr("float64", ta, tb) for ta, tb in _TRANSPOSES])
_loader.register(_DMMA_FILE, [_dmma_expr(ta, tb, al) for ta, tb, al in _LAYOUTS], min_cc=80)
_loader.register(_FILE, [_simple_expr(d, ta, tb) for d in ("float32", "float16", "bfloat16")
                         for ta, tb in _TRANSPOSES], max_cc=79)
# float32: K-major operands are loaded by bulk tensor copies (TMA), a transposed B by
# cp.async; a transposed A by TMA too, its fragments taken to registers, and then the
# product may be stored transposed (mm's swapped product, see _swaps). 16-bit: K-major
# operands by TMA only. TMA kernels also come in clusters (CLUSTER > 1).
_F32_WGMMA = (0, 1)
_loader.register(_WGMMA_FILE, [_wgmma_expr("float32", m, ta, tb, tma, False, cl) for m in _F32_WGMMA
                         for ta, tb in _TRANSPOSES for tma in {False, not tb} if tma or ta or tb
                         for cl in {1, _WGMMA[m]["CLUSTER"] if tma else 1}]
                 + [_wgmma_expr("float32", m, True, False, True, True, cl) for m in _F32_WGMMA
                    for cl in {1, _WGMMA[m]["CLUSTER"]}]
                 + [_wgmma_expr(d, _HALF, tma=True, cl=cl) for d in ("float16", "bfloat16")
                    for cl in {1, _WGMMA[_HALF]["CLUSTER"]}],
                 min_cc=90, max_cc=90)
_loader.register(_FILE, [_transpose_expr(d) for d in CTYPE])
# Slabs of the accumulation type: split K's (16-bit splits on Hopper's wgmma only);
# of the dtype itself: the statistics of a vendor product (statistics_call)
_loader.register(_FILE, [_reduce_expr(d) for d in CTYPE])
_loader.register(_FILE, [_reduce_expr(d, "float32") for d in ("float16", "bfloat16")],
                 min_cc=90, max_cc=90)


def layout(o):
    """``(transposed, ld)`` with which the GEMM reads the 2-D Operand ``o`` (rows, K) in
    place: K-contiguous rows ``(False, row stride)``, or rows-contiguous columns (a
    transposed view) ``(True, column stride)``; None if it is neither (copy it first)."""
    rs = row_stride(o.shape, o.strides)
    if rs is not None and rs >= o.shape[1]:
        return False, rs
    cs = row_stride(o.shape[::-1], o.strides[::-1])
    if cs is not None and cs >= o.shape[0]:
        return True, cs
    return None


class Gemm(NamedTuple):
    """How :func:`gemm_kernel` computes ``a @ b.T``: the GEMM kernel and its launch
    geometry; ``splits`` K chunks of ``kchunk`` (1 and K: no split), whose slabs
    ``reduce`` adds from a ``workspace`` of that many elements (of the accumulation type:
    float32 for 16-bit); ``bm`` the
    M-tile height of the partial statistics (GSBN); ``lda`` / ``ldb`` the operands' strides
    as :func:`layout` reads them."""
    fn: object
    grid: tuple
    block: tuple
    smem: int
    bm: int
    splits: int
    kchunk: int
    reduce: object
    workspace: int
    lda: int
    ldb: int
    maps: object = None  # gemm_wgmma: maps(a_ptr, b_ptr) -> its tensor maps and stack strides
    a_mn: bool = False  # gemm_wgmma loads a transposed A by TMA (M-major boxes)
    transposed_c: bool = False  # it stores the product's transpose (N x M; its slabs too)


class _Choice(NamedTuple):
    """The kernel :func:`gemm_kernel` launches, chosen without compiling it: its template
    instantiation, configuration (tiles, threads, shared memory), tensor maps (see
    :class:`Gemm`), whether it loads a transposed A by TMA, the operands' strides as
    :func:`layout` reads them, the CTAs per cluster, and whether it loads by TMA."""
    expr: str
    cfg: dict
    maps: object
    a_mn: bool
    lda: int
    ldb: int
    cluster: int = 1
    tma: bool = False


def _tc_mode(dtype: str, precision: str, wgmma: bool) -> int:
    """The tensor-core mode of a float32 (by ``precision``) or 16-bit product; where it
    runs on Hopper's wgmma, "medium" runs as "high" (our TF32 wgmma outruns the bf16
    mma.sync path)."""
    mode = _MODE[precision] if dtype == "float32" else _HALF
    return _MODE["high"] if wgmma and mode == _MODE["medium"] else mode


def _choose(a, b, precision: str, tc: bool = False) -> _Choice:
    """The :class:`_Choice` for ``a @ b.T`` (as :func:`gemm_kernel`)."""
    M, K = a.shape
    N = b.shape[0]
    dt, isz = a.dtype, ITEMSIZE[a.dtype]
    cc = _loader.device_cc(a.device)
    (ta, lda), (tb, ldb) = layout(a), layout(b)
    # 16-byte K-contiguous rows (a transposed operand is read by elements, or by TMA)
    aligned = (ta or vector_aligned(a.ptr, lda, K, isz)) and (tb or vector_aligned(b.ptr, ldb, K, isz))
    # rows that start on 16 bytes, whatever K: TMA reads them (zeros past K), where it loads
    # both operands (K % 4 float32 rows padded by a copy: gemm_operands.padded_ld)
    starts = (ta or vector_aligned(a.ptr, lda, 0, isz)) and (tb or vector_aligned(b.ptr, ldb, 0, isz))
    if dt == "float64" and cc in _DMMA_CCS:
        return _Choice(_dmma_expr(ta, tb, aligned and not (ta and tb)), _DMMA, None, False, lda, ldb)
    if dt == "float64" or cc < 80:
        return _Choice(_simple_expr(dt, ta, tb), _SIMPLE, None, False, lda, ldb)
    hopper = (aligned or starts) and cc == 90
    mode = _tc_mode(dt, precision, hopper)
    # (mma.sync in its own mode: "medium" as bf16 there, where rows that only start on 16
    # bytes keep Hopper off wgmma)
    mma = _Choice(_mma_expr(dt, _tc_mode(dt, precision, False), aligned and not (ta and tb), ta,
                            tb), _MMA, None, False, lda, ldb)
    if not (mode in _WGMMA and hopper):
        return mma
    cfg = _WGMMA[mode]
    # (a transposed A's storage is K rows of M: 16-byte aligned rows for the map)
    a_rows = (K, M) if ta else (M, K)
    tma = (not tb and _tma.fits(*a_rows, lda, isz) and _tma.fits(N, K, ldb, isz)
           and (not ta or vector_aligned(a.ptr, lda, 0, isz)))
    if (mode == _HALF and (ta or not tma)) or not (aligned or tma):
        return mma  # 16-bit wgmma: K-major operands by TMA only; a partial vector: by TMA only
    # a cluster's CTAs take M tiles 2i, 2i + 1 of one N tile (an even count of M tiles
    # keeps every raster group's pairs together)
    cl = cfg["CLUSTER"] if tma and cdiv(M, cfg["BM"]) % cfg["CLUSTER"] == 0 else 1
    return _Choice(_wgmma_expr(dt, mode, ta, tb, tma, tc and tma and ta, cl), cfg,
                   _tensor_maps(tma, ta, dt, mode, cfg, M, N, K, lda, ldb), tma and ta, lda, ldb, cl,
                   tma)


def half_wgmma(a, b, precision: str) -> bool:
    """Whether ``a @ b.T`` runs on our 16-bit wgmma kernel (as :func:`gemm_kernel` would
    choose; float32 and float64 never do)."""
    return a.dtype in ("float16", "bfloat16") and _choose(a, b, precision).cfg is _WGMMA[_HALF]


def gemm_kernel(a, b, precision: str, transposed_c: bool = False) -> Gemm:
    """The :class:`Gemm` for ``a @ b.T`` (2-D Operands that :func:`layout` reads in
    place): it depends on the dtype, the sizes, the layouts, the K-contiguous rows'
    16-byte alignment and the device. With ``transposed_c`` it stores the product's
    transpose, without an epilogue (only where :func:`stores_transposed` says so)."""
    (M, _), N = a.shape, b.shape[0]
    expr, cfg, maps, a_mn, lda, ldb, cl, _ = _choose(a, b, precision, transposed_c)
    assert not transposed_c or stores_transposed(a, b, precision), "no transposed store"
    if cfg is _SIMPLE:  # (registers only)
        ts = cfg["TILE"]
        fn = _loader.function(_FILE, expr, a.device)
        return _split(fn, (cdiv(M, ts) * cdiv(N, ts),), (cfg["THREADS"],), 0, ts, a, b, lda, ldb,
                      cfg)
    file = _MMA_FILE if cfg is _MMA else _DMMA_FILE if cfg is _DMMA else _WGMMA_FILE
    fn = _loader.function(file, expr, a.device, cfg["SMEM"])
    grid = (_tiles(M, N, cfg),)
    if transposed_c:  # persistent: one CTA per SM (its shared memory), taking every SMth tile
        grid = (min(grid[0], _loader.sm_count(a.device) // cl * cl),)  # (whole clusters)
    return _split(fn, grid, (cfg["THREADS"],), cfg["SMEM"], cfg["BM"], a, b, lda, ldb,
                  cfg)._replace(maps=maps, a_mn=a_mn, transposed_c=transposed_c)


class Stack(NamedTuple):
    """A stack of ``count`` products on one launch (:func:`batched_call`): matrix i of an
    operand starts ``i // inner * outer + i % inner * step`` elements after its first,
    ``a`` and ``b`` each a ``(step, outer)`` pair. One level of batch strides has ``inner
    == count``; two are attention's (batch, head) views of one projection's output, whose
    heads step along a row and whose batches step over rows."""
    count: int
    inner: int
    a: tuple
    b: tuple

    def swapped(self) -> "Stack":
        return self._replace(a=self.b, b=self.a)


def _stack_args(stack, sc: int) -> tuple:
    """gemm_wgmma's last arguments for ``stack`` (outputs ``sc`` elements apart): sa, sb,
    sc, count, sa_o, sb_o, inner."""
    (sa, sa_o), (sb, sb_o) = stack.a, stack.b
    count, inner = (scalar(v, "int") for v in (stack.count, stack.inner))
    return sa, sb, sc, count, sa_o, sb_o, inner


_ONE_PRODUCT = _stack_args(Stack(1, 1, (0, 0), (0, 0)), 0)


def _tensor_maps(tma: bool, ta: bool, dtype: str, mode: int, cfg, M: int, N: int, K: int,
                 lda: int, ldb: int, stack=None, k_rows: int = 0, extra=(0, 0)):
    """gemm_wgmma's ``maps(a_ptr, b_ptr)``: its trailing arguments, the tensor maps of A (M
    x K) and B (N x K) in boxes of BOX rows of one K slice (a transposed A: its K x M
    storage in boxes of one K slice x 32 columns), or two unused ones without TMA, then
    ``stack``, :func:`_stack_args` (None: one product's). M and N count every row the
    maps reach (a stack's: all its matrices'); a transposed A's stack reaches ``k_rows``
    rows of its storage (default K); ``extra``: columns A's and B's maps reach past the
    first matrix's (a stack whose matrices start past column 0)."""
    stack = stack or _ONE_PRODUCT
    if not tma:
        return lambda ap, bp: (_tma.NONE, _tma.NONE, *stack)
    dt = _MAP_DTYPE[dtype, mode]
    k = cfg["KS"]  # the kernel's K slice: one 128-byte swizzled row
    # (a transposed A's boxes are k x k: its M rows are 128-byte swizzled rows too)
    ma = _tma.row_maps(k_rows or K, M + extra[0], lda, k, k, dt) if ta else \
        _tma.row_maps(M, K + extra[0], lda, cfg["BOX"], k, dt)
    mb = _tma.row_maps(N, K + extra[1], ldb, cfg["BOX"], k, dt)
    return lambda ap, bp: (ma(ap), mb(bp), *stack)


def _splits(a, tiles: int, cfg, matrix: bool = False) -> int:
    """Into how many K chunks (1: none) a GEMM of ``a`` (M x K) over ``tiles`` output tiles
    of the kernel of launch constants ``cfg`` splits: where the tiles fill at most 1 /
    :func:`_fill` of the SMs and the dtype is float32 / float64, or 16-bit on gemm_wgmma
    (whose slabs hold float sums; gemm_mma's and gemm_simple's would hold T) (_SPLIT).
    ``matrix``: one 2-D product (a stack, one launch, keeps the default fill)."""
    K, sms = a.shape[1], _loader.sm_count(a.device)
    most = _SPLIT["MAX"] if K < _SPLIT["LONG_K"] else sms
    splits = min(sms // tiles, K // cfg.get("SPLIT_MIN_K", _SPLIT["MIN_K"]), most)
    if (a.dtype not in ("float32", "float64") and cfg is not _WGMMA[_HALF]) \
            or _fill(cfg, K, matrix) * tiles > sms or splits < 2:
        return 1
    return splits


def _fill(cfg, K: int, matrix: bool) -> int:
    """1 / the share of the SMs up to which a product's tiles split K: the kernel's
    MATRIX_SPLIT_FILL for a 2-D product (``matrix``) from MATRIX_SPLIT_FILL_K, else its
    SPLIT_FILL from SPLIT_FILL_K, else _SPLIT's FILL (the keys a kernel lacks never hold)."""
    if matrix and K >= cfg.get("MATRIX_SPLIT_FILL_K", K + 1):
        return cfg["MATRIX_SPLIT_FILL"]
    if K >= cfg.get("SPLIT_FILL_K", K + 1):
        return cfg["SPLIT_FILL"]
    return _SPLIT["FILL"]


def _tiles(M: int, N: int, cfg) -> int:
    return cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"])


def _split(fn, grid, block, smem, bm, a, b, lda, ldb, cfg) -> Gemm:
    """The :class:`Gemm` of kernel ``fn`` (launch constants ``cfg``) on ``grid``, split over
    K as :func:`_splits` says."""
    (M, K), N, dt = a.shape, b.shape[0], a.dtype
    splits = _splits(a, int(np.prod(grid)), cfg, matrix=True)
    if splits == 1:
        return Gemm(fn, grid, block, smem, bm, 1, K, None, 0, lda, ldb)
    # whole K slices per chunk (32 floats, or gemm_wgmma's KS): the TMA loads address the
    # whole tensor, so a slice crossing into the next chunk would be added twice
    align = cfg.get("KS", _SPLIT["ALIGN"])
    kchunk = cdiv(cdiv(K, splits), align) * align
    splits = cdiv(K, kchunk)
    reduce = _loader.function(_FILE, _reduce_expr(dt, acc_dtype(dt)), a.device)
    grid = (*grid, 1)[:2] + (splits,)  # block z takes K chunk z
    return Gemm(fn, grid, block, smem, _SPLIT["BM"], splits, kchunk, reduce, splits * M * N,
                lda, ldb)


def gemm_call(kernel: Gemm, a, b, ldc: int):
    """``call(a_ptr, b_ptr, c_ptr, bias, alpha, beta, part, ws) -> launches``: the launch
    tuples of ``kernel`` (:func:`gemm_kernel`) for these sizes (pointers 0 for none;
    ``ws`` a workspace of ``kernel.workspace`` elements, 0 without a split)."""
    M, K = a.shape
    N = b.shape[0]
    m_, n_ = scalar(M, "int"), scalar(N, "int")
    sizes = (m_, n_, scalar(K, "int"), scalar(kernel.kchunk, "int"), kernel.lda, kernel.ldb)
    if kernel.transposed_c:  # (the stored product, and so the slabs, are N x M)
        M, N, m_, n_ = N, M, n_, m_
    gemm_ = (kernel.fn, kernel.grid, kernel.block)
    maps = kernel.maps or (lambda ap, bp: ())
    if kernel.splits == 1:
        return lambda ap, bp, cp, bias, alpha, beta, part, ws: (
            (*gemm_, (ap, bp, cp) + sizes + (ldc, bias, alpha, beta, part) + maps(ap, bp), kernel.smem),)
    reduce_ = (kernel.reduce, (cdiv(N, _SPLIT["COLS"]), cdiv(M, _SPLIT["BM"])), (_SPLIT["THREADS"],))
    s_ = scalar(kernel.splits, "int")
    return lambda ap, bp, cp, bias, alpha, beta, part, ws: (
        (*gemm_, (ap, bp, ws) + sizes + (N, 0, 0, 0, 0) + maps(ap, bp), kernel.smem),
        (*reduce_, (ws, s_, m_, n_, cp, ldc, bias, alpha, beta, part), 0))


def batched_call(a, b, precision: str, stack: Stack, transposed_c: bool = False):
    """``call(a_ptr, b_ptr, c_ptr) -> launches``: the ``stack`` of products ``a_i @ b_i.T``
    into C-contiguous (M, N) outputs one after another (``transposed_c``: their
    transposes, (N, M), with ``a`` read transposed by TMA: a matmul's row-major b as A),
    on one launch of gemm_wgmma (grid y: the matrix; ``transposed_c``: persistent CTAs
    taking the stack's tiles matrix by matrix). ``a`` and ``b``: 2-D Operands of the
    first matrices. None where the stack does not run so (:func:`_batched`). H200,
    float32 "highest", (128, 512, 1024) @ (128, 1024, 2048): one launch per matrix (64
    tiles each on 132 SMs) ran at 0.77x eager's batched SGEMM."""
    plan = _batched(a, b, precision, stack, transposed_c)
    if plan is None:
        return None
    choice, tiles, rows_a, rows_b, extra = plan
    cfg, (M, K), N = choice.cfg, a.shape, b.shape[0]
    mode = _tc_mode(a.dtype, precision, True)
    maps = _tensor_maps(choice.tma, transposed_c, a.dtype, mode, cfg, M if transposed_c else rows_a,
                        rows_b, K, choice.lda, choice.ldb, _stack_args(stack, M * N),
                        rows_a if transposed_c else 0, extra)
    fn = _loader.function(_WGMMA_FILE, choice.expr, a.device, cfg["SMEM"])
    count = stack.count
    if transposed_c:  # persistent over the stack's tiles, matrix by matrix (whole clusters)
        sms = _loader.sm_count(a.device) // choice.cluster * choice.cluster
        launch = (fn, (min(tiles * count, sms), 1), (cfg["THREADS"],))
    else:
        launch = (fn, (tiles, count), (cfg["THREADS"],))
    ldc = M if transposed_c else N
    sizes = tuple(scalar(v, "int") for v in (M, N, K, K)) + (choice.lda, choice.ldb, ldc, 0, 0, 0, 0)
    return lambda ap, bp, cp: ((*launch, (ap, bp, cp) + sizes + maps(ap, bp), cfg["SMEM"]),)


def _batched(a, b, precision: str, stack: Stack, transposed_c: bool = False):
    """``(choice, tiles, rows_a, rows_b, extra)`` of :func:`batched_call`'s launch (tiles
    per matrix; rows of the stack's TMA maps, a transposed A's K rows; columns past the
    first matrix's, :func:`_reach`), or None where the stack does not run on one: another
    kernel than wgmma, a split K (few tiles in all), a transposed A by TMA unless
    ``transposed_c`` (and then only with that), more matrices than a grid's y, or, by
    TMA, a stack past a map's int32 rows or matrices that start past column 0 of a row
    but not within it, or do with K not a multiple of the K slice (a slice past K would
    read the next matrix's; so too a transposed A's K rows). Loads nothing (the route
    asks it)."""
    choice = _choose(a, b, precision, transposed_c)
    cfg, count = choice.cfg, stack.count
    if cfg not in _WGMMA.values() or choice.a_mn != transposed_c or not 0 < count <= MAX_GRID_Y:
        return None
    (M, K), N = a.shape, b.shape[0]
    tiles = _tiles(M, N, cfg)
    if _splits(a, tiles * count, cfg) > 1:
        return None
    rows_a, rows_b, extra = M, N, (0, 0)
    if choice.tma:
        lda, ldb, isz = choice.lda, choice.ldb, ITEMSIZE[a.dtype]
        (ra, ca), (rb, cb) = (_reach(stack, s, ld) for s, ld in ((stack.a, lda), (stack.b, ldb)))
        # (a transposed A is always by TMA: choice.a_mn)
        if ra is None or rb is None or ((transposed_c or ca or cb) and K % cfg["KS"]):
            return None
        rows_a = (K if transposed_c else M) + ra
        rows_b, extra = N + rb, (ca, cb)
        if not (_tma.fits(rows_a, (M if transposed_c else K) + ca, lda, isz)
                and _tma.fits(rows_b, K + cb, ldb, isz)):
            return None
    return choice, tiles, rows_a, rows_b, extra


def _reach(stack: Stack, steps, ld: int):
    """``(row, column)``: the furthest map row and column at which a matrix of ``stack``
    starts in an operand of row stride ``ld`` stepping by ``steps`` (the kernel's off /
    ld, off % ld); (None, None) for a negative offset."""
    step, outer = steps
    offs = (np.arange(stack.count // stack.inner, dtype=np.int64)[:, None] * outer
            + np.arange(stack.inner, dtype=np.int64) * step)
    if offs.min() < 0:
        return None, None
    return int((offs // ld).max()), int((offs % ld).max())


def one_launch(a, b, precision: str, stack: Stack, transposed_c: bool = False) -> bool:
    """Whether :func:`batched_call` runs the stack on one launch (without loading it)."""
    return _batched(a, b, precision, stack, transposed_c) is not None


def workspace(place, kernel: Gemm):
    """A fresh workspace for ``kernel``'s split K (None without a split): held by the
    caller until the launch is queued."""
    return empty(place, (kernel.workspace,), acc_dtype(place.dtype)) if kernel.workspace else None


def gemm(a, b, c, precision: str, bias=None, part=None, kernel=None) -> None:
    """Launch ``c = a @ b.T (+ bias)`` on 2-D Operands (a: M x K and b: N x K as
    :func:`layout` reads them; c: M x N, rows contiguous, row stride in ``strides[0]``);
    ``bias`` (T) an Operand or None; ``part`` None or an array for the epilogue's partial
    statistics of c's columns (per M tile of ``kernel.bm`` rows, in the accumulation
    type); ``kernel``: :func:`gemm_kernel`'s, if the caller has it already."""
    kernel = gemm_kernel(a, b, precision) if kernel is None else kernel
    call = gemm_call(kernel, a, b, c.strides[0])
    ws = workspace(a, kernel)
    launch_all(a, call(a.ptr, b.ptr, c.ptr, 0 if bias is None else bias.ptr, 0, 0,
                       0 if part is None else data_ptr(part), data_ptr(ws) if ws is not None else 0))


STATS_BM = _SPLIT["BM"]  # rows per tile of statistics_call's partials


def statistics_call(place, M: int, N: int):
    """``call(z_ptr, part_ptr) -> launch``: the per-tile (mean, M2, min, max) of the columns
    of a C-contiguous (M, N) array (a vendor product), as a GEMM epilogue leaves them in
    ``part`` (tiles of STATS_BM rows): splitk_reduce with one slab and no output."""
    fn = _loader.function(_FILE, _reduce_expr(place.dtype), place.device)
    launch = (fn, (cdiv(N, _SPLIT["COLS"]), cdiv(M, _SPLIT["BM"])), (_SPLIT["THREADS"],))
    sizes = (scalar(1, "int"), scalar(M, "int"), scalar(N, "int"), 0, N, 0, 0, 0)
    return lambda zp, part: (*launch, (zp,) + sizes + (part,), 0)


def tile_config(dtype: str, precision: str, device: int) -> dict:
    """The launch constants (tile BM x BN) of the kernel a product of ``dtype`` at
    ``precision`` runs on this device's arch with rows that Hopper's wgmma reads."""
    if dtype == "float64":
        return _DMMA
    hopper = _loader.device_cc(device) == 90
    mode = _tc_mode(dtype, precision, hopper)
    return _WGMMA[mode] if hopper and mode in _WGMMA else _MMA


def stores_transposed(a, b, precision: str) -> bool:
    """Whether :func:`gemm_kernel` can compute ``a @ b.T`` with ``transposed_c``: Hopper's
    TF32 / 3xTF32 kernel reading ``a`` transposed by TMA (split K or not), as
    :func:`reads_transposed_a` says."""
    return reads_transposed_a(a, b, precision)


def reads_transposed_a(a, b, precision: str) -> bool:
    """Whether :func:`gemm_kernel` reads a transposed ``a`` of ``a @ b.T`` in place by TMA
    (M-major boxes; Hopper's TF32 / 3xTF32 kernel, ``b`` K-major)."""
    return _choose(a, b, precision).a_mn


def transpose_kernel(dtype: str, device: int, rows: int, cols: int, ldd: int | None = None,
                     count: int = 1):
    """``(fn, grid, block)`` of the tiled copy of a (rows, cols) array whose columns (a
    transposed view) or rows are contiguous into rows of ``ldd`` elements (default
    ``cols``: C-contiguous), their columns past ``cols`` zeroed; of a stack of ``count``
    of them (at most a grid's y). Its arguments: ``(src, dst, rows, cols, row stride,
    column stride, ldd, src's stack stride, dst's stack stride)``, strides in elements."""
    fn = _loader.function(_FILE, _transpose_expr(dtype), device)
    grid = (cdiv(rows, _TRANSPOSE["TILE"]) * cdiv(ldd or cols, _TRANSPOSE["TILE"]), count)
    return fn, grid, (_TRANSPOSE["THREADS"],)
