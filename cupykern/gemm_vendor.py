"""The vendor's products: cuBLAS through torch (the torch layer's ``Vendor``) or through
CuPy (:class:`_CupyVendor`), for the plain products that :func:`cupykern.gemm_route.route`
gives them, as plans (:class:`VendorPlan`) made once per call signature."""
from __future__ import annotations

import math

import numpy as np

from . import _loader
from ._array import _is_cupy, is_torch, torch_layer
from .gemm_checks import matmul_shape

def vendor_linear(kind: str, precision: str, problem):
    """``run(x, weight, bias) -> x @ weight.T + bias``: the vendor's product (a new
    C-contiguous array), as a plan of ``problem`` (M, N, K, dtype) with its eager form
    (:func:`_plan`)."""
    vendor = vendor_of(kind)
    return _plan(vendor, vendor.linear, precision, vendor.linear_form(*problem, precision))


def vendor_matmul(kind: str, precision: str, problem):
    """``run(a, b) -> a @ b`` (NumPy's matmul): the vendor's product, as a plan of
    ``problem`` (M, N, K, dtype, b_matrix), with its eager form."""
    vendor = vendor_of(kind)
    return _plan(vendor, vendor.matmul, precision, vendor.matmul_form(*problem, precision))


def _plan(vendor, impl, precision, eager):
    """A :class:`VendorPlan`; for a library without autocast (CuPy), its eager form itself
    where it has one: the plan's host time is a small call's."""
    if eager is not None and vendor.autocasting is None:
        return eager
    return VendorPlan(vendor, impl, precision, eager)


def vendor_of(kind: str):
    """The vendor's products for arrays of ``kind``: an object with ``linear(x, w, b,
    precision)``, ``matmul(a, b, precision)`` (NumPy semantics, batched), their eager
    forms for one problem (``linear_form`` / ``matmul_form``, see :class:`VendorPlan`;
    None where the library has none), valid unless ``autocasting()`` (None: a library
    without autocast),
    ``takes(dtype, precision)`` (whether the library's own float32 setting gives that
    precision now: the vendor path never flips a library-wide switch, which other threads
    would see), ``state()`` (that setting, part of each plan's key), ``capturing()``
    (whether its current stream captures a CUDA graph) and ``prepare(device)``
    (:func:`planned_capture`)."""
    return torch_layer("gemm").Vendor if kind == "torch" else _CupyVendor


def vendor_state(x):
    """The float32 setting of ``x``'s library that :func:`~cupykern.gemm_route.route_of` read (None for
    anything else): calls under another setting plan again."""
    if _is_cupy(x):  # (first: CuPy's planned calls read it every call, torch's only off their shape plan)
        return _CupyVendor.state()
    return vendor_of("torch").state() if is_torch(x) else None


def float64_capture(x) -> bool:
    """Whether ``x`` is of 8-byte elements (float64, once checked) and the current stream of
    its library (torch or CuPy) is capturing a CUDA graph: where a fused op's float64
    products follow :func:`~cupykern.gemm_route.route` (``captured``, see :func:`~cupykern.gemm_route.fused_vendor`); part of its
    plans' keys (other dtypes' plans do not depend on capture)."""
    if getattr(x, "itemsize", 0) != 8:
        return False
    if is_torch(x):
        return x.is_cuda and vendor_of("torch").capturing()
    return _CupyVendor.capturing() if _is_cupy(x) else False


def planned_capture(a) -> bool:
    """For a fused op's plan (``a``: its 2-D GPU Operand): :func:`float64_capture` of
    ``a``'s array, and where it is False, for float64, the cuBLAS handle of ``a``'s
    library made for this thread and device now. The plan made again while a CUDA graph
    is captured takes the vendor's products where this one, warmed up before the
    capture, runs ours; a first cuBLAS call inside the capture would create the handle
    there, which fails (H200: CUBLAS_STATUS_NOT_INITIALIZED, the capture invalidated).
    Autograd runs a backward on a thread of its own: its plans prepare there."""
    captured = float64_capture(a.obj)
    if not captured and a.dtype == "float64":
        vendor_of(a.kind).prepare(a.device)
    return captured


class _CupyVendor:
    """cuBLAS through CuPy, on CuPy's current stream. float32 "highest" is cuBLAS's SGEMM:
    ``cupy.matmul`` (CUBLAS_COMPUTE_32F: exact fp32 products) unless CuPy's compute type is
    TF32 (CUPY_TF32=1), then ``cupy.cublas.gemm`` (SGEMM whatever CUPY_TF32 says; this path
    through it took 79 us a call against cupy's @ 36, H100, 256x1024x1024); "high" /
    "medium" only where CuPy's float32 compute type is TF32 already (CUPY_TF32=1: cuBLAS's
    CUBLAS_COMPUTE_32F_FAST_TF32), else ours; float64 / float16 cupy.matmul as it is
    (DGEMM on the FP64 tensor cores; fp16 products with fp32 sums). :meth:`linear` adds
    its bias to the stored product, so each output rounds twice: in float32 / float64 the
    second rounding is within the product's own error, in float16 it costs up to half an
    ulp of the product, many of the result's where the bias cancels most of it; the route
    gives a float16 linear with a bias to ours, which rounds once
    (:func:`cupykern.gemm._linear_route`)."""

    _compute_type = None  # (CuPy's get_compute_type, bound once: a plan key reads it each call)

    @staticmethod
    def state():
        get = _CupyVendor._compute_type
        if get is None:
            get = _CupyVendor._compute_type = _loader.cupy()._core._routines_linalg.get_compute_type
        return get(np.float32)

    @staticmethod
    def capturing():
        return _loader.cupy().cuda.get_current_stream().is_capturing()

    @staticmethod
    def prepare(device: int):
        _ = _loader.cupy().cuda.Device(device).cublas_handle  # (made for this thread if none)

    autocasting = None  # (CuPy has no autocast: its eager forms are the plans, _plan)

    @staticmethod
    def linear_form(M: int, N: int, K: int, dtype: str, precision: str):
        """``fn(x, w, b)``: :meth:`linear` of one problem as CuPy's own calls (x's rows
        times w.T, the bias added to the product), with what :meth:`matmul` decides per
        call decided; None where that is not cupy.matmul (K == 0; SGEMM under CuPy's TF32
        compute type)."""
        if _CupyVendor._matmul_form(K, dtype, precision) is None:
            return None
        matmul, shape = _loader.cupy().matmul, (M, K)

        def form(x, w, b):
            if x.ndim == 2:
                y = matmul(x, w.T)
            else:
                y = matmul(x.reshape(shape), w.T).reshape(x.shape[:-1] + (N,))
            if b is not None:
                y += b
            return y
        return form

    @staticmethod
    def matmul_form(M: int, N: int, K: int, dtype: str, b_matrix: bool, precision: str):
        """``fn(a, b)``, as :meth:`linear_form` for :meth:`matmul`."""
        return _CupyVendor._matmul_form(K, dtype, precision)

    @staticmethod
    def _matmul_form(K: int, dtype: str, precision: str):
        cupy = _loader.cupy()
        if K == 0 or (dtype == "float32" and precision == "highest"
                      and _CupyVendor.state() == cupy._core._routines_linalg.COMPUTE_TYPE_TF32):
            return None
        return cupy.matmul

    @staticmethod
    def takes(dtype: str, precision: str) -> bool:
        if dtype != "float32" or precision == "highest":
            return True
        return _CupyVendor.state() == _loader.cupy()._core._routines_linalg.COMPUTE_TYPE_TF32

    @staticmethod
    def matmul(a, b, precision):
        cupy = _loader.cupy()
        if a.shape[-1] == 0:  # (cuBLAS is not asked to sum nothing)
            return cupy.zeros(matmul_shape(a.shape, b.shape), a.dtype)
        if (a.dtype == np.float32 and precision == "highest"
                and _CupyVendor.state() == cupy._core._routines_linalg.COMPUTE_TYPE_TF32):
            return _CupyVendor._sgemm(a, b)
        return cupy.matmul(a, b)

    @staticmethod
    def _sgemm(a, b):
        import cupy.cublas  # (a submodule `import cupy` leaves out)
        cupy = _loader.cupy()
        if a.ndim == 1 or b.ndim == 1:
            shape = matmul_shape(a.shape, b.shape)
            return _CupyVendor._sgemm(a[None] if a.ndim == 1 else a,
                                      b[:, None] if b.ndim == 1 else b).reshape(shape)
        if a.ndim == 2 and b.ndim == 2:
            return cupy.cublas.gemm("N", "N", a, b, out=cupy.empty((a.shape[0], b.shape[1]), a.dtype))
        shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        a = cupy.broadcast_to(a, shape + a.shape[-2:])
        b = cupy.broadcast_to(b, shape + b.shape[-2:])
        out = cupy.empty(shape + (a.shape[-2], b.shape[-1]), a.dtype)
        for i in np.ndindex(*shape):  # (one SGEMM per matrix: cuBLAS's batched SGEMM takes no strides of 0)
            cupy.cublas.gemm("N", "N", a[i], b[i], out=out[i])
        return out

    @staticmethod
    def linear(x, w, b, precision):  # (the bias after the product: see the class's note)
        lead = x.shape[:-1]  # (math.prod: np.prod of a tuple costs a call microseconds)
        y = _CupyVendor.matmul(x.reshape(math.prod(lead), x.shape[-1]), w.T, precision)
        y = y.reshape(lead + (w.shape[0],))
        if b is not None:
            y += b
        return y


class VendorPlan:
    """A plan where :func:`~cupykern.gemm_route.route` chose the vendor: ``run(*arrays) = impl(*arrays,
    precision)`` (linear's ``(x, weight, bias)``, matmul's ``(a, b)``); ``eager``: the
    same product as the vendor's library computes it outside autocast and tracing, with
    what ``impl`` decides per call decided (``eager(*arrays)``), or None (CuPy's). A run
    takes the eager form unless the ``vendor`` is autocasting."""

    __slots__ = ("impl", "precision", "eager", "_autocasting")

    def __init__(self, vendor, impl, precision, eager=None):
        self.impl, self.precision, self.eager = impl, precision, eager
        self._autocasting = vendor.autocasting if eager is not None else None

    def __call__(self, *arrays):
        if self.eager is not None and not self._autocasting():
            return self.eager(*arrays)
        return self.impl(*arrays, self.precision)
