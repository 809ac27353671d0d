"""Documented model 4: MatmulSumMaxMeanLogSumExp, the sum of a Linear's outputs followed by
max / mean / logsumexp / logsumexp over the resulting size-1 dim."""
import torch

from ..torch.matmul_sum_max_mean_logsumexp import MatmulSumMaxMeanLogSumExp as ModelNew  # noqa: F401
from ..torch.matmul_sum_max_mean_logsumexp import (  # noqa: F401
    MatmulSumMaxMeanLogSumExpReference as Model)
from . import Case


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
