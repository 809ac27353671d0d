"""Drop-in ``torch.nn.Module`` replacements for the documented models."""
from .norms import L1Norm, L2Norm
from .gemm_bn import GemmScaleBatchNorm
from .matmul_reduce import MatmulSumMaxMeanLogSumExp

__all__ = ["L1Norm", "L2Norm", "GemmScaleBatchNorm", "MatmulSumMaxMeanLogSumExp"]
