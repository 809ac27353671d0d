"""``gemm_scale_batchnorm``: ``batch_norm((x @ W.T + b) * s)`` (documented model 3).

Training (batch statistics), three launches:
  1. the GEMM writes z = x @ W.T and, from its registers, per-(128-row tile, column)
     (mean, M2) partials of z (the bias cancels out of the output);
  2. one thread per column merges the partials in tile order (Chan's formula:
     stable and deterministic), folds s, gamma, beta into out = a*(z - mean) + beta and
     updates running_mean (bias included) / running_var (unbiased) like
     ``nn.BatchNorm1d``;
  3. an in-place pass out = a*(z - mean) + beta.
Eval (running statistics): a and c are folded first, then one GEMM with a per-column
affine epilogue.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from . import _loader
from ._array import (CTYPE, ITEMSIZE, empty, is_torch, launch, operand, require_writable, rows_2d,
                     same_place, scalar, torch_layer)
from ._geometry import acc_dtype, cdiv, vector_aligned
from .gemm import MIN_TILE_M, check_operands, check_precision, check_vector, gemm

_FILE = "gemm_scale_batchnorm.cu"
_COEF_THREADS = 256  # bn_train_coef / bn_eval_coef: one thread per column
_APPLY = {"THREADS": 128, "ROWS": 32}  # bn_apply: threads per block, rows per thread


def _apply_expr(dtype, vec):
    return f"bn_apply<{CTYPE[dtype]}, {vec}, {_APPLY['THREADS']}, {_APPLY['ROWS']}>"


for _dt in CTYPE:
    _t = CTYPE[_dt]
    _loader.register(_FILE, [f"bn_train_coef<{_t}, {_COEF_THREADS}>", f"bn_eval_coef<{_t}, {_COEF_THREADS}>",
                             _apply_expr(_dt, 1), _apply_expr(_dt, 16 // ITEMSIZE[_dt])])


def batch_size_error(size) -> ValueError:
    """PyTorch's error for training-mode BatchNorm on one value per channel."""
    return ValueError(f"Expected more than 1 value per channel when training, got input size {size}")


def gemm_scale_batchnorm(x, weight, bias, scale, bn_weight, bn_bias, running_mean=None,
                         running_var=None, num_batches_tracked=None, *, training=True,
                         momentum=0.1, eps=1e-5, precision=None):
    """``F.batch_norm(F.linear(x, weight, bias) * scale, ...)`` for a 2-D x.

    Args:
        x: (B, K); weight: (N, K); bias, scale, bn_weight, bn_bias: (N,) or None
            (bias None = 0, bn_weight None = 1, bn_bias None = 0); all of one kind,
            device and dtype (CuPy, torch CUDA/CPU, NumPy).
        running_mean, running_var: (N,) buffers updated in place in training mode
            (required in eval mode); num_batches_tracked: int64 scalar buffer,
            incremented in training mode.
        training: batch statistics (biased variance for the output) and running-stat
            updates; otherwise the running statistics are used.
        momentum: as ``nn.BatchNorm1d``; ``None`` means a cumulative average
            (factor 1 / num_batches_tracked), which then requires num_batches_tracked
            when running statistics are updated.
        eps: a non-negative number added to the variance.
        precision: GEMM precision for float32 (see :func:`cupykern.linear`).

    Returns out (B, N) of x's kind; torch tensors go through the custom op
    ``torch.ops.cupykern.gemm_scale_batchnorm`` (autograd in PyTorch ops for now).
    Raises ValueError for a training batch of one row, with PyTorch's message. x is
    copied to a contiguous array if its rows are not contiguous.
    """
    args = (x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
            num_batches_tracked)
    if is_torch(x):
        return torch_layer("gemm_scale_batchnorm").gemm_scale_batchnorm(
            *args, training=training, momentum=momentum, eps=eps, precision=precision)
    return gemm_scale_batchnorm_core(*args, training, momentum, eps, precision)


def check_inputs(x, weight):
    """Validate x (B, K) and weight (N, K); returns their Operands."""
    xo, wo = check_operands(x, weight)
    if xo.ndim != 2:
        raise ValueError(f"x: expected a 2-D (batch, in_features) array, got shape {tuple(xo.shape)}")
    return xo, wo


def check(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
          num_batches_tracked, training, momentum, eps, precision):
    """Validate every argument once: (x, weight Operands, dict of vector Operands or None,
    num_batches_tracked Operand or None, momentum, eps, precision)."""
    xo, wo = check_inputs(x, weight)
    M, N = xo.shape[0], wo.shape[0]
    vec = {name: check_vector(v, name, xo, N) for name, v in (
        ("bias", bias), ("scale", scale), ("bn_weight", bn_weight), ("bn_bias", bn_bias))}
    for name, v in (("running_mean", running_mean), ("running_var", running_var)):
        vec[name] = check_vector(v, name, xo, N, in_place=True)
    if vec["scale"] is None:
        raise ValueError("scale: required, got None")
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"training: expected a bool, got {type(training).__name__}")
    eps = check_real(eps, "eps")
    if eps < 0:
        raise ValueError(f"eps: expected a non-negative number, got {eps}")
    momentum = None if momentum is None else check_real(momentum, "momentum")
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be given or both be None")
    if not training and running_mean is None:
        raise ValueError("eval mode (training=False) needs running_mean and running_var")
    nbt = None
    if num_batches_tracked is not None:
        nbt = operand(num_batches_tracked, "num_batches_tracked", dtypes=("int64",))
        same_place(xo, nbt)
        require_writable(num_batches_tracked, "num_batches_tracked", ", but it is incremented in place")
        if nbt.size != 1 or nbt.ndim > 1:
            raise ValueError(f"num_batches_tracked: expected a 0-d int64 array, got shape "
                             f"{tuple(nbt.shape)}")
    if training and running_mean is not None and momentum is None and nbt is None:
        raise ValueError("num_batches_tracked: required when momentum is None (a cumulative "
                         "average) and running statistics are updated")
    if training and M <= 1:
        raise batch_size_error((M, N))
    return xo, wo, vec, nbt, momentum, eps, check_precision(precision)


def gemm_scale_batchnorm_core(x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                              running_var, num_batches_tracked, training, momentum, eps,
                              precision):
    """:func:`gemm_scale_batchnorm` for CuPy arrays, NumPy arrays and (from the torch
    layer) torch CUDA tensors."""
    xo, wo, vec, nbt, momentum, eps, prec = check(
        x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
        num_batches_tracked, training, momentum, eps, precision)
    if xo.kind == "cpu":
        return reference(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                         num_batches_tracked, training, momentum, eps)
    M, N = xo.shape[0], wo.shape[0]
    out = empty(xo, (M, N))
    if M == 0 or N == 0:
        return out
    a, b, c = rows_2d(xo, "x"), rows_2d(wo, "weight"), operand(out, "out")
    acc = acc_dtype(xo.dtype)
    mtiles = cdiv(M, MIN_TILE_M)  # partials sized for the smallest M tile of any GEMM kernel
    # One scratch buffer: the coefficients (3, N), then the training partials (2 * mtiles, N).
    scratch = operand(empty(xo, ((3 + (2 * mtiles if training else 0)) * N,), acc), "scratch")
    c0, c1, c2, part = (scratch.ptr + i * N * ITEMSIZE[acc] for i in range(4))
    ptr = lambda o: 0 if o is None else o.ptr  # noqa: E731
    t = CTYPE[xo.dtype]
    dev = xo.device
    grid_n = (cdiv(N, _COEF_THREADS),)
    block = (_COEF_THREADS,)
    common = (ptr(vec["bias"]), ptr(vec["scale"]), ptr(vec["bn_weight"]), ptr(vec["bn_bias"]))

    if not training:
        fn = _loader.function(_FILE, f"bn_eval_coef<{t}, {_COEF_THREADS}>", dev)
        launch(xo, fn, grid_n, block, (scalar(N, "int"),) + common + (
            ptr(vec["running_mean"]), ptr(vec["running_var"]), scalar(eps, "double"), c0, c1))
        gemm(a, b, c, prec, alpha=c0, beta=c1)
        return out

    bm = gemm(a, b, c, prec, part=part)
    factor = momentum if momentum is not None else -1.0  # -1: cumulative average
    fn = _loader.function(_FILE, f"bn_train_coef<{t}, {_COEF_THREADS}>", dev)
    launch(xo, fn, grid_n, block, (part, scalar(cdiv(M, bm), "int"), scalar(bm, "int"),
                                   scalar(M, "int"), scalar(N, "int")) + common + (
        ptr(vec["running_mean"]), ptr(vec["running_var"]), ptr(nbt),
        scalar(factor, "double"), scalar(eps, "double"), c0, c1, c2))
    if nbt is not None:
        num_batches_tracked += 1  # in place, on the same stream, after the kernel read it
    _apply(c, c0, c1, c2)
    return out


def check_real(v, name: str) -> float:
    """A finite real-number argument as a float; TypeError/ValueError naming it otherwise."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    return float(v)


def _apply(c, ca, cm, cb):
    M, N = c.shape
    isz = ITEMSIZE[c.dtype]
    vec = 16 // isz
    if not (N % vec == 0 and vector_aligned(c.ptr, c.strides[0], N, isz)):
        vec = 1
    fn = _loader.function(_FILE, _apply_expr(c.dtype, vec), c.device)
    launch(c, fn, (cdiv(cdiv(N, vec), _APPLY["THREADS"]), cdiv(M, _APPLY["ROWS"])),
           (_APPLY["THREADS"],), (c.ptr, c.strides[0], scalar(M, "int"), scalar(N, "int"), ca, cm, cb))


def reference(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt, training, momentum, eps):
    """NumPy reference with nn.BatchNorm1d's semantics (buffers updated in place)."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    n = x.shape[0]
    z = x.astype(acc) @ weight.astype(acc).T
    if bias is not None:
        z = z + bias.astype(acc)
    y = z * scale.astype(acc)
    if training:
        mean, var = y.mean(axis=0), y.var(axis=0)
        if rmean is not None:
            if nbt is not None:
                nbt += 1
            f = momentum if momentum is not None else (1.0 / float(nbt) if nbt is not None else 0.0)
            rmean[...] = (1 - f) * rmean + f * mean
            rvar[...] = (1 - f) * rvar + f * var * n / (n - 1)
    else:
        mean, var = rmean.astype(acc), rvar.astype(acc)
    out = (y - mean) / np.sqrt(var + acc(eps))
    if gamma is not None:
        out = out * gamma.astype(acc)
    if beta is not None:
        out = out + beta.astype(acc)
    return out.astype(x.dtype)

