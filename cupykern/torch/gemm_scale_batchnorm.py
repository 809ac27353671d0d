"""GemmScaleBatchNorm for torch: the ``cupykern::gemm_scale_batchnorm`` op and documented
model 3, ``bn(gemm(x) * scale)``.

The op updates ``running_mean`` / ``running_var`` / ``num_batches_tracked`` in place in
training mode (declared mutable in its schema) and has autograd: gradients for x,
weight, bias, scale, bn weight and bn bias. On the GPU, when a gradient is wanted, the
forward also returns z = x @ W.T and per-column coefficients (``save``), and the
backward is ``cupykern::gemm_scale_batchnorm_backward``: bandwidth passes (one launch for
a small batch, else three) and two GEMMs at the forward's precision, in either mode (in
eval mode BatchNorm is a per-column affine map: the passes are two column sums and dz =
ca * g). Elsewhere
(CPU, double backward) the backward is written in PyTorch ops and recomputes the GEMM.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..gemm_scale_batchnorm import (Affine, BatchNormState, apply_coefficients,
                                    batch_size_error, check, check_inputs, check_options,
                                    check_real, gemm_scale_batchnorm_core, gemm_statistics,
                                    planned_run)
from ..gemm_scale_batchnorm_backward import backward, backward_run_after, grad_dz, grad_partials
from torch.autograd.function import once_differentiable

from ._checks import autocast_input, hooked, members, require_submodule, require_tensor
from ._compat import (are_functorch_transforms_active, is_any_autocast_enabled,
                      top_saved_tensors_hooks)
from .._stats import merge_moments
from ._distributed import gather, moments, sum_in_order, world_size
from ._op import _PLAIN, Op, _direct, _eager, wants_grad
from .gemm import linear_op, mm_op, resolve_precision

_PARAMS = ("Tensor x, Tensor weight, Tensor? bias, Tensor scale, Tensor? bn_weight, "
           "Tensor? bn_bias")
# Outputs: out, and with ``save`` z (B, N) and coefs (4, N) for the fused backward
# (empty otherwise).
_RETURNS = "(Tensor, Tensor, Tensor)"
_SCHEMA = (f"gemm_scale_batchnorm({_PARAMS}, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
           "Tensor(c!)? num_batches_tracked, bool training, float? momentum, float eps, "
           f"str precision, bool save) -> {_RETURNS}")
# Training without running statistics mutates nothing: a functional op of its own
# (Inductor cannot lower the mutating op when every buffer it may mutate is None).
_BATCH_STATS_SCHEMA = (f"gemm_scale_batchnorm_batch_stats({_PARAMS}, float eps, str precision, "
                       f"bool save) -> {_RETURNS}")
# Gradients: x's and weight's (empty unless input_grad / weight_grad), and one (4, N)
# tensor of bias's, scale's, bn_weight's and bn_bias's (outputs of an op must not alias).
_BACKWARD_SCHEMA = ("gemm_scale_batchnorm_backward(Tensor g, Tensor z, Tensor coefs, Tensor x, "
                    "Tensor weight, Tensor? bias, Tensor scale, Tensor? bn_weight, "
                    "Tensor? running_mean, bool training, float eps, str precision, "
                    "bool input_grad, bool weight_grad) -> (Tensor, Tensor, Tensor)")


def _acc(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _impl(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt, training, momentum, eps,
          precision, save):
    if x.is_cuda:
        res = gemm_scale_batchnorm_core(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt,
                                        training, momentum, eps, precision, save)
        return res if save else (res, x.new_empty(0), x.new_empty(0, dtype=_acc(x)))
    if save:
        raise ValueError("save: the fused backward runs on CUDA tensors only")
    check(x, weight, Affine(bias, scale, gamma, beta),
          BatchNormState(rmean, rvar, nbt, training, momentum, eps), precision)
    return _reference(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt, training, momentum,
                      eps, precision, save)


def _reference(x, weight, bias, scale, gamma, beta, rmean, rvar, nbt, training, momentum, eps,
               precision, save):
    """The op in PyTorch ops (its CPU implementation, and its jvp and vmap under torch.func:
    there F.batch_norm raises as BatchNorm does for unbatched running statistics; and
    under torch.compile inside a transform, where the op's own checks do not run: the
    scalar options are checked here, and a float32 product follows torch's precision)."""
    training = bool(training)  # (check() takes NumPy's bool too; F.batch_norm does not)
    momentum, eps = check_options(training, momentum, eps)
    y = F.linear(x, weight, bias) * scale
    if training and nbt is not None:  # (before batch_norm, as nn.BatchNorm1d counts: under
        nbt.add_(1)  # vmap both count, then batch_norm refuses unbatched statistics)
    f = momentum
    if momentum is None:  # cumulative average; unused in eval, but F.batch_norm wants a float
        f = 1.0 / float(nbt) if training and nbt is not None else 0.0
    # (torch.batch_norm, F.batch_norm's op: check()'s rule for eps, not the Python
    # check that F.batch_norm has from torch 2.10)
    out = torch.batch_norm(y, gamma, beta, rmean, rvar, training, f, eps,
                           torch.backends.cudnn.enabled)
    return out, x.new_empty(0), x.new_empty(0, dtype=_acc(x))


def _fake(x, weight, *args):
    m, n, save = x.shape[0], weight.shape[0], args[-1]
    return (x.new_empty((m, n)), x.new_empty((m, n) if save else (0,)),
            x.new_empty((4, n) if save else (0,), dtype=_acc(x)))


def _setup_context(ctx, inputs, output):
    x, weight, bias, scale, gamma, beta, rmean, rvar, _, training, _, eps, precision, save = inputs
    ctx.training, ctx.eps, ctx.precision, ctx.save = training, eps, precision, save
    ctx.mark_non_differentiable(*output[1:])
    # No zero-filled (B, N) and (4, N) gradients for z and coefs (two allocations and
    # fills a step): _backward never reads them.
    ctx.set_materialize_grads(False)
    # Which of x, weight, bias, scale, gamma, beta want a gradient (read from the inputs:
    # ctx.needs_input_grad also counts the dispatch keyset of the Autograd kernel).
    ctx.wants = tuple(isinstance(t, torch.Tensor) and t.requires_grad
                      for t in (x, weight, bias, scale, gamma, beta))
    saved = _saved(inputs, output)
    ctx.save_for_backward(*saved)
    planned = ctx.__dict__.get("planned")  # (a module's planned forward: see _PlannedForward)
    if planned is not None:
        planned.keep(saved)


def _saved(inputs, output):
    """What the op keeps for its backward: x, weight, bias, scale, bn_weight, with ``save``
    z and coefs, and in eval mode running_mean and running_var (None where not kept)."""
    x, weight, bias, scale, gamma, _, rmean, rvar, _, training, *_, save = inputs
    kept = output[1:] if save else (None, None)  # z, coefs
    return (x, weight, bias, scale, gamma, *kept, *((None, None) if training else (rmean, rvar)))


class _PlannedForward:
    """A module's planned forward with ``save`` as :meth:`Op.call_planned` takes it
    (``self(*args)``: its outputs), and what its backward plans from (``ctx.planned``):
    the forward's launch plan, and the arrays the op saves for the backward with their
    data pointers (:meth:`keep`), unless saved-tensor hooks (e.g.
    torch.autograd.graph.save_on_cpu, which moves them off the GPU) are in force or torch
    cannot say (before 2.8). Where
    the backward gets these very objects back on the same storage, the forward's plan
    fixes their signatures (:func:`backward_run_after`). (An earlier form trusted g's
    signature alone: save_on_cpu gave x back in another layout, which it read with the
    old row stride.)"""
    __slots__ = ("outputs", "plan", "saved", "pointers")

    def __init__(self, outputs, plan):
        self.outputs, self.plan = outputs, plan
        self.saved = self.pointers = None

    def keep(self, saved):
        """From the op's setup_context: ``saved``, what it saves for the backward."""
        hooks = top_saved_tensors_hooks
        if hooks is not None and hooks(False) is None:
            self.saved = saved
            self.pointers = tuple(0 if t is None else t.data_ptr() for t in saved)

    def __call__(self, *_):
        outputs, self.outputs = self.outputs, None  # (out's node holds this: no cycle)
        return outputs

    def backward_run(self, saved, arrays, options):
        """:func:`backward_run_after`'s plan for the backward's ``arrays`` and ``options``
        where ``saved`` (``ctx.saved_tensors``) are the very arrays this forward saved,
        on the storage they had, else None. (A hook on the node's own saved tensors gives
        other objects back; an assignment to ``.data``, e.g. Module.half() or .to(), keeps
        the object and moves it to other storage: both take the general lookup.)"""
        kept = self.saved
        if kept is None:
            return None
        for a, b, p in zip(saved, kept, self.pointers):
            if a is not b or (a is not None and a.data_ptr() != p):
                return None
        return backward_run_after(self.plan, arrays, options)


def _backward(ctx, g, *_):
    # A module's planned forward (it holds the saved arrays, which autograd frees after
    # this backward unless asked to retain them: a second backward takes the general path)
    planned = ctx.__dict__.pop("planned", None)
    if g is None:  # no gradient reached out (z and coefs are not differentiable)
        return (None,) * 14
    saved = ctx.saved_tensors
    x, weight, bias, scale, gamma, z, coefs, rmean, rvar = saved
    want = ctx.wants
    if ctx.save and not torch.is_grad_enabled():  # (double backward: the PyTorch ops below)
        arrays = (g, z, coefs, x, weight, bias, scale, gamma, rmean)
        options = (ctx.training, ctx.eps, ctx.precision, want[0], want[1])
        if _direct((g, x, weight)):
            # In plain eager mode straight to the implementation, as the op's own entry
            # would go after checking each of its 14 arguments (~10 us of a small step's
            # host time); after a module's planned forward, by that forward's plan. The
            # general lookup reads every saved array's signature: saved-tensor hooks may
            # give them back in another layout.
            run = planned and planned.backward_run(saved, arrays, options)
            dx, dw, dvec = run(*arrays) if run else backward(*arrays, *options)
        else:
            dx, dw, dvec = backward_op(*arrays, *options)
        grads = (dx, dw, *dvec.unbind(0))  # (the vector gradients share dvec's storage)
        return tuple(t if w else None for t, w in zip(grads, want)) + (None,) * 8
    affine = Affine(bias, scale, gamma, None)  # (bn_bias's gradient needs no bn_bias)
    state = BatchNormState(rmean, rvar, None, ctx.training, None, ctx.eps)
    if not ctx.training and not torch.is_grad_enabled():
        return _grad_eval(ctx, g, x, weight, affine, state)
    return _grad_reference(ctx, g, x, weight, affine, state)


def _grad_eval(ctx, g, x, weight, affine, state):
    """Eval-mode gradients off the GPU's fused backward, from z = x @ W.T recomputed.
    BatchNorm is then a per-column affine map, out = c (s (z + b) - rm) + beta
    with c = gamma / sqrt(rv + eps), so with S1 = sum_m g and S2 = sum_m g z:
    dz = c s g, dx = dz @ W, dW = dz^T @ x (at the forward's precision),
    d bias = c s S1, d scale = c (S2 + b S1), d gamma = (s (S2 + b S1) - rm S1) /
    sqrt(rv + eps), d beta = S1."""
    want, dt, acc = ctx.wants, x.dtype, _acc(x)
    bias, scale, gamma, _ = affine
    z = F.linear(x, weight)
    inv = torch.rsqrt(state.running_var.to(acc) + state.eps)
    c = inv if gamma is None else inv * gamma.to(acc)
    s = scale.to(acc)
    ga = g.to(acc)
    s1 = ga.sum(0)
    s2b = (ga * z.to(acc)).sum(0)
    if bias is not None:
        s2b = s2b + bias.to(acc) * s1
    dz = (ga * (c * s)).to(dt)
    grads = (mm_op(dz, weight, ctx.precision) if want[0] else None,
             mm_op(dz.t(), x, ctx.precision) if want[1] else None,
             c * s * s1 if want[2] else None, c * s2b if want[3] else None,
             inv * (s * s2b - state.running_mean.to(acc) * s1) if want[4] else None,
             s1 if want[5] else None)
    return tuple(None if t is None else t.to(dt) for t in grads) + (None,) * 8


def _grad_reference(ctx, g, x, weight, affine, state):
    """The gradients in PyTorch ops (recomputing the GEMM), differentiable."""
    bias, scale, gamma, _ = affine
    dt = x.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    up = lambda t: None if t is None else t.to(acc)  # noqa: E731
    xa, wa, sa, ga = up(x), up(weight), up(scale), g.to(acc)
    z = F.linear(xa, wa, up(bias))
    y = z * sa
    if state.training:
        mean, var = y.mean(0), y.var(0, unbiased=False)
    else:
        mean, var = up(state.running_mean), up(state.running_var)
    inv = torch.rsqrt(var + state.eps)
    yhat = (y - mean) * inv
    dyhat = ga if gamma is None else ga * up(gamma)
    if state.training:
        dy = inv * (dyhat - dyhat.mean(0) - yhat * (dyhat * yhat).mean(0))
    else:
        dy = dyhat * inv
    dz = dy * sa
    want = ctx.wants
    grads = (dz @ wa if want[0] else None, dz.t() @ xa if want[1] else None,
             dz.sum(0) if want[2] else None, (dy * z).sum(0) if want[3] else None,
             (ga * yhat).sum(0) if want[4] else None, ga.sum(0) if want[5] else None)
    return tuple(None if t is None else t.to(dt) for t in grads) + (None,) * 8


def _full(args):
    """The batch-statistics op's arguments as the stateful op's (no buffers, training)."""
    *params, eps, precision, save = args
    return (*params, None, None, None, True, None, eps, precision, save)


def _backward_impl(g, z, coefs, x, weight, bias, scale, gamma, rmean, training, eps, precision,
                   input_grad, weight_grad):
    if g.is_cuda:
        dx, dw, dvec = backward(g, z, coefs, x, weight, bias, scale, gamma, rmean, training, eps,
                                precision, input_grad, weight_grad)
        return x.new_empty(0) if dx is None else dx, x.new_empty(0) if dw is None else dw, dvec
    return _grad_closed_form(g, z, coefs, x, weight, Affine(bias, scale, gamma, None),
                             BatchNormState(rmean, training=training, eps=eps), input_grad,
                             weight_grad)


def _grad_closed_form(g, z, coefs, x, weight, affine, state, input_grad, weight_grad):
    """The fused backward's formulas in PyTorch ops (its CPU implementation: what opcheck
    and the CPU tests check the kernels' algebra against;
    kernels_cu/gemm_scale_batchnorm_backward.cu derives them), in ``state``'s mode
    (training, eps; running_mean in eval mode)."""
    bias, scale, gamma, _ = affine
    training, eps = state.training, state.eps
    acc = coefs.dtype
    ga, za = g.to(acc), z.to(acc)
    ca, cm, _, inv = coefs
    s = scale.to(acc)
    gm = torch.ones_like(s) if gamma is None else gamma.to(acc)
    s1, s2 = ga.sum(0), (ga * (za - cm)).sum(0)
    if training:
        w, m = s * inv, z.shape[0]
        dz = ((w * gm) * (ga - s1 / m - (w * w * s2 / m) * (za - cm))).to(x.dtype)
        dvec = torch.stack([torch.zeros_like(s1), gm * eps * inv ** 3 * s2, w * s2, s1])
    else:  # (cm = 0: s2 = sum g z)
        s2b = s2 if bias is None else s2 + bias.to(acc) * s1
        dz = (ga * ca).to(x.dtype)
        dvec = torch.stack([ca * s1, gm * inv * s2b,
                            inv * (s * s2b - state.running_mean.to(acc) * s1), s1])
    dx = dz @ weight if input_grad else x.new_empty(0)
    dw = dz.t() @ x if weight_grad else x.new_empty(0)
    return dx, dw, dvec.to(x.dtype)


def _backward_fake(g, z, coefs, x, weight, *args):
    input_grad, weight_grad = args[-2:]
    n = weight.shape[0]
    return (x.new_empty(x.shape if input_grad else (0,)),
            weight.new_empty(weight.shape if weight_grad else (0,)),
            x.new_empty((4, n)))


def _fold(in_dims, x, *args):
    """vmap rule in eval mode (a per-row map) where only x is batched: more rows."""
    training, save = args[8], args[-1]
    if training or save or x.dim() != 3 or any(d is not None for d in in_dims[1:]):
        return None
    xs = x.movedim(in_dims[0], 0)
    v, m, k = xs.shape
    out, z, coefs = gemm_scale_batchnorm_op(xs.reshape(v * m, k), *args)
    return (out.reshape(v, m, -1), z, coefs), (0, None, None)


gemm_scale_batchnorm_op = Op(_SCHEMA, _impl, _fake, _setup_context, _backward,
                             reference=_reference, fold=_fold, captured=("num_batches_tracked",))
batch_stats_op = Op(_BATCH_STATS_SCHEMA, lambda *a: _impl(*_full(a)), _fake,
                    lambda ctx, inputs, output: _setup_context(ctx, _full(inputs), output),
                    lambda ctx, g, *_: _backward(ctx, g)[:6] + (None, None, None),
                    reference=lambda *a: _reference(*_full(a)))
backward_op = Op(_BACKWARD_SCHEMA, _backward_impl, _backward_fake)


def gemm_scale_batchnorm(x, weight, bias, scale, bn_weight, bn_bias, running_mean=None,
                         running_var=None, num_batches_tracked=None, *, training=True,
                         momentum=0.1, eps=1e-5, precision=None):
    """:func:`cupykern.gemm_scale_batchnorm` for torch tensors, through the custom op."""
    if type(training) is not bool and not isinstance(training, np.bool_):  # (before its truth)
        raise TypeError(f"training: expected a bool, got {type(training).__name__}")
    if is_any_autocast_enabled():  # (x as the reference's Linear takes it)
        x = autocast_input(x, weight)
    if (training and isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == 1
            and isinstance(weight, torch.Tensor) and weight.dim() == 2):
        raise batch_size_error(torch.Size([x.shape[0], weight.shape[0]]))
    # The fused backward needs z and the coefficients: kept when a gradient will be asked for.
    save = (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() == 2 and x.shape[0] > 0
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] > 0
            and wants_grad((x, weight, bias, scale, bn_weight, bn_bias))
            and not are_functorch_transforms_active())  # (its backward: PyTorch ops)
    if precision is None and _autocast_vendor(x, weight):
        check(x, weight, Affine(bias, scale, bn_weight, bn_bias), BatchNormState(
            running_mean, running_var, num_batches_tracked, training, momentum, eps),
            None)  # (as the op would)
        return _reference(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                          num_batches_tracked, training, momentum, eps, None, False)[0]
    op, args = _op_call(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
                        num_batches_tracked, training, momentum, eps, resolve_precision(precision),
                        save)
    return op(*args)[0]


# The dispatcher's one rule for torch's autocast. In a CUDA float16 / bfloat16 autocast
# region PyTorch's Linear runs in that dtype on cuBLAS, at twice the TF32 rate of our
# fused GEMM (which keeps float32 data: resolve_precision). Where that GEMM dominates,
# the reference composition itself (F.linear in the region's dtype, BatchNorm in float32:
# PyTorch's result exactly) is faster. H200, bf16 autocast, ours against eager, forward
# / training step: 1024x8192->8192 (2**36 multiply-adds) 0.71x / 0.99x, 16384x4096->4096
# (2**38) 0.78x / 0.81x; ours from 2**33 down: 2048x2048->2048 1.00x / 1.19x,
# 8192x1024->1024 1.01x / 1.24x, 256x4096->4096 (2**32) 0.96x / 1.02x, 128x1024->512
# 1.09x / 1.09x (one run each; no shape between 2**33 and 2**36 measured).
AUTOCAST_VENDOR_WORK = 2 ** 35


def _autocast_vendor(x, weight) -> bool:
    """Whether a call on float32 CUDA ``x`` (B, K) and ``weight`` (N, K) in a 16-bit CUDA
    autocast region runs as the reference composition (AUTOCAST_VENDOR_WORK)."""
    return (is_any_autocast_enabled() and torch.is_autocast_enabled("cuda")
            and isinstance(x, torch.Tensor) and x.is_cuda and x.dtype == torch.float32
            and x.dim() == 2 and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and x.shape[0] * x.shape[1] * weight.shape[0] >= AUTOCAST_VENDOR_WORK
            and torch.get_autocast_dtype("cuda") in (torch.float16, torch.bfloat16))


def _op_call(x, weight, bias, scale, bn_weight, bn_bias, running_mean, running_var,
             num_batches_tracked, training, momentum, eps, precision, save):
    """``(op, arguments)``: the batch-statistics op where training has no buffers to
    update, else the stateful one."""
    if training and running_mean is None and running_var is None and num_batches_tracked is None:
        if momentum is not None:  # unused without buffers, but checked as the stateful op does
            check_real(momentum, "momentum")
        return batch_stats_op, (x, weight, bias, scale, bn_weight, bn_bias, eps, precision, save)
    return gemm_scale_batchnorm_op, (x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                                     running_var, num_batches_tracked, training, momentum, eps,
                                     precision, save)


class _Synchronized(torch.autograd.Function):
    """Training-mode gemm_scale_batchnorm with batch statistics over the processes of a
    group, as nn.SyncBatchNorm computes them. Forward: z + b = x @ W.T + b on our GEMM
    (F.linear on the CPU); this rank's per-column (count, mean, M2) of z + b (one read);
    one all_gather and their merge in rank order; y = (z + b) * scale has mean s * mean
    and variance s^2 * var; out = a * u + beta with u = z + b - mean and a = gamma * s *
    invstd (two passes). Backward: the column sums of g and g * u, gathered the same way,
    make dz = a * g + k0 + k1 * u (two passes), then our two GEMMs; every vector gradient
    follows from those sums and the forward's moments (no pass). Gradients of the
    parameters are this rank's own, as SyncBatchNorm's (DDP averages them); the vector
    algebra runs in float64."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale, gamma, beta, rmean, rvar, nbt, momentum, eps,
                precision, group):
        acc, n = _acc(x), weight.shape[0]
        # z, and the moments and extremes of z + b (center: the mean z is taken about)
        z, local, extremes, offset = _forward_statistics(x, weight, bias, precision)
        parts = gather(torch.cat([local, extremes]), group)
        count, mean, m2 = merge_moments([p[:2 * n + 1] for p in parts])
        lo = torch.stack([p[2 * n + 1:3 * n + 1] for p in parts]).amin(0)
        hi = torch.stack([p[3 * n + 1:] for p in parts]).amax(0)
        # All rows are one or none only if every rank holds at most one: then all of them
        # (and only they) read the count and raise together, after the gather.
        if len(x) <= 1 and count.item() <= 1:
            raise batch_size_error(torch.Size([int(count.item()), n]))
        s = scale.double()
        mean_y, var = _overflowed(s * mean, s * s * m2 / count, lo, hi, scale)
        if rmean is not None:  # nn.BatchNorm1d's update, with the unbiased variance of all rows
            if nbt is not None:
                nbt.add_(1)
            f = momentum if momentum is not None else 1.0 / float(nbt)
            rmean.copy_(rmean * (1 - f) + mean_y.to(rmean.dtype) * f)
            rvar.copy_(rvar * (1 - f) + (var * count / (count - 1)).to(rvar.dtype) * f)
        invstd = torch.rsqrt(var + eps)
        a = s * invstd if gamma is None else gamma.double() * s * invstd
        cb = torch.zeros_like(a) if beta is None else beta.double()
        center = mean - offset  # u = z + b - mean = z - center
        out = _apply(z, *(v.to(acc) for v in (a, center, cb)))
        ctx.precision, ctx.group = precision, group
        ctx.save_for_backward(x, weight, scale, gamma, z, mean, center, invstd, a, count, local)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, weight, scale, gamma, z, mean, center, invstd, a, count, local = ctx.saved_tensors
        want, dt = ctx.needs_input_grad, x.dtype
        l1, l2 = _column_sums(g, z, center)  # this rank's: sum g, sum g u (u = z + b - mean)
        s = scale.double()
        n_l, m_l = local[0], local[1:len(s) + 1]  # this rank's count and mean of z + b
        su = n_l * (m_l - mean)  # sum u over this rank's rows
        suu = local[len(s) + 1:] + n_l * (m_l - mean) ** 2  # sum u^2
        dx = dw = db = ds = None
        if any(want[:4]):  # (the same on every rank: each joins the gather)
            s1, s2 = sum_in_order(gather(torch.stack([l1, l2]), ctx.group))
            # dy (of y = (z + b) s) = p g + q0 + q1 u, with p = gamma invstd
            p = invstd if gamma is None else gamma.double() * invstd
            k = torch.stack([a, s1 / count, s * s * invstd * invstd * s2 / count])
            d = _dz(g, z, k, center)  # = a g + s (q0 + q1 u), with q0, q1 below
            q0, q1 = -p * k[1], -p * k[2]
            if want[0]:
                dx = mm_op(d, weight, ctx.precision) if len(d) else torch.zeros_like(x)
            if want[1]:
                dw = mm_op(d.t(), x, ctx.precision) if len(d) else torch.zeros_like(weight)
            sdy = p * l1 + q0 * n_l + q1 * su  # sum dy over this rank's rows
            db = (s * sdy).to(dt) if want[2] else None
            # sum dy (z + b) = sum dy u + mean sum dy
            ds = (p * l2 + q0 * su + q1 * suu + mean * sdy).to(dt) if want[3] else None
        dgamma = (s * invstd * l2).to(dt) if want[4] else None
        dbeta = l1.to(dt) if want[5] else None
        return (dx, dw, db, ds, dgamma, dbeta) + (None,) * 7


def _overflowed(mean_y, var, lo, hi, scale):
    """y's batch (mean, variance) as the reference finds them: it forms y = scale * (z + b)
    in the parameters' dtype, so where that overflows in some row (checked at the
    column's extreme z + b, y being monotonic in it) the mean is +-inf (nan for both
    signs) and the variance nan, as the single-process kernel has it too."""
    sa = scale.to(_acc(scale))
    ends = [(sa * v.to(sa.dtype)).to(scale.dtype) for v in (lo, hi)]
    up = torch.isposinf(ends[0]) | torch.isposinf(ends[1])
    down = torch.isneginf(ends[0]) | torch.isneginf(ends[1])
    inf, nan = float("inf"), float("nan")
    mean_y = torch.where(up, inf, torch.where(down, -inf, mean_y))
    return torch.where(up & down, nan, mean_y), torch.where(up | down, nan, var)


# The synchronized path's passes over (B, N): our kernels on CUDA, PyTorch ops on the CPU
# (and for an empty batch). z in x's dtype (on CUDA x @ W.T, elsewhere with the bias);
# vectors in its accumulation type (apply) or float64.

def _forward_statistics(x, weight, bias, precision):
    """``(z, moments, extremes, offset)``: z (x @ W.T + offset), this rank's [count,
    mean, M2] and [min, max] of z + b (float64), offset b or 0. On CUDA the GEMM's
    epilogue gives them per row tile (merged here); elsewhere a pass over z + b."""
    n = weight.shape[0]
    if not (x.is_cuda and len(x) and n):
        zb = linear_op(x, weight, bias, precision)
        return (zb, *moments(zb.to(_acc(zb))), 0)
    z, part, bm = gemm_statistics(x, weight, precision)
    p = part.double()
    counts = torch.full((len(p), 1), float(bm), dtype=torch.float64, device=p.device)
    counts[-1] = len(x) - bm * (len(p) - 1)
    b = torch.zeros(n, dtype=torch.float64, device=p.device) if bias is None else bias.double()
    mean_z = (counts * p[:, 0]).sum(0) / len(x)
    m2 = (p[:, 1] + counts * (p[:, 0] - mean_z) ** 2).sum(0)
    local = torch.cat([m2.new_full((1,), float(len(x))), mean_z + b, m2])
    return z, local, torch.cat([p[:, 2].amin(0) + b, p[:, 3].amax(0) + b]), b


def _apply(z, ca, cm, cb):
    """out = ca * (z - cm) + cb, column by column, in z's dtype."""
    if z.is_cuda and z.numel():
        return apply_coefficients(z, ca, cm, cb)
    return torch.addcmul(cb, z.to(ca.dtype) - cm, ca).to(z.dtype)


def _column_sums(g, z, center):
    """float64 (sum g, sum g (z - center)) over the rows."""
    if z.is_cuda and z.numel():
        return grad_partials(g, z, center.to(_acc(z))).double().sum(0)
    acc = _acc(z)
    ga = g.to(acc)
    return ga.sum(0).double(), (ga * (z.to(acc) - center.to(acc))).sum(0).double()


def _dz(g, z, k, center):
    """k[0] * (g - k[1] - k[2] * (z - center)) in z's dtype (k: (3, N) float64)."""
    acc = _acc(z)
    if z.is_cuda and z.numel():
        return grad_dz(g, z, k.to(acc), center.to(acc))
    k0, k1, k2 = k.to(acc)
    return (k0 * (g.to(acc) - k1 - k2 * (z.to(acc) - center.to(acc)))).to(z.dtype)


@torch.compiler.disable  # (collectives in an autograd.Function: a graph break, not a crash)
def synchronized(x, weight, bias, scale, bn_weight, bn_bias, running_mean=None,
                 running_var=None, num_batches_tracked=None, *, momentum=0.1, eps=1e-5,
                 precision=None, process_group=None):
    """Training-mode :func:`gemm_scale_batchnorm` whose batch statistics are those of the
    rows of every process of ``process_group`` (None: the default group), as
    nn.SyncBatchNorm's: one all_gather of per-column moments forward, one of two column
    sums backward (torch.distributed must be initialized; any backend). A process may
    hold any number of rows, none included. The running statistics are updated with the
    statistics of all rows, identically on every rank."""
    if are_functorch_transforms_active():  # (its autograd.Function is eager-only)
        raise RuntimeError("synchronized batch statistics (SyncBatchNorm over several "
                           "processes) do not run under torch.func transforms")
    prec = resolve_precision(precision)
    xo = check(x, weight, Affine(bias, scale, bn_weight, bn_bias),
               BatchNormState(running_mean, running_var, num_batches_tracked, True, momentum,
                              eps), prec, synchronized=True)[0]
    if not xo.torch:
        raise TypeError("x: synchronized batch statistics take torch tensors")
    return _Synchronized.apply(x, weight, bias, scale, bn_weight, bn_bias, running_mean,
                               running_var, num_batches_tracked, momentum, float(eps), prec,
                               process_group)


class GemmScaleBatchNormReference(nn.Module):
    """Documented model 3 in plain PyTorch: ``bn(gemm(x) * scale)``."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        return self.bn(self.gemm(x) * self.scale)


class GemmScaleBatchNorm(GemmScaleBatchNormReference):
    """``bn(gemm(x) * scale)`` with the reference model's submodules, parameter names,
    RNG order and state_dict keys: ``gemm`` (nn.Linear), ``scale`` (Parameter of
    ``scale_shape``: one value per output feature, or one broadcast value), ``bn``
    (nn.BatchNorm1d).

    ``.train()`` uses batch statistics and updates ``bn``'s running_mean / running_var
    / num_batches_tracked exactly as nn.BatchNorm1d does (momentum None included);
    ``.eval()`` uses the running statistics. The float32 GEMM follows
    ``torch.get_float32_matmul_precision()``. CUDA tensors run the fused kernels through
    ``torch.ops.cupykern.gemm_scale_batchnorm`` (autograd, torch.compile, CUDA graphs);
    CPU tensors run the reference model itself. On CUDA, ``gemm`` must stay an
    nn.Linear and ``bn`` an nn.BatchNorm1d or nn.SyncBatchNorm; anything else raises
    rather than being silently ignored. While either has hooks (forward or backward, its
    own or global: pruning, weight norm, probes) the reference model runs, so they do too.

    Synchronized batch statistics: in training mode, when ``bn`` is an nn.SyncBatchNorm
    (``nn.SyncBatchNorm.convert_sync_batchnorm``) or the module was given a
    ``process_group``, and that group (None: the default one) spans several processes,
    the statistics are those of every process's rows, as SyncBatchNorm computes them
    (:func:`synchronized`; CPU tensors too, over gloo). Every process must then call
    the module alike: the same mode, and hooks on ``gemm`` / ``bn`` in all processes or
    in none (with hooks a SyncBatchNorm synchronizes itself, in the reference model).
    """

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1, *,
                 process_group=None):
        super().__init__(in_features, out_features, scale_shape, eps, momentum)
        self.process_group = process_group

    def forward(self, x):
        out = self._planned_call(x)
        if out is not None:
            return out
        require_tensor(x)
        if is_any_autocast_enabled():  # (x as the reference's Linear takes it)
            x = autocast_input(x, getattr(self.gemm, "weight", None))
        group = self._sync_group()
        if group is not None:
            return self._synchronized_call(x, group)
        if not x.is_cuda:  # the reference model itself: honours any submodule
            if isinstance(self.gemm, nn.Linear) and x.device.type == "cpu":  # (meta: shapes only)
                check_inputs(x, self.gemm.weight)
                if self.bn.training and x.shape[0] == 1:  # before bn counts it
                    raise batch_size_error(torch.Size([x.shape[0], self.gemm.out_features]))
            return super().forward(x)
        gemm, bn, scale = members(self, GemmScaleBatchNorm, ("gemm", "bn", "scale"))
        require_submodule(self, "gemm", nn.Linear, gemm)
        # (a SyncBatchNorm here does not synchronize: _sync_group said so)
        require_submodule(self, "bn", _bn_kind(bn), bn)
        if hooked(gemm, bn):  # hooks (pruning, weight norm, probes) run in the reference
            return super().forward(x)
        *tensors, training, momentum, eps = _arguments(gemm, bn, _flat_scale(scale, gemm))
        if isinstance(eps, (int, float)) and eps == 0:  # (what the installed PyTorch makes
            # of it: from 2.10 an error; a negative eps is the op's ValueError naming eps)
            return super().forward(x)
        return gemm_scale_batchnorm(x, *tensors, training=training, momentum=momentum, eps=eps)

    def _sync_group(self):
        """The process group whose rows the batch statistics span (a SyncBatchNorm
        ``bn``'s, else this module's ``process_group``), or None for this process's rows
        alone: eval mode, one process, or torch.distributed not initialized."""
        bn, group = self.bn, self.__dict__.get("process_group")
        if isinstance(bn, nn.SyncBatchNorm):
            if bn.process_group and group is not None and bn.process_group is not group:
                raise ValueError("process_group: GemmScaleBatchNorm was given one process group "
                                 "and its SyncBatchNorm bn another; give both the same")
            group = group or bn.process_group or None  # (SyncBatchNorm's rule: falsy is WORLD)
        elif group is None:
            return None
        if not bn.training or world_size(group) <= 1:
            return None
        return group if group is not None else torch.distributed.group.WORLD

    def _synchronized_call(self, x, group):
        gemm, bn, scale = members(self, GemmScaleBatchNorm, ("gemm", "bn", "scale"))
        require_submodule(self, "gemm", nn.Linear, gemm)
        require_submodule(self, "bn", _bn_kind(bn), bn)
        if hooked(gemm, bn):
            if x.is_cuda and isinstance(bn, nn.SyncBatchNorm):  # it synchronizes itself
                return super().forward(x)
            raise ValueError("GemmScaleBatchNorm: hooks on gemm or bn with synchronized batch "
                             "statistics; remove the hooks, or convert bn with "
                             "nn.SyncBatchNorm.convert_sync_batchnorm and run on CUDA")
        *tensors, _, momentum, eps = _arguments(gemm, bn, _flat_scale(scale, gemm))
        return synchronized(x, *tensors, momentum=momentum, eps=eps, process_group=group)

    def _planned_call(self, x):
        """What :meth:`forward` returns, from the launch plan of an earlier call alone: in
        plain eager mode, with plain submodules (nn.Linear, nn.BatchNorm1d, no hooks) and
        arrays like that call's. None where the checks must run (a tenth of the host time
        of a small call)."""
        if (type(self) is not GemmScaleBatchNorm or type(x) not in _PLAIN or not x.is_cuda
                or not _eager(True) or self.__dict__.get("process_group") is not None):
            return None  # (a subclass's properties could stand for submodules)
        mods = self.__dict__["_modules"]
        gemm, bn = mods.get("gemm"), mods.get("bn")
        scale = self.__dict__["_parameters"].get("scale")
        if (type(gemm) is not nn.Linear or type(bn) is not nn.BatchNorm1d
                or type(scale) not in _PLAIN or scale.dim() != 1 or hooked(gemm, bn)):
            return None
        weight = gemm.weight
        if is_any_autocast_enabled():
            x = autocast_input(x, weight)  # (as the reference's Linear takes it)
            if _autocast_vendor(x, weight):
                # PyTorch's composition (AUTOCAST_VENDOR_WORK) from the plain submodules
                # themselves, the op's checks left out (H200, 1024x8192->8192, bf16 forward
                # against eager: 0.85x through the op's entry, which checks every argument;
                # 0.93x calling the submodules after this method's checks, one run each)
                if x.shape[1] != weight.shape[1] or x.get_device() != weight.get_device():
                    check_inputs(x, weight)  # (its error, naming the argument)
                return super().forward(x)
        *tensors, training, momentum, eps = _arguments(gemm, bn, scale)
        if type(eps) is not float or type(momentum) not in (float, type(None)):
            return None  # (a plan key must hash; the checks name a bad one)
        save = wants_grad((x, *tensors[:5]))
        op, args = _op_call(x, *tensors, training, momentum, eps, resolve_precision(None), save)
        full = args if op is gemm_scale_batchnorm_op else _full(args)
        arrays = full[:9]
        run = planned_run(arrays, full[9:])  # (on a hit, x is 2-D with rows: save is exact)
        if run is None or save != wants_grad(arrays):
            return None
        res = run(*arrays)  # the kernels go out first: the GPU runs them during autograd's records
        if not save:
            return res
        return op.call_planned(_PlannedForward(res, run), True, *args)[0]


def _arguments(gemm, bn, scale):
    """The model's :func:`gemm_scale_batchnorm` arguments after x: weight, bias, scale,
    bn_weight, bn_bias, running_mean, running_var, num_batches_tracked (None where the
    mode leaves them alone, as nn.BatchNorm1d does), training, momentum, eps."""
    weight, bias = members(gemm, nn.Linear, ("weight", "bias"))
    gamma, beta, rmean, rvar, nbt = members(bn, nn.BatchNorm1d, (
        "weight", "bias", "running_mean", "running_var", "num_batches_tracked"))
    batch_stats = bn.training or rmean is None
    track = bn.training and bn.track_running_stats
    stats = track or not batch_stats
    return (weight, bias, scale, gamma, beta, rmean if stats else None, rvar if stats else None,
            nbt if track else None, batch_stats, bn.momentum, bn.eps)


def _bn_kind(bn) -> type:
    """What ``bn`` must compute: a SyncBatchNorm's forward, or nn.BatchNorm1d's."""
    return nn.SyncBatchNorm if isinstance(bn, nn.SyncBatchNorm) else nn.BatchNorm1d


def _flat_scale(scale, gemm):
    """The model's scale parameter as an (out_features,) vector (a view)."""
    if scale.dim() != 1:
        scale = scale.reshape(-1)
    if scale.shape[0] == 1:  # a broadcast scale, as the reference model allows
        scale = scale.expand(gemm.weight.shape[0])
    return scale
