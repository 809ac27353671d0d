"""Documented model 4: MatmulSumMaxMeanLogSumExp, the sum of a Linear's outputs followed by
max / mean / logsumexp / logsumexp over the resulting size-1 dim."""
import torch
from torch import nn

from ..torch import MatmulSumMaxMeanLogSumExp
from . import Case


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = self.linear(x)
        x = torch.sum(x, dim=1, keepdim=True)
        x = torch.max(x, dim=1, keepdim=True)[0]
        x = torch.mean(x, dim=1, keepdim=True)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        return x


class ModelNew(MatmulSumMaxMeanLogSumExp):
    pass


def _inputs(b, k, dist=torch.rand):
    return lambda device: [dist(b, k, device=device)]


# Byte model with the weights unchanged between calls (the plan is cached): read x once.
CASES = (
    Case("1024x8192->8192 float32", (8192, 8192), _inputs(1024, 8192), nbytes=1024 * 8192 * 4),
    Case("128x10->5 float32 randn", (10, 5), _inputs(128, 10, torch.randn), quick=True,
         nbytes=128 * 10 * 4),
)


def get_init_inputs():
    return [8192, 8192]


def get_inputs():
    return CASES[0].make_inputs("cpu")
