"""L1Norm / L2Norm: drop-in modules for documented models 1 and 2 (normalise over dim 1)."""
from __future__ import annotations

import torch
from torch import nn

from .. import normalize as _nz
from ._checks import require_tensor


def _reference(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "l1":
        return x / torch.mean(torch.abs(x), dim=1, keepdim=True)
    return x / torch.norm(x, p=2, dim=1, keepdim=True)


class _Normalize(torch.autograd.Function):
    """Forward on cupykern; backward in PyTorch ops (y = x / d(x))."""

    @staticmethod
    def forward(ctx, x, kind):
        y = _nz._normalize(x.detach(), 1, None, kind)
        ctx.kind = kind
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        # Gradient of the reference expression (not fused: training is not the hot path).
        with torch.enable_grad():
            xr = x.detach().requires_grad_(True)
            yr = _reference(xr, ctx.kind)
            (gx,) = torch.autograd.grad(yr, xr, g)
        return gx, None


class _NormModule(nn.Module):
    kind = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        require_tensor(x)
        if not x.is_cuda:
            return _reference(x, self.kind)
        if x.requires_grad and torch.is_grad_enabled():
            return _Normalize.apply(x, self.kind)
        return _nz._normalize(x, 1, None, self.kind)


class L1Norm(_NormModule):
    """``x / x.abs().mean(dim=1, keepdim=True)`` on cupykern (CUDA), PyTorch ops (CPU)."""

    kind = "l1"


class L2Norm(_NormModule):
    """``x / torch.norm(x, p=2, dim=1, keepdim=True)`` on cupykern (CUDA), PyTorch ops (CPU)."""

    kind = "l2"
