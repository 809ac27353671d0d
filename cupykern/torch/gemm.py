"""``linear`` for torch: the ``cupykern::linear`` ops.

``linear(Tensor x, Tensor weight, Tensor? bias, str precision) -> Tensor`` with autograd
(dx = dy @ W and dW = dy^T @ x on our GEMM at the forward's precision, reading the
transposes in place through ``mm(Tensor a, Tensor b, str precision) -> Tensor``;
db = sum(dy)) and ``linear_out(..., Tensor(a!) out) -> ()``. ``precision=None`` resolves to
``torch.get_float32_matmul_precision()`` here, in the torch layer, so that
torch.compile sees (and guards on) it too (see :func:`resolve_precision`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import gemm as core
from ._op import Op, lower_precision


def resolve_precision(precision) -> str:
    """``None`` -> torch's float32 matmul precision; anything else is checked by the op.

    In a CUDA autocast region ``None`` is "high" (TF32, at least as accurate as the
    region's 16-bit matmuls): a fused op whose GEMM PyTorch would autocast (GSBN's
    Linear) follows that policy while keeping its float32 output.

    Under torch.compile the precision string cannot be traced, but the TF32 flag it sets
    can (Dynamo folds it and guards on it): there "medium" runs as "high" (TF32), which
    PyTorch's definition of "medium" (at least bf16's accuracy) allows."""
    if precision is not None:
        return precision
    if torch.is_autocast_enabled("cuda"):
        return "high"
    if torch.compiler.is_compiling():
        return "high" if torch._C._get_cublas_allow_tf32() else "highest"
    return torch.get_float32_matmul_precision()


def _impl(x, weight, bias, precision):
    if x.is_cuda:
        return core.linear_core(x, weight, bias, precision)
    core.check(x, weight, bias, precision, None)
    return F.linear(x, weight, bias)


def _fake(x, weight, bias, precision):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    x, weight, bias, ctx.precision = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx, g):
    x, weight = ctx.saved_tensors
    n, k = weight.shape
    g2 = g.reshape(-1, n)
    # Double backward (create_graph) needs a differentiable graph: PyTorch's matmuls.
    matmul = torch.matmul if torch.is_grad_enabled() else (
        lambda a, b: mm_op(a, b, ctx.precision))
    dx = matmul(g2, weight).reshape(x.shape) if ctx.needs_input_grad[0] else None
    dw = matmul(g2.t(), x.reshape(-1, k)) if ctx.needs_input_grad[1] else None
    db = g2.sum(0) if ctx.needs_input_grad[2] else None
    return dx, dw, db, None


def _mm_impl(a, b, precision):
    if a.is_cuda:
        return core.mm(a, b, precision)
    core.check_mm(a, b, precision)
    return a @ b


mm_op = Op("mm(Tensor a, Tensor b, str precision) -> Tensor", _mm_impl,
           lambda a, b, precision: a.new_empty((a.shape[0], b.shape[1])))


def _out_impl(x, weight, bias, precision, out):
    if x.is_cuda:
        core.linear_core(x, weight, bias, precision, out)
        return
    core.check(x, weight, bias, precision, out)
    out.copy_(F.linear(x, weight, bias))


linear_op = Op("linear(Tensor x, Tensor weight, Tensor? bias, str precision) -> Tensor",
               _impl, _fake, _setup_context, _backward, autocast=lower_precision)
linear_out_op = Op("linear_out(Tensor x, Tensor weight, Tensor? bias, str precision, "
                   "Tensor(a!) out) -> ()", _out_impl, lambda *args: None)


def linear(x, weight, bias=None, *, precision=None, out=None):
    """:func:`cupykern.linear` for torch tensors, through the custom ops."""
    prec = resolve_precision(precision)
    if out is None:
        return linear_op(x, weight, bias, prec)
    # Anything but a tensor: the implementation's own checks say what is wrong with it.
    (linear_out_op if isinstance(out, torch.Tensor) else _out_impl)(x, weight, bias, prec, out)
    return out
