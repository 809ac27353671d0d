"""``linear`` (``x @ weight.T + bias``) and ``matmul`` (NumPy's ``a @ b``): our own
tensor-core GEMM (kernels_cu/gemm*.cu) or, where the dispatcher (:func:`~cupykern.gemm_route.route`, one table,
each boundary with its measurement) finds that no kernel of ours beats it for a plain
product, cuBLAS through torch or CuPy. The fused ops (GemmScaleBatchNorm, M4) keep our
kernels; ``mm`` is our GEMM for their backward passes.

Precision of float32 inputs follows PyTorch's names (on our kernels; the vendor's
"highest" is SGEMM, its "high" / "medium" TF32):

* ``"highest"``: 3xTF32 (each operand split into a TF32 part and a
  remainder; three tensor-core products) with the tensor-core sum promoted into an
  fp32 register accumulator every 32 of K: about as accurate as SGEMM (README: Known
  limitations).
* ``"high"``: TF32 tensor cores, both operands rounded to TF32 to nearest as cuBLAS
  does (by the copy engine on Hopper's wgmma path, ``cvt.rna`` on mma.sync's; README:
  Known limitations names the one path that truncates).
* ``"medium"``: operands rounded to bf16, fp32 accumulation; on Hopper with aligned
  rows, TF32 instead, which is faster there and more accurate (PyTorch's "medium"
  likewise allows any algorithm at least as accurate as bf16).

float16 / bfloat16 inputs use the tensor cores directly (fp32 accumulation);
float64 uses the FP64 tensor cores (DMMA) where the GPU has them (sm_80, sm_90,
sm_100), a CUDA-core kernel elsewhere. Any M, N, K work: tiles are bounds-checked, and
rows that are not 16-byte aligned take an element-wise load path. On Hopper,
float32 "highest"/"high" with 16-byte aligned rows, and float16 / bfloat16 with K-major
16-byte aligned rows, use wgmma (sm_90a); everything else uses mma.sync (sm_80+). Below
sm_80 (Turing: T4, RTX 20) every dtype runs on the CUDA-core kernel, accumulating in
float32 (float64 for float64): fp32-accurate at every precision, but without tensor cores.
"""
from __future__ import annotations

import math

import numpy as np

from . import _dask, _loader
from ._geometry import MAX_GRID_Y
from ._array import (ITEMSIZE, Operand, Place, cached_checked, contiguous, copy_into, data_ptr,
                     empty, is_torch, launch_all, native, operand, plannable, row_view_stride, rows_2d,
                     signature, torch_layer)
from .gemm_checks import check, check_matmul, promote, reference
from .gemm_kernels import (Stack, batched_call, gemm, gemm_call, gemm_kernel, layout, one_launch,
                           workspace)
from .gemm_operands import (copy_plan, fresh_like, matrix, mm, mm_plan, on_arrays, padded_ld,
                             planned_gemm)
from .gemm_route import OURS, VENDOR, register_plans, route_of
from .gemm_vendor import VendorPlan, vendor_linear, vendor_matmul, vendor_of, vendor_state

def linear(x, weight, bias=None, *, precision=None, out=None):
    """``x @ weight.T + bias`` (PyTorch's ``F.linear``).

    Args:
        x: (..., K) CuPy array, torch tensor (CUDA or CPU) or NumPy array of float16,
            bfloat16, float32 or float64.
        weight: (N, K), same kind, device and dtype as x.
        bias: optional (N,), same dtype.
        precision: for float32, "highest" (3xTF32, about SGEMM's accuracy), "high" (TF32) or
            "medium" (bf16). ``None``: torch inputs follow
            ``torch.get_float32_matmul_precision()``, CuPy/NumPy use "highest".
            Ignored for other dtypes.
        out: optional (..., N) array of x's kind, device and dtype.

    Returns an array of x's kind (torch in -> torch out, on torch's current stream,
    through the custom op ``torch.ops.cupykern.linear``, with autograd). The product runs
    on our kernels or cuBLAS as :func:`~cupykern.gemm_route.route` says (float32 on cuBLAS only where the
    library's own TF32 setting gives ``precision``: torch's TF32 switch, CuPy's compute
    type), decided once per argument signature. A Dask array x
    (CuPy or NumPy chunks; weight and bias concrete arrays of that kind) gives a Dask
    array computed block by block, K rechunked into one chunk where it is split
    (``out`` not supported).
    Copies: a 2-D x or weight whose rows are contiguous (any row stride: a column
    slice) is read in place, and so is a contiguous x of any rank; one whose columns
    are contiguous (a transposed view) is read in place where that is faster than a
    copy (small against the product); anything else is first copied to a contiguous
    array. NumPy arrays use a NumPy reference path.
    """
    if is_torch(x):
        return torch_layer("gemm").linear(x, weight, bias, precision=precision, out=out)
    if _dask.is_dask(x):
        _dask.no_out(out)
        check(_dask.sample(x, (0,) * (x.ndim - 1) + x.shape[-1:]), weight, bias, precision, None)
        return _dask_rows(linear_core, x, weight.shape[0], weight, bias, precision, name="linear")
    return linear_core(x, weight, bias, precision, out)


_plans: dict = {}  # (signatures, precision, vendor state) -> run(x, weight, bias), or None


def linear_core(x, weight, bias=None, precision=None, out=None):
    """:func:`linear` for CuPy arrays, NumPy arrays and (from the torch layer) torch
    CUDA tensors."""
    checked = None
    if out is None and (precision is None or type(precision) is str):  # the common call
        key = _linear_key(x, weight, bias, precision, vendor_state(x))
        run, checked = cached_checked(_plans, key, check, _fresh,
                                      (x, weight, bias, precision, None))
        if run is not None:
            return run(x, weight, bias)
    xo, wo, bo, o, prec, shape = checked or check(x, weight, bias, precision, out)
    if xo.kind == "cpu":
        res = reference(x, weight, bias)
        if o is None:
            return res
        copy_into(out, res)
        return out
    N = shape[-1]
    if N == 0 or int(np.prod(shape[:-1])) == 0:  # nothing to compute (K == 0 is not this)
        return empty(xo, shape) if o is None else out
    if _linear_route(xo, wo, bo, prec) == VENDOR:
        res = vendor_of(xo.kind).linear(x, weight, bias, prec)
        if o is None:
            return res
        copy_into(out, res)
        return out
    work = int(np.prod(shape)) * xo.shape[-1]
    a, b = matrix(xo, work), matrix(wo, work)
    direct = o is not None and o.is_c_contiguous()
    c = operand((out if direct else empty(xo, shape)).reshape(a.shape[0], N), "out")
    gemm(a, b, c, prec, bias=bo)
    res = c.obj.reshape(shape)
    if o is None:
        return res
    if not direct:
        copy_into(out, res)
    return out


def _fresh(checked, x, weight, bias, precision, out, grad=False):
    """``run(x, weight, bias) -> out`` for calls like this one without ``out``
    (``checked``: their validation), planned once (a transposed copy is a launch of the
    plan); None where the call needs the general path (CPU, empty, or an operand copied
    otherwise). With ``grad`` (:func:`eager_plan`'s) only the vendor's plan, else
    None."""
    xo, wo, bo, _, prec, shape = checked
    if xo.kind == "cpu" or 0 in shape:
        return None
    if _linear_route(xo, wo, bo, prec, grad) == VENDOR:
        M, N = int(np.prod(shape[:-1])), shape[-1]
        return vendor_linear(xo.kind, prec, (M, N, xo.shape[-1], xo.dtype))
    if grad:
        return None
    if bo is not None and bo.obj is not bias:
        return None
    if xo.ndim != 2:  # more dims as rows, where that is a view
        if row_view_stride(xo) is None:
            return None
        xo = rows_2d(xo, "x")
    work = int(np.prod(shape)) * xo.shape[-1]
    run = planned_gemm(xo, wo, work, prec, shape)
    if run is None:
        return None
    ptr = run.place.ptr  # (*_: the op's precision, from the torch layer's Op.call_planned)
    return lambda x, weight, bias, *_: run(ptr(x), ptr(weight), ptr(bias))


def _linear_route(xo, wo, bo, prec, grad: bool = False) -> str:
    """:func:`~cupykern.gemm_route.route_of` of linear's product (x's rows as ours reads
    them), the one place :func:`linear_core` and :func:`_fresh` decide it: CuPy float16 with
    a bias is ours. CuPy's cuBLAS call (``cupy.matmul``) stores the float16 product and the
    vendor path adds the bias to it after, so each output rounds twice (up to half an ulp of
    x @ W.T: many of the result's own where the bias cancels most of it); our kernels add
    the bias to the float32 sum and round once, as cuBLAS's GEMM with its bias (torch's
    addmm) does. (torch's vendor form rounds once itself: the torch layer's _linear_once.)"""
    which = route_of(_rows_planned(xo), wo, prec, grad)
    if which == VENDOR and bo is not None and xo.kind == "cupy" and xo.dtype == "float16":
        return OURS
    return which


def _rows_planned(xo):
    """x (..., K) as the 2-D (M, K) Operand ours would read: in place where that is a view,
    else a fresh contiguous array."""
    if xo.ndim == 2:
        return xo
    if row_view_stride(xo) is None:
        return fresh_like(xo, (xo.size // xo.shape[-1] if xo.shape[-1] else 0, xo.shape[-1]), "x")
    return rows_2d(xo, "x")


def eager_plan(x, weight, bias, precision, state, grad=False):
    """What the torch layer runs for :func:`linear` in plain eager mode (a string
    precision; ``state``: :func:`vendor_state` of x), from the cached plan of these
    arguments: ``(run, vendor)``. ``vendor``: the plan is the vendor's and ``run`` its eager
    form (torch's own ``F.linear``, with torch's autograd), called without the op's
    boundary; else ``run`` is ours' launch plan (``run(x, weight, bias, *_)``), for
    :meth:`cupykern.torch._op.Op.call_planned` (the op's autograd without its second
    lookup), or None until a first call has planned them or where the general path
    computes them. (Arguments that :func:`signature` does not describe, such as tensor
    subclasses, have no plan.) ``grad``: a call that autograd records, which also takes
    the vendor's form where :func:`~cupykern.gemm_route.route` with ``grad`` gives it the product, planned on
    its first call (which, where ours computes it, validates again in the op)."""
    key = _linear_key(x, weight, bias, precision, state)
    return _eager_plan(_plans, _grad_plans, key, grad, check, _fresh,
                       (x, weight, bias, precision, None))


def _eager_plan(plans, grad_plans, key, grad, check, fresh, args):
    """:func:`eager_plan`'s answer from the op's ``plans`` or, for a recorded call where
    those are not the vendor's, ``grad_plans`` (made by ``fresh`` with grad; not for a key
    no plan is stored for, which would validate on every call)."""
    plan = plans.get(key)
    if type(plan) is VendorPlan:
        return plan.eager, True
    if grad and plannable(key):
        vendor = cached_checked(grad_plans, key, check, fresh, args, (True,))[0]
        if type(vendor) is VendorPlan:
            return vendor.eager, True
    return plan, False


_grad_plans: dict = {}  # linear's keys -> the vendor's plan for a recorded call, or None


def _linear_key(x, weight, bias, precision, state) -> tuple:
    """The key of :func:`linear_core`'s cached plans (``state``: :func:`vendor_state` of x)."""
    return signature(x), signature(weight), signature(bias), precision, state


def matmul(a, b, *, precision=None, out=None):
    """``a @ b`` with NumPy's matmul semantics, on :func:`linear`'s dispatcher.

    Args:
        a, b: CuPy arrays, torch tensors (CUDA or CPU) or NumPy arrays of one kind and
            device, of float16, bfloat16, float32 or float64; two dtypes promote as in
            NumPy and PyTorch (float32 @ float64 is float64: the lower one converted
            first). 1-D operands are
            vectors (a row for ``a``, a column for ``b``, the dimension dropped from the
            result); more than 2 dims are stacks of matrices whose batch dims broadcast.
        precision: for float32 as in :func:`linear` ("highest": at least SGEMM's accuracy
            on any data; "high": TF32; "medium"), ``None``: torch's float32 matmul
            precision for torch inputs, "highest" otherwise.
        out: optional array of the result's shape, kind and dtype (not sharing memory
            with ``a`` or ``b``).

    A Dask array ``a`` (2 or more dims; CuPy or NumPy chunks) by a concrete matrix or
    vector ``b`` of its chunks' kind gives a Dask array, block by block.
    Returns an array of a's kind (torch: through ``torch.ops.cupykern.matmul``, with
    autograd; 1-D by 1-D: a 0-d array, as CuPy's and torch's, where NumPy's is a scalar;
    NumPy results in native byte order). Each matrix product goes where :func:`~cupykern.gemm_route.route` says: our tensor-core GEMM, or
    cuBLAS through torch / CuPy (batched there, except float32 "highest" that ours takes:
    a loop of our 2-D kernel, and CuPy bfloat16, ours). NumPy arrays use NumPy.
    """
    if is_torch(a):
        return torch_layer("gemm").matmul(a, b, precision=precision, out=out)
    if getattr(a, "dtype", None) != getattr(b, "dtype", None):
        a, b = promote(a, b)
    if _dask.is_dask(a):
        return _dask_matmul(a, b, precision, out)
    return matmul_core(a, b, precision, out)


def _dask_matmul(a, b, precision, out):
    """:func:`matmul` of a Dask array ``a`` (2-D or more, K rechunked whole) by a concrete
    matrix or vector ``b``, mapped over a's blocks as :func:`linear` maps x's."""
    _dask.no_out(out)
    if _dask.is_dask(b):
        raise TypeError("b: a Dask array; matmul maps over a's blocks with a concrete b: "
                        "compute b first")
    if a.ndim < 2:
        raise ValueError(f"a: with a Dask a, matmul takes 2 or more dimensions, got {a.ndim}")
    if getattr(b, "ndim", 2) > 2:
        raise ValueError(f"b: with a Dask a, matmul takes a matrix or vector b, got {b.ndim}-D")
    check_matmul(_dask.sample(a, (0,) * (a.ndim - 1) + a.shape[-1:]), b, precision, None)
    column = b.ndim == 1  # (a (K,) b: the (K, 1) product's one column)
    res = _dask_rows(matmul_core, a, 1 if column else b.shape[1], b[:, None] if column else b,
                     precision, name="matmul")
    return res[..., 0] if column else res


def _dask_rows(fn, x, n, *args, name):
    """``fn(block, *args)`` over a Dask x's blocks (its last axis, K, in one chunk), each
    giving ``n`` columns."""
    x = _dask.whole(x, x.ndim - 1)
    return _dask.map_blocks(fn, x, *args, name=name, chunks=x.chunks[:-1] + ((n,),))


_matmul_plans: dict = {}  # (signatures, precision, vendor state) -> run(a, b), or None


def matmul_core(a, b, precision=None, out=None):
    """:func:`matmul` for CuPy arrays, NumPy arrays and (from the torch layer) torch CUDA
    tensors."""
    checked = None
    if out is None and (precision is None or type(precision) is str):  # the common call
        run, checked = cached_checked(_matmul_plans, _matmul_key(a, b, precision, vendor_state(a)),
                                      check_matmul, _matmul_fresh, (a, b, precision, None))
        if run is not None:
            return run(a, b)
    ao, bo, prec, shape, o = checked or check_matmul(a, b, precision, out)
    if ao.kind == "cpu":
        acc = np.float64 if ao.dtype == "float64" else np.float32
        res = np.asarray(np.matmul(np.asarray(a, acc), np.asarray(b, acc))).astype(native(ao.array_dtype))
    elif 0 in shape or ao.shape[-1] == 0:  # (K == 0: zeros)
        res = empty(ao, shape)
        res[...] = 0
    else:
        res = _matmul_gpu(ao, bo, prec, shape)
    if o is None:
        return res
    copy_into(out, res)
    return out


def _as_matrices(ao, bo):
    """``a`` and ``b`` with 1-D operands as a (1, K) row and a (K, 1) column (views)."""
    a = ao.obj[None] if ao.ndim == 1 else ao.obj
    b = bo.obj[:, None] if bo.ndim == 1 else bo.obj
    return a, b


def _folded(ao, bo):
    """``a`` (..., M, K) as one (batch * M, K) view where ``b`` is a matrix and a's leading
    dims fold into its rows (C-contiguous): NumPy's matmul broadcasts b over a's batch,
    so the stack is one GEMM of all its rows (ours or the vendor's), not a launch per
    matrix; else None."""
    if ao.ndim <= 2 or bo.ndim != 2 or row_view_stride(ao) is None:
        return None
    return ao.obj.reshape(ao.size // ao.shape[-1], ao.shape[-1])


def _matmul_route(ao, bo, prec, grad: bool = False) -> str:
    """:func:`~cupykern.gemm_route.route` of one matrix product of ``a @ b`` (2-D views of
    the operands; a folded stack's one product, :func:`_folded`)."""
    flat = _folded(ao, bo)
    if flat is not None:
        return route_of(operand(flat, "a"), operand(bo.obj.T, "b"), prec, grad)
    a, b = _as_matrices(ao, bo)
    a2 = operand(a[(0,) * (a.ndim - 2)], "a")
    b2 = operand(b[(0,) * (b.ndim - 2)], "b")
    count, planned = _one_launch(ao, a, b, prec)
    return route_of(a2, operand(b2.obj.T, "b"), prec, grad, count, planned_stack=planned)


def _one_launch(ao, a, b, prec) -> tuple:
    """``(count, planned)``: how many products of the stack ``a @ b`` (matrices)
    :func:`_stack_on_ours` runs on one launch, and whether that launch is planned
    (:func:`_planned_stack`: b read in place); all of them where
    :func:`~cupykern.gemm_kernels.batched_call` would take them so (Hopper: the planned
    operands, else each read as :func:`_k_major` gives it, a copy's rows where it copies),
    else ``(1, False)`` (a launch each)."""
    if a.ndim == b.ndim == 2 or _loader.device_cc(ao.device) != 90:
        return 1, False
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    parts = _planned_stack(ao, a, b, prec, batch)
    if parts is not None:
        (first, second, steps, swapped), _ = parts
        if one_launch(first, second, prec, steps, swapped):
            return steps.count, True
    (a0, sa), (b0, sb) = (_as_read(t, batch) for t in (a, _swap_last(b)))
    steps = _stack_steps(batch, (sa, sb), ITEMSIZE[a0.dtype])
    return (steps.count if steps and one_launch(a0, b0, prec, steps) else 1), False


def _as_read(t, batch):
    """``(first, strides)``: the 2-D Operand of the first matrix of ``t`` (..., rows, K)
    as :func:`_stack_on_ours` reads it, and the element strides of its matrices over
    ``batch`` (broadcast dims: 0): ``t``'s own where its K dim is read in place
    (:func:`_in_place`), else those of its copy (C-contiguous, in rows of
    :func:`~cupykern.gemm_operands.padded_ld`, at a fresh allocation's 16-byte start)."""
    o = operand(t, "b")
    rows, K = o.shape[-2:]
    if _in_place(o):
        strides, first = o.strides[:-2], _matrix(o, (rows, K), o.strides[-2:])
    else:
        shape = o.shape[:-1] + (padded_ld(o),)
        strides = tuple(math.prod(shape[i + 1:]) for i in range(o.ndim - 2))
        first = _matrix(o, (rows, K), (shape[-1], 1), 0)
    strides = tuple(0 if n == 1 else s for n, s in zip(o.shape[:-2], strides))
    return first, (0,) * (len(batch) - len(strides)) + strides


def _matrix(o, shape, strides, ptr=None):
    """The 2-D Operand of one matrix of the stack Operand ``o``: ``shape`` and element
    ``strides``, from ``ptr`` (default: ``o``'s first element)."""
    return Operand(o.obj, o.kind, o.dtype, shape, strides, o.ptr if ptr is None else ptr,
                   o.device, o.name, o.torch)


def _stack_steps(batch, strides, isz):
    """The :class:`~cupykern.gemm_kernels.Stack` of a stack's one launch
    (:func:`~cupykern.gemm_kernels.batched_call`; ``strides``: the operands' element
    strides over ``batch``): each operand's stride from a matrix to the next
    (:func:`_stack_stride`) over one level of batch dims, else over two (the first dims
    an outer level, the rest an inner one: attention's (batch, head) views), or None
    where neither walks every operand or a matrix starts off its first one's 16-byte
    alignment (:func:`_misaligned`)."""
    if _misaligned(batch, strides, isz):
        return None
    for cut in range(len(batch)):  # batch[:cut] the outer level, batch[cut:] the inner
        steps = [(_stack_stride(batch[cut:], s[cut:]), _stack_stride(batch[:cut], s[:cut]))
                 for s in strides]
        if None not in (step for pair in steps for step in pair):
            return Stack(math.prod(batch), math.prod(batch[cut:]), *steps)
    return None


def _misaligned(batch, strides, isz) -> bool:
    """Whether some matrix of a stack starts off its first one's 16-byte alignment (then
    each has its own plan): ``strides``, each operand's element strides over ``batch``."""
    return any(n > 1 and (s * isz) % 16 for st in strides for n, s in zip(batch, st))


def _stack_stride(batch, strides):
    """The one element stride from each matrix of a stack (``batch`` dims in C order, the
    operand's ``strides`` over them) to the next, or None where no single stride walks
    it (0: one matrix, broadcast)."""
    dims = [(n, s) for n, s in zip(batch, strides) if n > 1]
    step = dims[-1][1] if dims else 0
    expect = step
    for n, s in reversed(dims):
        if s != expect:
            return None
        expect = s * n
    return step


def _matmul_gpu(ao, bo, prec, shape):
    """A new array of ``shape`` holding ``a @ b`` (GPU Operands, nothing empty)."""
    a, b = _as_matrices(ao, bo)
    if _matmul_route(ao, bo, prec) == VENDOR:
        return vendor_of(ao.kind).matmul(a, b, prec).reshape(shape)
    flat = _folded(ao, bo)
    if flat is not None:
        a = flat
    if a.ndim == 2 and b.ndim == 2:
        return mm(a, b, prec).reshape(shape)
    return _stack_on_ours(ao, a, b, prec).reshape(shape)


def _stack_on_ours(ao, a, b, prec):
    """A stack of products (batch dims broadcast) on our 2-D GEMM (float32 "highest"
    3xTF32, CuPy bfloat16): on Hopper, one launch reading b in place (and a, or its
    K-major copy) where :func:`_stack_call` plans it; otherwise each operand is first made
    K-major in one copy
    where it is not (b: its transpose), so that every matrix reads alike; then one launch
    with the matrix in the grid (Hopper's wgmma,
    :func:`~cupykern.gemm_kernels.batched_call`, where each operand's matrices lie one
    stride apart), else the kernel planned once for the first matrix and launched per
    matrix with its offsets, in one batch."""
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    M, N = a.shape[-2], b.shape[-1]
    call = _stack_call(ao, a, b, prec, batch)
    if call is not None:
        c = empty(ao, batch + (M, N))
        call(a, b, c)
        return c
    at, bt = (_k_major(t) for t in (a, _swap_last(b)))
    at, bt = (operand(_broadcast_to(t, batch + t.shape[-2:]), n) for t, n in ((at, "a"), (bt, "b")))
    isz = ITEMSIZE[ao.dtype]
    a0, b0 = (_matrix(o, o.shape[-2:], o.strides[-2:]) for o in (at, bt))
    c = empty(ao, batch + (M, N))
    strides = (at.strides[:-2], bt.strides[:-2])
    if _misaligned(batch, strides, isz):  # (each matrix its own plan)
        for i in np.ndindex(*batch):
            gemm(operand(at.obj[i], "a"), operand(bt.obj[i], "b"), operand(c[i], "out"), prec)
        return c
    place = Place(ao)
    steps = _stack_steps(batch, strides, isz)
    stack = steps and batched_call(a0, b0, prec, steps)
    if stack:
        launch_all(place, stack(a0.ptr, b0.ptr, place.ptr(c)))
        return c
    kernel = gemm_kernel(a0, b0, prec)
    call = gemm_call(kernel, a0, b0, N)
    ws = workspace(place, kernel)
    wsp, cp = (data_ptr(ws) if ws is not None else 0), place.ptr(c)
    launches = []
    for j, i in enumerate(np.ndindex(*batch)):
        oa = sum(k * s for k, s in zip(i, at.strides[:-2]))
        ob = sum(k * s for k, s in zip(i, bt.strides[:-2]))
        launches.extend(call(a0.ptr + oa * isz, b0.ptr + ob * isz, cp + j * M * N * isz, 0, 0,
                             0, 0, wsp))
    launch_all(place, launches)
    return c


def _stack_call(ao, a, b, prec, batch):
    """``call(a, b, c)``: queues the stack ``a @ b`` into ``c`` (C-contiguous; arrays that
    start at their first matrix) on one launch of Hopper's gemm_wgmma (:func:`_planned_stack`:
    b read in place, a in place or from its K-major copy, made by the call), or None."""
    parts = _planned_stack(ao, a, b, prec, batch)
    if parts is None:
        return None
    (first, second, steps, swapped), copy = parts
    stack = batched_call(first, second, prec, steps, transposed_c=swapped)
    if stack is None:
        return None
    place = Place(ao)
    ptr = place.ptr

    def call(a, b, c):
        if copy:
            a = _k_major(a)  # (held until its product is queued)
        ap, bp = ptr(a), ptr(b)
        launch_all(place, stack(bp, ap, ptr(c)) if swapped else stack(ap, bp, ptr(c)))
    return call


def _planned_stack(ao, a, b, prec, batch):
    """``((first, second, steps, swapped), copy)``: :func:`~cupykern.gemm_kernels.batched_call`'s
    operands for the stack ``a @ b`` on one launch that reads b in place: b's matrices
    K-major already (a transposed view), or row-major (as a batched b usually is) and
    computed as ``(b^T a^T)^T`` (``swapped``), each read as a transposed A by TMA and each
    product stored transposed (TF32 / 3xTF32), so that b's transpose is never copied (1 GB
    each way at (128, 512, 1024) @ (128, 1024, 2048)). a is read in place where it is
    K-major, else (``copy``) from its K-major copy (:func:`_k_major`, whose layout
    :func:`_as_read` gives), only where a's matrices are no larger than b's (M <= N: a
    backward's q^T ds, not its p^T g, whose copy would move more bytes than the product
    reads). None where b needs a copy, a is a vector needing one, or the matrices have no
    strides of one launch (:func:`_stack_steps`); the kernel may still decline (another
    arch or dtype, split K, K not a multiple of its K slice when swapped:
    :func:`~cupykern.gemm_kernels.one_launch`)."""
    if _loader.device_cc(ao.device) != 90:
        return None
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    bt = operand(_broadcast_to(_swap_last(b), batch + (N, K)), "b")
    b0 = _matrix(bt, bt.shape[-2:], bt.strides[-2:])
    lay = layout(b0)
    if lay is None or not (lay[0] or _in_place(bt)):
        return None
    copy = not _in_place(operand(a, "a"))
    if copy and (ao.ndim < 2 or M > N):
        return None
    a0, sa = _as_read(a, batch)
    steps = _stack_steps(batch, (sa, bt.strides[:-2]), ITEMSIZE[ao.dtype])
    if not steps:
        return None
    return ((b0, a0, steps.swapped(), True) if lay[0] else (a0, b0, steps, False)), copy


def _stack_plan(ao, bo, prec, shape):
    """``run(a, b) -> a @ b`` for calls like this stack where :func:`_stack_call` runs it
    (planned once: a's copy where it has one, a new output and one launch a call), else
    None. Unplanned, a small stack's call took ~144 us of Python (CPU, (96, 512, 64) @
    (96, 64, 512)), more than SGEMM's whole call on an H200 (102 us)."""
    a, b = _as_matrices(ao, bo)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    call = _stack_call(ao, a, b, prec, batch)
    if call is None:
        return None
    place, out = Place(ao), batch + (a.shape[-2], b.shape[-1])

    def run(a, b, *_):
        c = empty(place, out)
        call(a, b, c)  # (a and b start where their matrix views do)
        return c.reshape(shape)
    return run


def _swap_last(t):
    """``t`` with its last two dims swapped (a view)."""
    return t.mT if is_torch(t) else _loader.cupy().swapaxes(t, -1, -2)


def _k_major(t):
    """``t`` (..., rows, K) itself where our GEMM reads its rows in place (:func:`_in_place`),
    else a copy: C-contiguous, or in rows of :func:`~cupykern.gemm_operands.padded_ld`
    (Hopper's float32 rows of K % 4, which its TMA then reads)."""
    o = operand(t, "b")
    if _in_place(o):
        return t
    ld, (rows, K), batch = padded_ld(o), o.shape[-2:], o.shape[:-2]
    sr, sc = o.strides[-2:]
    step, count = _stack_stride(batch, o.strides[:-2]), math.prod(batch)
    if step is not None and 1 in (sr, sc) and count <= MAX_GRID_Y:
        # the tiled copy, every matrix on one launch (torch's / CuPy's strided copy of a
        # transposed stack runs at a third of copy speed)
        first = _matrix(o, (rows, K), (sr, sc))
        copy = copy_plan(first, sc if sr == 1 else sr, sr == 1, count, step)[1]
        launches, held = [], []
        copy(o.ptr, launches, held)
        launch_all(o, launches)
        return held[0].reshape(batch + (rows, ld))[..., :K]
    if ld == K:
        return contiguous(o)
    out = empty(o, batch + (rows, ld))[..., :K]  # (the pad is never read: maps stop at K)
    copy_into(out, t)
    return out


def _in_place(o) -> bool:
    """Whether our GEMM reads the matrices of the Operand ``o`` (..., rows, K) in place:
    K contiguous, and where rows are padded for Hopper (:func:`padded_ld`), rows that step
    on 16 bytes from a 16-byte start."""
    K = o.shape[-1]
    return (o.strides[-1] == 1 or K == 1) and (
        padded_ld(o) == K or (o.ptr % 16 == 0 and o.ndim > 1 and o.strides[-2] % 4 == 0))


def _broadcast_to(t, shape):
    return t.expand(shape) if is_torch(t) else _loader.cupy().broadcast_to(t, shape)


def _matmul_fresh(checked, a, b, precision, out, grad=False):
    """``run(a, b) -> a @ b`` for calls like this one (``checked``: their validation),
    planned once: the vendor's call, our planned 2-D GEMM
    (:func:`~cupykern.gemm_operands.mm_plan`, a folded stack's too), or a stack's one
    launch in place (:func:`_stack_plan`); None where the call needs the general path
    (CPU, empty, a stack whose operands are copied, an operand copied otherwise). With
    ``grad``, as :func:`_fresh`'s."""
    ao, bo, prec, shape, _ = checked
    if ao.kind == "cpu" or 0 in shape or ao.shape[-1] == 0:
        return None
    if _matmul_route(ao, bo, prec, grad) == VENDOR:
        K = ao.shape[-1]
        N = bo.shape[-1] if bo.ndim > 1 else 1
        return vendor_matmul(ao.kind, prec, (ao.size // K, N, K, ao.dtype, bo.ndim > 1))
    if grad:
        return None
    flat = _folded(ao, bo)
    if bo.ndim > 2 or (bo.ndim == 2 and ao.ndim > 2 and flat is None):
        return _stack_plan(ao, bo, prec, shape)
    if bo.ndim != 2:
        return None
    if ao.ndim == 2:
        return on_arrays(mm_plan(ao, bo, prec))
    plan = None if flat is None else mm_plan(operand(flat, "a"), bo, prec)  # (1-D a: None)
    if plan is None:
        return None
    ptr = plan.place.ptr  # (the folded view starts where a does)
    return lambda a, b, *_: plan(ptr(a), ptr(b), 0).reshape(shape)


def eager_plan_matmul(a, b, precision, state, grad=False):
    """As :func:`eager_plan`, for :func:`matmul` (ours' ``run(a, b, *_)``)."""
    return _eager_plan(_matmul_plans, _matmul_grad_plans, _matmul_key(a, b, precision, state),
                       grad, check_matmul, _matmul_fresh, (a, b, precision, None))


_matmul_grad_plans: dict = {}  # as _grad_plans, for matmul


def _matmul_key(a, b, precision, state) -> tuple:
    """The key of :func:`matmul_core`'s cached plans (``state``: :func:`vendor_state` of a)."""
    return signature(a), signature(b), precision, state

register_plans(_plans, _grad_plans, _matmul_plans, _matmul_grad_plans)  # (route-dependent)
