"""One bridge for every op: NumPy, CuPy and torch inputs, validated the same way.

An :class:`Operand` records what a kernel launch needs (raw pointer, shape,
element strides, dtype name, device) without DLPack round-trips, and remembers
the input's kind so results come back as the caller's type:

* ``"cupy"``  - CuPy array; launch on CuPy's current stream.
* ``"torch"`` - torch CUDA tensor; launch on torch's current stream, zero-copy,
  outputs allocated by torch's caching allocator.
* ``"cpu"``   - NumPy array or torch CPU tensor; computed by the op's reference path.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import struct
import sys
import threading

import numpy as np

from . import _loader
from ._geometry import byte_extent, extents_meet, row_stride, self_overlapping
from ._tma import TensorMap

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
CTYPE = {"float16": "half_t", "bfloat16": "bf16_t", "float32": "float", "float64": "double"}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


_TORCH = None


def _torch():
    """torch once it has been imported (cupykern never imports it itself), remembered:
    code that torch.compile traces must not read sys.modules, which the compiler's own
    imports change while it wraps the dict."""
    global _TORCH, _TORCH_PLAIN, _STRIDED
    if _TORCH is None:
        _TORCH = sys.modules.get("torch")
        if _TORCH is not None:
            _TORCH_PLAIN, _STRIDED = (_TORCH.Tensor, _TORCH.nn.Parameter), _TORCH.strided
    return _TORCH


# Plain tensor types and torch.strided once torch is imported (signature's hot path).
_TORCH_PLAIN, _STRIDED = (), None
_torch()


def is_torch(x) -> bool:
    if type(x) in _TORCH_PLAIN:  # (the common call: no call of _torch)
        return True
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


_CUPY_ARRAY = None  # cupy.ndarray once a CuPy array has been seen (signature's hot path)


def _is_cupy(x) -> bool:
    global _CUPY_ARRAY
    if type(x) is _CUPY_ARRAY:
        return True
    cp = sys.modules.get("cupy")
    if cp is None or not isinstance(x, cp.ndarray):
        return False
    _CUPY_ARRAY = cp.ndarray
    return True


class Operand:
    """A validated array argument. ``strides`` are in elements; ``torch``: a torch tensor."""

    __slots__ = ("obj", "kind", "dtype", "shape", "strides", "ptr", "device", "name", "torch")

    def __init__(self, obj, kind, dtype, shape, strides, ptr, device, name, torch=False):
        self.obj, self.kind, self.dtype, self.shape = obj, kind, dtype, shape
        self.strides, self.ptr, self.device, self.name = strides, ptr, device, name
        self.torch = torch

    @property
    def array_dtype(self):
        """The array library's own dtype object (torch.dtype / numpy.dtype)."""
        return self.obj.dtype

    @property
    def proto(self):
        """A plain tensor whose ``new_empty`` makes outputs like this one (torch kind)."""
        t = _torch()
        if type(self.obj) in (t.Tensor, t.nn.Parameter):  # (Parameter.new_empty: a Tensor)
            return self.obj
        return t.empty(0, dtype=self.obj.dtype, device=self.obj.device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def is_c_contiguous(self) -> bool:
        expect = 1
        for n, s in zip(reversed(self.shape), reversed(self.strides)):
            if n != 1 and s != expect:
                return False
            expect *= n
        return True


def operand(x, name: str, dtypes=FLOAT_DTYPES) -> Operand:
    """Validate ``x`` (argument ``name``) and describe it. Raises TypeError."""
    t = _torch()
    if t is not None and isinstance(x, t.Tensor):
        if x.layout is not t.strided or x.is_nested:
            raise TypeError(f"{name}: expected a strided (dense) tensor, got "
                            + ("a nested tensor" if x.is_nested else f"layout {x.layout}"))
        dtype = str(x.dtype).removeprefix("torch.")
        _check_dtype(dtype, name, dtypes)
        if x.is_cuda:
            kind, ptr, dev = "torch", x.data_ptr(), x.device.index
        elif x.device.type == "cpu":
            kind, ptr, dev = "cpu", 0, None
        else:
            raise TypeError(f"{name}: expected a CUDA or CPU tensor, got device {x.device}")
        return Operand(x, kind, dtype, tuple(x.shape), tuple(x.stride()), ptr, dev, name, True)
    if _is_cupy(x):
        dtype = x.dtype.name
        _check_dtype(dtype, name, dtypes)
        strides = tuple(s // x.itemsize for s in x.strides)
        return Operand(x, "cupy", dtype, x.shape, strides, x.data.ptr, x.device.id, name)
    if isinstance(x, np.ndarray):
        if isinstance(x, (np.matrix, np.ma.MaskedArray)):  # 2-D-only algebra; a mask we would ignore
            raise TypeError(f"{name}: {type(x).__module__}.{type(x).__name__} is not supported; "
                            "pass a plain numpy.ndarray (np.asarray(x), or x.filled(...) for a mask)")
        _check_dtype(x.dtype.name, name, dtypes)
        strides = tuple(s // x.itemsize for s in x.strides)
        return Operand(x, "cpu", x.dtype.name, x.shape, strides, 0, None, name)
    raise _not_an_operand(x, name)


def _not_an_operand(x, name: str) -> TypeError:
    """The TypeError for an argument :func:`operand` does not take: a clear one for a JAX
    tracer, a :class:`ProducerArgument` for another library's array (which the public
    functions import: :func:`accepts_producers`)."""
    if is_tracer(x):
        return TypeError(f"{name}: got a JAX tracer ({type(x).__name__}): cupykern's functions "
                         "take concrete arrays, not traced values inside jax.jit, grad or vmap; "
                         "call them outside the traced function")
    if is_producer(x):
        return ProducerArgument(f"{name}: got a {type(x).__name__}, another library's array: pass "
                                "it to cupykern's public functions (they import it through "
                                "DLPack), or convert it first with cupy.from_dlpack")
    return TypeError(f"{name}: expected a cupy.ndarray, torch.Tensor or numpy.ndarray, got "
                     f"{type(x).__name__} (other libraries' arrays: with __dlpack__ or "
                     "__cuda_array_interface__)")


def _check_dtype(dtype, name, dtypes):
    if dtype not in dtypes:
        raise TypeError(f"{name}: unsupported dtype {dtype}; expected one of {', '.join(dtypes)}")


def same_place(a: Operand, b: Operand) -> None:
    """``b`` must live where ``a`` lives (same kind and device). Raises ValueError/TypeError."""
    if a.kind != b.kind or a.torch != b.torch:
        raise TypeError(f"{b.name}: is a {_describe(b)} but {a.name} is a {_describe(a)}; "
                        "do not mix CPU and GPU or CuPy and torch arguments")
    if a.device != b.device:
        raise ValueError(f"{b.name}: is on cuda:{b.device} but {a.name} is on cuda:{a.device}")


def _describe(a: Operand) -> str:
    if a.kind == "cpu":
        return "torch CPU tensor" if a.torch else "NumPy array"
    return {"cupy": "CuPy array", "torch": "torch CUDA tensor"}[a.kind]


def normalize_axis(axis, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: {axis} is out of range for an array of {ndim} dimension(s)")
    return int(axis) % ndim


def stream_ptr(a) -> int:
    """The stream a launch for ``a`` (an Operand or a Place) must go on, as a raw handle:
    torch's current stream for tensors, CuPy's for CuPy arrays."""
    if a.kind == "torch":
        return _torch_stream(a.device)
    return _loader.cupy().cuda.get_current_stream().ptr


def empty(like, shape, dtype: str | None = None):
    """A new uninitialised C-contiguous array of the caller's kind, on ``like``'s device
    (``like``: an Operand or a Place), of ``like``'s dtype or the named one."""
    same = dtype is None or dtype == like.dtype
    if like.kind == "torch":  # new_empty: a fifth less host time than torch.empty(device=)
        return like.proto.new_empty(shape) if same else \
            like.proto.new_empty(shape, dtype=getattr(_torch(), dtype))
    cupy = _loader.cupy()
    with _on(like.device):
        return cupy.empty(shape, dtype=like.array_dtype if same else dtype)


def _on(device: int):
    """The context in which CuPy allocates on ``device``: ``cupy.cuda.Device`` (an object,
    a thread-local device stack, two runtime calls) only for another device than CuPy's
    current one, else nothing to enter."""
    return _HERE if _api()[0]() == device else _loader.cupy().cuda.Device(device)


_HERE = contextlib.nullcontext()  # (reusable, reentrant: one for every call)


def head(flat, shape):
    """The leading elements of the 1-D array ``flat`` as a C-contiguous view of ``shape``
    (CuPy or torch; the view keeps all of ``flat`` alive)."""
    if is_torch(flat):
        strides, n = [], 1
        for s in reversed(shape):
            strides.append(n)
            n *= s
        return flat.as_strided(shape, strides[::-1])
    return flat[:int(np.prod(shape))].reshape(shape)


def data_ptr(obj) -> int:
    """Raw device pointer of a CuPy array or torch tensor."""
    return obj.data_ptr() if is_torch(obj) else obj.data.ptr


def native(dtype):
    """A NumPy ``dtype`` in this machine's byte order: results are native whatever the
    operands' order, as NumPy's own ('>f4' operands give '<f4' on little-endian hosts)."""
    return dtype.newbyteorder("=")


def contiguous(a: Operand, copy: bool = False):
    """``a.obj`` as a C-contiguous array of the same kind (a new one if ``copy``,
    else a copy only if needed)."""
    if a.kind == "torch":
        t = _torch()
        return a.obj.clone(memory_format=t.contiguous_format) if copy else a.obj.contiguous()
    cupy = _loader.cupy()
    with _on(a.device):
        return cupy.array(a.obj, order="C", copy=True) if copy else cupy.ascontiguousarray(a.obj)


def require_writable(obj, name: str, why: str = "") -> None:
    """ValueError naming ``name`` if ``obj`` is a read-only NumPy array."""
    if isinstance(obj, np.ndarray) and not obj.flags.writeable:
        raise ValueError(f"{name}: is read-only{why}")


def check_out(out, ref: Operand, shape, dtype: str | None = None, inputs=(),
              in_place: bool = False) -> Operand:
    """Validate a user-supplied ``out=``: kind, device, shape and dtype must match, it
    must be writable with distinct elements, and on the GPU it must not share memory
    with any of ``inputs`` (Operands or None), except that with ``in_place`` it may be
    exactly one of them (the same view)."""
    o = operand(out, "out")
    same_place(ref, o)
    if tuple(o.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(o.shape)}")
    if o.dtype != (dtype or ref.dtype):
        raise TypeError(f"out: expected dtype {dtype or ref.dtype}, got {o.dtype}")
    require_writable(out, "out")
    if self_overlapping(o.shape, o.strides):
        raise ValueError("out: some of its elements share memory (an expanded or stride-0 "
                         "view); pass an array whose elements are distinct")
    if o.kind != "cpu":  # the CPU path computes the whole result before writing out
        span = byte_extent(o.ptr, o.shape, o.strides, ITEMSIZE[o.dtype])
        for a in inputs:
            if a is None or (in_place and (a.ptr, tuple(a.shape), a.strides) ==
                             (o.ptr, tuple(o.shape), o.strides)):
                continue
            if extents_meet(span, byte_extent(a.ptr, a.shape, a.strides, ITEMSIZE[a.dtype])):
                raise ValueError(f"out: overlaps {a.name} in memory"
                                 + (" without being the same view" if in_place else "")
                                 + "; pass a separate output array")
    return o


_SCALAR = {"int": np.int32, "double": np.float64}


def scalar(value, ctype: str):
    """A kernel argument of C type ``int`` or ``double``. The one convention for kernel
    arguments: pointers and ``long long`` go as Python ints (CuPy passes those as 64-bit),
    every other scalar through this function, typed exactly as the kernel declares it."""
    return _SCALAR[ctype](value)


# ------------------------------------------------------------ the torch layer
# cupykern.torch sits above this layer, which never imports it: its modules register
# here when imported, and the package installs how to import it (the torch layer's
# import), which a lookup runs on a miss (torch imported after cupykern).

_LAYERS: dict = {}  # stem -> the torch layer's module of that name, registered by it
_IMPORT_TORCH_LAYER = None  # set by the package: imports cupykern.torch


def register_torch_layer(stem: str, module) -> None:
    """Make ``module`` (``cupykern.torch.<stem>``) the torch layer of ``stem``."""
    _LAYERS[stem] = module


def set_torch_layer_import(import_layer) -> None:
    """``import_layer()`` imports the torch layer, which registers its modules and raw
    stream getter here (:func:`register_torch_layer`, :func:`register_torch_stream`)."""
    global _IMPORT_TORCH_LAYER
    _IMPORT_TORCH_LAYER = import_layer


def torch_layer(stem: str):
    """``cupykern.torch.<stem>``: where torch tensors go (custom ops, autograd). A lookup
    in a dict of our own, which torch.compile traces without a graph break (not
    sys.modules: see :func:`_torch`); on a miss the torch layer is imported first."""
    mod = _LAYERS.get(stem)
    if mod is None:
        _IMPORT_TORCH_LAYER()
        mod = _LAYERS[stem]
    return mod


def register_torch_stream(raw_stream) -> None:
    """``raw_stream(device)``: torch's current CUDA stream on ``device`` as a raw handle,
    what :func:`stream_ptr` returns for torch tensors (the torch layer hands it over)."""
    global _torch_stream
    _torch_stream = raw_stream


def _torch_stream(device: int) -> int:
    """Until the torch layer registers its getter: import the torch layer, then ask it."""
    _IMPORT_TORCH_LAYER()
    return _torch_stream(device)


def row_view_stride(o: Operand):
    """The row stride (elements, at least K) with which ``o`` (..., K) reads in place as
    2-D rows that are K-contiguous, or None if it must be copied first (see rows_2d)."""
    k = o.shape[-1]
    if o.ndim == 2:
        rs = row_stride(o.shape, o.strides)
        if rs is not None and rs >= k:
            return rs
    return k if o.is_c_contiguous() else None


def rows_2d(o: Operand, name: str) -> Operand:
    """``o`` (..., K) as a 2-D Operand (M, K) whose rows are K-contiguous, with its row
    stride in ``strides[0]`` (copies only if :func:`row_view_stride` says so)."""
    k = o.shape[-1]
    rs = row_view_stride(o)
    if rs is None:
        o, rs = operand(contiguous(o), name), k
    m = o.size // k if k else int(np.prod(o.shape[:-1]))
    return Operand(o.obj, o.kind, o.dtype, (m, k), (rs, 1), o.ptr, o.device, name, o.torch)


def launch(a, fn, grid, block, args, shared_mem: int = 0) -> None:
    """Launch ``fn`` on ``a``'s device and current stream (torch's or CuPy's); ``a`` is an
    Operand or a :class:`Place`."""
    launch_all(a, ((fn, grid, block, args, shared_mem),))


# Kernel arguments are packed by struct into a per-thread buffer whose argument
# addresses are the cuLaunchKernel parameter array (the driver copies the values before
# it returns): half the host time of CuPy's per-argument conversion. Scalars take 8-byte
# slots, tensor maps 128 bytes on a 64-byte boundary.
_SLOT = {int: "q", np.int32: "i4x", np.float64: "d", TensorMap: "128s"}  # see scalar()
_KERNEL_FORMATS: dict = {}  # kernel function -> struct format of its arguments
_OFFSETS: dict = {}  # struct format -> each argument's byte offset in it
_MAX_ARGS, _ARENA_BYTES = 32, 1024
_ARENA = threading.local()
_PAD = ((), (1, 1), (1,), ())  # the missing dimensions of a 1-, 2- or 3-d grid or block


def _format(types) -> str:
    """The struct format of kernel arguments of these types (TypeError for others),
    its argument offsets recorded in _OFFSETS."""
    bad = [t.__name__ for t in types if t not in _SLOT]
    if bad or len(types) > _MAX_ARGS:
        raise TypeError(f"kernel arguments: expected at most {_MAX_ARGS} of int "
                        f"(pointer, long long), numpy.int32, numpy.float64 or TensorMap, got {bad}")
    fmt, offsets = "=", []
    for t in types:
        size = struct.calcsize("=" + _SLOT[t])
        pad = -struct.calcsize(fmt) % (64 if size > 8 else 8)
        fmt += f"{pad}x" * (pad > 0)
        offsets.append(struct.calcsize(fmt))
        fmt += _SLOT[t]
    if struct.calcsize(fmt) > _ARENA_BYTES:
        raise TypeError(f"kernel arguments: more than {_ARENA_BYTES} bytes")
    _OFFSETS[fmt] = offsets
    return fmt


def _arena():
    """This thread's argument buffer: (its writable bytes, {format: address of that
    format's parameter array}, its address: a 64-byte boundary)."""
    arena = getattr(_ARENA, "arena", None)
    if arena is None:
        raw = np.zeros(_ARENA_BYTES + 64, np.uint8)
        base = -raw.ctypes.data % 64
        _ARENA.keep = [raw]  # (and each format's parameter array)
        arena = _ARENA.arena = (memoryview(raw)[base:base + _ARENA_BYTES], {}, raw.ctypes.data + base)
    return arena


def _param_array(arena, fmt: str) -> int:
    """The parameter array of arguments packed as ``fmt`` in this thread's buffer."""
    params = arena[2] + np.array(_OFFSETS[fmt], np.uint64)
    _ARENA.keep.append(params)
    arena[1][fmt] = params.ctypes.data
    return params.ctypes.data


_API = None  # CuPy's getDevice, setDevice, ctxGetCurrent, launchKernel, memsetAsync,
# launchCooperativeKernel, bound once


def _api():
    global _API
    if _API is None:  # (one assignment: threads racing here bind the same tuple)
        cuda = _loader.cupy().cuda
        _API = (cuda.runtime.getDevice, cuda.runtime.setDevice, cuda.driver.ctxGetCurrent,
                cuda.driver.launchKernel, cuda.runtime.memsetAsync,
                cuda.driver.launchCooperativeKernel)
    return _API


def _launch_calls(calls, stream: int, zero=(), cooperative=False) -> None:
    get_device, set_device, ctx_current, launch, memset, launch_cooperative = _API
    if not ctx_current():  # a thread's first launch: make the device's primary context current
        set_device(get_device())
    for ptr, nbytes in zero:
        memset(ptr, 0, nbytes, stream)
    arena = _arena()
    buf, by_format = arena[0], arena[1]
    pack = struct.pack_into
    for fn, grid, block, args, smem in calls:
        # Each kernel's argument types are fixed at its first launch (_format checks them
        # against _SLOT; the ops' tests check them against the kernels' signatures).
        fmt = _KERNEL_FORMATS.get(fn)
        if fmt is None:
            fmt = _KERNEL_FORMATS[fn] = _format(tuple(map(type, args)))
        params = by_format.get(fmt) or _param_array(arena, fmt)
        pack(fmt, buf, 0, *args)
        dims = (*grid, *_PAD[len(grid)], *block, *_PAD[len(block)], smem, stream, params)
        if cooperative:
            launch_cooperative(fn.ptr, *dims)
        else:
            launch(fn.ptr, *dims, 0)


def launch_all(a, calls, zero=(), cooperative=False) -> None:
    """Launch each ``(fn, grid, block, args, shared_mem)`` in order on ``a``'s device and
    current stream, looked up once, after zeroing each ``(pointer, bytes)`` of ``zero``
    there. ``args``: pointers and ``long long`` as Python ints, other scalars from
    :func:`scalar`. ``cooperative``: as cooperative launches (every CTA of a grid resident
    at once; the driver refuses a grid that cannot be)."""
    with _on(a.device):  # (CuPy's current stream is per device)
        _launch_calls(calls, stream_ptr(a), zero, cooperative)


class Place:
    """Where an Operand lives (kind, device, dtype) without the array itself: what a cached
    launch plan keeps, so that it holds no reference to the arrays it was planned for.
    :func:`empty` and :func:`launch` take it as they take an Operand."""

    __slots__ = ("kind", "device", "dtype", "array_dtype", "proto", "ptr")

    def __init__(self, a: Operand):
        self.kind, self.device, self.dtype = a.kind, a.device, a.dtype
        self.array_dtype = a.array_dtype
        # a plain tensor's new_empty (a subclass's would make outputs of the subclass)
        self.proto = _torch().empty(0, dtype=a.obj.dtype, device=a.obj.device) if a.torch else None
        # ptr(array) -> its data pointer (None -> 0), without data_ptr()'s type test
        tensor_ptr = _torch().Tensor.data_ptr if a.kind == "torch" else None
        self.ptr = (lambda v: 0 if v is None else tensor_ptr(v)) if tensor_ptr else \
            (lambda v: 0 if v is None else v.data.ptr)


UNPLANNED = object()  # the signature of an argument no plan is cached for


def signature(x):
    """What an op's checks and launch plan read of a GPU array argument, as a hashable key:
    dtype, device, shape, strides and the data pointer modulo 16 (alignment). Calls whose
    arguments share signatures validate and plan alike, so they can share a cached plan.
    None for None; :data:`UNPLANNED` for anything else (NumPy, CPU tensors, tensor
    subclasses, other types): see :func:`cached`."""
    if x is None:
        return None
    if type(x) in _TORCH_PLAIN:
        if x.is_cuda and x.layout is _STRIDED:  # (get_device: no torch.device object)
            return (x.dtype, x.get_device(), x.shape, x.stride(), x.data_ptr() & 15)
        return UNPLANNED
    # (_is_cupy's own first test, inline: a frame less on each of a CuPy call's three
    # signatures; data.device_id: no cupy.cuda.Device object)
    if type(x) is _CUPY_ARRAY or _is_cupy(x):
        data = x.data
        return (x.dtype, data.device_id, x.shape, x.strides, data.ptr & 15)
    if _TORCH is None and _torch() is not None:  # torch imported after cupykern
        return signature(x)
    return UNPLANNED


_PLAN_CACHE_SIZE = 4096


def plannable(key: tuple) -> bool:
    """Whether a plan may be stored under ``key``: none of its parts is :data:`UNPLANNED`."""
    return not any(k is UNPLANNED for k in key)


def cached(plans: dict, key: tuple, build):
    """``plans[key]``, made by ``build()`` on a miss (bounded: cleared when full). A key
    holding :data:`UNPLANNED` (an argument :func:`signature` does not describe) is never
    stored: then ``build()`` runs on every call."""
    plan = plans.get(key, plans)  # plans itself: a sentinel no plan can be
    if plan is plans:
        plan = build()
        if plannable(key):
            if len(plans) >= _PLAN_CACHE_SIZE:
                plans.clear()
            plans[key] = plan
    return plan


def cached_checked(plans: dict, key: tuple, check, fresh, args, options=()):
    """``(plan, checked)``: ``(plans[key], None)`` on a hit; on a miss ``checked =
    check(*args)`` and the plan ``fresh(checked, *args, *options)`` (stored as
    :func:`cached` does). A caller whose plan is None (the general path) reuses
    ``checked``, so that a call validates, and copies what it must, once."""
    plan = plans.get(key, plans)
    if plan is not plans:
        return plan, None
    checked = check(*args)
    return cached(plans, key, lambda: fresh(checked, *args, *options)), checked


def moveaxis(obj, src: int, dst: int):
    """``obj`` with axis ``src`` moved to ``dst`` (a view), for CuPy or torch."""
    if is_torch(obj):
        return obj.movedim(src, dst)
    cupy = _loader.cupy()
    return cupy.moveaxis(obj, src, dst)


def copy_into(dst, src) -> None:
    """``dst[...] = src`` for CuPy or torch (same kind, shape and dtype)."""
    if is_torch(dst):
        dst.copy_(src)
    else:
        dst[...] = src


# ------------------------------------------------------------ any array producer
# Arrays of other libraries come in through DLPack (``__dlpack__`` / ``__dlpack_device__``)
# or the CUDA array interface (Numba, older libraries), zero-copy, as CuPy arrays (CUDA)
# or NumPy arrays (CPU); the public functions then return results of x's kind: JAX
# arrays for JAX arrays, else the imported kind (:func:`accepts_producers`).

DLPACK_VERSION = (1, 1)  # the newest DLPack this consumer reads (requested as max_version)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13  # dlpack.h DLDeviceType
_DL_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY
_VERSIONED, _LEGACY = b"dltensor_versioned", b"dltensor"  # capsule names
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype, _capsule_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                         ctypes.c_char_p]
_FLAGS_OFFSET = 24  # DLManagedTensorVersioned: version (2 x u32), manager_ctx, deleter, flags


class ProducerArgument(TypeError):
    """An array of another library where only NumPy/CuPy/torch arrays are taken (the
    public functions import it: :func:`accepts_producers`)."""


def _native(x) -> bool:
    return is_torch(x) or _is_cupy(x) or isinstance(x, np.ndarray)


def is_tracer(x) -> bool:
    """A JAX tracer (an abstract value inside jax.jit, grad, vmap...), told by its class's
    ancestry so that jax need not be imported."""
    return any(c.__name__ == "Tracer" and c.__module__.startswith("jax")
               for c in type(x).__mro__)


def is_jax(x) -> bool:
    """A concrete JAX array."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array) and not is_tracer(x)


def is_producer(x) -> bool:
    """Another library's array: DLPack or the CUDA array interface (not NumPy/CuPy/torch)."""
    return not _native(x) and (hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__"))


class _Capsule:
    """A DLPack capsule already exported, for consumers that take only producers
    (numpy.from_dlpack)."""

    def __init__(self, capsule, device):
        self.capsule, self.device = capsule, device

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return self.device


class _WritableView:
    """A NumPy array's memory offered writable (``np.asarray`` of it: a writable view that
    keeps the array alive): what a legacy DLPack capsule, which carries no flags, is."""

    def __init__(self, arr):
        self.keep = arr
        self.__array_interface__ = {**arr.__array_interface__,
                                    "data": (arr.__array_interface__["data"][0], False)}


def _export(x, stream):
    """``x.__dlpack__``: DLPack 1.x first (``max_version``), the legacy call for producers
    that predate it (TypeError). ``stream``: the consumer's (the producer makes it wait
    for its pending work), None on the CPU."""
    kw = {} if stream is None else {"stream": stream}
    try:
        return x.__dlpack__(max_version=DLPACK_VERSION, **kw)
    except TypeError:
        return x.__dlpack__(**kw)


def _capsule_read_only(capsule, name: str) -> bool:
    """Whether a capsule's producer marked its array read-only (DLPack 1.x flag; a legacy
    capsule has no flags). BufferError for a newer major version than we read."""
    kind = _capsule_name(capsule)
    if kind == _LEGACY:
        return False
    if kind != _VERSIONED:
        raise TypeError(f"{name}: __dlpack__ returned no DLPack capsule ({kind!r})")
    ptr = _capsule_pointer(capsule, _VERSIONED)
    major = ctypes.c_uint32.from_address(ptr).value
    if major > DLPACK_VERSION[0]:
        raise BufferError(f"{name}: DLPack {major}.x capsule; this consumer reads up to "
                          f"{DLPACK_VERSION[0]}.x")
    return bool(ctypes.c_uint64.from_address(ptr + _FLAGS_OFFSET).value & _DL_READ_ONLY)


def import_array(x, name: str):
    """``(array, read_only)``: the producer ``x`` as a CuPy array (CUDA, managed) or NumPy
    array (CPU), zero-copy. DLPack first: the consumer's stream passed is CuPy's current
    one on x's device (where our kernels will run; 1 for the legacy default stream, as
    the protocol numbers it), so the producer orders its pending work before ours. The
    CUDA array interface (v3) is read by ``cupy.asarray``, which synchronises on the
    producer's ``stream`` as that protocol asks. ``read_only``: the producer's DLPack
    READ_ONLY flag, the interface's ``data[1]``, and always for JAX (immutable)."""
    if is_tracer(x):
        raise _not_an_operand(x, name)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        device_type, device_id = (int(v) for v in x.__dlpack_device__())
        if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
            cupy = _loader.cupy()
            with cupy.cuda.Device(device_id):
                capsule = _export(x, cupy.cuda.get_current_stream().ptr or 1)
                read_only = _capsule_read_only(capsule, name)
                try:
                    arr = cupy.from_dlpack(capsule)
                except (NotImplementedError, ValueError) as e:  # e.g. a dtype CuPy lacks
                    raise TypeError(f"{name}: CuPy cannot import this {type(x).__name__} ({e}); "
                                    "pass a torch tensor (torch.from_dlpack(x)) instead") from e
        elif device_type in (_DL_CPU, _DL_CUDA_HOST):
            capsule = _export(x, None)
            read_only = _capsule_read_only(capsule, name)
            arr = np.from_dlpack(_Capsule(capsule, (_DL_CPU, 0)))
            if not (read_only or arr.flags.writeable):  # NumPy's guess for a legacy capsule
                arr = np.asarray(_WritableView(arr))
        else:
            raise TypeError(f"{name}: a {type(x).__name__} on DLPack device type {device_type}; "
                            "cupykern takes CUDA and CPU arrays")
        return arr, read_only or is_jax(x)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise _not_an_operand(x, name)
    return _loader.cupy().asarray(x), bool(cai["data"][1])


def _imported(v, name, written):
    if not is_producer(v) and not is_tracer(v):
        return v
    arr, read_only = import_array(v, name)
    if name in written and read_only:
        raise ValueError(f"{name}: is read-only (its producer, {type(v).__name__}, marked it "
                         "so; JAX arrays are immutable) but it is written in place; pass a "
                         "writable array, or none")
    return arr


def call_imported(fn, bound: inspect.BoundArguments, written=()):
    """``fn(*bound)`` with every producer argument imported (:func:`import_array`; those
    named in ``written``, or in ``written(arguments)`` if it is callable, must be
    writable), the result of x's kind: a JAX array for a
    JAX x (zero-copy; JAX orders its reads after our stream's work), an ``out`` that was
    given as the caller's own object, else the imported kind (CuPy or NumPy)."""
    args = bound.arguments
    x = next(iter(args.values()))
    out = args.get("out")
    if callable(written):
        written = written(args)
    for name, v in args.items():
        args[name] = _imported(v, name, written)
    res = fn(*bound.args, **bound.kwargs)
    if out is not None:
        return out
    if is_jax(x) and _is_cupy(res):
        return sys.modules["jax"].dlpack.from_dlpack(res)
    return res


def accepts_producers(fn=None, *, written=("out",), torch_fn=None):
    """``fn`` (a public function whose first argument is x) taking arrays of any DLPack
    or CUDA-array-interface producer (:func:`call_imported`). Native arrays pay one call:
    the producers are found only when ``fn``'s checks raise :class:`ProducerArgument`
    (before anything runs). ``torch_fn`` ("stem.name"): the torch layer's function that
    ``fn`` hands a torch tensor x to, called here directly for a plain tensor x given
    positionally (two calls less of a small call's host time: H200, ~0.3-0.6 us)."""
    if fn is None:
        return functools.partial(accepts_producers, written=written, torch_fn=torch_fn)
    sig = inspect.signature(fn)
    direct = [None]  # the torch layer's function, once looked up

    def torch_call(*args, **kwargs):
        if direct[0] is None:
            stem, name = torch_fn.split(".")
            direct[0] = getattr(torch_layer(stem), name)
        return direct[0](*args, **kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            if torch_fn is not None and args and type(args[0]) in _TORCH_PLAIN:
                return (direct[0] or torch_call)(*args, **kwargs)
            return fn(*args, **kwargs)
        except ProducerArgument:
            pass
        return call_imported(fn, sig.bind(*args, **kwargs), written)
    return call
