"""Model 3, GemmScaleBatchNorm: ``bn(gemm(x) * scale)`` (../shared/spec/MODELS.md)."""
import torch
from torch import nn

from ..torch.gemm_scale_batchnorm import GemmScaleBatchNorm
from . import Case


class Model(nn.Module):
    """The reference, in plain PyTorch."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        x = self.gemm(x)
        x = x * self.scale
        return self.bn(x)


class ModelNew(GemmScaleBatchNorm):
    """Same parameters and buffers; GEMM + BN statistics fused on cupykern."""


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
