"""L1 / L2 normalisation for torch: the ``cupykern::normalize`` ops and the documented
models 1 and 2 (``L1Norm``, ``L2Norm``: normalise over dim 1).

Ops: ``normalize(Tensor x, int p, int axis, int[]? config) -> Tensor`` (autograd:
dx = (dy - x' * (sum(dy*x) / d / n)) / d for L1 with x' = sign(x), and (dy - x *
(sum(dy*x) / d / d)) / d for L2, by ``normalize_backward(Tensor x, Tensor dy, int p, int axis) -> Tensor``: one
fused kernel on CUDA where the rows allow, else PyTorch ops; in PyTorch ops throughout
when the backward must itself be differentiable) and ``normalize_out(..., Tensor(a!)
out) -> ()``.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import normalize as core
from ._checks import require_tensor
from ._op import Op


def reference(x: torch.Tensor, p: int, axis: int = 1) -> torch.Tensor:
    """The documented models in PyTorch ops (any axis): a zero row gives nan (0/0)."""
    if p == 1:
        return x / torch.mean(torch.abs(x), dim=axis, keepdim=True)
    return x / torch.norm(x, p=2, dim=axis, keepdim=True)


def _empty_result(x: torch.Tensor, axis: int) -> torch.Tensor:
    """A new tensor laid out as the kernel's result: contiguous with ``axis`` last, then
    viewed in x's axis order."""
    ax = axis % x.dim()
    shape = list(x.shape)
    shape.append(shape.pop(ax))
    return x.new_empty(shape).movedim(-1, ax)


def _impl(x, p, axis, config):
    if x.is_cuda:
        return core.normalize(x, p, axis, None, config)
    _, ax, p, _, _ = core.check(x, p, axis, None, config)
    out = _empty_result(x, ax)
    return out.copy_(reference(x, p, ax))


def _fake(x, p, axis, config):
    return _empty_result(x, axis)


def _setup_context(ctx, inputs, output):
    x, ctx.p, ctx.axis, _ = inputs
    ctx.save_for_backward(x)


def _grad_reference(x, g, p, axis):
    """dx of ``reference(x, p, axis)`` for the gradient g, in PyTorch ops (differentiable)."""
    ax = axis % x.dim()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xa, ga = x.to(acc), g.to(acc)
    s = (ga * xa).sum(ax, keepdim=True)
    # (in the kernels' order, kernels_cu/normalize.cuh's Grad: no step overflows for a
    # finite d; d = inf from finite elements whose sum overflowed gives 0 as torch's, and
    # from an infinite element nan, as torch's inf / inf)
    if p == 1:  # d = mean|x|, rounded to x's dtype as the forward rounds it
        d = xa.abs().mean(ax, keepdim=True).to(x.dtype).to(acc)
        c = s / d / x.shape[ax]
        t = xa.sign()
    else:  # d = ||x||
        d = torch.linalg.vector_norm(xa, 2, ax, keepdim=True).to(x.dtype).to(acc)
        c = s / d / d
        t = xa
    c = torch.where((d == torch.inf) & xa.isfinite().all(ax, keepdim=True), 0.0, c)
    return ((ga - t * c) / d).to(x.dtype)


def _backward_impl(x, dy, p, axis):
    if x.is_cuda:
        dx = core.normalize_backward(x, dy, p, axis)
        if dx is not None:
            return dx
    else:
        core.check(x, p, axis)  # (as normalize_backward checks a GPU call)
    return _grad_reference(x, dy, p, axis).contiguous()


def _backward(ctx, g):
    (x,) = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a backward that is itself differentiable
        return _grad_reference(x, g, ctx.p, ctx.axis), None, None, None
    return normalize_backward_op(x, g, ctx.p, ctx.axis), None, None, None


def _out_impl(x, p, axis, config, out):
    if x.is_cuda:
        core.normalize(x, p, axis, out, config)
        return
    _, ax, p, _, _ = core.check(x, p, axis, out, config)
    out.copy_(reference(x, p, ax))


def _autocast(device_type, x, p, axis, config):
    """PyTorch's CUDA autocast computes torch.norm in float32 (so the reference L2 model
    returns float32 for 16-bit x there); L1's abs/mean/div run in x's dtype."""
    return torch.float32 if device_type == "cuda" and p == 2 else None


def _fold(in_dims, x, p, axis, config):
    """vmap rule: the batch dimension is one more dimension the rows run along."""
    n = x.dim() - 1  # a sample's dimensions
    if in_dims[0] is None or not -n <= axis < n:  # (the reference raises for the axis)
        return None
    return normalize_op(x.movedim(in_dims[0], 0), p, axis % n + 1, config), 0


normalize_op = Op("normalize(Tensor x, int p, int axis, int[]? config) -> Tensor",
                  _impl, _fake, _setup_context, _backward, autocast=_autocast,
                  reference=lambda x, p, axis, config: reference(x, p, axis), fold=_fold)
normalize_backward_op = Op("normalize_backward(Tensor x, Tensor dy, int p, int axis) -> Tensor",
                           _backward_impl, lambda x, dy, p, axis: x.new_empty(x.shape))
normalize_out_op = Op("normalize_out(Tensor x, int p, int axis, int[]? config, Tensor(a!) out) -> ()",
                      _out_impl, lambda *args: None)


def normalize(x: torch.Tensor, p: int, axis: int = 1, out=None, config=None):
    """``x / d(x)`` along ``axis`` (p=1: mean|x|, p=2: ||x||) through the custom ops; what
    :func:`cupykern.l1_normalize` / :func:`cupykern.l2_normalize` do with tensors."""
    if type(axis) is bool:  # (the op's schema would take it as an int)
        raise TypeError("axis: expected an int, got bool")
    cfg = None if config is None else list(core.config_tuple(config))
    if out is None:
        return normalize_op(x, p, axis, cfg)
    # Anything but a tensor: the implementation's own checks say what is wrong with it.
    (normalize_out_op if isinstance(out, torch.Tensor) else _out_impl)(x, p, axis, cfg, out)
    return out


class L1NormReference(nn.Module):
    """Documented model 1 in plain PyTorch: ``x / mean(|x|, dim=1)``."""

    def forward(self, x):
        return reference(x, 1)


class L2NormReference(nn.Module):
    """Documented model 2 in plain PyTorch: ``x / ||x||_2`` over dim 1."""

    def forward(self, x):
        return reference(x, 2)


class L1Norm(L1NormReference):
    """``x / x.abs().mean(dim=1, keepdim=True)`` through ``cupykern::normalize`` (CUDA:
    our kernel; CPU: PyTorch ops); trains, compiles, captures in CUDA graphs."""

    def forward(self, x):
        _require_rows(x, type(self).__name__)
        return normalize_op(x, 1, 1, None)


class L2Norm(L2NormReference):
    """``x / torch.norm(x, p=2, dim=1, keepdim=True)`` through ``cupykern::normalize``."""

    def forward(self, x):
        _require_rows(x, type(self).__name__)
        return normalize_op(x, 2, 1, None)


def _require_rows(x, module: str) -> None:
    """The modules normalize over dim 1, which x must have (the axis is not the user's)."""
    require_tensor(x)
    if x.dim() < 2:
        raise ValueError(f"x: {module} normalizes over dim 1, so x needs at least 2 dimensions, "
                         f"got shape {tuple(x.shape)}")
