"""Layout facts every op needs about an array view, from its shape and element strides.

One place for them, so that each op asks the same questions the same way: can the
view be read as evenly strided rows, does it overlap itself (an expanded view), and
does it overlap another view's memory.
"""
from __future__ import annotations


def row_stride(shape, strides):
    """The row stride (elements) of ``shape`` seen as (rows, shape[-1]) rows that are
    contiguous along the last axis, or None if the view is not such a row view.

    Size-1 dims are skipped; the remaining leading dims must collapse into one evenly
    strided row index. A single leading dim may have any stride, 0 or negative included
    (an expanded row read many times); two or more must nest exactly. An empty view
    reads nothing, so it is a row view with any strides.
    """
    if 0 in shape:
        return shape[-1]
    if shape[-1] > 1 and strides[-1] != 1:
        return None
    lead = [(n, s) for n, s in zip(shape[:-1], strides[:-1]) if n != 1]
    for (_, outer), (n, inner) in zip(lead, lead[1:]):
        if outer != inner * n:
            return None
    return lead[-1][1] if lead else shape[-1]


def self_overlapping(shape, strides) -> bool:
    """True if two distinct indices of the view reach the same element (stride 0, or
    strides that interleave). Conservative: a view it calls disjoint is disjoint."""
    if any(n == 0 for n in shape):
        return False
    reach = 0  # the largest offset the smaller-stride dims span
    for s, n in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if s <= reach:
            return True
        reach += s * (n - 1)
    return False


def byte_extent(ptr: int, shape, strides, itemsize: int):
    """[lo, hi) bytes that the view touches (empty for a size-0 view)."""
    if any(n == 0 for n in shape):
        return ptr, ptr
    lo = hi = 0
    for n, s in zip(shape, strides):
        span = (n - 1) * s
        lo, hi = (lo + span, hi) if span < 0 else (lo, hi + span)
    return ptr + lo * itemsize, ptr + (hi + 1) * itemsize


def extents_meet(a, b) -> bool:
    """True if the [lo, hi) byte ranges ``a`` and ``b`` intersect."""
    return a[0] < b[1] and b[0] < a[1]


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative ints."""
    return -(-a // b)


# The most blocks a launch's grid holds on y (and z). Row passes put their row tiles there
# and loop over the rest (common.cuh's row_tiles): a few million rows make more tiles.
MAX_GRID_Y = 65535


def grid_rows(tiles: int) -> int:
    """The grid's y extent of a row pass over ``tiles`` row tiles (row_tiles)."""
    return min(tiles, MAX_GRID_Y)


def acc_dtype(dtype: str) -> str:
    """The type sums of ``dtype`` accumulate in (PyTorch's rule): float64 for float64,
    float32 otherwise."""
    return "float64" if dtype == "float64" else "float32"


def vector_aligned(ptr: int, row_stride_: int, ncols: int, itemsize: int) -> bool:
    """Whether rows of ``ncols`` elements at ``ptr`` + i * ``row_stride_`` can be read in
    whole 16-byte vectors: every row starts on a 16-byte boundary and holds whole vectors."""
    return ptr % 16 == 0 and (row_stride_ * itemsize) % 16 == 0 and (ncols * itemsize) % 16 == 0


def co_aligned(ptr_a: int, stride_a: int, ptr_b: int, stride_b: int, itemsize: int) -> bool:
    """Whether every row of two row views starts at the same offset modulo 16 bytes, so
    one vector loop serves both (row strides in elements)."""
    return (ptr_a - ptr_b) % 16 == 0 and ((stride_a - stride_b) * itemsize) % 16 == 0
