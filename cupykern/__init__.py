"""cupykern: fused GPU kernels for CuPy and PyTorch, compiled at runtime by NVRTC.

Array functions accept CuPy arrays, torch CUDA tensors (zero-copy, on torch's
current stream; they return torch tensors) and NumPy arrays (NumPy reference
path, so the API works without a GPU). Arrays of any other library that exports
DLPack (``__dlpack__``) or the CUDA array interface (JAX, Numba, cuda.core...) are
imported zero-copy on CuPy's current stream (the producer orders its pending work
before it): JAX arrays in give JAX arrays out; other CUDA producers give CuPy arrays
(NumPy arrays for CPU producers). ``out`` and updated buffers must be writable (a
producer's read-only flag, and JAX arrays, are refused). Inside ``jax.jit`` the
functions raise a TypeError: they take concrete arrays.
"""
import sys as _sys

from . import gemm as _gemm, gemm_scale_batchnorm as _gsbn, normalize as _normalize
from . import matmul_sum_max_mean_logsumexp as _m4
from . import _array
from ._array import accepts_producers as _producers
from .matmul_sum_max_mean_logsumexp import MatmulSumPlan, prepare_matmul_sum

# Arrays of any DLPack / CUDA array interface producer (JAX, Numba, cuda.core...) too.
l1_normalize = _producers(_normalize.l1_normalize)
l2_normalize = _producers(_normalize.l2_normalize)
linear = _producers(_gemm.linear, torch_fn="gemm.linear")
matmul = _producers(_gemm.matmul, torch_fn="gemm.matmul")
gemm_scale_batchnorm = _producers(  # (the running statistics: updated in training mode)
    _gsbn.gemm_scale_batchnorm, written=lambda a: ("running_mean", "running_var",
                                                   "num_batches_tracked") if a.get("training", True) else ())
matmul_sum_max_mean_logsumexp = _producers(_m4.matmul_sum_max_mean_logsumexp)


def _import_torch_layer():
    """Import cupykern.torch (its modules register with the array layer): what the array
    layer runs when it meets torch tensors before that (torch imported after cupykern)."""
    from . import torch  # noqa: F401


_array.set_torch_layer_import(_import_torch_layer)
if _sys.modules.get("torch") is not None:  # register the ops now: torch.compile cannot trace an import
    _import_torch_layer()

__version__ = "0.1.0"

__all__ = ["l1_normalize", "l2_normalize", "linear", "matmul", "gemm_scale_batchnorm",
           "matmul_sum_max_mean_logsumexp", "MatmulSumPlan", "prepare_matmul_sum"]
