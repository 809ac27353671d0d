"""cupykern for PyTorch: every kernel as a ``torch.ops.cupykern`` custom op (fake
implementation, autograd, ``mutates_args`` for the buffers it updates), and drop-in
``nn.Module`` replacements for the documented models."""
from .gemm_scale_batchnorm import GemmScaleBatchNorm
from .matmul_sum_max_mean_logsumexp import MatmulSumMaxMeanLogSumExp
from .normalize import L1Norm, L2Norm

__all__ = ["L1Norm", "L2Norm", "GemmScaleBatchNorm", "MatmulSumMaxMeanLogSumExp"]
