"""``GemmScaleBatchNorm``: documented model 3 on cupykern's fused GEMM + BatchNorm."""
from __future__ import annotations

import torch
from torch import nn

from ..gemm_bn import gemm_scale_batchnorm


class _NoBackward(torch.autograd.Function):
    """Forward through cupykern; backward is not implemented yet and says so."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, gamma, beta, kwargs):
        return gemm_scale_batchnorm(x, weight, bias, scale, gamma, beta, **kwargs)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(
            "cupykern.torch.GemmScaleBatchNorm has no backward yet; train with the plain "
            "PyTorch model (same parameters and state_dict) or run under torch.no_grad()")


class GemmScaleBatchNorm(nn.Module):
    """``bn(gemm(x) * scale)`` with the reference model's submodules, parameter names,
    RNG order and state_dict keys: ``gemm`` (nn.Linear), ``scale`` (Parameter of
    ``scale_shape``, one value per output feature), ``bn`` (nn.BatchNorm1d).

    ``.train()`` uses batch statistics and updates ``bn``'s running_mean / running_var
    / num_batches_tracked exactly as nn.BatchNorm1d does (momentum None included);
    ``.eval()`` uses the running statistics. The float32 GEMM follows
    ``torch.get_float32_matmul_precision()``. CUDA tensors only run cupykern kernels
    (CPU tensors take the reference path). Autograd: forward works with parameters
    that require grad, but ``backward()`` raises NotImplementedError.
    """

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        bn = self.bn
        batch_stats = bn.training or bn.running_mean is None
        track = bn.training and bn.track_running_stats
        kwargs = dict(
            running_mean=bn.running_mean if (track or not batch_stats) else None,
            running_var=bn.running_var if (track or not batch_stats) else None,
            num_batches_tracked=bn.num_batches_tracked if track else None,
            training=batch_stats, momentum=bn.momentum, eps=bn.eps)
        args = (x, self.gemm.weight, self.gemm.bias, self.scale.reshape(-1), bn.weight, bn.bias)
        if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args):
            return _NoBackward.apply(*args, kwargs)
        return gemm_scale_batchnorm(*args, **kwargs)
