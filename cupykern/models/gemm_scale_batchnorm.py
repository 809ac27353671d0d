"""Model 3, GemmScaleBatchNorm: ``bn(gemm(x) * scale)`` (README: The four models)."""
import torch

from ..torch.gemm_scale_batchnorm import GemmScaleBatchNorm as ModelNew  # noqa: F401
from ..torch.gemm_scale_batchnorm import GemmScaleBatchNormReference as Model  # noqa: F401
from . import Case


def get_init_inputs():
    return [8192, 8192, (8192,)]


def get_inputs():
    return [torch.rand(1024, 8192)]


def _case(batch, fin, fout, rand, quick=False):
    flops = 2 * batch * fin * fout
    nbytes = 4 * (batch * fin + fin * fout + batch * fout)  # read x, W; write out
    return Case(label=f"{batch}x{fin}->{fout} float32", init_inputs=(fin, fout, (fout,)),
                make_inputs=lambda dev: [rand(batch, fin, device=dev)], quick=quick,
                nbytes=nbytes, flops=flops)


CASES = (
    _case(1024, 8192, 8192, torch.rand),
    _case(16384, 4096, 4096, torch.rand),
    _case(128, 1024, 512, torch.randn, quick=True),
)
