"""MatmulSumMaxMeanLogSumExp for torch: the ``cupykern::matmul_sum_plan`` and
``cupykern::matmul_sum_max_mean_logsumexp`` ops and documented model 4.

``matmul_sum_plan(Tensor weight, Tensor? bias) -> Tensor`` is the float64 plan
[W.sum(0), b.sum(), max|W|, max|b|] (no autograd: pass detached weights);
``matmul_sum_max_mean_logsumexp(Tensor x, Tensor weight, Tensor? bias, Tensor plan)``
reads x (and the weights only for rows that overflow or hold inf/nan) and has autograd
for x, weight and bias.

In eager mode the module caches the plan and rebuilds it whenever the weight or bias
it was built from might have changed: another object (``.weight`` replaced,
``load_state_dict(assign=True)``), a new version counter (any in-place op: optimizer
steps, ``load_state_dict``, ``copy_``, ``mul_``), any optimizer step (fused optimizers
skip the version counter), or another data pointer, device, dtype, shape or strides
(``.to()``, ``.data = ...``). The one change it cannot see is an in-place op through
``.data``, which bypasses the version counter (PyTorch's own saved-tensor checks miss it
too). Under torch.compile / export the plan op is part of the graph and runs every call
(one read of W, still far below PyTorch's GEMM).

N-D x (B, S, ..., in_features), which nn.Linear and so the reference model take, has no
fused kernel (the chain reduces over S, then over dims of size 1: output (B, 1, ...,
out_features), and x @ W.sum(0) + b.sum() does not hold): the module and the function run
the reference chain in torch ops, with its autograd.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..matmul_sum_max_mean_logsumexp import (PLAN_TAIL, apply_cached, build_plan_cached,
                                              check_weights, check_x, planned_run)
from .._array import UNPLANNED, operand, signature
from ._checks import autocast_input, hooked, members, require_submodule, require_tensor
from ._compat import are_functorch_transforms_active, is_any_autocast_enabled
from ._op import _PLAIN, Op, _direct, _eager, wants_grad


def _tail(s: torch.Tensor) -> torch.Tensor:
    """The model after the sum, on (B, 1): max, mean, logsumexp, logsumexp over dim 1."""
    s = torch.max(s, dim=1, keepdim=True)[0]
    s = torch.mean(s, dim=1, keepdim=True)
    s = torch.logsumexp(s, dim=1, keepdim=True)
    return torch.logsumexp(s, dim=1, keepdim=True)


def reference(x, weight, bias=None):
    """The documented model in PyTorch ops."""
    return _tail(torch.sum(nn.functional.linear(x, weight, bias), dim=1, keepdim=True))


def _autocast_result(out):
    """``out`` as the reference model returns it in an autocast region (the caller tests
    is_any_autocast_enabled()): in a CUDA one torch.sum runs in float32, so there the
    model's result is float32 for 16-bit data too (ours: the 16-bit result, as float32)."""
    if (out.dtype in (torch.float16, torch.bfloat16) and out.is_cuda
            and torch.is_autocast_enabled("cuda")):
        return out.float()
    return out


def _plan_impl(weight, bias):
    if weight.is_cuda:
        return build_plan_cached(weight, bias, check_weights)
    check_weights(weight, bias)
    return _plan_reference(weight, bias)


def _plan_reference(weight, bias):
    """The plan in PyTorch ops (what torch.func transforms see: their wrapped tensors
    have no data pointer for the kernel, and a batch of weights gives a batch of plans)."""
    wd = weight.double()
    bd = wd.new_zeros(1) if bias is None else bias.double()
    maxabs = lambda t: t.abs().amax() if t.numel() else t.new_zeros(())  # noqa: E731
    return torch.cat([wd.sum(0), bd.sum().reshape(1), maxabs(wd).reshape(1),
                      maxabs(bd).reshape(1)])


def _plan_fake(weight, bias):
    return weight.new_empty((weight.shape[1] + PLAN_TAIL,), dtype=torch.float64)


def _impl(x, weight, bias, plan):
    if x.is_cuda:
        return apply_cached(x, weight, bias, plan, _check)
    _check(x, weight, bias, plan)
    return reference(x, weight, bias)


def _check(x, weight, bias, plan):
    """Validate the op's arguments: the Operands of x, weight and bias."""
    a = operand(x, "x")
    w, b = check_weights(weight, bias)
    check_x(a, w)
    _check_plan(plan, w)
    return a, w, b


def _check_plan(plan, w) -> None:
    """The plan the kernel reads: float64 [K + PLAN_TAIL], contiguous, beside the weights,
    16-byte aligned (it is read in 16-byte vectors)."""
    if not isinstance(plan, torch.Tensor):
        raise TypeError(f"plan: expected a torch.Tensor, got {type(plan).__name__}")
    want = (w.shape[1] + PLAN_TAIL,)
    if plan.dtype != torch.float64 or tuple(plan.shape) != want or not plan.is_contiguous():
        raise ValueError(f"plan: expected a contiguous float64 tensor of shape {want} from "
                         f"matmul_sum_plan, got {plan.dtype} {tuple(plan.shape)}")
    if plan.device != w.obj.device or plan.data_ptr() % 16:
        raise ValueError(f"plan: must be 16-byte aligned on the weights' device "
                         f"({w.obj.device}), got {plan.device}")


def _fake(x, weight, bias, plan):
    return x.new_empty((x.shape[0], 1))


def _setup_context(ctx, inputs, output):
    x, weight, _, plan = inputs
    # weight is saved for PyTorch's in-place-modification check (as nn.Linear's is).
    ctx.save_for_backward(x, weight, plan, output)


def _backward(ctx, g):
    """With g' = the gradient PyTorch's tail (max, mean, logsumexp x2 over a size-1 dim)
    passes to the sum (g where the output is finite, nan where it is inf or nan), every
    output j gets g', so dx = g' wsum, dW[j] = g'^T x for every j, db[j] = sum(g')."""
    x, weight, plan, out = ctx.saved_tensors
    g = torch.where(torch.isfinite(out), g, torch.full_like(g, float("nan")))
    n, k = weight.shape
    gx = gw = gb = None
    if ctx.needs_input_grad[0]:
        # create_graph=True (double backward, torch.func): wsum from the live weight, so
        # that dx carries its dependence on W (the plan is detached)
        wsum = _wsum(weight) if torch.is_grad_enabled() else plan[:k]
        gx = g * wsum.to(g.dtype)
    if ctx.needs_input_grad[1]:
        gw = (g.t() @ x).expand(n, -1)  # AccumulateGrad materialises it in W's layout
    if ctx.needs_input_grad[2]:
        gb = g.sum(0).expand(n)
    return gx, gw, gb, None


def _wsum(weight):
    """W.sum(0) in PyTorch ops, accumulated as the plan is (float64)."""
    return weight.to(torch.float64).sum(0)


def _fold(in_dims, x, weight, bias, plan):
    """vmap rule where only x is batched: the batch's samples are more rows."""
    if in_dims[1:] != (None, None, None) or x.dim() != 3:
        return None
    xs = x.movedim(in_dims[0], 0)
    v, m, k = xs.shape
    return matmul_sum_op(xs.reshape(v * m, k), weight, bias, plan).reshape(v, m, 1), 0


plan_op = Op("matmul_sum_plan(Tensor weight, Tensor? bias) -> Tensor", _plan_impl, _plan_fake)
matmul_sum_op = Op("matmul_sum_max_mean_logsumexp(Tensor x, Tensor weight, Tensor? bias, "
                   "Tensor plan) -> Tensor", _impl, _fake, _setup_context, _backward,
                   reference=lambda x, weight, bias, plan: reference(x, weight, bias), fold=_fold)


def _detach(t):
    """``t`` detached (the plan has no autograd); anything else as it is, for the op's
    own argument checks to name."""
    return t.detach() if isinstance(t, torch.Tensor) else t


def _plan_of(weight, bias):
    """The plan tensor of these weights, off autograd, outside eager mode."""
    if are_functorch_transforms_active():
        return _plan_reference(_detach(weight), _detach(bias))
    return plan_op(_detach(weight), _detach(bias))


def matmul_sum_max_mean_logsumexp(x, weight, bias=None, *, plan=None):
    """:func:`cupykern.matmul_sum_max_mean_logsumexp` for torch tensors (autograd); builds
    the plan unless a :class:`cupykern.MatmulSumPlan` of these weights is given. N-D x
    (B, S, ..., in_features): the reference chain in torch ops (see the module docstring)."""
    autocast = is_any_autocast_enabled()
    if autocast:  # (x as the reference's Linear takes it)
        x = autocast_input(x, weight)
    nd = isinstance(x, torch.Tensor) and x.dim() > 2
    data = plan.data if plan is not None and plan.data is not None and not nd else None
    if data is None:
        # x and the weights must agree before the weights are read (under torch.func the
        # op checks them, unwrapped: functorch's wrapped tensors have no data pointer)
        if not are_functorch_transforms_active():
            check_x(operand(x, "x"), check_weights(weight, bias)[0], nd=True)
        if nd:
            return reference(x, weight, bias)
        data = _plan_of(weight, bias)
    out = matmul_sum_op(x, weight, bias, data)
    return _autocast_result(out) if autocast else out


# Fused optimizers (e.g. AdamW(fused=True)) update parameters without bumping their
# version counters, so every optimizer step anywhere also invalidates cached plans.
_optimizer_steps = [0]


def _count_step(optimizer, args, kwargs):
    _optimizer_steps[0] += 1


register_optimizer_step_post_hook(_count_step)


def _key(w, b):
    """What a plan of weights ``w`` and bias ``b`` (or None) stays valid for: their
    versions, storage and layout, and the optimizer steps taken."""
    try:
        return (_optimizer_steps[0], w._version, w.data_ptr(), w.dtype, w.get_device(),
                w.shape, w.stride(), None if b is None else
                (b._version, b.data_ptr(), b.dtype, b.get_device(), b.shape, b.stride()))
    except RuntimeError:  # inference tensors have no version counter: never trust a cache
        return object()


class MatmulSumMaxMeanLogSumExpReference(nn.Module):
    """Documented model 4 in plain PyTorch."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = self.linear(x)
        x = torch.sum(x, dim=1, keepdim=True)
        x = torch.max(x, dim=1, keepdim=True)[0]
        x = torch.mean(x, dim=1, keepdim=True)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        return x


class _Cache:
    """A plan of ``linear``'s weights ``w`` / ``b`` (valid while their keys hold) and the
    launch plans of the calls made with it, by x's signature (None: x is copied first)."""

    __slots__ = ("linear", "w", "b", "key", "plan", "keep", "runs")
    RUNS = 64  # x signatures kept at most

    def __init__(self, linear, w, b, plan, keep):
        self.linear, self.w, self.b, self.plan, self.keep = linear, w, b, plan, keep
        self.key, self.runs = _key(w, b), {}


class MatmulSumMaxMeanLogSumExp(MatmulSumMaxMeanLogSumExpReference):
    """``logsumexp(logsumexp(mean(max(sum(linear(x), 1)))))`` over dim 1, keepdim.

    Same parameters (``linear.weight``, ``linear.bias``), RNG order and state_dict as the
    documented model. CUDA inputs run on cupykern with a plan of the weights (cached in
    eager mode, never stale: see the module docstring); CPU inputs, N-D x (B, S, ...,
    in_features: output (B, 1, ..., out_features), as the reference gives) and any call
    while ``linear`` has hooks (pruning, weight norm, probes), run the reference.
    """

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self._cache = None  # a _Cache, in eager mode

    def plan(self) -> torch.Tensor:
        """The plan tensor for the current weights (rebuilt if they changed since the last)."""
        linear = self.linear
        return self._plan(linear, linear.weight, linear.bias)

    def _plan(self, linear, w, b):
        c = self._cache
        if (c is not None and c.linear is linear and c.w is w and c.b is b
                and c.key == _key(w, b)):
            return c.plan
        wd, bd = w.detach(), _detach(b)
        # The detached views keep the old storage alive while cached, so that new data
        # (``.data = ...``) can never reuse the cached data pointer.
        self._cache = _Cache(linear, w, b, plan_op(wd, bd), (wd, bd))
        return self._cache.plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._planned_call(x)  # (None in an autocast region)
        if out is not None:
            return out
        require_tensor(x)
        autocast = is_any_autocast_enabled()
        if autocast:  # (x as the reference's Linear takes it)
            x = autocast_input(x, getattr(self.linear, "weight", None))
        (linear,) = members(self, MatmulSumMaxMeanLogSumExp, ("linear",))
        w, b = members(linear, nn.Linear, ("weight", "bias"))
        if not (x.is_cuda or w.is_cuda) or hooked(linear):  # the reference model itself
            if x.device.type == "cpu":  # (meta tensors: shapes only)
                check_x(operand(x, "x"), operand(w, "weight"), nd=True)
            return super().forward(x)
        require_submodule(self, "linear", nn.Linear, linear)
        if x.dim() > 2:  # no fused kernel: the reference chain, its autograd
            if _direct((x, w)):
                check_x(operand(x, "x"), operand(w, "weight"), nd=True)
            return super().forward(x)
        plan = self._plan(linear, w, b) if _direct((x, w)) else _plan_of(w, b)
        out = matmul_sum_op(x, w, b, plan)
        return _autocast_result(out) if autocast else out

    def _planned_call(self, x):
        """What :meth:`forward` returns, from the cache alone: in plain eager mode, while
        ``linear`` and its weights are those of the cached plan (not changed since, no
        hooks), for x like an earlier call's. None where the checks must run (a tenth of
        the host time of a call that is a few microseconds of GPU work)."""
        c = self._cache
        # (exact type: a subclass's property could stand for linear)
        if (c is None or type(self) is not MatmulSumMaxMeanLogSumExp or type(x) not in _PLAIN
                or not x.is_cuda or not _eager()):
            return None
        linear = self.__dict__["_modules"].get("linear")
        if linear is not c.linear or type(linear) is not nn.Linear or hooked(linear):
            return None
        params = linear.__dict__["_parameters"]
        w, b = params.get("weight"), params.get("bias")
        if w is not c.w or b is not c.b or _key(w, b) != c.key:
            return None
        sx = signature(x)
        run = c.runs.get(sx, c)
        if run is c:  # x's first call like this: validated (errors as forward's)
            if sx is UNPLANNED or type(w) not in _PLAIN or not (b is None or type(b) in _PLAIN):
                return None
            # (N-D x: forward's reference chain, its None cached like a copying call's)
            run = planned_run(x, w, b, c.plan, _check)[0] if x.dim() == 2 else None
            if len(c.runs) >= c.RUNS:
                c.runs.clear()
            c.runs[sx] = run
        if run is None:
            return None
        return matmul_sum_op.call_planned(run, wants_grad((x, w, b)), x, w, b, c.plan)

    def _apply(self, fn, *args, **kwargs):  # .to() / .cuda() / .half(): free the old plan now
        self._cache = None
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):  # copies and pickles do not carry the GPU cache
        state = self.__dict__.copy()
        state["_cache"] = None
        return state
