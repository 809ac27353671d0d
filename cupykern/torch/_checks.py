"""Checks at the module boundary, shared by every cupykern module."""
from __future__ import annotations

import torch
from torch import nn

from ._compat import GLOBAL_MODULE_HOOKS


def require_tensor(x, name: str = "x") -> None:
    """TypeError naming ``name`` unless ``x`` is a dense torch.Tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.layout is not torch.strided:
        raise TypeError(f"{name}: expected a strided (dense) tensor, got layout {x.layout}")


_AUTOCAST_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def autocast_input(x, weight):
    """``x`` in ``weight``'s dtype where, in an autocast region of x's device (CPU or
    CUDA), x is float16, bfloat16 or float32 and the weights float32 or the region's
    dtype; else ``x`` itself. The reference model's Linear takes both into the region's
    dtype there: a 16-bit x (an autocast Linear's output) by float32 weights gives the
    reference's float32 result from float32 data (the conversion is exact), a float32 x
    by weights of the region's dtype the reference's rounding of it. (Weights of the other
    16-bit dtype would round x twice: left to the op's error.) Outside autocast a
    mismatch stays an error. Callers test is_any_autocast_enabled() first."""
    if (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
            and x.dtype != weight.dtype and x.dtype in _AUTOCAST_FLOATS
            and x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type)
            and weight.dtype in (torch.float32, torch.get_autocast_dtype(x.device.type))):
        return x.to(weight.dtype)
    return x


def require_submodule(owner: nn.Module, attr: str, kind: type, m: nn.Module) -> nn.Module:
    """``m`` (= ``owner.attr``), after a TypeError unless it computes what ``kind``
    computes (an instance of ``kind`` or of a subclass that keeps its forward): the fused
    kernel reproduces that forward only, so a replacement it cannot honour must not be
    silently ignored."""
    if not isinstance(m, kind) or type(m).forward is not kind.forward:
        raise TypeError(f"{attr}: {type(owner).__name__}.{attr} is a {type(m).__name__}, but the "
                        f"fused CUDA kernel computes a {kind.__name__}; keep a plain "
                        f"{kind.__name__} there, or run the reference model")
    return m


def members(module: nn.Module, kind: type, names):
    """``[getattr(module, n) for n in names]``. For a module of exactly type ``kind`` (not a
    subclass, so no parametrization's property) its parameter, buffer and submodule
    dicts are read directly: nn.Module.__getattr__ costs about 0.5 us a name, and a
    call reads about ten. (The dicts: _compat.MODULE_STORES.)"""
    if type(module) is not kind:
        return [getattr(module, n) for n in names]
    d = module.__dict__
    found = []
    for n in names:
        for store in (d["_parameters"], d["_buffers"], d["_modules"]):
            if n in store:
                found.append(store[n])
                break
        else:
            found.append(getattr(module, n))
    return found


# register_module_forward_hook & co.'s dicts (see _compat)
_G_FORWARD, _G_FORWARD_PRE, _G_BACKWARD, _G_BACKWARD_PRE = GLOBAL_MODULE_HOOKS


def hooked(*modules: nn.Module) -> bool:
    """Whether calling these submodules would run code of the user's: hooks (their own or
    global ones), or a ``forward`` set on the instance (as accelerate's hooks and CPU
    offload do). A fused forward that never calls them would silently skip it. (Each
    module's hook dicts are read directly: _compat.MODULE_HOOKS.)"""
    if _G_FORWARD or _G_FORWARD_PRE or _G_BACKWARD or _G_BACKWARD_PRE:
        return True
    for m in modules:  # (a loop, not any(generator): a call's fast path reads this)
        if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or "forward" in m.__dict__):
            return True
    return False
