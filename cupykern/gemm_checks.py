"""The validation of the GEMM ops' arguments (each checked once per call signature: the
ops cache their plans by signature), NumPy matmul's shape rule, and the NumPy reference."""
from __future__ import annotations

import numpy as np

from ._array import FLOAT_DTYPES, check_out, contiguous, native, operand, require_writable, same_place

PRECISIONS = ("highest", "high", "medium")  # PyTorch's float32 matmul precisions

def check_precision(precision) -> str:
    """``precision`` as one of PRECISIONS, a plain str; ``None`` (CuPy / NumPy callers) is
    "highest". The torch layer resolves ``None`` to torch's float32 matmul precision first.
    (The plans' fast paths key on a plain str or None alone: any other precision takes
    the checked path.)"""
    if precision is None:
        return "highest"
    # A str subclass (numpy.str_, a str Enum) as its characters, compared as a plain str
    # (its own __eq__ is not asked); a plain str as it is, which torch.compile traces as a
    # constant. Anything else is refused before `in`, which an array answers elementwise.
    plain = precision if type(precision) is str else (
        str.__str__(precision) if isinstance(precision, str) else None)
    if plain not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS} or None, got {precision!r}")
    return plain


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


def reference(x, w, b=None):
    """NumPy reference in the accumulation type (float32 for 16-bit, as the GPU does)."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    y = x.astype(acc) @ w.astype(acc).T
    if b is not None:
        y = y + b.astype(acc)
    return y.astype(native(x.dtype))


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


def promote(a, b):
    """``(a, b)`` in their common dtype where both are arrays of two different float dtypes
    (NumPy's and CuPy's matmul promote: float32 @ float64 is float64, float16 @ float32
    float32), the lower one converted; anything else as it is, for the checks to judge."""
    try:
        names = {a.dtype.name, b.dtype.name}
        common = np.promote_types(a.dtype, b.dtype)
    except (AttributeError, TypeError):
        return a, b
    if not names <= set(FLOAT_DTYPES) or common.name not in FLOAT_DTYPES:
        return a, b
    return a.astype(common, copy=False), b.astype(common, copy=False)


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
