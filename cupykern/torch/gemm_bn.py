"""``GemmScaleBatchNorm``: documented model 3 on cupykern's fused GEMM + BatchNorm."""
from __future__ import annotations

import torch
from torch import nn

from ..gemm_bn import batch_size_error, check_inputs, gemm_scale_batchnorm
from ._checks import require_submodule, require_tensor


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
    ``torch.get_float32_matmul_precision()``. CUDA tensors run cupykern kernels; CPU
    tensors run the reference model itself (it trains). On CUDA, ``gemm`` must stay an
    nn.Linear and ``bn`` an nn.BatchNorm1d (or a SyncBatchNorm that does not
    synchronize, e.g. in eval mode or a single process); anything else raises rather
    than being silently ignored. Autograd on CUDA: forward works with parameters that
    require grad, but ``backward()`` raises NotImplementedError.
    """

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        require_tensor(x)
        if not x.is_cuda:  # the reference model itself: trains, honours any submodule
            if isinstance(self.gemm, nn.Linear):
                check_inputs(x, self.gemm.weight)
                if self.bn.training and x.shape[0] <= 1:  # before bn counts the batch
                    raise batch_size_error((x.shape[0], self.gemm.out_features), True)
            return self.bn(self.gemm(x) * self.scale)
        require_submodule(self, "gemm", nn.Linear)
        bn = self.bn
        batch_stats = bn.training or bn.running_mean is None
        if isinstance(bn, nn.SyncBatchNorm):
            if batch_stats and _synchronizes(bn):
                raise NotImplementedError(
                    "bn: GemmScaleBatchNorm.bn is a SyncBatchNorm over several processes; "
                    "cupykern does not synchronize batch statistics yet, and per-GPU "
                    "statistics would be wrong. Use the reference model for this step.")
        else:
            require_submodule(self, "bn", nn.BatchNorm1d)
        track = bn.training and bn.track_running_stats
        kwargs = dict(
            running_mean=bn.running_mean if (track or not batch_stats) else None,
            running_var=bn.running_var if (track or not batch_stats) else None,
            num_batches_tracked=bn.num_batches_tracked if track else None,
            training=batch_stats, momentum=bn.momentum, eps=bn.eps)
        scale = self.scale.reshape(-1)
        if scale.numel() == 1:  # a broadcast scale, as the reference model allows
            scale = scale.expand(self.gemm.out_features)
        args = (x, self.gemm.weight, self.gemm.bias, scale, bn.weight, bn.bias)
        if torch.is_grad_enabled() and any(a is not None and a.requires_grad for a in args):
            return _NoBackward.apply(*args, kwargs)
        return gemm_scale_batchnorm(*args, **kwargs)


def _synchronizes(bn: nn.SyncBatchNorm) -> bool:
    """Whether ``bn`` would reduce batch statistics across processes (its own rule)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(bn.process_group or dist.group.WORLD) > 1
