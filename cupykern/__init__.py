"""cupykern: fused GPU kernels for CuPy and PyTorch, compiled at runtime by NVRTC.

Array functions accept CuPy arrays, torch CUDA tensors (zero-copy, on torch's
current stream; they return torch tensors) and NumPy arrays (NumPy reference
path, so the API works without a GPU).
"""
from .normalize import l1_normalize, l2_normalize

__version__ = "0.1.0"

__all__ = ["l1_normalize", "l2_normalize"]
