"""``linear`` and ``matmul`` for torch: the ``cupykern::linear`` / ``matmul`` ops.

``linear(Tensor x, Tensor weight, Tensor? bias, str precision) -> Tensor`` with autograd
(dx = dy @ W and dW = dy^T @ x through ``matmul`` at the forward's precision, reading the
transposes in place; db = sum(dy)) and ``linear_out(..., Tensor(a!) out) -> ()``;
``matmul(Tensor a, Tensor b, str precision) -> Tensor`` (NumPy semantics) with autograd;
``mm(Tensor a, Tensor b, str precision) -> Tensor``, our own GEMM for the fused ops'
backward passes. ``precision=None`` resolves to ``torch.get_float32_matmul_precision()``
here, in the torch layer, so that torch.compile sees (and guards on) it too (see
:func:`resolve_precision`).

Where :func:`cupykern.gemm_route.route` gives a product to the vendor, the op computes it with
torch's own ``F.linear`` / ``torch.matmul`` (:class:`Vendor`; a 16-bit linear as one 2-D
product of contiguous operands, rounded once: :func:`_linear_once`); in plain eager mode, once
a call has planned that, ``linear`` / ``matmul`` call them directly, with torch's own
autograd, without the op's boundary (its microseconds are most of a small product's time);
so do calls that autograd records where ``route`` gives them to the vendor for that
(``grad``: a training step bound by the host). A call planned on ours runs that plan
through :meth:`Op.call_planned`. linear's backward copies a gradient whose
rows are off 16 bytes into padded rows first, where that pays
(:func:`cupykern.gemm_route.padded_grad`).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .. import _loader, gemm as core, gemm_checks as checks, gemm_operands as operands, gemm_route as route
from .._array import cached
from ..gemm_route import GemmProblem
from ._compat import get_cublas_allow_tf32, get_float32_matmul_precision, is_any_autocast_enabled
from ._op import _PLAIN, Op, _eager, lower_precision, wants_grad


def resolve_precision(precision) -> str:
    """``None`` -> torch's float32 matmul precision; anything else checked (its plain str:
    :func:`cupykern.gemm_checks.check_precision`).

    In a CUDA autocast region ``None`` is "high" (TF32, at least as accurate as the
    region's 16-bit matmuls): a fused op whose GEMM PyTorch would autocast (GSBN's
    Linear) follows that policy while keeping its float32 output.

    Under torch.compile the precision string cannot be traced, but the TF32 flag it sets
    can (Dynamo folds it and guards on it): there "medium" runs as "high" (TF32), which
    PyTorch's definition of "medium" (at least bf16's accuracy) allows."""
    if precision is not None:
        return checks.check_precision(precision)
    if torch.is_autocast_enabled("cuda"):
        return "high"
    if torch.compiler.is_compiling():
        return "high" if get_cublas_allow_tf32() else "highest"
    return torch.get_float32_matmul_precision()


class Vendor:
    """cuBLAS through torch, on torch's current stream: the products that
    :func:`cupykern.gemm_route.route` gives to the vendor (16-bit linears as one 2-D
    product of standard operands, rounded once: :func:`_linear_once`; those of a misaligned
    N computed padded, see :func:`cupykern.gemm_route.padded_n`; big float64 ones with their bias
    added apart, :func:`cupykern.gemm_route.bias_apart`). float32 only where torch's TF32
    switch gives the precision asked ("highest": SGEMM, TF32 off; "high" / "medium": TF32
    on), as it does for ``precision=None``; an explicit precision against the switch runs
    on ours (flipping the switch for the call would change other threads' matmuls too)."""

    @staticmethod
    def state():
        return get_cublas_allow_tf32()

    autocasting = staticmethod(is_any_autocast_enabled)  # (where the forms don't hold)
    capturing = staticmethod(torch.cuda.is_current_stream_capturing)

    @staticmethod
    def prepare(device: int):
        with torch.cuda.device(device):
            torch.cuda.current_blas_handle()  # (made for this thread if it has none)

    @staticmethod
    def takes(dtype: str, precision: str) -> bool:
        return dtype != "float32" or (precision != "highest") == Vendor.state()

    @staticmethod
    def linear_form(M: int, N: int, K: int, dtype: str, precision: str = None):
        """``fn(x, weight, bias)``: how the vendor computes a linear of M x K by N x K
        outside autocast; planned once per signature (:func:`cupykern.gemm.eager_plan`).
        (``precision``: torch's TF32 switch, part of the plan's key, decides it.)"""
        pad = route.padded_n(M, N, K, dtype) - N
        if pad:
            return functools.partial(_padded_linear, pad=pad)
        if _rounds_once(dtype, Vendor.state()):
            return _linear_once
        return _linear_bias_apart if route.bias_apart(M, N, K, dtype) else F.linear

    @staticmethod
    def matmul_form(M: int, N: int, K: int, dtype: str, b_matrix: bool, precision: str = None):
        """``fn(a, b)``, as :meth:`linear_form` for ``torch.matmul`` (M: a's rows, all
        batches; ``b_matrix``: b has a last dim N, not a vector's)."""
        pad = route.padded_n(M, N, K, dtype) - N if b_matrix else 0
        return functools.partial(_padded_matmul, pad=pad) if pad else torch.matmul

    @staticmethod
    def linear(x, weight, bias, precision):
        if Vendor.autocasting():  # (a fused op's product, in x's dtype)
            with torch.autocast(x.device.type, enabled=False):
                return Vendor.linear(x, weight, bias, precision)
        N, K = weight.shape
        form = Vendor.linear_form(x.numel() // K if K else 0, N, K, _name(x.dtype))
        return form(x, weight, bias)

    @staticmethod
    def zero_bias(proto, n: int):
        """n zeros of ``proto``'s device and dtype that live as long as the process (a CUDA
        graph captured around a product that adds them keeps reading their address, and a
        plan holding them may be dropped), or None while the current stream captures a
        graph and none that long exist yet (their fill would only be recorded)."""
        key = (proto.device, proto.dtype)
        z = _ZEROS.get(key)
        if z is None or z.numel() < n:
            if Vendor.capturing():
                return None
            z = torch.zeros(max(n, 2 * z.numel() if z is not None else n), dtype=proto.dtype,
                            device=proto.device)
            torch.cuda.current_stream(proto.device).synchronize()  # (filled for any stream)
            _ZEROS[key] = z
            _KEPT.append(z)  # (a shorter one stays: plans and graphs may hold it)
        return z[:n]

    @staticmethod
    def matmul(a, b, precision):
        if Vendor.autocasting():  # (a fused op's product, in a's dtype)
            with torch.autocast(a.device.type, enabled=False):
                return Vendor.matmul(a, b, precision)
        N, K = (b.shape[-1], b.shape[-2]) if b.dim() > 1 else (1, b.shape[0])
        form = Vendor.matmul_form(a.numel() // K if K else 0, N, K, _name(a.dtype), b.dim() > 1)
        return form(a, b)


_ZEROS: dict = {}  # (device, dtype) -> the longest zero vector (Vendor.zero_bias)
_KEPT: list = []  # every one made, never freed


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rounds_once(dtype: str, tf32: bool) -> bool:
    """Whether the vendor's linear of ``dtype`` (torch's TF32 switch ``tf32``) is
    :func:`_linear_once`: 16-bit, and float32 under the switch, whose TF32 products cuBLAS
    computes by layout-dependent algorithms too (H200, x (3, 1025) transposed, TF32: 0.018
    against 9e-6 for the same values contiguous). float32 with the switch off (SGEMM: exact
    products, float32 sums whatever the layout) is F.linear as it is, without
    _linear_once's layout reads (~1 us of an eager call's host time, H200)."""
    return dtype in ("float16", "bfloat16") or (dtype == "float32" and tf32)


def _linear_once(x, weight, bias):
    """F.linear of 16-bit (or TF32 float32) operands as torch computes it on contiguous 2-D
    copies of them: one cuBLAS GEMM that adds the bias to its float32 sums and rounds each
    output once (addmm), with the algorithm cuBLAS picks for that layout. F.linear on the arguments as
    they are would, for a 1-D x or an N-D x that is not contiguous (or a strided bias),
    store the 16-bit product and add the bias after it (a second rounding), and for
    transposed, sliced or misaligned operands run another algorithm, which may sum
    16-bit split-K partials (torch allows reduced-precision reductions by default), less
    accurate than the one for the same values laid out contiguously. So x is folded into
    rows (M, K) and every operand whose layout is not a fresh tensor's (C-contiguous,
    16-byte aligned) is copied first (:func:`_standard`); the result is viewed back as x's
    leading dims + (N,). A 2-D, or contiguous 3-D (which torch folds into addmm itself), x
    with standard operands goes straight to F.linear: a few attribute reads, on the
    shape-keyed plans' hot path. Differentiable (the copies and views are torch ops)."""
    if (2 <= x.dim() <= 3 and x.is_contiguous() and weight.is_contiguous()
            and (bias is None or bias.is_contiguous())
            and not (x.data_ptr() | weight.data_ptr() | (0 if bias is None else bias.data_ptr())) & 15):
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]  # (math.prod, not -1: x or weight may be empty)
    y = F.linear(_standard(x.reshape(math.prod(lead), x.shape[-1])), _standard(weight),
                 None if bias is None else _standard(bias))
    return y.view(*lead, weight.shape[0])


def _standard(t):
    """``t`` where it is laid out as a fresh tensor (C-contiguous, 16-byte aligned), else
    such a copy of it."""
    if t.is_contiguous() and not t.data_ptr() & 15:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _padded_linear(x, weight, bias, pad):
    """F.linear of N + pad rows of W (zeros), its N columns copied out (see
    :func:`cupykern.gemm_route.padded_n`); the unpadded product where autograd records the
    call (the pad's and the copy's backward ops: H200, bf16 training steps, 1024x1024x1025
    to 2048x2048x2047, 0.47-0.72x eager). 16-bit either way, so rounded once as
    :func:`_linear_once` computes it."""
    if wants_grad((x, weight, bias)):
        return _linear_once(x, weight, bias)
    N = weight.shape[0]
    bias = None if bias is None else F.pad(bias, (0, pad))
    return _linear_once(x, F.pad(weight, (0, 0, 0, pad)), bias)[..., :N].contiguous()


def _padded_matmul(a, b, pad):
    if wants_grad((a, b)):  # (as _padded_linear)
        return torch.matmul(a, b)
    return torch.matmul(a, F.pad(b, (0, pad)))[..., :b.shape[-1]].contiguous()


def _linear_bias_apart(x, weight, bias):
    """F.linear as mm, then the bias added in place (see :func:`cupykern.gemm_route.bias_apart`):
    float64 only, where the second rounding is float64's."""
    if bias is None:
        return F.linear(x, weight)
    return torch.matmul(x, weight.T).add_(bias)


def _impl(x, weight, bias, precision):
    if x.is_cuda:
        return core.linear_core(x, weight, bias, precision)
    checks.check(x, weight, bias, precision, None)
    return _cpu_linear(x, weight, bias)


def _cpu_linear(x, weight, bias):
    """The CPU path's product: F.linear, of 16-bit operands rounded once (as on CUDA)."""
    return (_linear_once if _rounds_once(_name(x.dtype), get_cublas_allow_tf32())
            else F.linear)(x, weight, bias)


def _fake(x, weight, bias, precision):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup_context(ctx, inputs, output):
    x, weight, bias, ctx.precision = inputs
    ctx.save_for_backward(x, weight)


def _products(ctx):
    """``a @ b`` for a backward: torch's matmul when a double backward needs a
    differentiable graph (create_graph), else :data:`matmul_op` at the forward's precision."""
    if torch.is_grad_enabled():
        return torch.matmul
    return lambda a, b: matmul_op(a, b, ctx.precision)


def _backward(ctx, g):
    x, weight = ctx.saved_tensors
    n, k = weight.shape
    mm = _products(ctx)
    m = math.prod(g.shape[:-1])  # (not reshape(-1, n): ambiguous where g or x is empty)
    cols = route.padded_grad(m, n, k, _name(g.dtype), ctx.precision)
    if cols > n and g.is_cuda and not torch.is_grad_enabled() and any(ctx.needs_input_grad[:2]):
        # dx = gp @ wp sums over cupykern.gemm_route.padded_grad's columns: g copied once (any
        # layout) into rows of an aligned stride, zeros past its n columns
        gp = g.new_empty(m, cols)
        gp[:, n:].zero_()
        g2 = gp[:, :n]
        g2.view(g.shape).copy_(g)
        wp = F.pad(weight, (0, 0, 0, cols - n)) if ctx.needs_input_grad[0] else None
    else:
        g2 = g.reshape(m, n)
        gp, wp = g2, weight
    dx = mm(gp, wp).reshape(x.shape) if ctx.needs_input_grad[0] else None
    dw = mm(g2.t(), x.reshape(m, k)) if ctx.needs_input_grad[1] else None
    db = g2.sum(0) if ctx.needs_input_grad[2] else None
    return dx, dw, db, None


def _mm_impl(a, b, precision):
    if a.is_cuda:
        return operands.mm(a, b, precision)
    checks.check_mm(a, b, precision)
    return a @ b


mm_op = Op("mm(Tensor a, Tensor b, str precision) -> Tensor", _mm_impl,
           lambda a, b, precision: a.new_empty((a.shape[0], b.shape[1])))


def _out_impl(x, weight, bias, precision, out):
    if x.is_cuda:
        core.linear_core(x, weight, bias, precision, out)
        return
    checks.check(x, weight, bias, precision, out)
    out.copy_(_cpu_linear(x, weight, bias))


def _fold(in_dims, x, weight, bias, precision):
    """vmap rule where only x is batched: one more leading dimension."""
    if in_dims[1:3] != (None, None):
        return None
    return linear_op(x.movedim(in_dims[0], 0), weight, bias, precision), 0


linear_op = Op("linear(Tensor x, Tensor weight, Tensor? bias, str precision) -> Tensor",
               _impl, _fake, _setup_context, _backward, autocast=lower_precision,
               reference=lambda x, weight, bias, precision: F.linear(x, weight, bias), fold=_fold)
linear_out_op = Op("linear_out(Tensor x, Tensor weight, Tensor? bias, str precision, "
                   "Tensor(a!) out) -> ()", _out_impl, lambda *args: None)


def _eager_precision(precision):
    """:func:`resolve_precision` where :func:`_eager` holds (neither compiling nor
    autocasting), without its checks of those: the plain call's host time, most of a small
    product's (the vendor's eager forms). None for a precision no plan is keyed by (not a
    plain str: :func:`resolve_precision` names a wrong one, reads a str subclass as its
    characters)."""
    prec = torch.get_float32_matmul_precision() if precision is None else precision
    return prec if type(prec) is str else None


def _call(op, eager_plan, args, precision, remember=None):
    """``op(*args, precision)``; in plain eager mode, once a call has planned these
    arguments (:func:`cupykern.gemm.eager_plan`), the plan itself: the vendor's as torch's
    own op, ours through :meth:`Op.call_planned` (the op's autograd, without its second
    key, mode checks and lookup: the host time of a call that ours computes).
    ``remember(run, precision)`` is told the vendor's plans (:func:`_remember`)."""
    if _eager():
        prec = _eager_precision(precision)
        if prec:
            grad = wants_grad(args)
            run, vendor = eager_plan(*args, prec, Vendor.state(), grad)
            if vendor:
                if remember is not None:
                    remember(run, prec)
                return run(*args)
            if run is not None:
                return op.call_planned(run, grad, *args, prec)
    return op(*args, resolve_precision(precision))


# Shape-keyed plans, the host time of a small call. Where route gives a product to the
# vendor whatever its layout, alignment and grad (cupykern.gemm_route.vendor_any_layout)
# and the vendor's form is torch's own op (16-bit linear: _linear_once, which reads the
# layout it needs itself), an eager call is planned by its shapes, dtype, device, precision
# (and for float32 the TF32 switch) alone: no strides or pointers to read before the
# call. A call that torch's op refuses (operands on two devices or of two dtypes, which
# the key does not tell apart) goes on to the full path, whose checks name the argument.
# Keys, flat (a nested tuple costs a hash and an allocation more): linear (x.shape,
# weight.shape, bias.shape or None, x.dtype, x's device, precision); matmul (a.shape,
# b.shape, a.dtype, a's device, precision, whether autograd records the call: a stack
# that a planned launch takes is ours unrecorded, and the vendor's recorded up to
# gemm_route's STACK_GRAD_MIN_WORK). float32 keys end with float32's own part: the
# precision it resolves to and torch's TF32 switch (the vendor takes float32 only where
# they agree).
_LINEAR_PLANS: dict = {}
_MATMUL_PLANS: dict = {}
_SHAPE_PLANS = {"linear": _LINEAR_PLANS, "matmul": _MATMUL_PLANS}
route.register_plans(_LINEAR_PLANS, _MATMUL_PLANS)  # (dropped with the routed plans)
_FLOAT32 = torch.float32


def _linear_shape_key(x, weight, bias, precision) -> tuple:
    key = (x.shape, weight.shape, None if bias is None else bias.shape, x.dtype,
           x.get_device(), precision)
    if key[3] is _FLOAT32:
        return key + (precision or get_float32_matmul_precision(), get_cublas_allow_tf32())
    return key


def planned_linear(x, weight, bias=None, precision=None):
    """``linear(x, weight, bias)`` by its shape-keyed plan (torch's own op): the result (a
    tensor) where the signature has one; else the signature's key (a tuple: a plan not
    made yet, or arguments torch's op refuses, which the full path names), under which
    :func:`linear_unplanned` stores the vendor's plan; or None where no plan applies (not
    a plain tensor, not plain eager mode, not tensors, a precision other than a plain str
    or None).
    :func:`linear`'s first step, and what :class:`cupykern.torch.Linear` tries before
    its own checks."""
    if (type(x) not in _PLAIN or not _eager()
            or (precision is not None and type(precision) is not str)):
        return None  # (not a plain str: resolve_precision's check reads or names it)
    try:
        key = _linear_shape_key(x, weight, bias, precision)
        run = _LINEAR_PLANS.get(key)
    except (AttributeError, TypeError, RuntimeError):  # (RuntimeError: a nested tensor's shape)
        return None
    if run is None:
        return key
    try:  # (an array that is not a tensor may share a tensor's key: torch.Size is a tuple)
        return run(x, weight, bias)
    except (AttributeError, TypeError, RuntimeError):
        return key


def _remember(op_name, key, forms, problem):
    """``remember`` for :func:`_call`: stores the vendor's plan ``run`` under ``key`` in
    the shape-keyed plans where it is one of the layout-free eager ``forms`` (torch's own
    op, or :func:`_linear_once`) and ``problem(precision)`` (a GemmProblem) goes to the
    vendor whatever its layout."""
    def remember(run, prec):
        if run in forms and route.vendor_any_layout(problem(prec)):
            cached(_SHAPE_PLANS[op_name], key, lambda: run)
    return remember


def linear(x, weight, bias=None, *, precision=None, out=None):
    """:func:`cupykern.linear` for torch tensors, through the custom ops (in plain eager
    mode their cached plan, :func:`_call`)."""
    if out is None:
        res = planned_linear(x, weight, bias, precision)
        if res is None or type(res) is tuple:
            return linear_unplanned(x, weight, bias, precision, res)
        return res
    prec = resolve_precision(precision)
    # Anything but a tensor: the implementation's own checks say what is wrong with it.
    (linear_out_op if isinstance(out, torch.Tensor) else _out_impl)(x, weight, bias, prec, out)
    return out


def linear_unplanned(x, weight, bias, precision, key):
    """:func:`linear` (no ``out``) past :func:`planned_linear`, whose answer ``key`` was
    not a result: the custom op's path, which stores the vendor's plan under ``key`` (a
    tuple; None: no plan applies) where it is one (:func:`_call`, :func:`_remember`)."""
    if key is None:
        return _call(linear_op, core.eager_plan, (x, weight, bias), precision)

    def problem(prec):
        N, K = weight.shape
        return GemmProblem(x.numel() // K if K else 0, N, K, _name(x.dtype), prec, "torch",
                           _loader.device_cc(x.get_device()))
    return _call(linear_op, core.eager_plan, (x, weight, bias), precision,
                 _remember("linear", key, (_linear_once, F.linear), problem))


def _matmul_impl(a, b, precision):
    if a.is_cuda:
        return core.matmul_core(a, b, precision)
    checks.check_matmul(a, b, precision, None)
    return torch.matmul(a, b)


def _matmul_fake(a, b, precision):
    # (torch.broadcast_shapes: batch sizes may be symbolic under torch.compile / export)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.new_empty((*batch, *a.shape[-2:-1], *(b.shape[-1:] if b.dim() > 1 else ())))


def _matmul_setup_context(ctx, inputs, output):
    a, b, ctx.precision = inputs
    ctx.save_for_backward(a, b)


def _matmul_backward(ctx, g):
    """NumPy matmul's gradients: 1-D operands as a row / a column, each gradient summed
    over the batch dims its operand was broadcast along."""
    a, b = ctx.saved_tensors
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    g2 = g.unsqueeze(-1) if b.dim() == 1 else g
    g2 = g2.unsqueeze(-2) if a.dim() == 1 else g2
    mm = _products(ctx)
    da = db = None
    if ctx.needs_input_grad[0]:
        da = mm(g2, b2.mT).sum_to_size(a2.shape).reshape(a.shape)
    if ctx.needs_input_grad[1]:
        if b.dim() == 2 and a2.dim() > 2:  # b broadcast over a's batch: one product of all rows
            db = mm(a2.reshape(-1, a2.shape[-1]).mT, g2.reshape(-1, g2.shape[-1]))
        else:
            db = mm(a2.mT, g2).sum_to_size(b2.shape).reshape(b.shape)
    return da, db, None


matmul_op = Op("matmul(Tensor a, Tensor b, str precision) -> Tensor", _matmul_impl,
               _matmul_fake, _matmul_setup_context, _matmul_backward, autocast=lower_precision,
               reference=lambda a, b, precision: torch.matmul(a, b))


def _matmul_shape_key(a, b, precision, recorded) -> tuple:
    key = (a.shape, b.shape, a.dtype, a.get_device(), precision, recorded)
    if key[2] is _FLOAT32:
        return key + (precision or get_float32_matmul_precision(), get_cublas_allow_tf32())
    return key


def matmul(a, b, *, precision=None, out=None):
    """:func:`cupykern.matmul` for torch tensors, through the custom op (as linear's). With ``out``
    (validated as the op's arguments are), the result is copied into it; as torch's own
    ``out=`` it takes no gradient. Two float dtypes promote as torch.promote_types says
    (the lower operand converted, differentiably; such a call skips the shape-keyed
    plans, whose key holds a's dtype alone), and the promoted call is planned as any
    other. A precision that is not a plain str skips them too: :func:`resolve_precision`
    reads a str subclass as its characters and names anything else."""
    key = None
    if out is None and _eager() and (precision is None or type(precision) is str):
        try:  # (recorded: a stack planned on ours may be the vendor's when autograd records it)
            if a.dtype is b.dtype:  # (two dtypes: promoted below)
                key = _matmul_shape_key(a, b, precision, torch.is_grad_enabled() and (
                    a.requires_grad or b.requires_grad))
                run = _MATMUL_PLANS.get(key)
                if run is not None:
                    return run(a, b)
        except (AttributeError, TypeError, RuntimeError):  # (as linear's)
            pass
    if (isinstance(b, torch.Tensor) and a.dtype != b.dtype and a.is_floating_point()
            and b.is_floating_point()):  # (the promoted call: its own plan, or its planning)
        common = torch.promote_types(a.dtype, b.dtype)
        return matmul(a.to(common), b.to(common), precision=precision, out=out)
    if out is None:
        remember = None
        if key is not None:
            recorded = key[5]

            def problem(prec):
                # as the route of a stack reads it: all rows folded where b is a matrix, else
                # one matrix, of a stack of all of them on one planned launch (the most the
                # route gives ours: the vendor's at that is the vendor's at any count and
                # layout)
                K = a.shape[-1]
                M = (a.numel() // K if K else 0) if b.dim() == 2 else a.shape[-2] if a.dim() > 1 else 1
                N = b.shape[-1] if b.dim() > 1 else 1
                count = 1 if b.dim() == 2 else math.prod(
                    torch.broadcast_shapes(a.shape[:-2], b.shape[:-2] if b.dim() > 2 else ()))
                return GemmProblem(M, N, K, _name(a.dtype), prec, "torch",
                                   _loader.device_cc(a.get_device()), grad=recorded, count=count,
                                   planned_stack=count > 1)
            remember = _remember("matmul", key, (torch.matmul,), problem)
        return _call(matmul_op, core.eager_plan_matmul, (a, b), precision, remember)
    prec = resolve_precision(precision)
    checks.check_matmul(a, b, prec, out)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or out.requires_grad):
        raise ValueError("out: matmul with out= does not support autograd (an input requires "
                         "grad); call it under torch.no_grad() or without out=")
    with torch.no_grad():
        out.copy_(matmul_op(a, b, prec))
    return out
