"""The one way a cupykern kernel becomes a PyTorch operator.

:class:`Op` defines ``torch.ops.cupykern.<name>`` from a schema, with one Python
implementation for CPU and CUDA tensors (the CPU one computes the reference in
PyTorch ops), a fake (meta) implementation for tracing, and optionally autograd
(``setup_context`` + ``backward``, written in PyTorch ops so that they trace too).

Calling an :class:`Op` goes through the dispatcher whenever something is tracing or
transforming the call (torch.compile, torch.export, fake or functional tensors,
dispatch modes, vmap/grad transforms). In plain eager mode it calls the very same
implementation directly (see :func:`_direct`), inside an ``autograd.Function`` made of the very same
``setup_context`` / ``backward`` when a gradient is needed: the dispatcher costs
microseconds a call, which small calls cannot afford.
"""
from __future__ import annotations

import torch

NAMESPACE = "cupykern"
_LIB = torch.library.Library(NAMESPACE, "DEF")
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not subclasses: fake, functional, DTensor...


def _eager() -> bool:
    """Nothing is tracing or watching: no torch.compile/export, jit.trace, dispatch or
    torch-function mode, functorch transform or autocast region."""
    return (not torch.compiler.is_compiling()
            and not torch._C._is_any_autocast_enabled()
            and not torch._C._get_tracing_state()
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._are_functorch_transforms_active())


def _plain(t) -> bool:
    """A real CPU/CUDA tensor (not fake, functional, meta or another subclass)."""
    return type(t) in _PLAIN and not t.is_meta


def wants_grad(tensors) -> bool:
    """Whether autograd records a call on these (tensors or None)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _direct(tensors) -> bool:
    """Whether an eager call on ``tensors`` may skip the dispatcher."""
    return _eager() and all(_plain(t) for t in tensors)


# autograd.Function.apply without what only functorch transforms need (a pytree pass
# over the arguments to unwrap dead wrappers), which _direct rules out: ~0.3 us an argument.
_FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]


def _function(name, forward, setup_context, backward, lead=False, trail=False):
    """An autograd.Function of ``forward`` with the op's own setup_context / backward.
    With ``lead``, the first argument (a dispatch keyset) is not the op's and gets no
    gradient; with ``trail``, the last (the planned implementation of
    :meth:`Op.call_planned`), so that ``ctx.needs_input_grad`` keeps the op's indices.
    It uses the ``forward(ctx, ...)`` form: with a separate ``setup_context`` autograd
    binds the arguments through ``inspect.signature`` on every call, tens of
    microseconds."""
    first, last = (1 if lead else 0), (1 if trail else 0)

    def fwd(ctx, *args):
        out = forward(*args)
        setup_context(ctx, args[first:len(args) - last], out)
        return out

    def bwd(ctx, *grads):
        return (None,) * first + tuple(backward(ctx, *grads)) + (None,) * last

    cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd),
                                                  "backward": staticmethod(bwd)})
    cls.apply_eager = _FUNCTION_APPLY.__get__(None, cls)
    return cls


def _below_autograd(op):
    """``op`` called again past the autograd keys, as the Autograd kernel's forward."""
    def forward(keyset, *args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)
    return forward


def _run_planned(*args):
    return args[-1](*args[:-1])


def _autocast_key(device_type: str) -> str:
    return "Autocast" + torch._C._dispatch_key_for_device(device_type)


def _autocast_args(args, device_type, policy):
    """The op's autocast rule: in an autocast region of ``device_type``, floating tensors
    on that device other than float64 are cast to ``policy(device_type, *args)`` (None:
    left as they are)."""
    dtype = policy(device_type, *args)
    if dtype is None:
        return args
    return [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
            and a.dtype != torch.float64 and a.device.type == device_type else a
            for a in args]


def _autocast_kernel(op, device_type, policy):
    """The op's Autocast kernel: :func:`_autocast_args`, then the op with autocast off, as
    PyTorch's own ops do."""
    key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _autocast_key(device_type)))

    def kernel(keyset, *args):
        args = _autocast_args(args, device_type, policy)
        with torch._C._ExcludeDispatchKeyGuard(key):
            return op(*args)

    return kernel


def lower_precision(device_type, *args):
    """Autocast policy of PyTorch's matmuls: the region's 16-bit dtype."""
    return torch.get_autocast_dtype(device_type)


class Op:
    """``torch.ops.cupykern.<name>`` (see the module docstring).

    ``impl(*args)`` computes the result for CPU and CUDA tensors; ``fake(*args)`` its
    outputs' metadata; ``setup_context(ctx, inputs, output)`` / ``backward(ctx, *grads)``
    (both or neither) its autograd, as ``torch.library.register_autograd`` takes them.
    An op without backward raises a ValueError when a gradient would be needed, rather
    than returning a result cut off from autograd. ``autocast(device_type, *args)``, if
    given, names the dtype the op computes in inside an autocast region (None: the
    inputs' own), e.g. :func:`lower_precision` as PyTorch's matmuls.
    """

    def __init__(self, schema: str, impl, fake, setup_context=None, backward=None,
                 autocast=None):
        self.name = schema.split("(", 1)[0]
        qualname = f"{NAMESPACE}::{self.name}"
        _LIB.define(schema)
        _LIB.impl(self.name, impl, "CPU")
        _LIB.impl(self.name, impl, "CUDA")
        torch.library.register_fake(qualname, fake, lib=_LIB)
        self.impl, self.autocast = impl, autocast
        self.op = getattr(getattr(torch.ops, NAMESPACE), self.name).default
        if autocast is not None:
            for device_type in ("cpu", "cuda"):
                _LIB.impl(self.name, _autocast_kernel(self.op, device_type, autocast),
                          _autocast_key(device_type), with_keyset=True)
        self.function = self.planned = None
        if backward is None:
            return
        self.function = _function(self.name, impl, setup_context, backward)
        self.planned = _function(self.name, _run_planned, setup_context, backward, trail=True)
        if torch._library.utils.is_functional_schema(self.op._schema):
            torch.library.register_autograd(qualname, backward, setup_context=setup_context,
                                            lib=_LIB)
        else:  # register_autograd takes functional ops only: its own recipe, by hand
            redispatch = _function(self.name, _below_autograd(self.op), setup_context, backward,
                                   lead=True)
            _LIB.impl(self.name, lambda keyset, *args: redispatch.apply(keyset, *args),
                      "Autograd", with_keyset=True)

    def __call__(self, *args):
        direct, grad = _eager(), False
        for a in args:  # one pass: small calls cannot afford three
            if isinstance(a, torch.Tensor):
                grad = grad or a.requires_grad
                direct = direct and _plain(a)
        grad = grad and torch.is_grad_enabled()
        if grad and self.function is None:
            self._no_backward()
        if not direct:
            if self.autocast is not None and torch.compiler.is_compiling():
                # The casts, in the traced graph: Inductor's compiled-graph cache keys on the
                # graph, not on the autocast dtype (the Autocast kernel then casts nothing).
                for device_type in ("cpu", "cuda"):
                    if torch.is_autocast_enabled(device_type):
                        args = _autocast_args(args, device_type, self.autocast)
            return self.op(*args)
        return self.function.apply_eager(*args) if grad else self.impl(*args)

    def call_planned(self, run, grad: bool, *args):
        """``self(*args)`` in plain eager mode (:func:`_direct`), where ``run(*args)`` computes
        what the implementation would (a module's cached launch plan for these arguments),
        with autograd if ``grad`` (a gradient is needed): the call without the checks
        and lookups that chose ``run``."""
        if not grad:
            return run(*args)
        if self.planned is None:
            self._no_backward()
        return self.planned.apply_eager(*args, run)

    def _no_backward(self):
        raise ValueError(f"cupykern.{self.name}: has no backward, and an input requires "
                         "grad; call it under torch.no_grad() or on detached tensors")
