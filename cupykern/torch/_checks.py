"""Checks at the module boundary, shared by every cupykern module."""
from __future__ import annotations

import torch
from torch import nn


def require_tensor(x, name: str = "x") -> None:
    """TypeError naming ``name`` unless ``x`` is a dense torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.layout is not torch.strided:
        raise TypeError(f"{name}: expected a strided (dense) tensor, got layout {x.layout}")


def require_submodule(owner: nn.Module, attr: str, kind: type) -> None:
    """TypeError unless ``owner.attr`` computes what ``kind`` computes (an instance of
    ``kind`` or of a subclass that keeps its forward): the fused kernel reproduces that
    forward only, so a replacement it cannot honour must not be silently ignored."""
    m = getattr(owner, attr)
    if not isinstance(m, kind) or type(m).forward is not kind.forward:
        raise TypeError(f"{attr}: {type(owner).__name__}.{attr} is a {type(m).__name__}, but the "
                        f"fused CUDA kernel computes a {kind.__name__}; keep a plain "
                        f"{kind.__name__} there, or run the reference model")
