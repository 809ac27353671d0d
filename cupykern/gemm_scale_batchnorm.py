"""``gemm_scale_batchnorm``: ``batch_norm((x @ W.T + b) * s)`` (documented model 3).

Training (batch statistics), three launches (four where the GEMM splits K, see
``cupykern.gemm``):
  1. the GEMM writes z = x @ W.T and, from its registers (with split K: the pass that
     adds the chunks), per-(M tile, column) (mean, M2, min, max) partials of z (the
     bias cancels out of the output; min and max tell where y = s*(z + b), as the
     reference forms it, overflows the dtype);
  2. one thread per column merges the partials in tile order (Chan's formula:
     stable and deterministic), folds s, gamma, beta into out = a*(z - mean) + beta and
     updates running_mean (bias included) / running_var (unbiased) like
     ``nn.BatchNorm1d``;
  3. an in-place pass out = a*(z - mean) + beta, which also counts num_batches_tracked.
Eval (running statistics): a and c are folded first, then one GEMM with a per-column
affine epilogue.

The backward is :mod:`cupykern.gemm_scale_batchnorm_backward`'s (it reads this module's
helpers; this module does not import it). Inside, the vectors travel as an
:class:`Affine` and the buffers and options as a :class:`BatchNormState`.
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any, NamedTuple

import numpy as np

from . import _dask, _loader
from ._array import (CTYPE, ITEMSIZE, Place, cached_checked, empty, head, is_torch,
                     launch_all, native, operand, require_writable, row_view_stride, rows_2d, same_place,
                     scalar, signature, torch_layer)
from ._geometry import acc_dtype, cdiv, grid_rows
from ._stats import merge_moments
from .gemm import linear_core, matmul_core
from .gemm_checks import check_operands, check_precision, check_vector, reference as linear_reference
from .gemm_kernels import PART_ROWS, STATS_BM, gemm, gemm_call, gemm_kernel, statistics_call, workspace
from .gemm_operands import fresh_like
from .gemm_route import bias_apart, fused_vendor, register_plans, routed_mm_plan
from .gemm_vendor import float64_capture, planned_capture, vendor_linear, vendor_state

_FILE = "gemm_scale_batchnorm.cu"
_COEF_THREADS = 256  # bn_eval_coef: one thread per column
# bn_train_coef, bn_grad_coef, bn_grad_eval_coef: THREADS a block, in chunks of columns
# (stats.cuh's ColumnChunk), each reducing a run of a column's tiles: runs of
# ceil(tiles / chunks) >= MIN_RUN tiles (the last ones shorter or empty), up to
# WIDE_CHUNKS chunks, and beyond, up to THREADS / 2, while N's columns fill fewer blocks
# than the GPU has SMs (_chunks): a narrow N's few blocks would merge long runs one tile
# after another. H200, bf16 65536x256->16 (2048 tiles, 2 blocks at 64 chunks),
# bn_train_coef at 64 / 128 / 256 / 512 chunks: 11.6 / 10.3 / 9.9 / 13.6 us (the forward
# 0.90x eager at 64, 0.95x at 256); at 65536x256->256 the backward's 1024 tiles now take
# 128 chunks: bn_grad_coef 4.0 -> 3.9 us. An N of 8 * SMs columns or more keeps
# WIDE_CHUNKS (a chunk of 8 columns reads whole 32-byte sectors of a tile's row).
_CHUNKED = {"THREADS": 512, "MIN_RUN": 8, "WIDE_CHUNKS": 64}
_APPLY = {"THREADS": 128, "ROWS": 32}  # bn_apply: threads per block, rows per thread (_apply_shape)
# A vendor product's column statistics (_vendor_statistics) take bn_column_stats from this
# many tiles of STATS_BM rows. H200, GemmScaleBatchNorm's training forward on the vendor's
# product, GPU us (CUDA graphs), splitk_reduce / bn_column_stats, eager: float32 "high"
# 1000000x32->8 (31250 tiles) 244.4 / 114.6, 158.6; 1000000x64->64 523.9 / 409.4, 618.8;
# 200000x64->16 (6250) 70.4 / 58.9, 62.5; bf16 65536x256->16 (2048) 30.9 / 35.8, 28.0;
# float32 16465x126->14 (515) 20.5 / 25.0, 23.8; 4096x4096->32 (128) 34.0 / 43.4, 38.4
# (its grid of few blocks, each thread 32 rows, fills too little of the GPU there).
_ROW_STATS_FROM = 4096
_BACKWARD_FILE = "gemm_scale_batchnorm_backward.cu"
# The backward's kernels (cupykern.gemm_scale_batchnorm_backward runs them) are declared
# here with the forward's, so that importing the package registers every instantiation
# for the compile check (the backward's module is imported with the torch layer).
_GRAD = {"THREADS": 128, "ROWS": 64}  # bn_grad_partials / bn_grad_dz: a column per thread
# bn_grad_fused, the backward's passes in one launch, takes batches of at most ROWS rows,
# COLS columns (a warp's lanes) per block.
# H200, the passes alone, one launch / three, us of GPU (CUDA graph) and back to back
# with host, float32 N = 512: M = 64 6.7 / 14.2 and 8.4 / 21.9, 256 8.2 / 14.8 and
# 11.6 / 24.8, 512 15.0 / 15.1 and 15.7 / 25.3, 1024 27.9 / 15.5 and 28.7 / 26.3 (its
# blocks, one per 32 columns, then hold too many rows each); N = 4096 and bfloat16 alike
# (M = 512: 15.4-16.2 / 18.1-26.9 GPU; 1024: 30.8-44.3 / 31.2-37.2). Its warps per block
# by element size: each stages a 32 x 33 tile of dz in static shared memory, which eight
# of float64 would overfill.
_GRAD_FUSED = {"ROWS": 512, "COLS": 32, "WARPS": {2: 8, 4: 8, 8: 4}}
# Training batches of at most this many GEMM M-tiles merge their statistics in the apply
# pass (bn_train_apply: each of its rows of blocks merges them all) rather than in a
# launch of their own: a launch costs the host ~9 us after a synchronize (H100 machines here).
_FUSED_TILES = 8
# (bn_train_coef then merges such a batch in one chunk, in tile order: bn_train_apply's bits)
assert _FUSED_TILES < 2 * _CHUNKED["MIN_RUN"]


def _train_coef_expr(t):
    return f"bn_train_coef<{t}, {_CHUNKED['THREADS']}, {PART_ROWS}>"


def _chunks(tiles: int, N: int, sms: int):
    """``(chunks, (grid, block))`` of a _CHUNKED kernel over ``tiles`` tiles of N columns on
    a GPU of ``sms`` SMs: chunks of threads per column, a power of 2 dividing THREADS (one,
    a thread per column adding every tile in order, below 2 * MIN_RUN tiles), the most
    that keeps runs of MIN_RUN tiles, up to WIDE_CHUNKS or, while the grid has fewer
    blocks than SMs, THREADS / 2. (The merge's rounding depends on the count: results are
    deterministic for a given shape and SM count.)"""
    c, threads = _CHUNKED, _CHUNKED["THREADS"]

    def blocks(chunks):
        return cdiv(N, threads // chunks)

    chunks = 1
    while 2 * chunks <= tiles // c["MIN_RUN"] and (
            2 * chunks <= c["WIDE_CHUNKS"] or (2 * chunks < threads and blocks(chunks) < sms)):
        chunks *= 2
    return chunks, ((blocks(chunks),), (threads,))


_ROW_PASSES = {"apply": "bn_apply", "train": "bn_train_apply", "stats": "bn_column_stats"}


def _row_pass_expr(dtype, vec, kind="apply"):
    """A pass over z's rows for ``dtype`` and ``vec`` columns per thread, laid out alike
    (RowSpot): bn_apply ("apply"), bn_train_apply ("train": its coefficients computed
    in the same launch, from partials of PART_ROWS rows) or bn_column_stats ("stats")."""
    a = f"{CTYPE[dtype]}, {vec}, {_APPLY['THREADS']}, {_APPLY['ROWS']}"
    return f"{_ROW_PASSES[kind]}<{a}{f', {PART_ROWS}' if kind == 'train' else ''}>"


def _grad_exprs(t):
    """The backward's three-launch kernels for C type ``t``, by role."""
    g = f"{_GRAD['THREADS']}, {_GRAD['ROWS']}"
    c = _CHUNKED["THREADS"]
    return {"partials": f"bn_grad_partials<{t}, {g}>", "coef": f"bn_grad_coef<{t}, {c}>",
            "dz": f"bn_grad_dz<{t}, {g}>", "dz_rows": f"bn_grad_dz_rows<{t}, {g}>",
            "eval_coef": f"bn_grad_eval_coef<{t}, {c}>"}


def _fused_grad_warps(dtype) -> int:
    return _GRAD_FUSED["WARPS"][ITEMSIZE[dtype]]


def _fused_grad_expr(dtype, training: bool):
    return (f"bn_grad_fused<{CTYPE[dtype]}, {str(training).lower()}, {_GRAD_FUSED['COLS']}, "
            f"{_fused_grad_warps(dtype)}>")


for _dt in CTYPE:
    _t = CTYPE[_dt]
    _loader.register(_FILE, [_train_coef_expr(_t), f"bn_eval_coef<{_t}, {_COEF_THREADS}>",
                             *(_row_pass_expr(_dt, v, k) for v in (1, 16 // ITEMSIZE[_dt])
                               for k in _ROW_PASSES)])
    _loader.register(_BACKWARD_FILE, [*_grad_exprs(_t).values(),
                                      *(_fused_grad_expr(_dt, m) for m in (False, True))])


def batch_size_error(size) -> ValueError:
    """PyTorch's error for training-mode BatchNorm on one value per channel."""
    return ValueError(f"Expected more than 1 value per channel when training, got input size {size}")


class Affine(NamedTuple):
    """The per-column vectors of ``bn_weight * normalize((x @ W.T + bias) * scale) +
    bn_bias``, (N,) each: arrays, or after :func:`check` their Operands. None: bias 0,
    bn_weight 1, bn_bias 0 (scale is required)."""

    bias: Any
    scale: Any
    bn_weight: Any
    bn_bias: Any


class BatchNormState(NamedTuple):
    """``nn.BatchNorm1d``'s buffers and options: running_mean, running_var (N,) and
    num_batches_tracked (0-d int64), updated in place in training mode (arrays, or after
    :func:`check` their Operands; None where absent); ``training`` (batch statistics, else
    the running ones), ``momentum`` (None: a cumulative average) and ``eps``.

    The entry points (:func:`gemm_scale_batchnorm`, :func:`gemm_scale_batchnorm_core`, the
    torch ops) take these flat; a call whose launch plan is cached never builds one."""

    running_mean: Any = None
    running_var: Any = None
    num_batches_tracked: Any = None
    training: Any = True
    momentum: float | None = 0.1
    eps: float = 1e-5


def gemm_scale_batchnorm(x, weight, bias, scale, bn_weight, bn_bias, running_mean=None,
                         running_var=None, num_batches_tracked=None, *, training=True,
                         momentum=0.1, eps=1e-5, precision=None):
    """``F.batch_norm(F.linear(x, weight, bias) * scale, ...)`` for a 2-D x.

    Args:
        x: (B, K); weight: (N, K); scale: (N,), or (1,) broadcast as the module's;
            bias, bn_weight, bn_bias: (N,) or None (bias None = 0, bn_weight None = 1,
            bn_bias None = 0); all of one kind, device and dtype (CuPy, torch CUDA/CPU,
            NumPy).
        running_mean, running_var: (N,) buffers updated in place in training mode
            (required in eval mode); num_batches_tracked: int64 scalar buffer,
            incremented in training mode.
        training: batch statistics (biased variance for the output) and running-stat
            updates; otherwise the running statistics are used.
        momentum: as ``nn.BatchNorm1d``; ``None`` means a cumulative average
            (factor 1 / num_batches_tracked), which then requires num_batches_tracked
            when running statistics are updated.
        eps: a number added to the variance: positive (in eval mode, non-negative).
        precision: GEMM precision for float32 (see :func:`cupykern.linear`).

    Returns out (B, N) of x's kind; torch tensors go through the custom op
    ``torch.ops.cupykern.gemm_scale_batchnorm`` (autograd: a fused backward in training
    mode on the GPU, PyTorch ops elsewhere). A Dask array x (CuPy or NumPy chunks; the
    other arguments concrete arrays of that kind) gives a Dask array: in eval mode each
    block runs the fused eval-mode kernel; in training mode the batch statistics are
    those of all rows, computed now (one pass: each block's GEMM and per-column moments,
    merged in block order, which also updates the running statistics), and the output
    normalizes each block with them (the GEMM again, then one elementwise pass).
    Raises ValueError for a training batch of one row, with PyTorch's message; an empty
    batch gives an empty result and is counted in num_batches_tracked, as nn.BatchNorm1d. x is
    copied to a contiguous array if its rows are not contiguous.
    """
    if getattr(scale, "shape", None) == (1,) and len(getattr(weight, "shape", ())) == 2:
        # A (1,) scale as a stride-0 (N,) view (np.broadcast_to serves CuPy and Dask too).
        n = weight.shape[0]
        scale = scale.expand(n) if is_torch(scale) else np.broadcast_to(scale, (n,))
    args = (x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
            num_batches_tracked)
    if is_torch(x):
        return torch_layer("gemm_scale_batchnorm").gemm_scale_batchnorm(
            *args, training=training, momentum=momentum, eps=eps, precision=precision)
    if _dask.is_dask(x):
        return _dask_call(x, weight, Affine(bias, scale, bn_weight, bn_bias), BatchNormState(
            running_mean, running_var, num_batches_tracked, training, momentum, eps), precision)
    return gemm_scale_batchnorm_core(*args, training, momentum, eps, precision)


def _dask_call(x, weight, affine: Affine, state: BatchNormState, precision):
    """:func:`gemm_scale_batchnorm` of a Dask array x (see its docstring). (Its tasks take
    the vectors flat: dask reads a tuple inside a task's arguments as a task.)"""
    # (rows: a training batch of one row gets its error)
    rows = min(x.shape[0], 2) if x.ndim and not math.isnan(x.shape[0]) else 2
    sample = _dask.sample(x, (rows,) + x.shape[1:])
    checked, prec = check(sample, weight, affine, state, precision)[3:]
    x = _dask.whole(x, 1)
    chunks = (x.chunks[0], (weight.shape[0],))
    if not state.training:  # a per-row map: the fused eval-mode GEMM on each block, with
        # the running statistics as they are now (a later training call updates them in place)
        stats = (checked.running_mean.obj.copy(), checked.running_var.obj.copy())
        return _dask.map_blocks(gemm_scale_batchnorm_core, x, weight, *affine, *stats, None,
                                False, None, checked.eps, prec, chunks=chunks,
                                name="gemm_scale_batchnorm")
    part = _dask.delayed(_block_moments)
    parts = _dask.compute(*(part(b, weight, affine.bias, affine.scale, prec)
                            for b in _dask.blocks(x)))
    rmean, rvar, nbt = state[:3]
    if nbt is not None:  # (every batch counts, an empty one too)
        nbt += 1
    with np.errstate(all="ignore"):  # (nan and inf columns as the reference's, quietly)
        count, mean, m2 = merge_moments(parts)
        if rmean is not None and count:  # nn.BatchNorm1d's update, from all rows' statistics
            f = checked.momentum if checked.momentum is not None else 1.0 / float(nbt)
            rmean[...] = (1 - f) * rmean + f * mean
            rvar[...] = (1 - f) * rvar + f * m2 / (count - 1)
        invstd = 1 / (m2 / (count + (count == 0)) + checked.eps) ** 0.5  # (no rows: unused)
    return _dask.map_blocks(_normalize_block, x, weight, *affine, mean, invstd, prec,
                            chunks=chunks, name="gemm_scale_batchnorm")


def _affine_block(xb, weight, bias, scale, precision):
    """y = (x @ W.T + b) * scale of one block, stored in x's dtype as torch stores it, in
    the accumulation type."""
    acc = acc_dtype(xb.dtype.name)
    y = linear_core(xb, weight, bias, precision).astype(acc) * scale.astype(acc)
    return y.astype(xb.dtype).astype(acc) if xb.dtype != acc else y


def _block_moments(xb, weight, bias, scale, precision):
    """One block's [count, mean (N), M2 (N)] of y (float64; see cupykern._stats). Overflow,
    nan and inf follow the arithmetic without NumPy's warnings, as in :func:`reference`."""
    with np.errstate(all="ignore"):
        y = _affine_block(xb, weight, bias, scale, precision)
        xp = sys.modules[type(y).__module__.split(".")[0]]
        out = xp.zeros(2 * y.shape[1] + 1)
        if len(y):
            mean = y.mean(0)
            out[0], out[1:y.shape[1] + 1] = len(y), mean
            out[y.shape[1] + 1:] = ((y - mean) ** 2).sum(0)
    return out


def _normalize_block(xb, weight, bias, scale, gamma, beta, mean, invstd, precision):
    """One block of the output, from the statistics of all rows (quietly, as above)."""
    with np.errstate(all="ignore"):
        y = _affine_block(xb, weight, bias, scale, precision)
        acc = y.dtype
        out = (y - mean.astype(acc)) * invstd.astype(acc)
        if gamma is not None:
            out = out * gamma.astype(acc)
        if beta is not None:
            out = out + beta.astype(acc)
        return out.astype(native(xb.dtype))


def check_inputs(x, weight):
    """Validate x (B, K) and weight (N, K); returns their Operands."""
    xo, wo = check_operands(x, weight)
    if xo.ndim != 2:
        raise ValueError(f"x: expected a 2-D (batch, in_features) array, got shape {tuple(xo.shape)}")
    return xo, wo


def check_options(training, momentum, eps):
    """``(momentum, eps)`` as floats (momentum None: the cumulative average) after their
    rules: eps positive in training (F.batch_norm's from torch 2.10: batch statistics
    may have a zero variance), non-negative in eval mode."""
    eps = check_real(eps, "eps")
    if eps < 0 or (training and eps == 0):
        raise ValueError(f"eps: expected a positive number (in eval mode, a non-negative "
                         f"one), got {eps}")
    return (None if momentum is None else check_real(momentum, "momentum")), eps


def check(x, weight, affine: Affine, state: BatchNormState, precision, synchronized=False):
    """Validate every argument once: ``(x, weight Operands, Affine of vector Operands or
    None, BatchNormState (Operands or None; training as given, momentum and eps as floats),
    precision)``. ``synchronized``: batch statistics over several processes, where one
    process may hold any number of rows."""
    xo, wo = check_inputs(x, weight)
    M, N = xo.shape[0], wo.shape[0]
    vec = Affine(*(check_vector(v, name, xo, N) for name, v in zip(Affine._fields, affine)))
    running_mean, running_var, num_batches_tracked, training = state[:4]
    if not isinstance(training, (bool, np.bool_)):
        raise TypeError(f"training: expected a bool, got {type(training).__name__}")
    # (updated in place in training mode; in eval mode only read, as F.batch_norm reads them)
    rm, rv = (check_vector(v, name, xo, N, in_place=bool(training))
              for name, v in (("running_mean", running_mean), ("running_var", running_var)))
    if vec.scale is None:
        raise ValueError(f"scale: required, shape ({N},) or (1,); got None")
    momentum, eps = check_options(training, state.momentum, eps=state.eps)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must both be given or both be None")
    if not training and running_mean is None:
        raise ValueError("eval mode (training=False) needs running_mean and running_var")
    nbt = None
    if num_batches_tracked is not None:
        nbt = operand(num_batches_tracked, "num_batches_tracked", dtypes=("int64",))
        same_place(xo, nbt)
        if training:
            require_writable(num_batches_tracked, "num_batches_tracked",
                             ", but it is incremented in place")
        if nbt.size != 1 or nbt.ndim > 1:
            raise ValueError(f"num_batches_tracked: expected a 0-d int64 array, got shape "
                             f"{tuple(nbt.shape)}")
    if training and running_mean is not None and momentum is None and nbt is None:
        raise ValueError("num_batches_tracked: required when momentum is None (a cumulative "
                         "average) and running statistics are updated")
    if training and M == 1 and not synchronized:  # (an empty batch is nn.BatchNorm1d's no-op)
        raise batch_size_error((M, N))
    return (xo, wo, vec, BatchNormState(rm, rv, nbt, training, momentum, eps),
            check_precision(precision))


def _check_flat(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                num_batches_tracked, training, momentum, eps, precision):
    """:func:`check` of :func:`gemm_scale_batchnorm_core`'s flat arguments (a plan cache's
    miss: the parameter objects are built here, not on a hit)."""
    return check(x, weight, Affine(bias, scale, bn_weight, bn_bias), BatchNormState(
        running_mean, running_var, num_batches_tracked, training, momentum, eps), precision)


def _arrays(*operands) -> tuple:
    """The arrays of ``operands`` (Operands or None)."""
    return tuple(None if o is None else o.obj for o in operands)


_plans: dict = {}  # _plan_key(arrays, options) -> run(*arrays), or None
register_plans(_plans)  # (their GEMMs follow the route: forced_route drops them)


def gemm_scale_batchnorm_core(x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                              running_var, num_batches_tracked, training, momentum, eps,
                              precision, save=False):
    """:func:`gemm_scale_batchnorm` for CuPy arrays, NumPy arrays and (from the torch
    layer) torch CUDA tensors. With ``save`` (GPU, B > 0, N > 0) it returns ``(out, z, coefs)``:
    also z = x @ W.T and (4, N) accumulation-type rows, which
    :func:`cupykern.gemm_scale_batchnorm_backward.backward` takes: in
    training mode (ca, cm, cb, inv); in eval mode (ca, 0, cb, inv), out being ca * z + cb
    and inv 1 / sqrt(running_var + eps).

    Its arguments are flat, as the ops' schemas have them: a call whose plan is cached
    reads them as they come; a miss builds the parameter objects (:func:`_check_flat`)."""
    arrays = (x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
              num_batches_tracked)
    options = (training, momentum, eps, precision, save)
    checked = None
    if (type(training) is bool and type(eps) is float and type(momentum) in (float, type(None))
            and type(precision) in (str, type(None))):  # hashable: the common call, cached
        run, checked = cached_checked(_plans, _plan_key(arrays, options), _check_flat, _fresh,
                                      arrays + options[:4], options[4:])
        if run is not None:
            return run(*arrays)
    xo, wo, vec, state, prec = checked or _check_flat(*arrays, *options[:4])
    M, N = xo.shape[0], wo.shape[0]
    if save and (xo.kind == "cpu" or M == 0 or N == 0):
        raise ValueError("save: needs GPU arrays, a non-empty batch and out_features > 0")
    if xo.kind == "cpu":
        return reference(x, weight, Affine(bias, scale, bn_weight, bn_bias), BatchNormState(
            running_mean, running_var, num_batches_tracked, training, state.momentum, state.eps))
    if M == 0 or N == 0:  # (running statistics untouched, the batch counted: as PyTorch)
        if training and num_batches_tracked is not None:
            num_batches_tracked += 1  # (in place: NumPy, CuPy and torch arrays alike)
        return empty(xo, (M, N))
    a, b = rows_2d(xo, "x"), rows_2d(wo, "weight")  # (copies if rows are not contiguous)
    run = _plan(a, b, state, prec, save)
    return run(a.obj, b.obj, *_arrays(*vec, *state[:2]), num_batches_tracked)


def planned_run(arrays, options):
    """The launch plan ``run(*arrays)`` cached for the 9 arrays of
    :func:`gemm_scale_batchnorm_core` like these and its ``options`` (training, momentum,
    eps, precision, save), or None: not planned yet, or a call that takes the general path."""
    return _plans.get(_plan_key(arrays, options))


def _plan_key(arrays, options):
    # (with the vendor's float32 setting: a float32 GEMM off Hopper's wgmma, or a narrow
    # one, may be the vendor's, whose precision follows torch's TF32 switch when it runs;
    # and, for float64, whether a CUDA graph is being captured: fused_vendor's rule)
    x = arrays[0]
    return tuple(signature(v) for v in arrays) + options + (vendor_state(x), float64_capture(x))


def _fresh(checked, *args):
    """``run(*arrays) -> out`` for calls like this one (``args``: the 9 arrays, training,
    momentum, eps, precision, save; ``checked``: their validation), no copies; None where
    the call needs the general path (CPU, empty, or an array to copy first)."""
    xo, wo, vec, state, prec = checked
    arrays, save = args[:9], args[13]
    if (xo.kind == "cpu" or 0 in (xo.shape[0], wo.shape[0]) or row_view_stride(xo) is None
            or row_view_stride(wo) is None
            or any(v is not None and v.obj is not arr
                   for v, arr in zip((*vec, *state[:2]), arrays[2:8]))):
        return None
    return _plan(rows_2d(xo, "x"), rows_2d(wo, "weight"), state, prec, save)


def _plan(a, b, state: BatchNormState, precision, save=False):
    """``run(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
    num_batches_tracked) -> out`` (with ``save``: ``(out, z, coefs)``) for 2-D Operands
    ``a`` (x) and ``b`` (weight) with contiguous rows and validated vectors
    (contiguous), in ``state``'s mode (training, momentum, eps: :func:`check`'s): the
    launches with their sizes fixed, so that a call only allocates and reads data
    pointers."""
    training, momentum, eps = state[3:]
    M, N = a.shape[0], b.shape[0]
    place, t, dev = Place(a), CTYPE[a.dtype], a.device
    acc = acc_dtype(a.dtype)
    step = N * ITEMSIZE[acc]
    captured = planned_capture(a)
    product = _ZProduct(a, b, precision, save, captured)
    ptr = place.ptr

    if not training:  # the affine map in the GEMM's epilogue; with ``save`` (or the
        # vendor's GEMM), a pass of its own
        coef = _loader.function(_FILE, f"bn_eval_coef<{t}, {_COEF_THREADS}>", dev)
        coef_launch = ((cdiv(N, _COEF_THREADS),), (_COEF_THREADS,))
        n_, eps_ = scalar(N, "int"), scalar(eps, "double")
        apply_ = _apply_call(place, M, N)

        def run_eval(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt):
            coef_args = (n_, ptr(bias), ptr(scale), ptr(gamma), ptr(beta), ptr(rmean), ptr(rvar), eps_)
            if not (save or product.vendor):
                ws = workspace(place, product.kernel)  # (held to the launches)
                out, coefs = empty(place, (M, N)), empty(place, (2, N), acc)  # (ca, cb)
                c0 = ptr(coefs)
                launch_all(place, (
                    (coef, *coef_launch, coef_args + (c0, 0, c0 + step, 0), 0),
                    *product.gemm(ptr(x), ptr(weight), ptr(out), 0, c0, c0 + step, 0, ptr(ws))))
                return out
            z = product(x, weight, 0)[0]  # (the GEMM first: see run_train)
            zp = ptr(z)
            out, coefs = empty(place, (M, N)) if save else z, empty(place, (4, N), acc)  # (ca, cm, cb, inv)
            c0 = ptr(coefs)
            cb = c0 + 2 * step
            launch_all(place, ((coef, *coef_launch, coef_args + (c0, c0 + step, cb, cb + step), 0),
                               apply_(zp, ptr(out), c0, c0 + step, cb, 0)))
            return (out, z, coefs) if save else out

        return run_eval

    # One scratch buffer: the coefficients (4, N) (ca, cm, cb, inv), the GEMM's partial
    # statistics (PART_ROWS * mtiles, N), then its split-K workspace (if any).
    bm = product.bm
    mtiles = cdiv(M, bm)
    part_end = (4 + PART_ROWS * mtiles) * N
    scratch = part_end + product.workspace
    ws_off = part_end * ITEMSIZE[acc] if product.workspace else 0  # (split K slabs are of acc too)
    coef = _loader.function(_FILE, _train_coef_expr(t), dev)
    chunks, train_launch = _chunks(mtiles, N, _loader.sm_count(dev))
    sizes = tuple(scalar(v, "int") for v in (mtiles, chunks, bm, M, N))
    # nan: momentum None, the cumulative average (check_real rejects a nan momentum)
    factor = scalar(momentum if momentum is not None else math.nan, "double")
    eps_ = scalar(eps, "double")
    apply_ = _apply_call(place, M, N)
    # Few M-tiles and a momentum: coefficients and apply in one launch (bn_train_apply).
    few = mtiles <= _FUSED_TILES and momentum is not None
    fused = _apply_launch(place, M, N, "train") if few else None  # (fn, grid, block, sizes)

    # With ``save`` the coefficients the backward keeps are a view of the buffer's head
    # (one allocation less a call), unless a split-K workspace would be kept with them.
    own_coefs = save and product.workspace

    def run_train(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt):
        # The GEMM goes out first, and the rest is allocated while it runs: a step begins
        # with the host's cold allocations, which the GPU would otherwise wait for (H200,
        # 1024x8192 "high", benchmarked: the first kernel began 57 us into the step in
        # training mode, 146 us in eval mode, when every buffer came first; now 26 / 30).
        buf = empty(place, (scratch,), acc)  # (held to the launches)
        b0 = ptr(buf)
        part = b0 + 4 * step
        z, pending = product(x, weight, part, b0 + ws_off if ws_off else 0)
        zp = ptr(z)
        out = empty(place, (M, N)) if save else z  # (without save bn_apply runs in place)
        coefs = empty(place, (4, N), acc) if own_coefs else None
        c0, n = ptr(coefs) if own_coefs else b0, ptr(nbt)
        vectors = (ptr(bias), ptr(scale), ptr(gamma), ptr(beta), ptr(rmean), ptr(rvar), n,
                   factor, eps_, c0, c0 + step, c0 + 2 * step, c0 + 3 * step if save else 0)
        if fused:
            args = (zp, ptr(out), *fused[3], part, sizes[0], sizes[2], *vectors)
            launch_all(place, (*pending, (*fused[:3], args, 0)))
        else:
            launch_all(place, (*pending, (coef, *train_launch, (part, *sizes, *vectors), 0),
                               apply_(zp, ptr(out), c0, c0 + step, c0 + 2 * step, n)))
        if save:
            return out, z, coefs if own_coefs else head(buf, (4, N))
        return out

    return run_train


class _ZProduct:
    """z = x @ W.T for :func:`_plan`, on our GEMM or the vendor's (``vendor``:
    :func:`cupykern.gemm.fused_vendor`; ``grad``: the forward of a training step):
    ``self(x, weight, part, ws=None) -> (z, pending)``, z a new C-contiguous (M, N)
    array, and, with ``part`` (a pointer, 0 for none), z's per-tile column statistics
    there (tiles of ``bm`` rows): the GEMM's epilogue (launched here), or after the
    vendor's a pass of its own, ``pending``, the launches the caller sends out in its next
    batch (else empty); ``workspace``: the elements of a split K's ``ws`` (ours; a
    pointer, or None: allocated for the call);
    ``kernel`` / ``gemm``: our GEMM and its launches (:func:`cupykern.gemm.gemm_call`),
    for an epilogue of the caller's own."""

    __slots__ = ("vendor", "kernel", "gemm", "bm", "workspace", "_place", "_shape", "_linear",
                 "_stats", "_zero")

    def __init__(self, a, b, precision, grad=False, captured=False):
        M, N = a.shape[0], b.shape[0]
        self._place, self._shape = Place(a), (M, N)
        self.vendor = fused_vendor(a, b, precision, grad=grad, captured=captured)
        if self.vendor:
            self.kernel = self.gemm = None
            self._stats, self.bm = _vendor_statistics(self._place, M, N)
            self.workspace = 0
            self._linear = vendor_linear(a.kind, precision, (M, N, a.shape[1], a.dtype))
            # torch's F.linear with a zero bias runs addmm, eager's kernel choice, where a
            # bias-free one runs mm, whose cuBLAS kernel is slower at few rows (H200, GPU
            # us, mm / addmm: 2x7241->12523 float32 "highest" sgemm_largek 167.6 / GEMV
            # 117.1; 73x13->16 float64 22.7 / 4.9). Adding zeros gives x @ W.T's values
            # (-0 as +0); bias_apart's form would add them in a pass of its own: none
            # there. (Zeros that outlive the plan: see Vendor.zero_bias.)
            zero = a.kind == "torch" and not bias_apart(M, N, a.shape[1], a.dtype)
            self._zero = (torch_layer("gemm").Vendor.zero_bias(self._place.proto, N)
                          if zero else None)
        else:
            self.kernel = gemm_kernel(a, b, precision)
            self.gemm = gemm_call(self.kernel, a, b, N)
            self.bm, self.workspace = self.kernel.bm, self.kernel.workspace

    def __call__(self, x, weight, part, ws=None):
        place, ptr = self._place, self._place.ptr
        if self.vendor:
            z = self._linear(x, weight, self._zero)
            return z, ((self._stats(ptr(z), part),) if part else ())
        held = workspace(place, self.kernel) if ws is None else None  # (to the launches)
        z = empty(place, self._shape)
        launch_all(place, self.gemm(ptr(x), ptr(weight), ptr(z), 0, 0, 0, part,
                                    ptr(held) if ws is None else ws))
        return z, ()


def check_real(v, name: str) -> float:
    """A finite real-number argument as a float; TypeError/ValueError naming it otherwise."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    return float(v)


def _apply_shape(place, N):
    """``(vec, lanes)`` of bn_apply / bn_train_apply over rows of N elements: 16-byte
    vectors where every row keeps them aligned, and ``lanes`` rows side by side in a block
    (RowSpot), the most, a power of 2, whose THREADS / lanes threads still span a row's
    vectors. (H200, GemmScaleBatchNorm's forward at 200000x64->16 float32, bn_apply with
    a row per block, 4 threads of 128 busy: 12.5 us, eager's normalization 7.7.)"""
    isz = ITEMSIZE[place.dtype]
    vec = 16 // isz if (N * isz) % 16 == 0 else 1
    return vec, _side_by_side(_APPLY["THREADS"], cdiv(N, vec))


def _side_by_side(threads: int, vectors: int) -> int:
    """``lanes``: how many rows of ``vectors`` vectors (or columns) lie side by side in a
    row pass's block of ``threads`` (RowSpot): the most, a power of 2, whose threads /
    lanes threads still span a row."""
    lanes = 1
    while 2 * lanes <= threads and threads // (2 * lanes) >= vectors:
        lanes *= 2
    return lanes


def _apply_launch(place, M, N, kind="apply"):
    """``(fn, grid, block, sizes)`` of a pass over the rows of fresh (M, N) arrays
    (``kind``: see :func:`_row_pass_expr`), ``sizes`` its (ldz, M, N, lanes) arguments."""
    vec, lanes = _apply_shape(place, N)
    fn = _loader.function(_FILE, _row_pass_expr(place.dtype, vec, kind), place.device)
    across, tile = _APPLY["THREADS"] // lanes, _APPLY["ROWS"] * lanes
    grid = (cdiv(cdiv(N, vec), across), grid_rows(cdiv(M, tile)))
    sizes = (N, scalar(M, "int"), scalar(N, "int"), scalar(lanes, "int"))
    return fn, grid, (_APPLY["THREADS"],), sizes


def _vendor_statistics(place, M, N):
    """``(call, bm)``: ``call(z_ptr, part_ptr) -> launch``, the per-tile (mean, M2, min,
    max) of the columns of a C-contiguous (M, N) z made elsewhere (a vendor product), as a
    GEMM epilogue leaves them in ``part``, in tiles of ``bm`` rows. Below _ROW_STATS_FROM
    tiles of STATS_BM rows, splitk_reduce's (:func:`cupykern.gemm.statistics_call`: a
    warp per 32 columns, many blocks); from there bn_column_stats's, laid out as bn_apply
    (a tile of ROWS * lanes rows per block: fewer tiles for bn_train_coef to merge)."""
    if cdiv(M, STATS_BM) < _ROW_STATS_FROM:
        return statistics_call(place, M, N), STATS_BM
    fn, grid, block, (_, *sizes) = _apply_launch(place, M, N, "stats")
    lanes = _apply_shape(place, N)[1]
    return (lambda zp, part: (fn, grid, block, (zp, *sizes, part), 0)), _APPLY["ROWS"] * lanes


def _apply_call(place, M, N):
    """``call(z_ptr, out_ptr, ca, cm, cb, nbt)``: the launch tuple of bn_apply from a
    fresh (M, N) z to a fresh out (out may be z); it also counts num_batches_tracked
    (nbt, 0 for none)."""
    fn, grid, block, sizes = _apply_launch(place, M, N)
    return lambda z, o, ca, cm, cb, nbt: (fn, grid, block, (z, o) + sizes + (ca, cm, cb, nbt), 0)


# ---- the BatchNorm passes with column statistics from elsewhere (synchronized training:
# every process's rows; the backward's, grad_partials and grad_dz, are in
# gemm_scale_batchnorm_backward). z: a contiguous (M > 0, N) GPU array; vectors:
# contiguous (N,) (or (3, N)) arrays of the accumulation type, beside z.

def _checked_z(z, name="z"):
    zo = operand(z, name)
    if (zo.kind == "cpu" or zo.ndim != 2 or not zo.is_c_contiguous() or 0 in zo.shape
            or zo.ptr % 16):
        raise ValueError(f"{name}: expected a contiguous, 16-byte aligned, non-empty 2-D GPU "
                         "array")
    return zo, Place(zo), zo.shape


def gemm_statistics(x, weight, precision):
    """``(z, part, bm)``: z = x @ W.T (x: (M > 0, K), weight: (N > 0, K) GPU arrays) and the
    GEMM epilogue's per-M-tile (mean, M2, min, max) of z's columns, ``part`` of shape
    (tiles, PART_ROWS, N) in the accumulation type, for tiles of ``bm`` rows (the last
    one holds the rest): a training forward's first pass, for statistics merged
    elsewhere."""
    xo, wo = check_inputs(x, weight)
    prec = check_precision(precision)
    if xo.kind == "cpu" or 0 in (xo.shape[0], wo.shape[0]):
        raise ValueError("x, weight: expected GPU arrays with rows and out_features > 0")
    a, b = rows_2d(xo, "x"), rows_2d(wo, "weight")
    (M, _), N = a.shape, b.shape[0]
    kernel = gemm_kernel(a, b, prec)
    z = operand(empty(a, (M, N)), "z")
    part = empty(a, (cdiv(M, kernel.bm), PART_ROWS, N), acc_dtype(a.dtype))
    gemm(a, b, z, prec, part=part, kernel=kernel)
    return z.obj, part, kernel.bm


def apply_coefficients(z, ca, cm, cb):
    """out = ca * (z - cm) + cb, column by column (bn_apply)."""
    zo, place, (M, N) = _checked_z(z)
    out = empty(place, (M, N))
    launch_all(place, (_apply_call(place, M, N)(zo.ptr, place.ptr(out), place.ptr(ca),
                                                 place.ptr(cm), place.ptr(cb), 0),))
    return out


def reference(x, weight, affine: Affine, state: BatchNormState):
    """NumPy reference with nn.BatchNorm1d's semantics (buffers updated in place; an empty
    batch counted, the running statistics left alone). Overflow, nan and inf follow the
    arithmetic, without NumPy's warnings (as the GPU's)."""
    with np.errstate(all="ignore"):
        return _reference(x, weight, affine, state)


def _reference(x, weight, affine, state):
    bias, scale, gamma, beta = affine
    rmean, rvar, nbt, training, momentum, eps = state
    acc = np.float64 if x.dtype == np.float64 else np.float32
    n = x.shape[0]
    # z and y = z * scale rounded to x's dtype, as torch's Linear and product store them
    # (16-bit batch statistics come from the stored values)
    z = linear_reference(x, weight, bias).astype(acc, copy=False)
    y = z * scale.astype(acc)
    if x.dtype != acc:
        y = y.astype(x.dtype).astype(acc)
    if training and nbt is not None:
        nbt += 1
    if training and n == 0:
        return y.astype(native(x.dtype))
    if training:
        mean, var = y.mean(axis=0), y.var(axis=0)
        if rmean is not None:
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
    return out.astype(native(x.dtype))

