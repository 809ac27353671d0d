"""Tensor maps for Hopper's bulk tensor copy engine (TMA), encoded by the CUDA driver.

A kernel that loads tiles with ``cp.async.bulk.tensor`` takes the 128-byte
``CUtensorMap`` of each operand by value (a ``const __grid_constant__`` parameter).
``cuTensorMapEncodeTiled`` builds it on the host; it is a libcuda function, so it is
called through ctypes on the driver CuPy already runs on (no new dependency).
"""
from __future__ import annotations

import ctypes
import functools

from . import _loader
from ._geometry import cdiv

# CUtensorMapDataType / Swizzle / L2promotion values (cuda.h)
FLOAT16, FLOAT32, BFLOAT16, TFLOAT32 = 6, 7, 9, 11
_ITEMSIZE = {FLOAT16: 2, FLOAT32: 4, BFLOAT16: 2, TFLOAT32: 4}
_SWIZZLE_128B = 3
_L2_128B = 2  # the L2 sector promotion (H100: 128 B ahead of 256 B and none, 16384x4096x4096)
_MAP_BYTES = 128
# Sizes the kernels address with int32 coordinates (a box past them included); the
# driver's stride bound (bytes).
_MAX_DIM, _MAX_STRIDE = 2**31 - 256, 2**40
_INVALID_CONTEXT = 201  # CUresult: no context is current in the calling thread
_encode = None


class TensorMap(bytes):
    """The opaque 128 bytes of one CUtensorMap: a kernel argument passed by value."""


NONE = TensorMap(bytes(_MAP_BYTES))  # the argument of launches that use no tensor map


def _encoder():
    """libcuda's cuTensorMapEncodeTiled, bound once (threads racing here bind the same)."""
    global _encode
    if _encode is None:
        f = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        u32, u64p, u32p = ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        f.restype = ctypes.c_int
        _encode = f
    return _encode


def fits(rows: int, cols: int, ld: int, itemsize: int) -> bool:
    """Whether rows x cols at row stride ``ld`` (elements) can be a 2-D tensor map: not
    empty, positive strides no shorter than a row (one row: any), within int32
    coordinates and the driver's stride bound. The caller has checked that the rows
    start on 16-byte boundaries (the driver requires it)."""
    return 0 < rows < _MAX_DIM and 0 < cols < _MAX_DIM and (rows == 1 or ld >= cols) and \
        ld * itemsize < _MAX_STRIDE


@functools.lru_cache(maxsize=256)
def row_maps(rows: int, cols: int, ld: int, box_rows: int, box_cols: int, dtype: int = FLOAT32):
    """The :class:`Rows2D` of this geometry, shared by every plan and unplanned call that
    reads it (each keeps the maps it encoded)."""
    return Rows2D(rows, cols, ld, box_rows, box_cols, dtype)


class Rows2D:
    """Tensor maps of rows x cols row views (row stride ``ld`` elements of ``dtype``, 2 or
    4 bytes each) read in boxes of ``box_rows`` x ``box_cols`` with 128-byte swizzle,
    zero-filled outside the view; one per data pointer, the 64 latest kept (a map
    depends on the pointer and these sizes only, never on the contents)."""

    def __init__(self, rows: int, cols: int, ld: int, box_rows: int, box_cols: int,
                 dtype: int = FLOAT32):
        isz = _ITEMSIZE[dtype]
        stride = ld if rows > 1 else cdiv(cols * isz, 16) * 16 // isz  # (one row: any valid stride)
        self._args = (dtype, 2, (ctypes.c_uint64 * 2)(cols, rows), (ctypes.c_uint64 * 1)(stride * isz),
                      (ctypes.c_uint32 * 2)(box_cols, box_rows), (ctypes.c_uint32 * 2)(1, 1))
        self._maps: dict[int, TensorMap] = {}

    def __call__(self, ptr: int) -> TensorMap:
        m = self._maps.get(ptr)
        if m is None:
            if len(self._maps) >= 64:  # bound what a stream of fresh pointers keeps
                try:  # the oldest; another thread may be evicting or adding at once
                    self._maps.pop(next(iter(self._maps)), None)
                except (StopIteration, RuntimeError):
                    pass
            m = self._maps[ptr] = self._encode(ptr)
        return m

    def _encode(self, ptr: int) -> TensorMap:
        buf = ctypes.create_string_buffer(_MAP_BYTES + 64)
        at = cdiv(ctypes.addressof(buf), 64) * 64  # the map must be 64-byte aligned
        dtype, rank, dims, strides, box, elem = self._args
        args = (at, dtype, rank, ptr, dims, strides, box, elem, 0, _SWIZZLE_128B, _L2_128B, 0)
        err = _encoder()(*args)
        if err == _INVALID_CONTEXT:
            # A thread that has made no CUDA runtime call has no current context: autograd's
            # backward thread on device 0 (torch sets no device there when it is already
            # the current one), where the first op of a backward is ours. cudaFree(0) makes
            # the current device's primary context current, as the runtime's first call would.
            _loader.cupy().cuda.runtime.free(0)
            err = _encoder()(*args)
        if err:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {err}) for rows "
                               f"{dims[1]}, cols {dims[0]}, stride {strides[0]} bytes, pointer {ptr:#x}")
        return TensorMap(ctypes.string_at(at, _MAP_BYTES))
