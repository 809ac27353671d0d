"""MatmulSumMaxMeanLogSumExp: drop-in module for documented model 4.

The module caches a :class:`cupykern.matmul_reduce.MatmulSumPlan` (W.sum(0), b.sum(),
max|W|, max|b|) and rebuilds it whenever the weight or bias it was built from might have
changed: another object (``.weight`` replaced, ``load_state_dict(assign=True)``), a new
version counter (any in-place op: optimizer steps, ``load_state_dict``, ``copy_``,
``mul_``), any optimizer step (fused optimizers skip the version counter), or another
data pointer, device, dtype, shape or strides (``.to()``,
``.data = ...``). The one change it cannot see is an in-place op through ``.data``, which
bypasses the version counter (PyTorch's own saved-tensor checks miss it too).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._array import operand
from ..matmul_reduce import MatmulSumPlan, check_x
from ._checks import require_submodule, require_tensor


def _tail(s: torch.Tensor) -> torch.Tensor:
    """The model after the sum, on (B, 1): max, mean, logsumexp, logsumexp over dim 1."""
    s = torch.max(s, dim=1, keepdim=True)[0]
    s = torch.mean(s, dim=1, keepdim=True)
    s = torch.logsumexp(s, dim=1, keepdim=True)
    return torch.logsumexp(s, dim=1, keepdim=True)


def reference(x, weight, bias=None):
    """The documented model in PyTorch ops (used for CPU tensors)."""
    return _tail(torch.sum(nn.functional.linear(x, weight, bias), dim=1, keepdim=True))


class _MatmulSum(torch.autograd.Function):
    """Forward on cupykern; backward from the identities, in PyTorch ops.

    With g' = the gradient that PyTorch's tail (max/mean/logsumexp x2) passes to the sum
    (g, or nan where the output is inf/nan), every output j gets g', so
    dx = g' wsum, dW[j] = g'^T x for every j, db[j] = sum(g').
    """

    @staticmethod
    def forward(ctx, x, weight, bias, plan):
        out = plan(x)
        # weight is saved for PyTorch's in-place-modification check (as nn.Linear's is).
        ctx.save_for_backward(x, weight, out)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight, out = ctx.saved_tensors
        with torch.enable_grad():  # the tail's own backward, so inf/nan match PyTorch's
            v = out.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(_tail(v), v, g)
        n = weight.shape[0]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g * ctx.plan.wsum.to(g.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x).expand(n, -1)  # AccumulateGrad materialises it in W's layout
        if ctx.needs_input_grad[2]:
            gb = g.sum(0).expand(n)
        return gx, gw, gb, None


def _needs_grad(x, weight, bias) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))


def matmul_sum_max_mean_logsumexp(x, weight, bias=None, *, plan=None):
    """The model as a function with autograd; builds the plan unless one is given."""
    if not (x.is_cuda or weight.is_cuda):
        return reference(x, weight, bias)
    if plan is None:
        plan = MatmulSumPlan(weight.detach(), None if bias is None else bias.detach())
    if _needs_grad(x, weight, bias):
        return _MatmulSum.apply(x, weight, bias, plan)
    return plan(x)


# Fused optimizers (e.g. AdamW(fused=True)) update parameters without bumping their
# version counters, so every optimizer step anywhere also invalidates cached plans.
_optimizer_steps = [0]


def _count_step(optimizer, args, kwargs):
    _optimizer_steps[0] += 1


register_optimizer_step_post_hook(_count_step)


def _key(t):
    if t is None:
        return _optimizer_steps[0]
    try:
        version = t._version
    except RuntimeError:  # inference tensors have no version counter: never trust a cache
        version = object()
    return (version, _optimizer_steps[0], t.data_ptr(), t.dtype, t.device, t.shape, t.stride())


class MatmulSumMaxMeanLogSumExp(nn.Module):
    """``logsumexp(logsumexp(mean(max(sum(linear(x), 1)))))`` over dim 1, keepdim.

    Same parameters (``linear.weight``, ``linear.bias``), RNG order and state_dict as the
    documented model. CUDA inputs run on cupykern with a cached plan of the weights
    (never stale, see the module docstring); CPU inputs use PyTorch ops.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self._cache = None  # (weight, bias, key(weight), key(bias), plan)

    def plan(self) -> MatmulSumPlan:
        """The plan for the current weights (rebuilt if they changed since the last one)."""
        w, b = self.linear.weight, self.linear.bias
        c = self._cache
        if c is not None and c[0] is w and c[1] is b and c[2] == _key(w) and c[3] == _key(b):
            return c[4]
        # The plan holds detached views: they keep the old storage alive while cached, so
        # a new tensor can never reuse the cached data pointer.
        plan = MatmulSumPlan(w.detach(), None if b is None else b.detach())
        self._cache = (w, b, _key(w), _key(b), plan)
        return plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        require_tensor(x)
        w, b = self.linear.weight, self.linear.bias
        if not (x.is_cuda or w.is_cuda):  # the reference model itself
            check_x(operand(x, "x"), operand(w, "weight"))
            return _tail(torch.sum(self.linear(x), dim=1, keepdim=True))
        require_submodule(self, "linear", nn.Linear)
        if _needs_grad(x, w, b):
            return _MatmulSum.apply(x, w, b, self.plan())
        return self.plan()(x)

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda() / .half(): free the old plan now
        self._cache = None
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # copies and pickles do not carry the GPU cache
        state = self.__dict__.copy()
        state["_cache"] = None
        return state
