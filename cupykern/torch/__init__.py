"""Drop-in ``torch.nn.Module`` replacements for the documented models."""
from .norms import L1Norm, L2Norm

__all__ = ["L1Norm", "L2Norm"]
