"""``Linear``, a drop-in ``nn.Linear`` on :func:`cupykern.linear`, and :func:`convert` /
:func:`unconvert`, which swap a model's ``nn.Linear`` layers (and its ``nn.Linear`` ->
``nn.BatchNorm1d`` pairs inside ``nn.Sequential``) for ours and back, sharing every
parameter and buffer.

How a converted model keeps PyTorch's behaviour:

* :class:`Linear` subclasses ``nn.Linear``: the same ``__init__`` (RNG draws, factory
  kwargs), parameters, ``state_dict`` keys, ``extra_repr`` and ``repr``; its forward is
  ``cupykern.linear(x, weight, bias)`` (any leading dimensions; float32 follows
  ``torch.get_float32_matmul_precision()``: "highest" runs the 3xTF32 GEMM, "high" TF32).
* A fused pair stays two modules. :func:`convert` retypes an ``nn.Sequential`` that holds
  an ``nn.Linear`` directly followed by an ``nn.BatchNorm1d`` into a :class:`FusedSequential`
  (an ``nn.Sequential`` subclass) holding the very same children under the very same
  names: ``model[i]`` is the Linear, ``model[i + 1]`` the BatchNorm1d, and the
  ``state_dict`` keys, ``named_parameters`` and ``named_buffers`` are the original
  model's. Its forward runs each such pair as one ``cupykern.gemm_scale_batchnorm`` call
  (scale 1: ``bn(x @ W.T + b)``), in training and eval mode, updating running_mean /
  running_var / num_batches_tracked as nn.BatchNorm1d does (momentum None, affine=False
  and track_running_stats=False included). So the converted model loads the original's
  ``state_dict`` and the original loads the converted one's, with no hooks.
* A pair runs unfused (our Linear, then the BatchNorm1d itself), computing exactly what
  PyTorch does, where the fused op does not express the call: input other than 2-D
  (nn.BatchNorm1d's (N, C, L) form), an autocast region (PyTorch's Linear -> BatchNorm1d
  returns the region's 16-bit dtype, the fused op float32), hooks on either module (or
  global ones), a training batch of one row (BatchNorm's own error) or none, sparse
  input, an eps of 0 (what PyTorch's version makes of it), mixed dtypes or devices, or
  modules replaced after conversion by other types.
* Only pairs adjacent in an ``nn.Sequential`` fuse: a custom forward's
  ``self.bn(self.fc(x))`` is data flow that convert does not see (its Linear is still
  converted). nn.SyncBatchNorm and BatchNorm1d subclasses are not fused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import hooked
from ._compat import are_functorch_transforms_active, is_any_autocast_enabled
from ._op import _PLAIN
from .gemm import linear_unplanned, planned_linear
from .gemm_scale_batchnorm import GemmScaleBatchNorm, _arguments, gemm_scale_batchnorm
from .matmul_sum_max_mean_logsumexp import MatmulSumMaxMeanLogSumExp

__all__ = ["Linear", "FusedSequential", "convert", "unconvert"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STRIDED = torch.strided
_DEVICES = ("cuda", "cpu", "meta")


def _ours(x, weight) -> bool:
    """Whether :func:`cupykern.linear` takes ``x`` and ``weight`` (else F.linear computes
    the call, and raises PyTorch's own errors where it is wrong)."""
    return (isinstance(x, torch.Tensor) and x.dtype == weight.dtype and weight.dtype in _FLOATS
            and x.device.type in _DEVICES and x.dim() > 0 and x.layout is _STRIDED
            and not x.is_nested)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is :func:`cupykern.linear`.

    Construction, parameters, ``state_dict``, ``reset_parameters``, ``extra_repr`` and the
    device / dtype factory kwargs are ``nn.Linear``'s (it is one: ``isinstance(m,
    nn.Linear)`` holds). The float32 product follows ``torch.get_float32_matmul_precision()``
    as :func:`cupykern.linear` does ("highest", PyTorch's default: 3xTF32, about SGEMM's
    accuracy; "high": TF32); 16-bit and float64 run as cupykern.linear routes them; autocast
    casts as for nn.Linear. Inputs cupykern.linear does not take (other dtypes, mixed
    dtypes, other devices, sparse and nested tensors) go to ``F.linear``.

    ``Linear.from_linear(m)`` makes one from an existing ``nn.Linear`` sharing its
    parameters; :func:`convert` does so for a whole model.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        # (a planned signature: no checks to repeat; else the key to plan it under)
        out = planned_linear(input, weight, bias)
        if out is not None and type(out) is not tuple:
            return out
        if _ours(input, weight):
            return linear_unplanned(input, weight, bias, None, out)
        return F.linear(input, weight, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Linear":
        """A :class:`Linear` that shares ``linear``'s state: the same ``weight`` and ``bias``
        Parameter objects (not copies: an optimizer over either updates both), its
        training flag, attributes and hooks. ``linear`` must be a plain ``nn.Linear`` (or
        one of ours); a subclass, or a parametrized one
        (``torch.nn.utils.parametrize``), raises a TypeError: its class-level behaviour
        would be lost."""
        if type(linear) not in (nn.Linear, Linear):
            raise TypeError(f"linear: expected an nn.Linear, got {type(linear).__name__} (a "
                            "subclass or parametrized Linear is not converted: its own "
                            "behaviour would be lost)")
        return _retyped(linear, cls)


def _retyped(module: nn.Module, cls: type) -> nn.Module:
    """A new ``cls`` instance holding ``module``'s state: the same Parameter, buffer and
    submodule objects (in dictionaries of its own: registering a new one on either does
    not reach the other), the same attributes, and the same hook dictionaries (a hook's
    handle removes it from both). Nothing is initialized: no RNG draw, no copy."""
    new = cls.__new__(cls)
    state = module.__dict__.copy()
    for key in ("_parameters", "_buffers", "_modules"):
        state[key] = state[key].copy()
    state["_non_persistent_buffers_set"] = set(state["_non_persistent_buffers_set"])
    new.__dict__.update(state)
    return new


# ---- Linear -> BatchNorm1d pairs

_LINEARS = (nn.Linear, Linear)


def _pair(first, second) -> bool:
    """Whether ``first`` -> ``second`` is a pair the fused op may compute."""
    return (type(first) in _LINEARS and type(second) is nn.BatchNorm1d
            and second.num_features == first.out_features)


_ONES: dict = {}  # (device, dtype) -> the longest vector of ones made (CUDA)
_KEPT: list = []  # every one made: a CUDA graph or a saved autograd graph may hold a shorter one


def _ones(proto: torch.Tensor, n: int) -> torch.Tensor:
    """n ones of ``proto``'s dtype and device: the scale of a fused Linear -> BatchNorm1d
    pair. On CUDA in eager mode a slice of a vector kept for the process (no fill kernel
    a call); elsewhere (CPU, tracing, graph capture before one exists) made anew."""
    if (not proto.is_cuda or type(proto) not in _PLAIN or torch.compiler.is_compiling()
            or are_functorch_transforms_active()):
        return proto.new_ones(n)
    key = (proto.device, proto.dtype)
    t = _ONES.get(key)
    if t is None or t.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            return proto.new_ones(n)
        with torch.inference_mode(False), torch.no_grad():
            t = torch.ones(max(n, 2 * t.numel() if t is not None else n), dtype=proto.dtype,
                           device=proto.device)
        torch.cuda.current_stream(proto.device).synchronize()  # (filled for any stream)
        _ONES[key] = t
        _KEPT.append(t)
    return t[:n]


def fused_linear_batchnorm(linear: nn.Linear, bn: nn.BatchNorm1d, x):
    """``bn(linear(x))`` through one ``cupykern.gemm_scale_batchnorm`` call (scale 1), or
    None where that call would not compute exactly what the two modules do (see the
    module docstring): then the caller runs the modules."""
    if (not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.layout is _STRIDED)
            or not _pair(linear, bn)):
        return None
    if is_any_autocast_enabled() or hooked(linear, bn):
        return None
    weight = linear.weight
    dt, dev = x.dtype, x.device
    if (dt not in _FLOATS or dev.type not in ("cuda", "cpu") or weight.dtype != dt
            or weight.device != dev or x.shape[1] != weight.shape[1]):
        return None  # (F.linear's own result or error)
    weight, bias, _, gamma, beta, rmean, rvar, nbt, batch_stats, momentum, eps = _arguments(
        linear, bn, None)
    for t in (bias, gamma, beta, rmean, rvar):
        if t is not None and (t.dtype != dt or t.device != dev or t.dim() != 1):
            return None  # (mixed dtypes: what PyTorch's modules make of them)
    if nbt is not None and (nbt.dtype != torch.int64 or nbt.device != dev):
        return None
    if batch_stats and x.shape[0] <= 1:
        return None  # (nn.BatchNorm1d's own error for one row, its no-op for none)
    if rmean is not None and batch_stats and momentum is None and nbt is None:
        return None  # (a cumulative average without its count: BatchNorm's own behaviour)
    if type(eps) is not float or not (momentum is None or type(momentum) is float):
        return None
    if eps <= 0:  # (torch from 2.10 refuses it in training, and 2.10-2.11 in eval too)
        return None
    scale = _ones(weight, weight.shape[0])
    return gemm_scale_batchnorm(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt,
                                training=batch_stats, momentum=momentum, eps=eps)


class FusedSequential(nn.Sequential):
    """``nn.Sequential`` whose forward runs each ``nn.Linear`` (or :class:`Linear`)
    directly followed by an ``nn.BatchNorm1d`` as one fused
    ``cupykern.gemm_scale_batchnorm`` call (see :func:`fused_linear_batchnorm`), and
    every other child as nn.Sequential does. Its children, names, ``state_dict`` keys and
    indexing are nn.Sequential's: the pairs stay two modules. :func:`convert` makes one
    from an nn.Sequential holding such a pair, :func:`unconvert` turns it back."""

    def forward(self, input):
        mods = list(self._modules.values())
        i, n = 0, len(mods)
        while i < n:
            if i + 1 < n:
                out = fused_linear_batchnorm(mods[i], mods[i + 1], input)
                if out is not None:
                    input = out
                    i += 2
                    continue
            input = mods[i](input)
            i += 1
        return input


# ---- convert / unconvert

def convert(module: nn.Module, *, fuse_batchnorm: bool = True) -> nn.Module:
    """``module`` with every ``nn.Linear`` (exact type: subclasses and parametrized
    Linears are left alone) replaced by :class:`Linear`, sharing its Parameter objects
    (see :meth:`Linear.from_linear`), recursively through all children (Sequential,
    ModuleList, ModuleDict, custom modules).

    cupykern's own fused modules (GemmScaleBatchNorm, MatmulSumMaxMeanLogSumExp) are
    left as they are: their kernels already compute their nn.Linear.

    With ``fuse_batchnorm``, each ``nn.Sequential`` (exact type) holding an nn.Linear
    directly followed by an ``nn.BatchNorm1d`` of its out_features becomes a
    :class:`FusedSequential` with the same children, which runs the pair as one fused
    kernel call; the state_dict keys stay the original model's.

    As ``nn.SyncBatchNorm.convert_sync_batchnorm``: children are replaced in place and
    the converted module is returned (a new object where ``module`` itself is replaced:
    an nn.Linear, or an nn.Sequential fused); use the returned module. Parameters and
    buffers are shared, not copied: an optimizer made before conversion still updates
    the converted model. To keep the original, convert ``copy.deepcopy(model)``. A module
    reached twice (shared) is converted once. Undo with :func:`unconvert`.

    Example::

        model = cupykern.torch.convert(model)   # before making the optimizer, or after
    """
    _require_module(module)
    return _walk(module, lambda m: _convert_one(m, fuse_batchnorm), {}, _FUSED_ALREADY)


# cupykern's own fused modules: their kernels read their nn.Linear's parameters
# themselves, and they require it to stay a plain nn.Linear (left alone, children too).
_FUSED_ALREADY = (GemmScaleBatchNorm, MatmulSumMaxMeanLogSumExp)


def unconvert(module: nn.Module) -> nn.Module:
    """The inverse of :func:`convert`: each :class:`Linear` back to a plain ``nn.Linear``
    and each :class:`FusedSequential` back to an ``nn.Sequential``, sharing their
    parameters, buffers and children (in place, as :func:`convert`; use the returned
    module). A Linear parametrized after :func:`convert` (``torch.nn.utils.parametrize``,
    whose class is made from Linear's) stays one: remove its parametrizations first."""
    _require_module(module)
    return _walk(module, _unconvert_one, {})


def _require_module(module):
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")


def _walk(module, one, memo, skip=()):
    """``one`` applied bottom-up: each child replaced in its parent by what it becomes
    (modules of the types ``skip`` left as they are, children included)."""
    key = id(module)
    if key in memo:
        return memo[key]
    if isinstance(module, skip):
        memo[key] = module
        return module
    for name, child in list(module._modules.items()):
        if child is not None:
            new = _walk(child, one, memo, skip)
            if new is not child:
                module._modules[name] = new
    out = one(module)
    memo[key] = out
    return out


def _convert_one(m, fuse_batchnorm):
    if type(m) is nn.Linear:
        return Linear.from_linear(m)
    if fuse_batchnorm and type(m) is nn.Sequential:
        mods = list(m._modules.values())
        if any(_pair(a, b) for a, b in zip(mods, mods[1:])):
            return _retyped(m, FusedSequential)
    return m


def _unconvert_one(m):
    if type(m) is Linear:
        return _retyped(m, nn.Linear)
    if type(m) is FusedSequential:
        return _retyped(m, nn.Sequential)
    return m
