"""Documented model 2: L2Norm, y = x / ||x||_2 over dim=1 (same shapes as L1Norm)."""
import torch
from torch import nn

from ..torch import L2Norm
from .l1norm import CASES, get_init_inputs, get_inputs  # noqa: F401  (same benchmark shapes)


class Model(nn.Module):
    def forward(self, x):
        return x / torch.norm(x, p=2, dim=1, keepdim=True)


class ModelNew(L2Norm):
    pass
