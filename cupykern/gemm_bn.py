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
from ._array import CTYPE, empty, is_torch, launch, operand, require_writable, same_place, scalar
from .gemm import ITEMSIZE, check_operands, check_vector, gemm, resolve_precision, rows_2d

_FILE = "gemm_bn.cu"
_DTYPES = ("float16", "bfloat16", "float32", "float64")
for _dt in _DTYPES:
    _t = CTYPE[_dt]
    _loader.register(_FILE, [f"bn_train_coef<{_t}>", f"bn_eval_coef<{_t}>", f"bn_apply<{_t}, 1>",
                             f"bn_apply<{_t}, {16 // ITEMSIZE[_dt]}>"])
_APPLY_ROWS = 32  # rows per thread in the normalize pass


def _acc(dtype):
    return "float64" if dtype == "float64" else "float32"


def batch_size_error(shape, torch_like: bool) -> ValueError:
    """PyTorch's error for training-mode BatchNorm on one value per channel."""
    if torch_like:
        import torch
        shape = torch.Size(shape)
    return ValueError(f"Expected more than 1 value per channel when training, got input size {shape}")


def check_inputs(x, weight):
    """Validate x (B, K) and weight (N, K); returns their Operands."""
    xo, wo = check_operands(x, weight)
    if xo.ndim != 2:
        raise ValueError(f"x: expected a 2-D (batch, in_features) array, got shape {tuple(xo.shape)}")
    return xo, wo


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

    Returns out (B, N) of x's kind. Raises ValueError for a training batch of one row,
    with PyTorch's message. x is copied to a contiguous array if its rows are not
    contiguous.
    """
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
    eps = _real(eps, "eps")
    if eps < 0:
        raise ValueError(f"eps: expected a non-negative number, got {eps}")
    momentum = None if momentum is None else _real(momentum, "momentum")
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
        raise batch_size_error((M, N), is_torch(x))
    prec = resolve_precision(precision, x)

    if xo.kind == "cpu":
        return _on_cpu(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                       num_batches_tracked, training, momentum, eps)
    out = empty(xo, (M, N))
    if M == 0 or N == 0:
        return out
    a, b, c = rows_2d(xo, "x"), rows_2d(wo, "weight"), operand(out, "out")
    coef = operand(empty(xo, (3, N), _acc(xo.dtype)), "coef")
    c0, c1, c2 = (coef.ptr + i * N * ITEMSIZE[coef.dtype] for i in range(3))
    ptr = lambda o: scalar(0 if o is None else (o if isinstance(o, int) else o.ptr), "ptr")  # noqa: E731
    t = CTYPE[xo.dtype]
    dev = xo.device
    grid_n = (-(-N // 256),)
    common = (ptr(vec["bias"]), ptr(vec["scale"]), ptr(vec["bn_weight"]), ptr(vec["bn_bias"]))

    if not training:
        fn = _loader.function(_FILE, f"bn_eval_coef<{t}>", dev)
        launch(xo, fn, grid_n, (256,), (scalar(N, "int"),) + common + (
            ptr(vec["running_mean"]), ptr(vec["running_var"]), scalar(eps, "double"), ptr(c0), ptr(c1)))
        gemm(a, b, c, prec, alpha=_View(c0), beta=_View(c1))
        return out

    # Partials are sized for the smallest M tile any GEMM kernel uses (64 rows).
    part = operand(empty(xo, (2 * -(-M // 64), N), _acc(xo.dtype)), "part")
    bm = gemm(a, b, c, prec, part=part)
    factor = momentum if momentum is not None else -1.0  # -1: cumulative average
    fn = _loader.function(_FILE, f"bn_train_coef<{t}>", dev)
    launch(xo, fn, grid_n, (256,), (ptr(part), scalar(-(-M // bm), "int"), scalar(bm, "int"),
                                    scalar(M, "int"), scalar(N, "int")) + common + (
        ptr(vec["running_mean"]), ptr(vec["running_var"]), ptr(nbt),
        scalar(factor, "double"), scalar(eps, "double"), ptr(c0), ptr(c1), ptr(c2)))
    if nbt is not None:
        num_batches_tracked += 1  # in place, on the same stream, after the kernel read it
    _apply(c, c0, c1, c2)
    return out


def _real(v, name: str) -> float:
    """A finite real-number argument as a float; TypeError/ValueError naming it otherwise."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    return float(v)


class _View:
    """A raw device pointer posing as an Operand for :func:`cupykern.gemm.gemm`."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


def _apply(c, ca, cm, cb):
    M, N = c.shape
    isz = ITEMSIZE[c.dtype]
    vec = 16 // isz
    if not (N % vec == 0 and c.ptr % 16 == 0 and (c.strides[0] * isz) % 16 == 0):
        vec = 1
    fn = _loader.function(_FILE, f"bn_apply<{CTYPE[c.dtype]}, {vec}>", c.device)
    cols = -(-N // vec)
    launch(c, fn, (-(-cols // 128), -(-M // _APPLY_ROWS)), (128,),
           (scalar(c.ptr, "ptr"), scalar(c.strides[0], "long long"), scalar(M, "int"),
            scalar(N, "int"), scalar(ca, "ptr"), scalar(cm, "ptr"), scalar(cb, "ptr"),
            scalar(_APPLY_ROWS, "int")))


def _on_cpu(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt, training, momentum, eps):
    """Reference path: torch CPU tensors through torch itself (exact BatchNorm1d
    semantics, buffers updated in place), NumPy arrays through a NumPy port."""
    if is_torch(x):
        import torch.nn.functional as F
        y = F.linear(x, weight, bias) * scale
        if training and nbt is not None:
            nbt.add_(1)
        f = momentum
        if momentum is None:  # unused in eval, but F.batch_norm wants a float
            f = 1.0 / float(nbt) if training and nbt is not None else 0.0
        return F.batch_norm(y, rmean, rvar, gamma, beta, training, f, eps)
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

