"""``linear``: ``x @ weight.T + bias`` on our own tensor-core GEMM (kernels_cu/gemm.cu).

Precision of float32 inputs follows PyTorch's names:

* ``"highest"``: fp32-accurate 3xTF32 (each operand split into a TF32 part and a
  remainder; three tensor-core products) with the tensor-core sum promoted into an
  fp32 register accumulator every 32 of K, which is as accurate as SGEMM.
* ``"high"``: TF32 tensor cores.
* ``"medium"``: operands rounded to bf16, fp32 accumulation; on Hopper with aligned
  rows, TF32 instead, which is faster there and more accurate (PyTorch's "medium"
  likewise allows any algorithm at least as accurate as bf16).

float16 / bfloat16 inputs use the tensor cores directly (fp32 accumulation);
float64 uses a CUDA-core kernel. Any M, N, K work: tiles are bounds-checked, and
rows that are not 16-byte aligned take an element-wise load path. On Hopper,
float32 "highest"/"high" with 16-byte aligned rows use wgmma (sm_90a); everything
else uses mma.sync (sm_80+).
"""
from __future__ import annotations

import numpy as np

from . import _loader
from ._array import (CTYPE, ITEMSIZE, check_out, contiguous, copy_into, empty, is_torch, launch,
                     on_cpu, operand, require_writable, same_place, scalar)

_FILE = "gemm.cu"
PRECISIONS = ("highest", "high", "medium")
_MODE = {"highest": 0, "high": 1, "medium": 2}
_MMA = {"BM": 128, "BN": 128, "THREADS": 256, "SMEM": 4 * 256 * 144}
# gemm_wgmma<MODE> (Hopper, float32 "highest"/"high", 16-byte aligned rows), as wg_cfg::Cfg
# in gemm.cu: tile width BN and dynamic smem (stages of 32-float K slices of A and B,
# 3xTF32 also B's remainders; mbarriers; 1 KB alignment slack).
_WGMMA = {0: {"BN": 128, "SMEM": 4 * (128 + 2 * 128) * 128 + 96 + 1024},
          1: {"BN": 256, "SMEM": 4 * (128 + 256) * 128 + 96 + 1024}}
_WGMMA_THREADS = 384
_SIMPLE_TILE = 64


def _mma_expr(dtype: str, mode: int, aligned: bool) -> str:
    return f"gemm_mma<{CTYPE[dtype]}, {mode}, {'true' if aligned else 'false'}>"


for _al in (True, False):
    _loader.register(_FILE, [_mma_expr("float32", m, _al) for m in _MODE.values()])
    _loader.register(_FILE, [_mma_expr(d, 3, _al) for d in ("float16", "bfloat16")])
_loader.register(_FILE, ["gemm_simple<double>"])
_loader.register(_FILE, [f"gemm_wgmma<{m}>" for m in _WGMMA], min_cc=90)


def resolve_precision(precision, x) -> str:
    """``None`` -> torch's float32 matmul precision for torch inputs, else "highest"."""
    if precision is None:
        if is_torch(x):
            import torch
            return torch.get_float32_matmul_precision()
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


def rows_2d(o, name):
    """``o`` (..., K) as a 2-D Operand whose rows are K-contiguous (copies only if needed)."""
    k = o.shape[-1]
    m = o.size // k if k else int(np.prod(o.shape[:-1]))
    if o.ndim == 2 and (o.strides[1] == 1 or k <= 1) and o.strides[0] >= k:
        return o
    obj = o.obj if o.is_c_contiguous() else contiguous(o)
    return operand(obj.reshape(m, k), name)


def _aligned(o, isz) -> bool:
    return o.ptr % 16 == 0 and (o.strides[0] * isz) % 16 == 0 and (o.shape[1] * isz) % 16 == 0


def gemm(a, b, c, precision: str, bias=None, alpha=None, beta=None, part=None) -> int:
    """Launch ``c = epilogue(a @ b.T)`` on 2-D Operands (a: M x K, b: N x K, c: M x N rows
    contiguous). ``bias`` (T), ``alpha``/``beta``/``part`` (accumulation type) are
    Operands or None. Returns the M-tile height of ``part``'s partial statistics."""
    M, K = a.shape
    N = b.shape[0]
    dt, isz = a.dtype, ITEMSIZE[a.dtype]
    ptr = lambda o: scalar(0 if o is None else o.ptr, "ptr")  # noqa: E731
    args = (ptr(a), ptr(b), ptr(c), scalar(M, "int"), scalar(N, "int"), scalar(K, "int"),
            scalar(a.strides[0], "long long"), scalar(b.strides[0], "long long"),
            scalar(c.strides[0], "long long"), ptr(bias), ptr(alpha), ptr(beta), ptr(part))
    if dt == "float64" or _loader.device_cc(a.device) < 80:
        if dt != "float64":
            raise NotImplementedError("cupykern.linear: float32/16-bit GEMM needs compute capability >= 8.0")
        ts = _SIMPLE_TILE
        fn = _loader.function(_FILE, "gemm_simple<double>", a.device)
        launch(a, fn, (-(-M // ts), -(-N // ts)), (256,), args)
        return ts
    mode = _MODE[precision] if dt == "float32" else 3
    aligned = _aligned(a, isz) and _aligned(b, isz)
    hopper = aligned and _loader.device_cc(a.device) == 90
    if mode == 2 and hopper:
        mode = 1  # our TF32 wgmma outruns the bf16 mma.sync path
    if mode in _WGMMA and hopper:
        cfg, threads = _WGMMA[mode], _WGMMA_THREADS
        fn = _loader.function(_FILE, f"gemm_wgmma<{mode}>", a.device, cfg["SMEM"])
    else:
        cfg, threads = _MMA, _MMA["THREADS"]
        fn = _loader.function(_FILE, _mma_expr(dt, mode, aligned), a.device, cfg["SMEM"])
    tiles = -(-M // _MMA["BM"]) * -(-N // cfg["BN"])  # both kernels use 128-row tiles
    launch(a, fn, (tiles,), (threads,), args, shared_mem=cfg["SMEM"])
    return _MMA["BM"]


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
        precision: for float32, "highest" (fp32-accurate 3xTF32), "high" (TF32) or
            "medium" (bf16). ``None``: torch inputs follow
            ``torch.get_float32_matmul_precision()``, CuPy/NumPy use "highest".
            Ignored for other dtypes.
        out: optional (..., N) array of x's kind, device and dtype.

    Returns an array of x's kind (torch in -> torch out, on torch's current stream).
    Copies: a 2-D x or weight whose rows are contiguous (any row stride, e.g. a column
    slice) is used in place; any other non-contiguous x or weight is first copied to a
    contiguous array. NumPy and CPU tensors use a NumPy reference path.
    """
    xo, wo = check_operands(x, weight)
    N = wo.shape[0]
    bo = check_vector(bias, "bias", xo, N)
    prec = resolve_precision(precision, x)
    shape = tuple(xo.shape[:-1]) + (N,)
    o = check_out(out, xo, shape, inputs=(xo, wo, bo)) if out is not None else None
    if xo.kind == "cpu":
        res = on_cpu(reference, x, weight, bias)
        if o is None:
            return res
        copy_into(out, res)
        return out
    if N == 0 or int(np.prod(shape[:-1])) == 0:  # nothing to compute (K == 0 is not this)
        return empty(xo, shape) if o is None else out
    a, b = rows_2d(xo, "x"), rows_2d(wo, "weight")
    direct = o is not None and o.is_c_contiguous()
    c = operand((out if direct else empty(xo, shape)).reshape(a.shape[0], N), "out")
    gemm(a, b, c, prec, bias=bo)
    res = c.obj.reshape(shape)
    if o is None:
        return res
    if not direct:
        copy_into(out, res)
    return out
