"""cupykern: fused GPU kernels for CuPy and PyTorch, compiled at runtime by NVRTC.

Array functions accept CuPy arrays, torch CUDA tensors (zero-copy, on torch's
current stream; they return torch tensors) and NumPy arrays (NumPy reference
path, so the API works without a GPU).
"""
import sys as _sys

from .normalize import l1_normalize, l2_normalize
from .gemm import linear, matmul
from .gemm_scale_batchnorm import gemm_scale_batchnorm
from .matmul_sum_max_mean_logsumexp import MatmulSumPlan, matmul_sum_max_mean_logsumexp, prepare_matmul_sum

if _sys.modules.get("torch") is not None:  # register the ops now: torch.compile cannot trace an import
    from . import torch as _torch_layer  # noqa: F401

__version__ = "0.1.0"

__all__ = ["l1_normalize", "l2_normalize", "linear", "matmul", "gemm_scale_batchnorm",
           "matmul_sum_max_mean_logsumexp", "MatmulSumPlan", "prepare_matmul_sum"]
