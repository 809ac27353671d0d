"""The one way a cupykern kernel becomes a PyTorch operator.

:class:`Op` defines ``torch.ops.cupykern.<name>`` from a schema, with one Python
implementation for CPU and CUDA tensors (the CPU one computes the reference in
PyTorch ops), a fake (meta) implementation for tracing, and optionally autograd
(``setup_context`` + ``backward``, written in PyTorch ops so that they trace too).

Calling an :class:`Op` goes through the dispatcher whenever something is tracing the call
(torch.compile, torch.export, fake or functional tensors, dispatch modes). Under
torch.func transforms (grad, vjp, jacrev, jvp, jacfwd, vmap) and forward-mode AD an op
with autograd is an ``autograd.Function`` in the form those take (see
:func:`_transformable`). In plain eager
mode it calls the very same
implementation directly (see :func:`_direct`), inside an ``autograd.Function`` made of the very same
``setup_context`` / ``backward`` when a gradient is needed: the dispatcher costs
microseconds a call, which small calls cannot afford.
"""
from __future__ import annotations

import torch

from .._array import operand
from ._compat import (AFTER_AUTOGRAD_KEYSET, FUNCTION_APPLY, AutoDispatchBelowAutograd, DispatchKey,
                      DispatchKeySet, ExcludeDispatchKeyGuard, TransformType,
                      are_functorch_transforms_active, is_functional_schema, maybe_get_level,
                      op_schema, retrieve_current_functorch_interpreter, tree_map)
# Plain eager mode (whose tests are torch internals) and torch.func / forward AD; the
# torch layer's modules import _eager from here.
from ._compat import eager as _eager, transforming as _transforming

NAMESPACE = "cupykern"
_LIB = torch.library.Library(NAMESPACE, "DEF")
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not subclasses: fake, functional, DTensor...


def _plain(t) -> bool:
    """A real CPU/CUDA tensor (not fake, functional, meta or another subclass)."""
    return type(t) in _PLAIN and not t.is_meta


def wants_grad(tensors) -> bool:
    """Whether autograd records a call on these (tensors or None). (A loop, not any() of a
    generator: a third of its host time, on every eager call.)"""
    if torch.is_grad_enabled():
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                return True
    return False


def _direct(tensors) -> bool:
    """Whether an eager call on ``tensors`` may skip the dispatcher."""
    return _eager() and all(_plain(t) for t in tensors)


def _function(name, forward, setup_context, backward, lead=False, trail=False):
    """An autograd.Function of ``forward`` with the op's own setup_context / backward.
    With ``lead``, the first argument (a dispatch keyset) is not the op's and gets no
    gradient; with ``trail``, the last (the planned implementation of
    :meth:`Op.call_planned`, which the backward finds as ``ctx.planned``), so that
    ``ctx.needs_input_grad`` keeps the op's indices. It uses the ``forward(ctx, ...)``
    form: with a separate ``setup_context`` autograd binds the arguments through
    ``inspect.signature`` on every call, tens of microseconds."""
    first, last = (1 if lead else 0), (1 if trail else 0)

    def fwd(ctx, *args):
        out = forward(*args)
        if last:
            ctx.planned = args[-1]
        setup_context(ctx, args[first:len(args) - last], out)
        return out

    def bwd(ctx, *grads):
        return (None,) * first + tuple(backward(ctx, *grads)) + (None,) * last

    cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd),
                                                  "backward": staticmethod(bwd)})
    cls.apply_eager = FUNCTION_APPLY.__get__(None, cls)  # (see _compat)
    return cls


def _transformable(name, op, setup_context, backward, reference, fold):
    """The op as torch.func transforms take it: an ``autograd.Function`` with a separate
    ``setup_context`` (its forward is the op itself, through the dispatcher, with every
    transform peeled off), the op's backward in grad mode (its create_graph branch, made of
    PyTorch ops, so that grad of grad and vmap of grad compose), a ``jvp`` (forward-mode AD of
    ``reference``, the op's computation in PyTorch ops) and a ``vmap`` rule: ``fold(in_dims,
    *args)`` where the batch dimension folds into the op's own (e.g. into its rows), else
    ``reference`` under vmap, which also raises what the reference model raises (e.g.
    BatchNorm's running statistics in training mode)."""
    mutated, returns = _mutated(op), len(op_schema(op).returns)

    def forward(*args):
        return op(*args)

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs, output)
        ctx.primals = inputs  # (for jvp: tensors at the transform's own level)
        y = output[0] if isinstance(output, tuple) else output
        ctx.layout = y.stride()  # (a tangent must be laid out as its primal)

    def jvp(ctx, *tangents):
        args = list(ctx.primals)
        moving = [i for i, t in enumerate(tangents) if isinstance(t, torch.Tensor)]
        # The forward updated the mutated arguments already: the reference updates copies,
        # made inside the nested transform where they have no tangent (it refuses to update
        # a tensor captured from outside it, e.g. num_batches_tracked)
        copied = [i for i in mutated if isinstance(args[i], torch.Tensor)]
        for i in copied:
            if i in moving:
                args[i] = args[i].clone()

        def f(*ts):
            a = list(args)
            for i in copied:
                if i not in moving:
                    a[i] = a[i].clone()
            for i, t in zip(moving, ts):
                a[i] = t
            out = reference(*a)
            return out[0] if isinstance(out, tuple) else out  # (the rest: non-differentiable)

        primals, moved = [args[i] for i in moving], [tangents[i] for i in moving]
        if are_functorch_transforms_active():
            jt = torch.func.jvp(f, tuple(primals), tuple(moved))[1]
        else:  # eager forward AD (cannot nest dual levels): J t = d/du <J^T u, t>
            with torch.enable_grad():
                primals = [p.detach().requires_grad_() for p in primals]
                y = f(*primals)
                u = torch.zeros_like(y, requires_grad=True)
                vjps = torch.autograd.grad(y, primals, u, create_graph=True, allow_unused=True)
                dot = sum((g * t).sum() for g, t in zip(vjps, moved) if g is not None)
                jt = (torch.autograd.grad(dot, u)[0] if isinstance(dot, torch.Tensor)
                      else torch.zeros_like(y))
        if jt.stride() != ctx.layout:
            jt = jt.new_empty_strided(jt.shape, ctx.layout).copy_(jt)
        return (jt,) + (None,) * (returns - 1) if returns > 1 else jt

    def differentiable(ctx, *grads):
        with torch.enable_grad():  # the backward's PyTorch-ops branch: no kernel call (whose
            return backward(ctx, *grads)  # data pointers functorch's wrappers lack)

    def vmap(info, in_dims, *args):
        if fold is not None:
            res = fold(in_dims, *args)
            if res is not None:
                return res
        out = torch.vmap(reference, in_dims=in_dims, randomness=info.randomness)(*args)
        return out, tree_map(lambda _: 0, out)

    return type(name, (torch.autograd.Function,), {
        "generate_vmap_rule": False, "forward": staticmethod(forward),
        "setup_context": staticmethod(setup), "backward": staticmethod(differentiable),
        "jvp": staticmethod(jvp), "vmap": staticmethod(vmap)})


def _mutated(op) -> list:
    """The indices of the arguments ``op`` writes in place."""
    return [i for i, a in enumerate(op_schema(op).arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _check_captured(name, op, captured, args):
    """The RuntimeError PyTorch's in-place ops (e.g. BatchNorm's ``num_batches_tracked += 1``
    in training mode) raise inside a grad or jvp transform when the tensor they would
    update is captured from outside it (not an input of the transformed function), for
    the arguments (indices ``captured``) the op's reference updates that way."""
    interpreter = retrieve_current_functorch_interpreter()
    if interpreter.key() not in (TransformType.Grad, TransformType.Jvp):
        return
    for i in captured:
        t = args[i]
        if isinstance(t, torch.Tensor) and maybe_get_level(t) < interpreter.level():
            raise RuntimeError(
                f"During a grad (vjp, jvp, grad, etc) transform, cupykern.{name} would update "
                f"its argument {op_schema(op).arguments[i].name} in place, a tensor captured from "
                "outside the transform; pass it as an input of the transformed function "
                "(e.g. the module's buffers through torch.func.functional_call), or use "
                "torch.func.replace_all_batch_norm_modules_ or eval mode, as for BatchNorm")


def _wrong_argument(op, args):
    """The TypeError the direct path's checks give, naming the argument, for the first of
    ``args`` of a type ``op``'s schema refuses, or None. On the dispatcher's path its
    parse of the schema comes first, and raises a RuntimeError (a NotImplementedError
    for a sparse tensor, which no kernel is registered for). Types only: the tensors
    may be functorch's wrappers, without storage."""
    spec = op_schema(op).arguments
    for s, a in zip(spec, args):
        kind = str(s.type).removeprefix("Optional[").removesuffix("]")
        if a is None and str(s.type).startswith("Optional["):
            continue
        if kind == "Tensor":
            if isinstance(a, torch.Tensor):
                if a.layout is not torch.strided:
                    return TypeError(f"{s.name}: expected a strided (dense) tensor, got layout "
                                     f"{a.layout}")
                continue
            try:
                operand(a, s.name)  # (its TypeError for what no array is)
            except TypeError as error:
                return error
            return TypeError(f"{s.name}: is a {type(a).__module__}.{type(a).__name__} but "
                             f"{spec[0].name} is a torch tensor; do not mix CPU and GPU or "
                             "CuPy and torch arguments")
        elif kind in _SCALARS and (isinstance(a, bool) or not isinstance(a, _SCALARS[kind][0])):
            return TypeError(f"{s.name}: expected {_SCALARS[kind][1]}, got {type(a).__name__}")
    return None


_SCALARS = {"int": ((int, torch.SymInt), "an int"), "str": (str, "a str"),
            "float": ((int, float, torch.SymFloat), "a real number")}


def _below_autograd(op):
    """``op`` called again past the autograd keys, as the Autograd kernel's forward."""
    def forward(keyset, *args):
        with AutoDispatchBelowAutograd():
            return op.redispatch(keyset & AFTER_AUTOGRAD_KEYSET, *args)
    return forward


def _run_planned(*args):
    return args[-1](*args[:-1])


def _autocast_key(device_type: str) -> str:
    """The Autocast dispatch key of "cpu" / "cuda": AutocastCPU / AutocastCUDA."""
    return "Autocast" + device_type.upper()


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
    key = DispatchKeySet(getattr(DispatchKey, _autocast_key(device_type)))

    def kernel(keyset, *args):
        args = _autocast_args(args, device_type, policy)
        with ExcludeDispatchKeyGuard(key):
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
    inputs' own), e.g. :func:`lower_precision` as PyTorch's matmuls. An op with autograd
    takes ``reference(*args)`` (its result in differentiable, vmappable PyTorch ops) and
    optionally ``fold(in_dims, *args)`` (its vmap rule where the batch folds into the op:
    ``(out, out_dims)``, or None) for torch.func transforms (:func:`_transformable`);
    ``captured`` names the arguments its reference updates by an in-place op, which
    PyTorch refuses on tensors captured from outside a grad/jvp transform
    (:func:`_check_captured`).
    """

    def __init__(self, schema: str, impl, fake, setup_context=None, backward=None,
                 autocast=None, reference=None, fold=None, captured=()):
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
        self.function = self.planned = self.transformable = self.reference = None
        schema_names = [a.name for a in op_schema(self.op).arguments]
        self.captured = [schema_names.index(n) for n in captured]
        if backward is None:
            return
        if reference is None:  # (what torch.func transforms run for jvp and vmap)
            raise TypeError(f"{self.name}: an op with a backward needs its reference")
        self.reference = reference
        self.function = _function(self.name, impl, setup_context, backward)
        self.transformable = _transformable(self.name, self.op, setup_context, backward,
                                            reference, fold)
        self.planned = _function(self.name, _run_planned, setup_context, backward, trail=True)
        if is_functional_schema(op_schema(self.op)):
            torch.library.register_autograd(qualname, backward, setup_context=setup_context,
                                            lib=_LIB)
        else:  # register_autograd takes functional ops only: its own recipe, by hand
            redispatch = _function(self.name, _below_autograd(self.op), setup_context, backward,
                                   lead=True)
            _LIB.impl(self.name, lambda keyset, *args: redispatch.apply(keyset, *args),
                      "Autograd", with_keyset=True)

    def __call__(self, *args):
        direct, grad = _eager(self.autocast is None), False
        for a in args:  # one pass: small calls cannot afford three
            if isinstance(a, torch.Tensor):
                grad = grad or a.requires_grad
                direct = direct and _plain(a)
        grad = grad and torch.is_grad_enabled()
        if grad and self.function is None:
            self._no_backward()
        if not direct:
            try:
                return self._dispatched(args)
            except RuntimeError as error:  # (the dispatcher's parse: named as the checks do)
                wrong = _wrong_argument(self.op, args)
                if wrong is None:
                    raise
                raise wrong from error
        return self.function.apply_eager(*args) if grad else self.impl(*args)

    def _dispatched(self, args):
        """The op through torch's dispatcher (autocast, compile, torch.func, modes)."""
        if self.transformable is not None and _transforming():
            if self.captured and are_functorch_transforms_active():
                _check_captured(self.name, self.op, self.captured, args)
            if torch.compiler.is_compiling():  # Dynamo cannot trace this Function under
                # torch.func (an internal error): the reference's PyTorch ops, which it can
                return self.reference(*args)
            return self.transformable.apply(*args)
        if self.autocast is not None and torch.compiler.is_compiling():
            # The casts, in the traced graph: Inductor's compiled-graph cache keys on the
            # graph, not on the autocast dtype (the Autocast kernel then casts nothing).
            for device_type in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device_type):
                    args = _autocast_args(args, device_type, self.autocast)
        return self.op(*args)

    def call_planned(self, run, grad: bool, *args):
        """``self(*args)`` in plain eager mode (:func:`_direct`), where ``run(*args)`` computes
        what the implementation would (a module's cached launch plan for these arguments),
        with autograd if ``grad`` (a gradient is needed): the call without the checks
        and lookups that chose ``run``. The backward finds ``run`` as ``ctx.planned``."""
        if not grad:
            return run(*args)
        if self.planned is None:
            self._no_backward()
        return self.planned.apply_eager(*args, run)

    def _no_backward(self):
        raise ValueError(f"cupykern.{self.name}: has no backward, and an input requires "
                         "grad; call it under torch.no_grad() or on detached tensors")
