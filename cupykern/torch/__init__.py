"""cupykern for PyTorch: every kernel as a ``torch.ops.cupykern`` custom op (fake
implementation, autograd, ``mutates_args`` for the buffers it updates), and drop-in
``nn.Module`` replacements for the documented models."""
try:
    import torch  # noqa: F401
except ImportError as e:
    raise ImportError("cupykern.torch needs PyTorch: install the torch build for your CUDA "
                      "driver (or the CPU build) as the README's install recipes show") from e

from .. import _array
from . import gemm, gemm_scale_batchnorm, matmul_sum_max_mean_logsumexp, normalize
from ._compat import current_raw_stream
from .gemm_scale_batchnorm import GemmScaleBatchNorm
from .linear import FusedSequential, Linear, convert, unconvert
from .matmul_sum_max_mean_logsumexp import MatmulSumMaxMeanLogSumExp
from .normalize import L1Norm, L2Norm
from . import attention

_array._torch()  # torch was imported after cupykern: remember it before anything is traced
# Where the array layer sends torch tensors (_array.torch_layer("<module's name>")), and
# the stream it launches their kernels on.
for _module in (gemm, gemm_scale_batchnorm, matmul_sum_max_mean_logsumexp, normalize):
    _array.register_torch_layer(_module.__name__.rpartition(".")[2], _module)
del _module
_array.register_torch_stream(current_raw_stream)
from ._pool import pool_in_use, use_cupy_pool, use_torch_pool  # noqa: F401 (installs it)

__all__ = ["L1Norm", "L2Norm", "GemmScaleBatchNorm", "MatmulSumMaxMeanLogSumExp", "Linear",
           "FusedSequential", "convert", "unconvert", "attention"]
