"""Documented model 1: L1Norm, y = x / mean(|x|, dim=1)."""
import torch

from ..torch.normalize import L1Norm as ModelNew  # noqa: F401
from ..torch.normalize import L1NormReference as Model  # noqa: F401
from . import Case


def _rand(shape, dtype=torch.float32, dist=torch.rand):
    return lambda device: [dist(*shape, device=device).to(dtype)]


_ROW = 32768 * 65535 * 4
CASES = (
    Case("32768x65535 float32", (), _rand((32768, 65535)), nbytes=2 * _ROW),
    Case("32768x65535 float16", (), _rand((32768, 65535), torch.float16), nbytes=_ROW, atol=1e-2),
    Case("32768x65535 bfloat16", (), _rand((32768, 65535), torch.bfloat16), nbytes=_ROW, atol=1e-2),
    Case("16x16384 float32 randn", (), _rand((16, 16384), dist=torch.randn), quick=True,
         nbytes=2 * 16 * 16384 * 4),
    Case("128x4096 float32 randn", (), _rand((128, 4096), dist=torch.randn), quick=True,
         nbytes=2 * 128 * 4096 * 4),
)


def get_init_inputs():
    return []


def get_inputs():
    return CASES[0].make_inputs("cpu")
