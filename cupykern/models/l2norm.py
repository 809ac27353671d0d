"""Documented model 2: L2Norm, y = x / ||x||_2 over dim=1 (same shapes as L1Norm)."""
from ..torch.normalize import L2Norm as ModelNew  # noqa: F401
from ..torch.normalize import L2NormReference as Model  # noqa: F401
from .l1norm import CASES, get_init_inputs, get_inputs  # noqa: F401  (same benchmark shapes)
