"""MatmulSumMaxMeanLogSumExp (documented model 4) as one GEMV-speed call.

The model is ``logsumexp(logsumexp(mean(max(sum(x @ W.T + b, 1)))))``, each over dim 1
with keepdim. The four reductions after the sum act on a dimension of size 1 and return
their input (inf -> inf, nan -> nan), and the sum of a Linear's outputs is
``x @ W.sum(0) + b.sum()``. So a plan holding ``wsum = W.sum(0)`` and ``bsum = b.sum()``
(float64) turns the model into one read of x.

Exactness (kernels_cu/matmul_reduce.cu): the identity is used for a row only when a bound
(K * max|x[b]| * max|W| + max|b|) proves that nothing in PyTorch's chain can overflow and
nothing is inf/nan; any other row is computed in the same kernel the literal way (every
z[b, j] formed and rounded as torch's Linear does, then summed), so nan/inf behave as
PyTorch's ops. Only an overflow of torch's own finite partial sums, which depends on
torch's summation order, can differ.

Accuracy: the dot is float64; W.sum(0) adds 8 rows at a time in the accumulation type, then
in float64 (float32 inputs: ~1e-7 relative, against ~1e-5 for PyTorch's own float32 chain).
Sums are deterministic (fixed order, no float atomics).
"""
from __future__ import annotations

import numpy as np

from . import _loader
from ._array import (CTYPE, ITEMSIZE, contiguous, empty, launch, on_cpu, operand, same_place,
                     scalar)

_FILE = "matmul_reduce.cu"
_ROWS = (1, 2, 4)  # rows per block of msml_rows
# Largest finite value of each dtype and of the type torch accumulates it in.
_FMAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38,
         "float32": 3.4028234663852886e38, "float64": 1.7976931348623157e308}
_ACC_MAX = {"float16": _FMAX["float32"], "bfloat16": _FMAX["float32"],
            "float32": _FMAX["float32"], "float64": _FMAX["float64"]}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _vec(dtype: str) -> int:
    return 16 // ITEMSIZE[dtype]


def _rows_expr(dtype, v, r):
    return f"msml_rows<{CTYPE[dtype]}, {v}, {r}>"


def _partial_expr(dtype, v):
    return f"msml_colsum_partial<{CTYPE[dtype]}, {v}>"


def _final_expr(dtype):
    return f"msml_colsum_final<{CTYPE[dtype]}>"


for _dt in CTYPE:
    for _v in (1, _vec(_dt)):
        _loader.register(_FILE, [_partial_expr(_dt, _v)] + [_rows_expr(_dt, _v, r) for r in _ROWS])
    _loader.register(_FILE, [_final_expr(_dt)])

def _rows_2d(a):
    """Row stride (elements) of a 2-D operand, or None if its last dim is not contiguous."""
    n, k = a.shape
    if k > 1 and a.strides[1] != 1:
        return None
    return a.strides[0] if n > 1 else k


def _vector_ok(a, ld, k) -> bool:
    v = _vec(a.dtype)
    return a.ptr % 16 == 0 and ld % v == 0 and k % v == 0


def _zlim(dtype: str, n: int) -> float:
    """Fast-path limit for the per-output bound Z >= |z[b, j]|: with Z < zlim no z overflows
    T, no partial or total of N outputs overflows torch's accumulation type, and cuBLAS's
    rounding (relative K * eps) cannot push them over (the factor 1/2)."""
    return 0.5 * min(_FMAX[dtype], _ACC_MAX[dtype] / max(n, 1))


def reference(x: np.ndarray, weight: np.ndarray, bias=None) -> np.ndarray:
    """NumPy reference with PyTorch's semantics (and the GPU kernel's exact path): z = x @ W.T
    rounded to the accumulation type (float32, float64 for float64), + b there, rounded to
    x's dtype as torch stores the Linear output; summed over outputs (float64), rounded.
    max / mean / logsumexp over the resulting size-1 dim return their input."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    with np.errstate(all="ignore"):
        z = (x.astype(np.float64) @ weight.astype(np.float64).T).astype(acc)
        if bias is not None:
            z = z + bias.astype(acc)
        z = z.astype(x.dtype).astype(np.float64)
        return z.sum(axis=1, keepdims=True).astype(x.dtype)


class MatmulSumPlan:
    """What the model needs from the weights alone, computed once.

    ``MatmulSumPlan(weight, bias=None)`` reads ``weight`` (out_features, in_features) and
    ``bias`` (out_features,) on the GPU (CuPy arrays or torch CUDA tensors) and keeps
    ``wsum = weight.sum(0)``, ``bias.sum()``, ``max|weight|`` and ``max|bias|`` in float64,
    so that ``plan(x)`` reads only x. The plan is a snapshot: after changing the weights
    in place, build a new one (the torch module does this automatically). NumPy / CPU
    weights give a plan whose calls run the NumPy reference.
    """

    __slots__ = ("weight", "bias", "wsum", "data", "in_features", "out_features", "dtype",
                 "kind", "device", "_w", "_b", "_ldw", "_zlim", "_sms", "_ptr")

    def __init__(self, weight, bias=None, *, _x=None):
        w = operand(weight, "weight")
        if w.ndim != 2:
            raise ValueError(f"weight: expected a 2-D array (out_features, in_features), "
                             f"got shape {tuple(w.shape)}")
        n, k = w.shape
        b = None
        if bias is not None:
            b = operand(bias, "bias")
            same_place(w, b)
            if b.dtype != w.dtype:
                raise TypeError(f"bias: dtype {b.dtype} does not match weight's dtype {w.dtype}")
            if tuple(b.shape) != (n,):
                raise ValueError(f"bias: expected shape ({n},) (out_features), got {tuple(b.shape)}")
        if _x is not None:
            check_x(_x, w)
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = n, k
        self.dtype, self.kind, self.device = w.dtype, w.kind, w.device
        self.wsum = self.data = None
        if w.kind != "cpu":
            self._build(w, b)

    def _build(self, w, b):
        n, k = w.shape
        ldw = _rows_2d(w)
        if ldw is None:
            w = operand(contiguous(w), "weight")
            ldw = k
        if b is not None and n > 1 and b.strides[0] != 1:
            b = operand(contiguous(b), "bias")
        self._w, self._b, self._ldw = w, b, ldw
        self._zlim = _zlim(w.dtype, n)
        self._sms = _loader.sm_count(w.device)
        dt = w.dtype
        self.data = empty(w, (k + 3,), "float64")
        self.wsum = self.data[:k]
        self._ptr = operand(self.data, "plan").ptr
        v = _vec(dt) if _vector_ok(w, ldw, k) else 1
        gx = _cdiv(k // v, 32)
        # (column tile, row chunk) blocks: about 16 per SM, chunks a multiple of the
        # kernel's 64-row step.
        nchunks = rows_per_chunk = 0
        if n and k:
            nchunks = min(_cdiv(n, 64), _cdiv(self._sms * 16, gx))
            rows_per_chunk = _cdiv(_cdiv(n, nchunks), 64) * 64
            nchunks = _cdiv(n, rows_per_chunk)
        psum = operand(empty(w, (max(nchunks * k, 1),), "float64"), "psum")
        pmax = operand(empty(w, (max(nchunks * gx, 1),), "float64"), "pmax")
        dev = w.device
        if nchunks:
            fn = _loader.function(_FILE, _partial_expr(dt, v), dev)
            launch(w, fn, (gx, nchunks), (32, 8), (
                scalar(w.ptr, "ptr"), scalar(ldw, "long long"), scalar(n, "long long"),
                scalar(k, "long long"), scalar(rows_per_chunk, "long long"),
                scalar(psum.ptr, "ptr"), scalar(pmax.ptr, "ptr")))
        fn = _loader.function(_FILE, _final_expr(dt), dev)
        launch(w, fn, (_cdiv(k, 256) + 1,), (256,), (
            scalar(psum.ptr, "ptr"), scalar(pmax.ptr, "ptr"), scalar(nchunks, "long long"),
            scalar(nchunks * gx, "long long"), scalar(k, "long long"),
            scalar(b.ptr if b is not None else 0, "ptr"), scalar(n, "long long"),
            scalar(self._ptr, "ptr")))

    def __call__(self, x):
        """The model's output (B, 1) for x (B, in_features), as x's kind."""
        return self._apply(operand(x, "x"))

    def _apply(self, a, rows=None):
        w = self._w if self.kind != "cpu" else operand(self.weight, "weight")
        check_x(a, w, self.in_features)
        if a.kind == "cpu":
            return on_cpu(reference, a.obj, self.weight, self.bias)
        bsz, k = a.shape
        out = empty(a, (bsz, 1))
        if bsz == 0:
            return out
        ldx = _rows_2d(a)
        if ldx is None:
            a = operand(contiguous(a), "x")
            ldx = k
        v = _vec(a.dtype) if _vector_ok(a, ldx, k) else 1
        if rows is None:  # 4 rows per block share wsum's L2 reads, if that still fills the GPU
            rows = 4 if bsz >= 4 * self._sms else 2 if bsz >= 2 * self._sms else 1
        fn = _loader.function(_FILE, _rows_expr(a.dtype, v, rows), a.device)
        b = self._b
        launch(a, fn, (_cdiv(bsz, rows),), (256,), (
            scalar(a.ptr, "ptr"), scalar(ldx, "long long"), scalar(bsz, "long long"),
            scalar(k, "long long"), scalar(self._ptr, "ptr"),
            scalar(w.ptr, "ptr"), scalar(self._ldw, "long long"),
            scalar(b.ptr if b is not None else 0, "ptr"), scalar(self.out_features, "long long"),
            scalar(self._zlim, "double"),
            scalar(out.data_ptr() if a.kind == "torch" else out.data.ptr, "ptr")))
        return out


def check_x(a, w, k=None):
    """x must be 2-D, match weight's place and dtype, and have in_features columns."""
    same_place(a, w)
    if w.dtype != a.dtype:
        raise TypeError(f"weight: dtype {w.dtype} does not match x's dtype {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"x: expected a 2-D array (batch, in_features), got shape {tuple(a.shape)}")
    k = w.shape[1] if k is None else k
    if a.shape[1] != k:
        raise ValueError(f"x: has {a.shape[1]} features (x.shape[1]) but weight has "
                         f"in_features = {k} (weight.shape[1])")


def prepare_matmul_sum(weight, bias=None) -> MatmulSumPlan:
    """Precompute what depends only on the weights (see :class:`MatmulSumPlan`)."""
    return MatmulSumPlan(weight, bias)


def matmul_sum_max_mean_logsumexp(x, weight, bias=None, *, plan=None):
    """``logsumexp(logsumexp(mean(max(sum(x @ weight.T + bias, 1)))))`` over dim 1 (keepdim).

    Args:
        x: (B, in_features) CuPy array, torch tensor (CUDA or CPU) or NumPy array of
            float16, bfloat16, float32 or float64.
        weight: (out_features, in_features), same kind, device and dtype as x.
        bias: (out_features,) or None.
        plan: optional :class:`MatmulSumPlan` prepared from these same ``weight`` and
            ``bias`` objects; then the call reads only x. Without it the plan is built
            first (reads the weights once).

    Returns the (B, 1) result as x's kind and dtype (torch in -> torch out, on torch's
    current stream). Results are PyTorch's, nan and inf included (see the module
    docstring), and more accurate than PyTorch's own chain.
    """
    if plan is None:
        a = operand(x, "x")
        return MatmulSumPlan(weight, bias, _x=a)._apply(a)
    if not isinstance(plan, MatmulSumPlan):
        raise TypeError(f"plan: expected a MatmulSumPlan or None, got {type(plan).__name__}")
    if weight is not plan.weight or bias is not plan.bias:
        raise ValueError("plan: was prepared from other weight/bias objects; pass those, "
                         "or plan=None")
    return plan(x)
