"""MatmulSumMaxMeanLogSumExp (documented model 4) as one GEMV-speed call.

The model is ``logsumexp(logsumexp(mean(max(sum(x @ W.T + b, 1)))))``, each over dim 1
with keepdim. The four reductions after the sum act on a dimension of size 1 and return
their input (inf -> inf, nan -> nan), and the sum of a Linear's outputs is
``x @ W.sum(0) + b.sum()``. So a plan holding ``wsum = W.sum(0)`` and ``bsum = b.sum()``
(float64) turns the model into one read of x.

Exactness (kernels_cu/matmul_sum_max_mean_logsumexp.cu): the identity is used for a row only when a bound
(K * max|x[b]| * max|W| + max|b|) proves that nothing in PyTorch's chain can overflow and
nothing is inf/nan; any other row is computed in the same kernel the literal way (every
z[b, j] formed and rounded as torch's Linear does, then summed), so nan/inf behave as
PyTorch's ops. Only an overflow of torch's own finite partial sums, which depends on
torch's summation order, can differ.

N-D x (B, S, ..., in_features), as nn.Linear takes it: the chain reduces over dim 1 (S)
each time, so the Linear's (B, S, ..., out) outputs are summed over S and the output is
(B, 1, ..., out_features); the identity above is for 2-D x only. No fused kernel applies:
NumPy x runs :func:`reference`, GPU x our ``linear`` and a float64 sum over dim 1 (the
torch layer: the reference chain in torch ops, with its autograd).

Accuracy: the dot is float64; W.sum(0) adds 8 rows at a time in the accumulation type, then
in float64 (float32 inputs: ~1e-7 relative, against ~1e-5 for PyTorch's own float32 chain).
Sums are deterministic (fixed order, no float atomics).
"""
from __future__ import annotations

import inspect

import numpy as np

from . import _dask, _loader
from ._array import (CTYPE, ITEMSIZE, Place, ProducerArgument, cached_checked, call_imported,
                     contiguous, data_ptr, empty, import_array, is_producer, is_torch, launch_all,
                     native, operand, same_place, scalar, signature, torch_layer)
from ._geometry import cdiv, row_stride, vector_aligned

_FILE = "matmul_sum_max_mean_logsumexp.cu"
ROWS_PER_BLOCK = (1, 2, 4)  # rows of x per block of matmul_sum_rows (MatmulSumPlan.apply)
# rows per block -> 16-byte loads of x per row in flight per thread (each with wsum's
# values for it: 64 bytes for 16-bit x). H200, 1024/300/100 x 8192 float32: 15.4, 9.5,
# 6.8 us, against 22.1, 14.0, 9.0 for {1: 8, 2: 8, 4: 4} with wsum loaded after x.
_LOADS = {1: 8, 2: 2, 4: 2}
_THREADS = 256  # matmul_sum_rows and matmul_sum_plan
# matmul_sum_plan: U rows of W added at once; a column tile is _LANES lanes of 16 bytes
# (128 bytes: whole DRAM sectors), or 32 lanes of one element where rows are unaligned;
# row chunks are added where tiles alone give fewer than _BLOCKS_PER_SM blocks per SM.
_PLAN_U, _LANES, _BLOCKS_PER_SM = 8, 8, 2
PLAN_TAIL = 3  # plan = [wsum (K), bias.sum(), max|W|, max|bias|] in float64
# Largest finite value of each dtype and of the type torch accumulates it in.
_FMAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
         "float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}
_ACC_MAX = {"float16": _FMAX["float32"], "bfloat16": _FMAX["float32"],
            "float32": _FMAX["float32"], "float64": _FMAX["float64"]}


def _vec(dtype: str) -> int:
    return 16 // ITEMSIZE[dtype]


def _rows_expr(dtype, v, r):
    return f"matmul_sum_rows<{CTYPE[dtype]}, {v}, {r}, {_LOADS[r]}, {_THREADS}>"


def _lanes(v: int) -> int:
    return _LANES if v > 1 else 32


def _plan_expr(dtype, v):
    return f"matmul_sum_plan<{CTYPE[dtype]}, {v}, {_lanes(v)}, {_THREADS}, {_PLAN_U}>"


for _dt in CTYPE:
    for _v in (1, _vec(_dt)):
        _loader.register(_FILE, [_plan_expr(_dt, _v)] + [_rows_expr(_dt, _v, r) for r in ROWS_PER_BLOCK])


def _zlim(dtype: str, n: int) -> float:
    """Fast-path limit for the per-output bound Z >= |z[b, j]|: with Z < zlim no z overflows
    T, no partial or total of N outputs overflows torch's accumulation type, and cuBLAS's
    rounding (relative K * eps) cannot push them over (the factor 1/2)."""
    return 0.5 * min(_FMAX[dtype], _ACC_MAX[dtype] / max(n, 1))


def reference(x: np.ndarray, weight: np.ndarray, bias=None) -> np.ndarray:
    """NumPy reference with PyTorch's semantics (and the GPU kernel's exact path): z = x @ W.T
    rounded to the accumulation type (float32, float64 for float64), + b there, rounded to
    x's dtype as torch stores the Linear output; summed over dim 1 (float64: the outputs for
    2-D x, (B, 1); S for N-D x (B, S, ..., K), (B, 1, ..., N)), rounded. max / mean /
    logsumexp over the resulting size-1 dim return their input."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    with np.errstate(all="ignore"):
        z = (x.astype(np.float64) @ weight.astype(np.float64).T).astype(acc)
        if bias is not None:
            z = z + bias.astype(acc)
        z = z.astype(x.dtype).astype(np.float64)
        return z.sum(axis=1, keepdims=True).astype(native(x.dtype))


def check_weights(weight, bias=None):
    """Validate weight (N, K) and bias (N,) or None; returns their Operands."""
    w = operand(weight, "weight")
    if w.ndim != 2:
        raise ValueError(f"weight: expected a 2-D array (out_features, in_features), "
                         f"got shape {tuple(w.shape)}")
    b = None
    if bias is not None:
        b = operand(bias, "bias")
        same_place(w, b)
        if b.dtype != w.dtype:
            raise TypeError(f"bias: dtype {b.dtype} does not match weight's dtype {w.dtype}")
        if tuple(b.shape) != (w.shape[0],):
            raise ValueError(f"bias: expected shape ({w.shape[0]},) (out_features), got "
                             f"{tuple(b.shape)}")
    return w, b


def check_x(a, w, k=None, nd=False):
    """x must be 2-D (with ``nd``: 2-D or more, features last, as nn.Linear takes them),
    match weight's place and dtype, and have in_features columns."""
    same_place(a, w)
    if w.dtype != a.dtype:
        raise TypeError(f"weight: dtype {w.dtype} does not match x's dtype {a.dtype}")
    if a.ndim != 2 and not (nd and a.ndim > 2):
        more = " or more dimensions (batch, dim 1, ..., in_features)" if nd else ""
        raise ValueError(f"x: expected a 2-D array (batch, in_features){more}, got shape "
                         f"{tuple(a.shape)}")
    k = w.shape[1] if k is None else k
    if a.shape[-1] != k:
        raise ValueError(f"x: has {a.shape[-1]} features (x.shape[-1]) but weight has "
                         f"in_features = {k} (weight.shape[1])")


def unfused(x, weight, bias=None):
    """The model for N-D GPU x (B, S, ..., K), checked: our ``linear`` (z rounded to x's
    dtype, as torch's Linear stores it), summed over dim 1 in float64, rounded: (B, 1, ...,
    N). The reductions after the sum act on a size-1 dim and return their input."""
    from . import linear

    z = linear(x, weight, bias)
    return z.astype("float64").sum(axis=1, keepdims=True).astype(z.dtype)


def _row_view(o, name):
    """(o, row stride) with o's rows contiguous, copying o only if they are not."""
    ld = row_stride(o.shape, o.strides)
    if ld is None:
        o = operand(contiguous(o), name)
        ld = o.shape[1]
    return o, ld


def build_plan(w, b):
    """The plan of GPU weights (Operands from :func:`check_weights`): a new float64 array
    [W.sum(0), bias.sum(), max|W|, max|bias|] of w's kind, from one read of W."""
    w = _row_view(w, "weight")[0]
    if b is not None and w.shape[0] > 1 and b.strides[0] != 1:
        b = operand(contiguous(b), "bias")
    return _plan_builder(w, b)(w.obj, None if b is None else b.obj)


def _plan_builder(w, b):
    """``run(weight, bias) -> plan`` for weights like ``w`` / ``b`` (Operands, rows and
    bias contiguous): the launch of matmul_sum_plan with its sizes fixed."""
    n, k = w.shape
    dt, dev = w.dtype, w.device
    ldw = row_stride(w.shape, w.strides)
    v = _vec(dt) if vector_aligned(w.ptr, ldw, k, ITEMSIZE[dt]) else 1
    lanes = _lanes(v)
    ntiles, step = cdiv(k, lanes * v), _THREADS // lanes * _PLAN_U  # step: rows a pass adds
    # Row chunks (whole passes each) only where the tiles alone are too few blocks.
    nchunks = (min(cdiv(n, step), cdiv(_BLOCKS_PER_SM * _loader.sm_count(dev), ntiles))
               if n and ntiles else 1)
    rows_per_chunk = cdiv(cdiv(n, nchunks), step) * step
    nchunks = cdiv(n, rows_per_chunk) if n and ntiles else 1
    # scratch, float64 slots: [max|W| key, block counter, tile counters (with chunks)], psum
    nsync = cdiv(12 + (4 * ntiles if nchunks > 1 else 0), 8)
    nscratch = nsync + (nchunks * k if nchunks > 1 else 0)
    fn = _loader.function(_FILE, _plan_expr(dt, v), dev)
    place = Place(w)
    ptr = place.ptr

    def run(weight, bias):
        data = empty(place, (k + PLAN_TAIL,), "float64")
        scratch = empty(place, (nscratch,), "float64")  # held to the launch
        sync = ptr(scratch)
        psum = sync + 8 * nsync if nchunks > 1 else 0
        launch_all(place, ((fn, (ntiles + 1, nchunks), (_THREADS,), (
            ptr(weight), ldw, n, k, rows_per_chunk, ptr(bias), ptr(data), psum, sync, sync + 8,
            sync + 12), 0),), zero=((sync, 8 * nsync),))
        return data

    return run


# (signatures of x, weight, bias, plan) -> run(x, weight, bias, plan), and
# ("build", signatures of weight, bias) -> run(weight, bias) -> plan; or None
_plans: dict = {}


def build_plan_cached(weight, bias, check):
    """:func:`build_plan` for GPU arrays, with the launches planned once per signature;
    ``check(weight, bias)`` validates them on a miss (Operands of weight and bias)."""
    key = ("build", signature(weight), signature(bias))
    run, checked = cached_checked(_plans, key, check, _builder_fresh, (weight, bias))
    return build_plan(*(checked or check(weight, bias))) if run is None else run(weight, bias)


def _builder_fresh(checked, *_):
    """A plan builder for weights like these (``checked``: their Operands), or None where
    they must be copied first."""
    w, b = checked
    if row_stride(w.shape, w.strides) is None or (
            b is not None and b.shape[0] > 1 and b.strides[0] != 1):
        return None
    return _plan_builder(w, b)


def apply_plan(a, w, b, plan_ptr: int, rows=None):
    """The model's output (B, 1) for x (Operand ``a``) on the GPU, from the plan at
    ``plan_ptr`` built from the weights ``w`` / ``b`` (Operands)."""
    out = empty(a, (a.shape[0], 1))
    if a.shape[0] == 0:
        return out
    a, w = _row_view(a, "x")[0], _row_view(w, "weight")[0]
    if b is not None and b.shape[0] > 1 and b.strides[0] != 1:
        b = operand(contiguous(b), "bias")
    call = _rows_call(a, w, b, rows)
    launch_all(a, (call(a.ptr, plan_ptr, w.ptr, 0 if b is None else b.ptr, data_ptr(out)),))
    return out


def _rows_call(a, w, b, rows=None):
    """``call(x_ptr, plan_ptr, w_ptr, b_ptr, out_ptr)``: the launch tuple of
    matmul_sum_rows for x (``a``, B > 0) and the weights, rows contiguous."""
    bsz, k = a.shape
    ldx, ldw = row_stride(a.shape, a.strides), row_stride(w.shape, w.strides)
    v = _vec(a.dtype) if vector_aligned(a.ptr, ldx, k, ITEMSIZE[a.dtype]) else 1
    if rows is None:  # 4 rows per block share wsum's L2 reads, if that still fills the GPU
        sms = _loader.sm_count(a.device)
        rows = 4 if bsz >= 4 * sms else 2 if bsz >= 2 * sms else 1
    fn = _loader.function(_FILE, _rows_expr(a.dtype, v, rows), a.device)
    n = w.shape[0]
    grid, block = (cdiv(bsz, rows),), (_THREADS,)
    zlim = scalar(_zlim(a.dtype, n), "double")
    return lambda x, plan, wp, bp, out: (fn, grid, block,
                                         (x, ldx, bsz, k, plan, wp, ldw, bp, n, zlim, out), 0)


def apply_cached(x, weight, bias, plan, check):
    """The model's output for GPU arrays ``x``, ``weight``, ``bias`` and the ``plan``
    array built from those weights, with the launch planned once per signature.
    ``check(x, weight, bias, plan)`` validates them on a miss and returns the Operands
    of x, weight and bias."""
    run, checked = planned_run(x, weight, bias, plan, check)
    if run is None:  # x or the weights need copies first
        a, w, b = checked or check(x, weight, bias, plan)
        return apply_plan(a, w, b, data_ptr(plan))
    return run(x, weight, bias, plan)


def planned_run(x, weight, bias, plan, check):
    """``(run, checked)``: the launch plan ``run(x, weight, bias, plan) -> out`` cached for
    arrays like these (validated by ``check`` on a miss, whose Operands are ``checked``),
    or ``run`` None where x or the weights must be copied first."""
    key = (signature(x), signature(weight), signature(bias), signature(plan))
    return cached_checked(_plans, key, check, _fresh, (x, weight, bias, plan))


def _fresh(checked, *_):
    """``run(x, weight, bias, plan) -> out`` for calls like this one (``checked``: the
    Operands of x, weight and bias), or None where x or the weights must be copied first."""
    a, w, b = checked
    if (row_stride(a.shape, a.strides) is None or row_stride(w.shape, w.strides) is None
            or (b is not None and b.shape[0] > 1 and b.strides[0] != 1)):
        return None
    place, shape = Place(a), (a.shape[0], 1)
    if a.shape[0] == 0:
        return lambda x, weight, bias, plan: empty(place, shape)
    call, ptr = _rows_call(a, w, b), place.ptr

    def run(x, weight, bias, plan):
        out = empty(place, shape)
        launch_all(place, (call(ptr(x), ptr(plan), ptr(weight), ptr(bias), ptr(out)),))
        return out

    return run


class MatmulSumPlan:
    """What the model needs from the weights alone, computed once.

    ``MatmulSumPlan(weight, bias=None)`` reads ``weight`` (out_features, in_features) and
    ``bias`` (out_features,) on the GPU (CuPy arrays or torch CUDA tensors) and keeps
    ``data`` = [``wsum`` = weight.sum(0), bias.sum(), max|weight|, max|bias|] in float64,
    so that ``plan(x)`` reads only x. The plan is a snapshot: after changing the weights
    in place, build a new one (the torch module does this automatically). NumPy / CPU
    weights give a plan whose calls run the reference. Arrays of other libraries (DLPack
    or CUDA array interface producers) are imported zero-copy, as the functions do.
    """

    __slots__ = ("weight", "bias", "wsum", "data", "in_features", "out_features", "dtype",
                 "kind", "device", "_w", "_b")

    def __init__(self, weight, bias=None):
        w, b = check_weights(*(import_array(v, n)[0] if is_producer(v) else v
                               for v, n in ((weight, "weight"), (bias, "bias"))))
        self.weight, self.bias = weight, bias  # the caller's (calls check identity)
        self.out_features, self.in_features = w.shape
        self.dtype, self.kind, self.device = w.dtype, w.kind, w.device
        self.wsum = self.data = None
        if w.kind != "cpu":  # rows contiguous once here, so calls never copy the weights
            w = _row_view(w, "weight")[0]
            if b is not None and b.shape[0] > 1 and b.strides[0] != 1:
                b = operand(contiguous(b), "bias")
            self.data = build_plan(w, b)
            self.wsum = self.data[:self.in_features]
        self._w, self._b = w, b

    def __call__(self, x):
        """The model's output (B, 1) for x (B, in_features), as x's kind; (B, 1, ...,
        out_features) for N-D x (B, S, ..., in_features) (see the module docstring)."""
        if is_torch(x):
            return torch_layer("matmul_sum_max_mean_logsumexp").matmul_sum_max_mean_logsumexp(
                x, self.weight, self.bias, plan=self)
        if _dask.is_dask(x):  # block by block: a block of rows needs only the plan
            self.apply(_dask.sample(x, (0,) * (x.ndim - 1) + x.shape[-1:]))  # (the checks)
            x = _dask.whole(x, x.ndim - 1)
            if x.ndim > 2:  # N-D: blocks whole along the summed dim 1 too
                x = _dask.whole(x, 1)
                chunks = (x.chunks[0], (1,), *x.chunks[2:-1], (self.out_features,))
            else:
                chunks = (x.chunks[0], (1,))
            return _dask.map_blocks(self.apply, x, name="matmul_sum_max_mean_logsumexp",
                                    chunks=chunks)
        try:
            return self.apply(x)
        except ProducerArgument:  # another library's x: imported, the result of its kind
            return call_imported(self.apply, inspect.signature(self.apply).bind(x))

    def apply(self, x, rows=None):
        """:meth:`__call__` for CuPy/NumPy arrays and (from the torch layer) tensors.
        ``rows``: rows of x per thread block (1, 2 or 4; tuning), None to choose."""
        a = operand(x, "x")
        check_x(a, self._w, self.in_features, nd=True)
        if a.kind == "cpu":
            return reference(x, self._w.obj, None if self._b is None else self._b.obj)
        if a.ndim > 2:
            return unfused(x, self._w.obj, None if self._b is None else self._b.obj)
        return apply_plan(a, self._w, self._b, data_ptr(self.data), rows)



def prepare_matmul_sum(weight, bias=None) -> MatmulSumPlan:
    """Precompute what depends only on the weights (see :class:`MatmulSumPlan`)."""
    return MatmulSumPlan(weight, bias)


def matmul_sum_max_mean_logsumexp(x, weight, bias=None, *, plan=None):
    """``logsumexp(logsumexp(mean(max(sum(x @ weight.T + bias, 1)))))`` over dim 1 (keepdim).

    Args:
        x: (B, in_features) CuPy array, torch tensor (CUDA or CPU) or NumPy array of
            float16, bfloat16, float32 or float64; or N-D (B, S, ..., in_features), as
            ``nn.Linear`` takes it: the chain then reduces over S, the output is (B, 1,
            ..., out_features), computed unfused (our ``linear``, then the sum; on torch
            the reference chain in torch ops; NumPy: :func:`reference`).
        weight: (out_features, in_features), same kind, device and dtype as x.
        bias: (out_features,) or None.
        plan: optional :class:`MatmulSumPlan` prepared from these same ``weight`` and
            ``bias`` objects; then the call reads only x. Without it the plan is built
            first (reads the weights once).

    Returns the (B, 1) result ((B, 1, ..., out_features) for N-D x) as x's kind and dtype
    (torch in -> torch out, on torch's current stream, through the custom ops
    ``cupykern::matmul_sum_plan`` and ``cupykern::matmul_sum_max_mean_logsumexp``, with
    autograd; JAX arrays in give JAX arrays out, other DLPack / CUDA array interface
    producers CuPy arrays: see :mod:`cupykern`). Results are PyTorch's, nan and inf
    included (see the module docstring), and more accurate than PyTorch's own chain.
    """
    if plan is not None:
        if not isinstance(plan, MatmulSumPlan):
            raise TypeError(f"plan: expected a MatmulSumPlan or None, got {type(plan).__name__}")
        if weight is not plan.weight or bias is not plan.bias:
            raise ValueError("plan: was prepared from other weight/bias objects; pass those, "
                             "or plan=None")
    if is_torch(x):
        return torch_layer("matmul_sum_max_mean_logsumexp").matmul_sum_max_mean_logsumexp(
            x, weight, bias, plan=plan)
    if _dask.is_dask(x):
        return (plan or MatmulSumPlan(weight, bias))(x)
    if plan is None:
        a = operand(x, "x")
        w, _ = check_weights(weight, bias)
        check_x(a, w, nd=True)
        if a.ndim > 2 and a.kind != "cpu":  # (no plan: it would read the weights for nothing)
            return unfused(x, weight, bias)
        return MatmulSumPlan(weight, bias).apply(x)
    return plan(x)  # (which imports another library's x)
