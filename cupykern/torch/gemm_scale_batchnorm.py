"""GemmScaleBatchNorm for torch: the ``cupykern::gemm_scale_batchnorm`` op and documented
model 3, ``bn(gemm(x) * scale)``.

The op updates ``running_mean`` / ``running_var`` / ``num_batches_tracked`` in place in
training mode (declared mutable in its schema) and has autograd: gradients for x,
weight, bias, scale, bn weight and bn bias, in PyTorch ops for now (the forward's GEMM
is recomputed in backward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..gemm_scale_batchnorm import (batch_size_error, check, check_inputs, check_real,
                                    gemm_scale_batchnorm_core)
from ._checks import hooked, members, require_submodule, require_tensor
from ._op import Op
from .gemm import resolve_precision

_PARAMS = ("Tensor x, Tensor weight, Tensor? bias, Tensor scale, Tensor? bn_weight, "
           "Tensor? bn_bias")
_SCHEMA = (f"gemm_scale_batchnorm({_PARAMS}, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
           "Tensor(c!)? num_batches_tracked, bool training, float? momentum, float eps, "
           "str precision) -> Tensor")
# Training without running statistics mutates nothing: a functional op of its own
# (Inductor cannot lower the mutating op when every buffer it may mutate is None).
_BATCH_STATS_SCHEMA = f"gemm_scale_batchnorm_batch_stats({_PARAMS}, float eps, str precision) -> Tensor"


def _impl(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt, training, momentum, eps,
          precision):
    if x.is_cuda:
        return gemm_scale_batchnorm_core(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt,
                                          training, momentum, eps, precision)
    check(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt, training, momentum, eps,
               precision)
    y = F.linear(x, weight, bias) * scale
    if training and nbt is not None:
        nbt.add_(1)
    f = momentum
    if momentum is None:  # cumulative average; unused in eval, but F.batch_norm wants a float
        f = 1.0 / float(nbt) if training and nbt is not None else 0.0
    return F.batch_norm(y, rmean, rvar, gamma, beta, training, f, eps)


def _fake(x, weight, *args):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    x, weight, bias, scale, gamma, beta, rmean, rvar, _, training, _, eps, _ = inputs
    ctx.training, ctx.eps = training, eps
    # Which of x, weight, bias, scale, gamma, beta want a gradient (read from the inputs:
    # ctx.needs_input_grad also counts the dispatch keyset of the Autograd kernel).
    ctx.wants = tuple(isinstance(t, torch.Tensor) and t.requires_grad
                      for t in (x, weight, bias, scale, gamma, beta))
    stats = (None, None) if training else (rmean, rvar)
    ctx.save_for_backward(x, weight, bias, scale, gamma, *stats)


def _backward(ctx, g):
    x, weight, bias, scale, gamma, rmean, rvar = ctx.saved_tensors
    dt = x.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    up = lambda t: None if t is None else t.to(acc)  # noqa: E731
    xa, wa, sa, ga = up(x), up(weight), up(scale), g.to(acc)
    z = F.linear(xa, wa, up(bias))
    y = z * sa
    if ctx.training:
        mean, var = y.mean(0), y.var(0, unbiased=False)
    else:
        mean, var = up(rmean), up(rvar)
    inv = torch.rsqrt(var + ctx.eps)
    yhat = (y - mean) * inv
    dyhat = ga if gamma is None else ga * up(gamma)
    if ctx.training:
        dy = inv * (dyhat - dyhat.mean(0) - yhat * (dyhat * yhat).mean(0))
    else:
        dy = dyhat * inv
    dz = dy * sa
    want = ctx.wants
    grads = (dz @ wa if want[0] else None, dz.t() @ xa if want[1] else None,
             dz.sum(0) if want[2] else None, (dy * z).sum(0) if want[3] else None,
             (ga * yhat).sum(0) if want[4] else None, ga.sum(0) if want[5] else None)
    return tuple(None if t is None else t.to(dt) for t in grads) + (None,) * 7


def _full(args):
    """The batch-statistics op's arguments as the stateful op's (no buffers, training)."""
    *params, eps, precision = args
    return (*params, None, None, None, True, None, eps, precision)


gemm_scale_batchnorm_op = Op(_SCHEMA, _impl, _fake, _setup_context, _backward)
batch_stats_op = Op(_BATCH_STATS_SCHEMA, lambda *a: _impl(*_full(a)), _fake,
                    lambda ctx, inputs, output: _setup_context(ctx, _full(inputs), output),
                    lambda ctx, g: _backward(ctx, g)[:6] + (None, None))


def gemm_scale_batchnorm(x, weight, bias, scale, bn_weight, bn_bias, running_mean=None,
                         running_var=None, num_batches_tracked=None, *, training=True,
                         momentum=0.1, eps=1e-5, precision=None):
    """:func:`cupykern.gemm_scale_batchnorm` for torch tensors, through the custom op."""
    if (training and isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] <= 1
            and isinstance(weight, torch.Tensor) and weight.dim() == 2):
        raise batch_size_error(torch.Size([x.shape[0], weight.shape[0]]))
    prec = resolve_precision(precision)
    if training and running_mean is None and running_var is None and num_batches_tracked is None:
        if momentum is not None:  # unused without buffers, but checked as the stateful op does
            check_real(momentum, "momentum")
        return batch_stats_op(x, weight, bias, scale, bn_weight, bn_bias, eps, prec)
    return gemm_scale_batchnorm_op(x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                                   running_var, num_batches_tracked, training, momentum, eps, prec)


class GemmScaleBatchNormReference(nn.Module):
    """Documented model 3 in plain PyTorch: ``bn(gemm(x) * scale)``."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        return self.bn(self.gemm(x) * self.scale)


class GemmScaleBatchNorm(GemmScaleBatchNormReference):
    """``bn(gemm(x) * scale)`` with the reference model's submodules, parameter names,
    RNG order and state_dict keys: ``gemm`` (nn.Linear), ``scale`` (Parameter of
    ``scale_shape``: one value per output feature, or one broadcast value), ``bn``
    (nn.BatchNorm1d).

    ``.train()`` uses batch statistics and updates ``bn``'s running_mean / running_var
    / num_batches_tracked exactly as nn.BatchNorm1d does (momentum None included);
    ``.eval()`` uses the running statistics. The float32 GEMM follows
    ``torch.get_float32_matmul_precision()``. CUDA tensors run the fused kernels through
    ``torch.ops.cupykern.gemm_scale_batchnorm`` (autograd, torch.compile, CUDA graphs);
    CPU tensors run the reference model itself. On CUDA, ``gemm`` must stay an
    nn.Linear and ``bn`` an nn.BatchNorm1d (or a SyncBatchNorm that does not
    synchronize, e.g. in eval mode or a single process); anything else raises rather
    than being silently ignored. While either has hooks (forward or backward, its own
    or global: pruning, weight norm, probes) the reference model runs, so they do too.
    """

    def forward(self, x):
        require_tensor(x)
        if not x.is_cuda:  # the reference model itself: honours any submodule
            if isinstance(self.gemm, nn.Linear) and x.device.type == "cpu":  # (meta: shapes only)
                check_inputs(x, self.gemm.weight)
                if self.bn.training and x.shape[0] <= 1:  # before bn counts it
                    raise batch_size_error(torch.Size([x.shape[0], self.gemm.out_features]))
            return super().forward(x)
        gemm, bn, scale = members(self, GemmScaleBatchNorm, ("gemm", "bn", "scale"))
        require_submodule(self, "gemm", nn.Linear, gemm)
        if isinstance(bn, nn.SyncBatchNorm):
            if (bn.training or bn.running_mean is None) and _synchronizes(bn):
                raise NotImplementedError(
                    "bn: GemmScaleBatchNorm.bn is a SyncBatchNorm over several processes; "
                    "cupykern does not synchronize batch statistics yet, and per-GPU "
                    "statistics would be wrong. Use the reference model for this step.")
        else:
            require_submodule(self, "bn", nn.BatchNorm1d, bn)
        if hooked(gemm, bn):  # hooks (pruning, weight norm, probes) run in the reference
            return super().forward(x)
        weight, bias = members(gemm, nn.Linear, ("weight", "bias"))
        gamma, beta, rmean, rvar, nbt = members(bn, nn.BatchNorm1d, (
            "weight", "bias", "running_mean", "running_var", "num_batches_tracked"))
        batch_stats = bn.training or rmean is None
        track = bn.training and bn.track_running_stats
        stats = track or not batch_stats
        if scale.dim() != 1:
            scale = scale.reshape(-1)
        if scale.shape[0] == 1:  # a broadcast scale, as the reference model allows
            scale = scale.expand(weight.shape[0])
        return gemm_scale_batchnorm(
            x, weight, bias, scale, gamma, beta, rmean if stats else None,
            rvar if stats else None, nbt if track else None, training=batch_stats,
            momentum=bn.momentum, eps=bn.eps)


def _synchronizes(bn: nn.SyncBatchNorm) -> bool:
    """Whether ``bn`` would reduce batch statistics across processes (its own rule)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(bn.process_group or dist.group.WORLD) > 1
