"""``linear`` (``x @ weight.T + bias``) and ``matmul`` (NumPy's ``a @ b``): our own
tensor-core GEMM (kernels_cu/gemm*.cu) or, where the dispatcher (:func:`route`, one table,
each boundary with its measurement) finds that no kernel of ours beats it for a plain
product, cuBLAS through torch or CuPy. The fused ops (GemmScaleBatchNorm, M4) keep our
kernels; ``mm`` is our GEMM for their backward passes.

Precision of float32 inputs follows PyTorch's names (on our kernels; the vendor's
"highest" is SGEMM, its "high" / "medium" TF32):

* ``"highest"``: 3xTF32 (each operand split into a TF32 part and a
  remainder; three tensor-core products) with the tensor-core sum promoted into an
  fp32 register accumulator every 32 of K: about as accurate as SGEMM (README: Known
  limitations).
* ``"high"``: TF32 tensor cores, both operands rounded to TF32 to nearest as cuBLAS
  does (by the copy engine on Hopper's wgmma path, ``cvt.rna`` on mma.sync's; README:
  Known limitations names the one path that truncates).
* ``"medium"``: operands rounded to bf16, fp32 accumulation; on Hopper with aligned
  rows, TF32 instead, which is faster there and more accurate (PyTorch's "medium"
  likewise allows any algorithm at least as accurate as bf16).

float16 / bfloat16 inputs use the tensor cores directly (fp32 accumulation);
float64 uses the FP64 tensor cores (DMMA) where the GPU has them (sm_80, sm_90,
sm_100), a CUDA-core kernel elsewhere. Any M, N, K work: tiles are bounds-checked, and
rows that are not 16-byte aligned take an element-wise load path. On Hopper,
float32 "highest"/"high" with 16-byte aligned rows, and float16 / bfloat16 with K-major
16-byte aligned rows, use wgmma (sm_90a); everything else uses mma.sync (sm_80+). Below
sm_80 (Turing: T4, RTX 20) every dtype runs on the CUDA-core kernel, accumulating in
float32 (float64 for float64): fp32-accurate at every precision, but without tensor cores.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import numpy as np

from . import _dask, _loader, _tma
from ._array import (CTYPE, ITEMSIZE, Operand, Place, _is_cupy, cached_checked, check_out,
                     contiguous, copy_into, data_ptr, empty, is_torch, launch_all, operand,
                     plannable, require_writable, row_view_stride, rows_2d, same_place, scalar,
                     signature, torch_layer)
from ._geometry import acc_dtype, cdiv, row_stride, vector_aligned

# Kernel files, one per variant (kernels_cu/gemm.cuh: what they share): the CUDA-core
# kernel and the passes, mma.sync (sm_80+), wgmma (Hopper), float64's mma.sync (DMMA)
_FILE, _MMA_FILE, _WGMMA_FILE, _DMMA_FILE = "gemm.cu", "gemm_mma.cu", "gemm_wgmma.cu", "gemm_dmma.cu"
PRECISIONS = ("highest", "high", "medium")
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
# the SMs (gemm_wgmma's 16-bit mode with a long K: its SPLIT_FILL);
# splitk_reduce adds the slabs in blocks of COLS columns (a warp) by THREADS / COLS groups
# of ROWS rows (its M tile for the partial statistics: BM rows). Measured on H100
# (128x1024 @ 1024x512, 3xTF32): 40.5 us unsplit, 16.0 us with 8 rows per thread, 14.2
# with 4; 16-row tiles of statistics made GSBN's merge longer.
_SPLIT = {"MAX": 16, "MIN_K": 128, "ALIGN": 32, "FILL": 4, "THREADS": 256, "ROWS": 4, "COLS": 32}
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


def check_precision(precision) -> str:
    """``precision`` as one of PRECISIONS; ``None`` (CuPy / NumPy callers) is "highest".
    The torch layer resolves ``None`` to torch's float32 matmul precision first."""
    if precision is None:
        return "highest"
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS} or None, got {precision!r}")
    return precision


def check_vector(v, name: str, like, n: int, dtype: str | None = None, in_place: bool = False):
    """Validate an optional 1-D length-``n`` parameter living where ``like`` lives.
    A strided GPU vector is copied, unless ``in_place`` (a buffer the op updates), which
    must then be contiguous."""
    if v is None:
        return None
    o = operand(v, name)
    same_place(like, o)
    if o.ndim != 1 or o.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(o.shape)}")
    if o.dtype != (dtype or like.dtype):
        raise TypeError(f"{name}: dtype {o.dtype} does not match x's dtype {like.dtype}")
    if in_place:
        require_writable(v, name, ", but it is updated in place")
    if o.strides[0] != 1 and n > 1:
        if in_place:
            raise ValueError(f"{name}: must be contiguous (it is updated in place), got "
                             f"stride {o.strides[0]}")
        if o.kind != "cpu":
            o = operand(contiguous(o), name)
    return o


def check_operands(x, weight):
    """Validate x (..., K) and weight (N, K); returns their Operands."""
    xo, wo = operand(x, "x"), operand(weight, "weight")
    same_place(xo, wo)
    if wo.ndim != 2:
        raise ValueError(f"weight: expected a 2-D (out_features, in_features) array, got "
                         f"{wo.ndim}-D shape {tuple(wo.shape)}")
    if xo.ndim < 1:
        raise ValueError("x: expected at least 1 dimension (..., in_features), got a 0-d array")
    if xo.shape[-1] != wo.shape[1]:
        raise ValueError(f"x: last dimension {xo.shape[-1]} does not match weight's in_features "
                         f"{wo.shape[1]} (weight shape {tuple(wo.shape)})")
    if xo.dtype != wo.dtype:
        raise TypeError(f"weight: dtype {wo.dtype} does not match x's dtype {xo.dtype}")
    return xo, wo


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
    maps: object = None  # gemm_wgmma: maps(a_ptr, b_ptr) -> its two tensor-map arguments
    a_mn: bool = False  # gemm_wgmma loads a transposed A by TMA (M-major boxes)


class _Choice(NamedTuple):
    """The kernel :func:`gemm_kernel` launches, chosen without compiling it: its template
    instantiation, configuration (tiles, threads, shared memory), tensor maps (see
    :class:`Gemm`), whether it loads a transposed A by TMA, the operands' strides as
    :func:`layout` reads them, and the CTAs per cluster."""
    expr: str
    cfg: dict
    maps: object
    a_mn: bool
    lda: int
    ldb: int
    cluster: int = 1


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
    if dt == "float64" and cc in _DMMA_CCS:
        return _Choice(_dmma_expr(ta, tb, aligned and not (ta and tb)), _DMMA, None, False, lda, ldb)
    if dt == "float64" or cc < 80:
        return _Choice(_simple_expr(dt, ta, tb), _SIMPLE, None, False, lda, ldb)
    hopper = aligned and cc == 90
    mode = _tc_mode(dt, precision, hopper)
    mma = _Choice(_mma_expr(dt, mode, aligned and not (ta and tb), ta, tb), _MMA, None, False,
                  lda, ldb)
    if not (mode in _WGMMA and hopper):
        return mma
    cfg = _WGMMA[mode]
    # (a transposed A's storage is K rows of M: 16-byte aligned rows for the map)
    a_rows = (K, M) if ta else (M, K)
    tma = (not tb and _tma.fits(*a_rows, lda, isz) and _tma.fits(N, K, ldb, isz)
           and (not ta or vector_aligned(a.ptr, lda, 0, isz)))
    if mode == _HALF and (ta or not tma):
        return mma  # 16-bit wgmma: K-major operands by TMA only
    # a cluster's CTAs take M tiles 2i, 2i + 1 of one N tile (an even count of M tiles
    # keeps every raster group's pairs together)
    cl = cfg["CLUSTER"] if tma and cdiv(M, cfg["BM"]) % cfg["CLUSTER"] == 0 else 1
    return _Choice(_wgmma_expr(dt, mode, ta, tb, tma, tc and tma and ta, cl), cfg,
                   _tensor_maps(tma, ta, dt, mode, cfg, M, N, K, lda, ldb), tma and ta, lda, ldb, cl)


def _half_wgmma(a, b, precision: str) -> bool:
    """Whether ``a @ b.T`` runs on our 16-bit wgmma kernel (as :func:`gemm_kernel` would
    choose; float32 and float64 never do)."""
    return a.dtype in ("float16", "bfloat16") and _choose(a, b, precision).cfg is _WGMMA[_HALF]


def gemm_kernel(a, b, precision: str, transposed_c: bool = False) -> Gemm:
    """The :class:`Gemm` for ``a @ b.T`` (2-D Operands that :func:`layout` reads in
    place): it depends on the dtype, the sizes, the layouts, the K-contiguous rows'
    16-byte alignment and the device. With ``transposed_c`` it stores the product's
    transpose, without an epilogue or split K (only where :func:`_swaps` says so)."""
    (M, _), N = a.shape, b.shape[0]
    expr, cfg, maps, a_mn, lda, ldb, cl = _choose(a, b, precision, transposed_c)
    assert not transposed_c or (a_mn and _splits(a, _tiles(M, N, cfg), cfg) == 1), \
        "no transposed store"
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
                  cfg)._replace(maps=maps, a_mn=a_mn)


def _tensor_maps(tma: bool, ta: bool, dtype: str, mode: int, cfg, M: int, N: int, K: int,
                 lda: int, ldb: int):
    """gemm_wgmma's ``maps(a_ptr, b_ptr)``: the tensor maps of A (M x K) and B (N x K) in
    boxes of BOX rows of one K slice (a transposed A: its K x M storage in boxes of one K
    slice x 32 columns), or two unused ones without TMA."""
    if not tma:
        return lambda ap, bp: (_tma.NONE, _tma.NONE)
    dt = _MAP_DTYPE[dtype, mode]
    k = cfg["KS"]  # the kernel's K slice: one 128-byte swizzled row
    # (a transposed A's boxes are k x k: its M rows are 128-byte swizzled rows too)
    ma = _tma.row_maps(K, M, lda, k, k, dt) if ta else _tma.row_maps(M, K, lda, cfg["BOX"], k, dt)
    mb = _tma.row_maps(N, K, ldb, cfg["BOX"], k, dt)
    return lambda ap, bp: (ma(ap), mb(bp))


def _splits(a, tiles: int, cfg) -> int:
    """Into how many K chunks (1: none) a GEMM of ``a`` (M x K) over ``tiles`` output tiles
    of the kernel of launch constants ``cfg`` splits: where the tiles fill at most 1 / FILL
    of the SMs (16-bit with a long K: SPLIT_FILL) and the dtype is float32 / float64, or
    16-bit on gemm_wgmma (whose slabs hold float sums; gemm_mma's and gemm_simple's would
    hold T) (_SPLIT)."""
    K, sms = a.shape[1], _loader.sm_count(a.device)
    splits = min(sms // tiles, K // cfg.get("SPLIT_MIN_K", _SPLIT["MIN_K"]), _SPLIT["MAX"])
    fill = cfg["SPLIT_FILL"] if K >= cfg.get("SPLIT_FILL_K", K + 1) else _SPLIT["FILL"]
    if (a.dtype not in ("float32", "float64") and cfg is not _WGMMA[_HALF]) or fill * tiles > sms \
            or splits < 2:
        return 1
    return splits


def _tiles(M: int, N: int, cfg) -> int:
    return cdiv(M, cfg["BM"]) * cdiv(N, cfg["BN"])


def _split(fn, grid, block, smem, bm, a, b, lda, ldb, cfg) -> Gemm:
    """The :class:`Gemm` of kernel ``fn`` (launch constants ``cfg``) on ``grid``, split over
    K as :func:`_splits` says."""
    (M, K), N, dt = a.shape, b.shape[0], a.dtype
    splits = _splits(a, int(np.prod(grid)), cfg)
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


_mm_plans: dict = {}  # (signatures, precision) -> run(a, b), or None


def mm(a, b, precision=None):
    """``a @ b`` for 2-D a (M, K) and b (K, N) of one kind, device and dtype: the backward
    passes' GEMMs (dx = dy @ W, dW = dy^T @ x). Each operand is read in place whether
    its rows or its columns are contiguous (a transposed view is never copied where that
    would be slower, see :func:`matrix`); any other layout is copied first. ``precision``
    as in :func:`linear`. Returns a new (M, N) array of a's kind (NumPy: the reference)."""
    checked = None
    if precision is None or type(precision) is str:  # the common call, cached
        key = (signature(a), signature(b), precision)
        run, checked = cached_checked(_mm_plans, key, check_mm, _mm_fresh, (a, b, precision))
        if run is not None:
            return run(a, b)
    ao, bo, prec = checked or check_mm(a, b, precision)
    if ao.kind == "cpu":
        return reference(a, b.T)
    (M, K), N = ao.shape, bo.shape[1]
    if M == 0 or N == 0:
        return empty(ao, (M, N))
    a2 = matrix(ao, M * N * K)
    bt = matrix(operand(b.T, "b"), M * N * K)  # the GEMM's (N, K) operand
    c = operand(empty(ao, (M, N)), "out")
    gemm(a2, bt, c, prec)
    return c.obj


def _mm_fresh(checked, a, b, precision):
    """``run(a, b) -> a @ b`` for calls like this one (``checked``: check_mm's result),
    planned once (a transposed copy :func:`matrix` would make is a launch of the plan);
    None where the call needs the general path (CPU, empty, or an operand copied
    otherwise)."""
    ao, bo, prec = checked
    M, N = ao.shape[0], bo.shape[1]
    if ao.kind == "cpu" or M == 0 or N == 0:
        return None
    return _on_arrays(mm_plan(ao, bo, prec))


def mm_plan(a, b, precision: str):
    """The launch plan of :func:`mm` for 2-D GPU Operands ``a`` (M, K) and ``b`` (K, N),
    M, N > 0, and a checked precision: a :class:`_Product` (``run(a_ptr, b_ptr, 0)``),
    or None where an operand needs a general copy. An
    Operand may describe an array to be allocated later (pointer 0: 16-byte aligned)."""
    (M, K), N = a.shape, b.shape[1]
    bt = Operand(b.obj, b.kind, b.dtype, b.shape[::-1], b.strides[::-1], b.ptr, b.device,
                 b.name, b.torch)  # the GEMM's (N, K) operand
    work = M * N * K
    if _swaps(a, bt, work, precision):
        return _planned_swapped(a, bt, precision)
    return _planned_gemm(a, bt, work, precision, (M, N))


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
    if _narrow(a, b_nk, precision, batch is None):
        return _route_of(a, b_nk, precision) == VENDOR
    if a.dtype == "float64":
        role = "backward" if batch is not None else "forward with grad" if grad else "forward"
        if not captured and a.shape[0] * a.shape[1] * b_nk.shape[0] <= FUSED_F64_WORK[role]:
            return False
        return _route_of(a, b_nk, precision) == VENDOR
    if (a.dtype == "float32" and (batch is None or batch >= FUSED_VENDOR_BATCH)
            and not _off_wgmma(a, b_nk) and not (batch is not None and _transposed_b(a, b_nk))):
        return False
    if batch is None and _half_wgmma(a, b_nk, precision):
        return False
    return _route_of(a, b_nk, precision) == VENDOR


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
    if a.dtype == "float64":
        cfg = _DMMA
    else:
        hopper = _loader.device_cc(a.device) == 90
        mode = _tc_mode(a.dtype, precision, hopper)
        cfg = _WGMMA[mode] if hopper and mode in _WGMMA else _MMA
    return 4 * b_nk.shape[0] <= cfg["BN"] or (forward and 4 * a.shape[0] <= cfg["BM"])


def vendor_linear(kind: str, precision: str, problem):
    """``run(x, weight, bias) -> x @ weight.T + bias``: the vendor's product (a new
    C-contiguous array), as a plan (:class:`_VendorPlan`) of ``problem`` (M, N, K, dtype),
    with its eager form (:func:`eager_plan`)."""
    vendor = _vendor(kind)
    return _VendorPlan(vendor, vendor.linear, precision, vendor.linear_form(*problem))


def vendor_matmul(kind: str, precision: str, problem):
    """``run(a, b) -> a @ b`` (NumPy's matmul): the vendor's product, as a plan of
    ``problem`` (M, N, K, dtype, b_matrix), with its eager form."""
    vendor = _vendor(kind)
    return _VendorPlan(vendor, vendor.matmul, precision, vendor.matmul_form(*problem))


STATS_BM = _SPLIT["BM"]  # rows per tile of statistics_call's partials


def statistics_call(place, M: int, N: int):
    """``call(z_ptr, part_ptr) -> launch``: the per-tile (mean, M2, min, max) of the columns
    of a C-contiguous (M, N) array (a vendor product), as a GEMM epilogue leaves them in
    ``part`` (tiles of STATS_BM rows): splitk_reduce with one slab and no output."""
    fn = _loader.function(_FILE, _reduce_expr(place.dtype), place.device)
    launch = (fn, (cdiv(N, _SPLIT["COLS"]), cdiv(M, _SPLIT["BM"])), (_SPLIT["THREADS"],))
    sizes = (scalar(1, "int"), scalar(M, "int"), scalar(N, "int"), 0, N, 0, 0, 0)
    return lambda zp, part: (*launch, (zp,) + sizes + (part,), 0)


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
    return _on_arrays(mm_plan(a, b, precision)), False


def _on_arrays(plan):
    """:func:`mm_plan`'s ``plan`` as ``run(a, b) -> a @ b`` on the arrays themselves (None
    for None)."""
    if plan is None:
        return None
    ptr = plan.place.ptr  # (b.T starts where b does; *_: as _fresh's)
    return lambda a, b, *_: plan(ptr(a), ptr(b), 0)


class _Product:
    """A planned GEMM product: calling it with ``(a_ptr, b_ptr, bias_ptr)`` launches it
    and returns its new output. Its ``_stage(a_ptr, b_ptr, bias_ptr, launches, held) ->
    out`` allocates the output (and any operand copies, appended to ``held``, kept until
    the launch) and appends the launches, so that the copies and the GEMM go out in one
    batch. ``place``: where it allocates."""

    __slots__ = ("place", "_stage")

    def __init__(self, place, stage):
        self.place, self._stage = place, stage

    def __call__(self, ap, bp, bias):
        launches, held = [], []
        out = self._stage(ap, bp, bias, launches, held)
        launch_all(self.place, launches)
        return out


def _planned_gemm(a, b, work: int, precision: str, shape):
    """The :class:`_Product` of a new array of ``shape`` (rows of N) holding ``a @ b.T
    (+ bias)`` for 2-D Operands like ``a`` and ``b`` in a product of ``work``
    multiply-adds: their copies (:func:`_planned_read`), the GEMM and its split K, as
    launches with their sizes fixed. None where an operand needs a general copy."""
    reads = [_planned_read(o, work) for o in (a, b)]
    if None in reads:
        return None
    (a, copy_a), (b, copy_b) = reads
    kernel, place = gemm_kernel(a, b, precision), Place(a)
    call, ptr = gemm_call(kernel, a, b, b.shape[0]), place.ptr

    def stage(ap, bp, bias, launches, held):
        if copy_a:
            ap = copy_a(ap, launches, held)
        if copy_b:
            bp = copy_b(bp, launches, held)
        out, ws = empty(place, shape), workspace(place, kernel)
        held.append(ws)
        launches.extend(call(ap, bp, ptr(out), bias, 0, 0, 0, ptr(ws)))
        return out

    return _Product(place, stage)


def _swaps(a, b, work: int, precision: str) -> bool:
    """Whether ``a @ b.T`` (2-D Operands, ``a`` read in place) is better computed as
    ``(b @ a.T).T``: where ``b``'s rows are not K-contiguous (``b`` is ``W.T`` for mm's
    row-major ``W``, as in dx = dy @ W) and worth a transposed copy (:func:`_read_mode`),
    and the GEMM can read ``b`` in place as a transposed A (Hopper TF32 / 3xTF32: TMA
    boxes, fragments in registers) and store the product transposed (enough tiles not to
    split K). H200, dx = dy @ W "high" against copying W's transpose first: 0.331 / 0.546
    ms at 1024x8192 @ 8192x8192, 1.429 / 1.570 at 16384x4096 @ 4096x4096, 0.351 / 0.430
    at 4096x4096 @ 4096x4096 (3xTF32: 1.147 / 1.430, 4.991 / 4.989, 1.316 / 1.327)."""
    if _read_mode(b, work)[0] != "transpose" or _read_mode(a, work)[0] != "view" or layout(a)[0]:
        return False
    choice = _choose(b, a, precision, True)
    return choice.a_mn and _splits(b, _tiles(b.shape[0], a.shape[0], choice.cfg), choice.cfg) == 1


def _planned_swapped(a, b, precision: str):
    """The :class:`_Product` of ``a @ b.T`` computed as ``(b @ a.T).T`` (:func:`_swaps`):
    the GEMM stores the (N, M) product transposed, into the (M, N) output. mm's products
    have no bias."""
    M, N = a.shape[0], b.shape[0]
    kernel, place = gemm_kernel(b, a, precision, transposed_c=True), Place(a)
    call, ptr = gemm_call(kernel, b, a, N), place.ptr

    def stage(ap, bp, bias, launches, held):
        assert not bias, "a swapped product has no bias"
        out = empty(place, (M, N))
        launches.extend(call(bp, ap, ptr(out), 0, 0, 0, 0, 0))
        return out

    return _Product(place, stage)


def check_mm(a, b, precision):
    """Validate :func:`mm`'s arguments: (a, b Operands, precision)."""
    ao, bo = operand(a, "a"), operand(b, "b")
    same_place(ao, bo)
    if ao.ndim != 2 or bo.ndim != 2 or ao.shape[1] != bo.shape[0]:
        raise ValueError(f"b: expected 2-D a (M, K) and b (K, N), got shapes {tuple(ao.shape)} "
                         f"and {tuple(bo.shape)}")
    if ao.dtype != bo.dtype:
        raise TypeError(f"b: dtype {bo.dtype} does not match a's dtype {ao.dtype}")
    return ao, bo, check_precision(precision)


# Multiply-adds per element above which a transposed operand is copied to K-contiguous
# rows first. Its transposed loads (4-byte cp.async, or register gathers for 16-bit) feed
# the tensor cores at a fraction of the K-major rate (H100, 1024x8192x8192: TF32 85
# against 400 TFLOP/s, 3xTF32 32 against 114), while a copy costs about as much as 100
# multiply-adds per element at those rates: small operands of big products (dW's dy and
# x) are copied, a big one read by few rows (W in dx = dy @ W at a small batch) is not.
# The same bound decides whether misaligned float32 rows are copied for Hopper's wgmma.
# (Hopper TF32 / 3xTF32 read a transposed A by TMA; mm uses that for a row-major b,
# see _swaps, while other transposed operands still follow this bound.)
_COPY_WORK = 128


def _misaligned_rows(o, ld: int) -> bool:
    """Whether ``o``'s K-contiguous float32 rows (stride ``ld``) keep a Hopper GPU off its
    wgmma kernels only by where they start or by their stride (K a multiple of 4): a
    16-byte aligned copy then pays for a big product (H200, 1024x8192 @ (8192x8192)^T
    "high": 4.29 ms on mma.sync, 0.32 ms on wgmma)."""
    K = o.shape[1]
    return (o.dtype == "float32" and o.kind != "cpu" and o.size > 0 and K % 4 == 0
            and not vector_aligned(o.ptr, ld, K, 4) and _loader.device_cc(o.device) == 90)


def _read_mode(o, work: int):
    """How the GEMM reads the 2-D Operand ``o`` in a product of ``work`` multiply-adds:
    ``("view", None)`` in place, ``("transpose", column stride)`` by the tiled transpose
    copy (its columns are contiguous and copying pays, ``_COPY_WORK``), or ``("copy",
    None)`` (neither rows nor columns contiguous, or rows :func:`_misaligned_rows` where
    copying pays)."""
    lay = layout(o)
    if lay is None:
        return "copy", None
    pays = work >= _COPY_WORK * o.size
    if lay[0] and pays:
        return "transpose", lay[1]
    if not lay[0] and pays and _misaligned_rows(o, lay[1]):
        return "copy", None
    return "view", None


def matrix(o, work: int):
    """``o`` (..., K) as the GEMM's 2-D (rows, K) operand of a product of ``work``
    multiply-adds (:func:`_read_mode`): in place, transposed or copied; more dims as rows
    (:func:`rows_2d`)."""
    if o.ndim != 2:
        o = rows_2d(o, o.name)
    mode, ld = _read_mode(o, work)
    if mode == "transpose":
        copy = _transpose_plan(o, ld)[1]
        launches, held = [], []
        copy(o.ptr, launches, held)
        launch_all(o, launches)
        return operand(held[0], o.name)
    if mode == "copy":  # (a new array: also where a C-contiguous view starts misaligned)
        return operand(contiguous(o, copy=True).reshape(o.shape), o.name)
    return o


def _planned_read(o, work: int):
    """(Operand to plan the GEMM with, copy or None) for the 2-D Operand ``o``
    (:func:`_read_mode`); None if it needs a general copy. ``copy`` as
    :func:`_transpose_plan`'s."""
    mode, ld = _read_mode(o, work)
    if mode == "transpose":
        return _transpose_plan(o, ld)
    return None if mode == "copy" else (o, None)


def fresh_like(o, shape, name):
    """An Operand describing a new C-contiguous 2-D array of ``shape`` beside ``o`` (a fresh
    allocation: 16-byte aligned), to plan a GEMM that will read it."""
    return Operand(o.obj, o.kind, o.dtype, shape, (shape[1], 1), 0, o.device, name, o.torch)


def _transpose_plan(o, ld: int):
    """The C-contiguous copy of the 2-D GPU Operand ``o`` whose columns are contiguous
    (column stride ``ld``), by the tiled transpose kernel (torch's and CuPy's strided
    copies run at a third of copy bandwidth: H100, 8192 x 8192 float32, 0.56 ms against
    0.18 ms for a clone): ``(planned, copy)``, ``planned`` an Operand that describes the
    copy for planning (a fresh allocation: 16-byte aligned), ``copy(src_ptr, launches,
    held) -> dst_ptr`` allocating it (appended to ``held``) and appending its launch."""
    rows, cols = o.shape
    fn = _loader.function(_FILE, _transpose_expr(o.dtype), o.device)
    grid = (cdiv(rows, _TRANSPOSE["TILE"]) * cdiv(cols, _TRANSPOSE["TILE"]),)
    place = Place(o)
    planned = fresh_like(o, (rows, cols), o.name)

    def copy(src, launches, held):
        out = empty(place, (rows, cols))
        held.append(out)
        dst = place.ptr(out)
        launches.append((fn, grid, (_TRANSPOSE["THREADS"],), (src, dst, rows, cols, ld), 0))
        return dst

    return planned, copy


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
          "HIGHEST_MIN_WORK": 2 ** 30, "HIGHEST_MIN_WORK_CUPY": 2 ** 28,
          "MISALIGNED_MIN_WORK": 2 ** 30, "HALF_MISALIGNED_MIN_K": 512,
          "MISALIGNED_GRAD_MIN_WORK": 2 ** 33, "HIGHEST_GRAD_MIN_WORK": 2 ** 33,
          # the vendor path's own forms: padded_n, bias_apart
          "PADDED_N_MIN_WORK": 2 ** 30, "PADDED_N_MIN_M": 512,
          "PADDED_GRAD_MIN_WORK": 2 ** 34, "PADDED_GRAD_MIN_N": 64,
          "BIAS_APART_MIN_WORK": 2 ** 28, "BIAS_APART_MIN_K": 1024, "BIAS_APART_MIN_N": 64}


def route(M: int, N: int, K: int, dtype: str, precision: str, kind: str, cc: int,
          aligned: bool = True, grad: bool = False) -> str:
    """OURS or VENDOR for a plain product (M x K) @ (K x N) of ``dtype`` at ``precision``
    (a checked one; ignored but for float32) for arrays of ``kind`` on a GPU of compute
    capability ``cc``; ``aligned``: Hopper runs ours on wgmma (:func:`_route_of`);
    ``grad``: a torch call that autograd records, in plain eager mode (the vendor's is
    then torch's own op and backward, :func:`eager_plan`). Each rule with its
    measurement: H200, one run, our kernel forced against the vendor (cuBLAS through
    torch; "highest": SGEMM), events around each call, host included, shapes as M x K x
    N."""
    if _FORCED[0] is not None:
        return _FORCED[0]
    if dtype not in _VENDOR_DTYPES.get(kind, ()):
        return OURS  # (CuPy bfloat16)
    # Below sm_80 ours runs on CUDA cores only, as cuBLAS's SGEMM/DGEMM do, while cuBLAS
    # has Turing's fp16 tensor cores and tuned tiles (not measured: no sm_75 machine).
    if cc < 80:
        return VENDOR
    # float64: ours was a CUDA-core kernel (1x4096x4096 440 us against 35, 0.08x, the
    # issue's figure). On DMMA it still never wins against cuBLAS's DGEMM (mm, H200, one
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
    c, work = _ROUTE, M * N * K
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
        #  K < 128: linear 100000x64x64 ours 44 us against 38 (0.85x).
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
        # On Hopper, rows that wgmma cannot read (K % 4: no copy aligns them) leave ours on
        # mma.sync's element loads, slower than SGEMM (H200, linear, GPU time from CUDA
        # graphs, ours / SGEMM: 231x3650x4130 676 / 209 us, 296x305x6324 102 / 33,
        # 4099x5583x297 937 / 439, 748x1602x632 73 / 53): the vendor's.
        # A call that autograd records, below HIGHEST_GRAD_MIN_WORK: the vendor's (its
        # backward's two products on ours each pay the op's host time). H200, training
        # steps back to back, ours / the vendor route x eager: linear 256x1024x1025 0.49x,
        # 1024^3 0.63 / 0.91x, 1024x2048x1024 1.10 / 0.99x, 2048x2048x1024 (2**32) 1.13x,
        # 2048^3 1.98x; matmul 1024^3 0.41 / 0.89x, 1024x2048x1024 0.65 / 0.99x, 2**32
        # 1.22x, 2048^3 1.83x. On a slower host (2026-11-28, H200, F.linear 24-33 us a
        # call, ours forced / dispatched x eager) ours' step is the host's: ~490 us a step
        # at 1024x2048x1024 of 168 us GPU time (0.55x; matmul 0.60x), 2**32 0.88-1.09x
        # (matmul 0.83-0.99x): the vendor's below 2**33, where ours' step stays ahead
        # (2048^3: ~1100 us of eager GPU time against ours' ~340).
        if (M < c["HIGHEST_MIN_M"] or N < c["HIGHEST_MIN_N"] or K < c["HIGHEST_MIN_K"]
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
    if cc == 90 and aligned and N % 4 and misaligned_ours:
        return OURS
    return VENDOR


def padded_n(M: int, N: int, K: int, dtype: str) -> int:
    """How many columns the vendor's 16-bit product computes: N, or N rounded up to a
    multiple of 8 in a product of at least 2**30 multiply-adds where cuBLAS runs slow
    kernels for the output's rows (an odd N with an even K; N % 4 == 2 with K % 8 == 0)
    and the padded product does not: the vendor path then pads W (or b) with zero rows,
    computes the padded product and copies its N columns out. Elsewhere the pad and the
    copy only slow cuBLAS's own kernel down. H200 bf16 linear, GPU time from CUDA graphs,
    F.linear / padded (us): padded 8192x1024x50257 9010 / 2263, 2048x2048x2047 190 / 41,
    1024x4096x4097 359 / 87, 2048x2050x2047 134 / 94, 1024x4096x4098 126 / 87; not
    (an odd K) 2048x2047x2047 137 / 157, 4099x5583x297 180 / 194, 1372x59x14086 49 / 98,
    35x3671x11870 100 / 204; (N % 4 == 2, K % 8 == 2) 231x3650x4130 56 / 97,
    2854x66x6810 39 / 88, 4525x234x2530 45 / 74; (N % 4 == 0) 256x4096x4100 53 / 56.
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
    for cache in (_plans, _matmul_plans, _grad_plans, _matmul_grad_plans, *_ROUTED_CACHES):
        cache.clear()


def _route_of(ao, bo_nk, precision: str, grad: bool = False) -> str:
    """:func:`route` for GPU Operands ``ao`` (M, K) and ``bo_nk`` (N, K) as the GEMM reads
    them (a transposed or misaligned operand that ours would copy counts as aligned)."""
    (M, K), N = ao.shape, bo_nk.shape[0]
    cc = _loader.device_cc(ao.device)
    aligned = True
    if ao.dtype != "float64" and cc == 90:
        work = M * N * K
        if ao.dtype == "float32":
            aligned = all(_wgmma_rows(o, work) for o in (ao, bo_nk))
        else:  # 16-bit wgmma reads both in place, where _choose takes it
            aligned = (all(_read_mode(o, work)[0] == "view" for o in (ao, bo_nk))
                       and _half_wgmma(ao, bo_nk, precision))
    which = route(M, N, K, ao.dtype, precision, ao.kind, cc, aligned, grad)
    if which == VENDOR and not _vendor(ao.kind).takes(ao.dtype, precision):
        return OURS
    return which


def _transposed_b(a, b_nk) -> bool:
    """Whether ours would read ``b_nk`` of ``a @ b_nk.T`` transposed in place (element
    loads, no TMA: a copy does not pay, :func:`_read_mode`), as a fused op's dW = dz^T @ x
    does for fewer than _COPY_WORK output features: such a product follows :func:`route`
    too. H200, GemmScaleBatchNorm's training step "highest", dW alone, ours (3xTF32, split
    K) / eager's SGEMM: 200000x64->16 1452 / 50 us, 200000x64->64 1448 / 54, 12108x1961->57
    184 / 75."""
    lay = layout(b_nk)
    work = a.shape[0] * a.shape[1] * b_nk.shape[0]
    return lay is not None and lay[0] and _read_mode(b_nk, work)[0] == "view"


def _off_wgmma(a, b_nk) -> bool:
    """Whether a Hopper GPU runs the float32 ``a @ b_nk.T`` off its wgmma kernels (rows
    that no copy aligns): then a fused op's product follows :func:`route` too (H200,
    GemmScaleBatchNorm's forward, GPU time, ours on mma.sync / eager: 4099x5583->297
    "highest" 949 / 464 us, "high" 573 / 212; 296x305->6324 "highest" 117 / 54)."""
    work = a.shape[0] * a.shape[1] * b_nk.shape[0]
    return (_loader.device_cc(a.device) == 90
            and not all(_wgmma_rows(o, work) for o in (a, b_nk)))


def _wgmma_rows(o, work: int) -> bool:
    """Whether ours reads the float32 2-D Operand ``o`` on Hopper's wgmma: its rows (after
    any copy :func:`_read_mode` makes) K-contiguous and 16-byte aligned, or a transposed
    one (see :func:`route`). A copy is a fresh array of rows of K: aligned where K % 4 == 0."""
    lay = layout(o)
    if lay is None or _read_mode(o, work)[0] != "view":
        return o.shape[1] % 4 == 0
    return lay[0] or vector_aligned(o.ptr, lay[1], o.shape[1], 4)


def _vendor(kind: str):
    """The vendor's products for arrays of ``kind``: an object with ``linear(x, w, b,
    precision)``, ``matmul(a, b, precision)`` (NumPy semantics, batched), their eager
    forms for one problem (``linear_form`` / ``matmul_form``, see :class:`_VendorPlan`;
    None where the library has none), valid unless ``autocasting()``,
    ``takes(dtype, precision)`` (whether the library's own float32 setting gives that
    precision now: the vendor path never flips a library-wide switch, which other threads
    would see), ``state()`` (that setting, part of each plan's key), ``capturing()``
    (whether its current stream captures a CUDA graph) and ``prepare(device)``
    (:func:`planned_capture`)."""
    return torch_layer("gemm").Vendor if kind == "torch" else _CupyVendor


def vendor_state(x):
    """The float32 setting of ``x``'s library that :func:`_route_of` read (None for
    anything else): calls under another setting plan again."""
    if is_torch(x):
        return _vendor("torch").state()
    return _CupyVendor.state() if _is_cupy(x) else None


def float64_capture(x) -> bool:
    """Whether ``x`` is of 8-byte elements (float64, once checked) and the current stream of
    its library (torch or CuPy) is capturing a CUDA graph: where a fused op's float64
    products follow :func:`route` (``captured``, see :func:`fused_vendor`); part of its
    plans' keys (other dtypes' plans do not depend on capture)."""
    if getattr(x, "itemsize", 0) != 8:
        return False
    if is_torch(x):
        return x.is_cuda and _vendor("torch").capturing()
    return _CupyVendor.capturing() if _is_cupy(x) else False


def planned_capture(a) -> bool:
    """For a fused op's plan (``a``: its 2-D GPU Operand): :func:`float64_capture` of
    ``a``'s array, and where it is False, for float64, the cuBLAS handle of ``a``'s
    library made for this thread and device now. The plan made again while a CUDA graph
    is captured takes the vendor's products where this one, warmed up before the
    capture, runs ours; a first cuBLAS call inside the capture would create the handle
    there, which fails (H200: CUBLAS_STATUS_NOT_INITIALIZED, the capture invalidated).
    Autograd runs a backward on a thread of its own: its plans prepare there."""
    captured = float64_capture(a.obj)
    if not captured and a.dtype == "float64":
        _vendor(a.kind).prepare(a.device)
    return captured


class _CupyVendor:
    """cuBLAS through CuPy, on CuPy's current stream. float32 "highest" is cuBLAS's SGEMM:
    ``cupy.matmul`` (CUBLAS_COMPUTE_32F: exact fp32 products) unless CuPy's compute type is
    TF32 (CUPY_TF32=1), then ``cupy.cublas.gemm`` (SGEMM whatever CUPY_TF32 says; this path
    through it took 79 us a call against cupy's @ 36, H100, 256x1024x1024); "high" /
    "medium" only where CuPy's float32 compute type is TF32 already (CUPY_TF32=1: cuBLAS's
    CUBLAS_COMPUTE_32F_FAST_TF32), else ours; float64 / float16 cupy.matmul as it is
    (DGEMM on the FP64 tensor cores; fp16 products with fp32 sums)."""

    @staticmethod
    def state():
        return _loader.cupy()._core._routines_linalg.get_compute_type(np.float32)

    @staticmethod
    def capturing():
        return _loader.cupy().cuda.get_current_stream().is_capturing()

    @staticmethod
    def prepare(device: int):
        _ = _loader.cupy().cuda.Device(device).cublas_handle  # (made for this thread if none)

    @staticmethod
    def linear_form(*problem):
        return None  # (no eager form: CuPy's calls run the plan itself)

    matmul_form = linear_form

    @staticmethod
    def takes(dtype: str, precision: str) -> bool:
        if dtype != "float32" or precision == "highest":
            return True
        return _CupyVendor.state() == _loader.cupy()._core._routines_linalg.COMPUTE_TYPE_TF32

    @staticmethod
    def matmul(a, b, precision):
        cupy = _loader.cupy()
        if a.shape[-1] == 0:  # (cuBLAS is not asked to sum nothing)
            return cupy.zeros(matmul_shape(a.shape, b.shape), a.dtype)
        if (a.dtype == np.float32 and precision == "highest"
                and _CupyVendor.state() == cupy._core._routines_linalg.COMPUTE_TYPE_TF32):
            return _CupyVendor._sgemm(a, b)
        return cupy.matmul(a, b)

    @staticmethod
    def _sgemm(a, b):
        import cupy.cublas  # (a submodule `import cupy` leaves out)
        cupy = _loader.cupy()
        if a.ndim == 1 or b.ndim == 1:
            shape = matmul_shape(a.shape, b.shape)
            return _CupyVendor._sgemm(a[None] if a.ndim == 1 else a,
                                      b[:, None] if b.ndim == 1 else b).reshape(shape)
        if a.ndim == 2 and b.ndim == 2:
            return cupy.cublas.gemm("N", "N", a, b, out=cupy.empty((a.shape[0], b.shape[1]), a.dtype))
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a = cupy.broadcast_to(a, shape + a.shape[-2:])
        b = cupy.broadcast_to(b, shape + b.shape[-2:])
        out = cupy.empty(shape + (a.shape[-2], b.shape[-1]), a.dtype)
        for i in np.ndindex(*shape):  # (one SGEMM per matrix: cuBLAS's batched SGEMM takes no strides of 0)
            cupy.cublas.gemm("N", "N", a[i], b[i], out=out[i])
        return out

    @staticmethod
    def linear(x, w, b, precision):
        lead = x.shape[:-1]  # (math.prod: np.prod of a tuple costs a call microseconds)
        y = _CupyVendor.matmul(x.reshape(math.prod(lead), x.shape[-1]), w.T, precision)
        y = y.reshape(lead + (w.shape[0],))
        if b is not None:
            y += b
        return y


def reference(x, w, b=None):
    """NumPy reference in the accumulation type (float32 for 16-bit, as the GPU does)."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    y = x.astype(acc) @ w.astype(acc).T
    if b is not None:
        y = y + b.astype(acc)
    return y.astype(x.dtype)


def linear(x, weight, bias=None, *, precision=None, out=None):
    """``x @ weight.T + bias`` (PyTorch's ``F.linear``).

    Args:
        x: (..., K) CuPy array, torch tensor (CUDA or CPU) or NumPy array of float16,
            bfloat16, float32 or float64.
        weight: (N, K), same kind, device and dtype as x.
        bias: optional (N,), same dtype.
        precision: for float32, "highest" (3xTF32, about SGEMM's accuracy), "high" (TF32) or
            "medium" (bf16). ``None``: torch inputs follow
            ``torch.get_float32_matmul_precision()``, CuPy/NumPy use "highest".
            Ignored for other dtypes.
        out: optional (..., N) array of x's kind, device and dtype.

    Returns an array of x's kind (torch in -> torch out, on torch's current stream,
    through the custom op ``torch.ops.cupykern.linear``, with autograd). The product runs
    on our kernels or cuBLAS as :func:`route` says (float32 on cuBLAS only where the
    library's own TF32 setting gives ``precision``: torch's TF32 switch, CuPy's compute
    type), decided once per argument signature. A Dask array x
    (CuPy or NumPy chunks; weight and bias concrete arrays of that kind) gives a Dask
    array computed block by block, K rechunked into one chunk where it is split
    (``out`` not supported).
    Copies: a 2-D x or weight whose rows are contiguous (any row stride: a column
    slice) is read in place, and so is a contiguous x of any rank; one whose columns
    are contiguous (a transposed view) is read in place where that is faster than a
    copy (small against the product); anything else is first copied to a contiguous
    array. NumPy arrays use a NumPy reference path.
    """
    if is_torch(x):
        return torch_layer("gemm").linear(x, weight, bias, precision=precision, out=out)
    if _dask.is_dask(x):
        _dask.no_out(out)
        check(_dask.sample(x, (0,) * (x.ndim - 1) + x.shape[-1:]), weight, bias, precision, None)
        x = _dask.whole(x, x.ndim - 1)
        return _dask.map_blocks(linear_core, x, weight, bias, precision, name="linear",
                                chunks=x.chunks[:-1] + ((weight.shape[0],),))
    return linear_core(x, weight, bias, precision, out)


def check(x, weight, bias, precision, out):
    """Validate ``linear``'s arguments once: (x, weight, bias, out Operands or None,
    precision, output shape)."""
    xo, wo = check_operands(x, weight)
    N = wo.shape[0]
    bo = check_vector(bias, "bias", xo, N)
    prec = check_precision(precision)
    shape = tuple(xo.shape[:-1]) + (N,)
    o = check_out(out, xo, shape, inputs=(xo, wo, bo)) if out is not None else None
    return xo, wo, bo, o, prec, shape


_plans: dict = {}  # (signatures, precision, vendor state) -> run(x, weight, bias), or None


def linear_core(x, weight, bias=None, precision=None, out=None):
    """:func:`linear` for CuPy arrays, NumPy arrays and (from the torch layer) torch
    CUDA tensors."""
    checked = None
    if out is None and (precision is None or type(precision) is str):  # the common call
        key = _linear_key(x, weight, bias, precision, vendor_state(x))
        run, checked = cached_checked(_plans, key, check, _fresh,
                                      (x, weight, bias, precision, None))
        if run is not None:
            return run(x, weight, bias)
    xo, wo, bo, o, prec, shape = checked or check(x, weight, bias, precision, out)
    if xo.kind == "cpu":
        res = reference(x, weight, bias)
        if o is None:
            return res
        copy_into(out, res)
        return out
    N = shape[-1]
    if N == 0 or int(np.prod(shape[:-1])) == 0:  # nothing to compute (K == 0 is not this)
        return empty(xo, shape) if o is None else out
    if _route_of(_rows_planned(xo), wo, prec) == VENDOR:
        res = _vendor(xo.kind).linear(x, weight, bias, prec)
        if o is None:
            return res
        copy_into(out, res)
        return out
    work = int(np.prod(shape)) * xo.shape[-1]
    a, b = matrix(xo, work), matrix(wo, work)
    direct = o is not None and o.is_c_contiguous()
    c = operand((out if direct else empty(xo, shape)).reshape(a.shape[0], N), "out")
    gemm(a, b, c, prec, bias=bo)
    res = c.obj.reshape(shape)
    if o is None:
        return res
    if not direct:
        copy_into(out, res)
    return out


def _fresh(checked, x, weight, bias, precision, out, grad=False):
    """``run(x, weight, bias) -> out`` for calls like this one without ``out``
    (``checked``: their validation), planned once (a transposed copy is a launch of the
    plan); None where the call needs the general path (CPU, empty, or an operand copied
    otherwise). With ``grad`` (:func:`eager_plan`'s) only the vendor's plan, else
    None."""
    xo, wo, bo, _, prec, shape = checked
    if xo.kind == "cpu" or 0 in shape:
        return None
    if _route_of(_rows_planned(xo), wo, prec, grad) == VENDOR:
        M, N = int(np.prod(shape[:-1])), shape[-1]
        return vendor_linear(xo.kind, prec, (M, N, xo.shape[-1], xo.dtype))
    if grad:
        return None
    if bo is not None and bo.obj is not bias:
        return None
    if xo.ndim != 2:  # more dims as rows, where that is a view
        if row_view_stride(xo) is None:
            return None
        xo = rows_2d(xo, "x")
    work = int(np.prod(shape)) * xo.shape[-1]
    run = _planned_gemm(xo, wo, work, prec, shape)
    if run is None:
        return None
    ptr = run.place.ptr  # (*_: the op's precision, from the torch layer's Op.call_planned)
    return lambda x, weight, bias, *_: run(ptr(x), ptr(weight), ptr(bias))


def _rows_planned(xo):
    """x (..., K) as the 2-D (M, K) Operand ours would read: in place where that is a view,
    else a fresh contiguous array."""
    if xo.ndim == 2:
        return xo
    if row_view_stride(xo) is None:
        return fresh_like(xo, (xo.size // xo.shape[-1] if xo.shape[-1] else 0, xo.shape[-1]), "x")
    return rows_2d(xo, "x")


class _VendorPlan:
    """A plan where :func:`route` chose the vendor: ``run(*arrays) = impl(*arrays,
    precision)`` (linear's ``(x, weight, bias)``, matmul's ``(a, b)``); ``eager``: the
    same product as the vendor's library computes it outside autocast and tracing, with
    what ``impl`` decides per call decided (``eager(*arrays)``), or None (CuPy's). A run
    takes the eager form unless the ``vendor`` is autocasting."""

    __slots__ = ("impl", "precision", "eager", "_autocasting")

    def __init__(self, vendor, impl, precision, eager=None):
        self.impl, self.precision, self.eager = impl, precision, eager
        self._autocasting = vendor.autocasting if eager is not None else None

    def __call__(self, *arrays):
        if self.eager is not None and not self._autocasting():
            return self.eager(*arrays)
        return self.impl(*arrays, self.precision)


def eager_plan(x, weight, bias, precision, state, grad=False):
    """What the torch layer runs for :func:`linear` in plain eager mode (a string
    precision; ``state``: :func:`vendor_state` of x), from the cached plan of these
    arguments: ``(run, vendor)``. ``vendor``: the plan is the vendor's and ``run`` its eager
    form (torch's own ``F.linear``, with torch's autograd), called without the op's
    boundary; else ``run`` is ours' launch plan (``run(x, weight, bias, *_)``), for
    :meth:`cupykern.torch._op.Op.call_planned` (the op's autograd without its second
    lookup), or None until a first call has planned them or where the general path
    computes them. (Arguments that :func:`signature` does not describe, such as tensor
    subclasses, have no plan.) ``grad``: a call that autograd records, which also takes
    the vendor's form where :func:`route` with ``grad`` gives it the product, planned on
    its first call (which, where ours computes it, validates again in the op)."""
    key = _linear_key(x, weight, bias, precision, state)
    return _eager_plan(_plans, _grad_plans, key, grad, check, _fresh,
                       (x, weight, bias, precision, None))


def _eager_plan(plans, grad_plans, key, grad, check, fresh, args):
    """:func:`eager_plan`'s answer from the op's ``plans`` or, for a recorded call where
    those are not the vendor's, ``grad_plans`` (made by ``fresh`` with grad; not for a key
    no plan is stored for, which would validate on every call)."""
    plan = plans.get(key)
    if type(plan) is _VendorPlan:
        return plan.eager, True
    if grad and plannable(key):
        vendor = cached_checked(grad_plans, key, check, fresh, args, (True,))[0]
        if type(vendor) is _VendorPlan:
            return vendor.eager, True
    return plan, False


_grad_plans: dict = {}  # linear's keys -> the vendor's plan for a recorded call, or None


def _linear_key(x, weight, bias, precision, state) -> tuple:
    """The key of :func:`linear_core`'s cached plans (``state``: :func:`vendor_state` of x)."""
    return signature(x), signature(weight), signature(bias), precision, state


# ---- matmul: NumPy's matmul on the same dispatcher.

def matmul_shape(a_shape, b_shape) -> tuple:
    """NumPy matmul's result shape for operands of these shapes (ValueError naming the
    argument that does not fit)."""
    if len(a_shape) == 0:
        raise ValueError("a: expected at least 1 dimension, got a 0-d array (use * to scale)")
    if len(b_shape) == 0:
        raise ValueError("b: expected at least 1 dimension, got a 0-d array (use * to scale)")
    kb = b_shape[-2] if len(b_shape) > 1 else b_shape[0]
    if a_shape[-1] != kb:
        raise ValueError(f"b: its {'rows' if len(b_shape) > 1 else 'length'} ({kb}) do not "
                         f"match a's last dimension ({a_shape[-1]}); shapes {tuple(a_shape)} "
                         f"and {tuple(b_shape)}")
    try:
        batch = np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2]))
    except ValueError:
        raise ValueError(f"b: batch dimensions {tuple(b_shape[:-2])} do not broadcast with "
                         f"a's {tuple(a_shape[:-2])}") from None
    return batch + tuple(a_shape[-2:-1]) + tuple(b_shape[-1:] if len(b_shape) > 1 else ())


def check_matmul(a, b, precision, out):
    """Validate :func:`matmul`'s arguments: (a, b Operands, precision, result shape, out
    Operand or None)."""
    ao, bo = operand(a, "a"), operand(b, "b")
    same_place(ao, bo)
    if ao.dtype != bo.dtype:
        raise TypeError(f"b: dtype {bo.dtype} does not match a's dtype {ao.dtype}")
    shape = matmul_shape(ao.shape, bo.shape)
    prec = check_precision(precision)
    o = check_out(out, ao, shape, inputs=(ao, bo)) if out is not None else None
    return ao, bo, prec, shape, o


def matmul(a, b, *, precision=None, out=None):
    """``a @ b`` with NumPy's matmul semantics, on :func:`linear`'s dispatcher.

    Args:
        a, b: CuPy arrays, torch tensors (CUDA or CPU) or NumPy arrays of one kind,
            device and dtype (float16, bfloat16, float32, float64). 1-D operands are
            vectors (a row for ``a``, a column for ``b``, the dimension dropped from the
            result); more than 2 dims are stacks of matrices whose batch dims broadcast.
        precision: for float32 as in :func:`linear` ("highest": at least SGEMM's accuracy
            on any data; "high": TF32; "medium"), ``None``: torch's float32 matmul
            precision for torch inputs, "highest" otherwise.
        out: optional array of the result's shape, kind and dtype (not sharing memory
            with ``a`` or ``b``).

    Returns an array of a's kind (torch: through ``torch.ops.cupykern.matmul``, with
    autograd). Each matrix product goes where :func:`route` says: our tensor-core GEMM, or
    cuBLAS through torch / CuPy (batched there, except float32 "highest" that ours takes:
    a loop of our 2-D kernel, and CuPy bfloat16, ours). NumPy arrays use NumPy.
    """
    if is_torch(a):
        return torch_layer("gemm").matmul(a, b, precision=precision, out=out)
    return matmul_core(a, b, precision, out)


_matmul_plans: dict = {}  # (signatures, precision, vendor state) -> run(a, b), or None


def matmul_core(a, b, precision=None, out=None):
    """:func:`matmul` for CuPy arrays, NumPy arrays and (from the torch layer) torch CUDA
    tensors."""
    checked = None
    if out is None and (precision is None or type(precision) is str):  # the common call
        run, checked = cached_checked(_matmul_plans, _matmul_key(a, b, precision, vendor_state(a)),
                                      check_matmul, _matmul_fresh, (a, b, precision, None))
        if run is not None:
            return run(a, b)
    ao, bo, prec, shape, o = checked or check_matmul(a, b, precision, out)
    if ao.kind == "cpu":
        acc = np.float64 if ao.dtype == "float64" else np.float32
        res = np.asarray(np.matmul(np.asarray(a, acc), np.asarray(b, acc))).astype(ao.array_dtype)
    elif 0 in shape or ao.shape[-1] == 0:  # (K == 0: zeros)
        res = empty(ao, shape)
        res[...] = 0
    else:
        res = _matmul_gpu(ao, bo, prec, shape)
    if o is None:
        return res
    copy_into(out, res)
    return out


def _as_matrices(ao, bo):
    """``a`` and ``b`` with 1-D operands as a (1, K) row and a (K, 1) column (views)."""
    a = ao.obj[None] if ao.ndim == 1 else ao.obj
    b = bo.obj[:, None] if bo.ndim == 1 else bo.obj
    return a, b


def _matmul_route(ao, bo, prec, grad: bool = False) -> str:
    """:func:`route` of one matrix product of ``a @ b`` (2-D views of the operands)."""
    a, b = _as_matrices(ao, bo)
    a2 = operand(a[(0,) * (a.ndim - 2)], "a")
    b2 = operand(b[(0,) * (b.ndim - 2)], "b")
    return _route_of(a2, operand(b2.obj.T, "b"), prec, grad)


def _matmul_gpu(ao, bo, prec, shape):
    """A new array of ``shape`` holding ``a @ b`` (GPU Operands, nothing empty)."""
    a, b = _as_matrices(ao, bo)
    if _matmul_route(ao, bo, prec) == VENDOR:
        return _vendor(ao.kind).matmul(a, b, prec).reshape(shape)
    if a.ndim == 2 and b.ndim == 2:
        return mm(a, b, prec).reshape(shape)
    return _stack_on_ours(ao, a, b, prec).reshape(shape)


def _stack_on_ours(ao, a, b, prec):
    """A stack of products (batch dims broadcast) on our 2-D GEMM, planned once for the
    first matrix and launched per matrix with its offsets in one batch: each operand is
    first made K-major in one copy where it is not (b: its transpose), so that every
    matrix reads alike (float32 "highest" 3xTF32, CuPy bfloat16)."""
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    at, bt = (_k_major(t) for t in (a, _swap_last(b)))
    at, bt = (operand(_broadcast_to(t, batch + t.shape[-2:]), n) for t, n in ((at, "a"), (bt, "b")))
    isz = ITEMSIZE[ao.dtype]
    a0, b0 = (Operand(o.obj, o.kind, o.dtype, o.shape[-2:], o.strides[-2:], o.ptr, o.device, o.name,
                      o.torch) for o in (at, bt))
    c = empty(ao, batch + (M, N))
    # every matrix 16-byte aligned as the first (else its own plan each)
    if any(n > 1 and (s * isz) % 16 for o in (at, bt) for n, s in zip(batch, o.strides[:-2])):
        for i in np.ndindex(*batch):
            gemm(operand(at.obj[i], "a"), operand(bt.obj[i], "b"), operand(c[i], "out"), prec)
        return c
    kernel = gemm_kernel(a0, b0, prec)
    call, place = gemm_call(kernel, a0, b0, N), Place(ao)
    ws = workspace(place, kernel)
    wsp, cp = (data_ptr(ws) if ws is not None else 0), place.ptr(c)
    launches = []
    for j, i in enumerate(np.ndindex(*batch)):
        oa = sum(k * s for k, s in zip(i, at.strides[:-2]))
        ob = sum(k * s for k, s in zip(i, bt.strides[:-2]))
        launches.extend(call(a0.ptr + oa * isz, b0.ptr + ob * isz, cp + j * M * N * isz, 0, 0,
                             0, 0, wsp))
    launch_all(place, launches)
    return c


def _swap_last(t):
    """``t`` with its last two dims swapped (a view)."""
    return t.mT if is_torch(t) else _loader.cupy().swapaxes(t, -1, -2)


def _k_major(t):
    """``t`` (..., rows, K) itself where its K dim is contiguous, else a C-contiguous copy."""
    o = operand(t, "b")
    return t if o.strides[-1] == 1 or o.shape[-1] == 1 else contiguous(o)


def _broadcast_to(t, shape):
    return t.expand(shape) if is_torch(t) else _loader.cupy().broadcast_to(t, shape)


def _matmul_fresh(checked, a, b, precision, out, grad=False):
    """``run(a, b) -> a @ b`` for calls like this one (``checked``: their validation),
    planned once: the vendor's call, or our planned 2-D GEMM (:func:`mm_plan`); None where
    the call needs the general path (CPU, empty, a stack on ours, an operand copied
    otherwise). With ``grad``, as :func:`_fresh`'s."""
    ao, bo, prec, shape, _ = checked
    if ao.kind == "cpu" or 0 in shape or ao.shape[-1] == 0:
        return None
    if _matmul_route(ao, bo, prec, grad) == VENDOR:
        K = ao.shape[-1]
        N = bo.shape[-1] if bo.ndim > 1 else 1
        return vendor_matmul(ao.kind, prec, (ao.size // K, N, K, ao.dtype, bo.ndim > 1))
    if grad or ao.ndim != 2 or bo.ndim != 2:
        return None
    return _on_arrays(mm_plan(ao, bo, prec))


def eager_plan_matmul(a, b, precision, state, grad=False):
    """As :func:`eager_plan`, for :func:`matmul` (ours' ``run(a, b, *_)``)."""
    return _eager_plan(_matmul_plans, _matmul_grad_plans, _matmul_key(a, b, precision, state),
                       grad, check_matmul, _matmul_fresh, (a, b, precision, None))


_matmul_grad_plans: dict = {}  # as _grad_plans, for matmul


def _matmul_key(a, b, precision, state) -> tuple:
    """The key of :func:`matmul_core`'s cached plans (``state``: :func:`vendor_state` of a)."""
    return signature(a), signature(b), precision, state
