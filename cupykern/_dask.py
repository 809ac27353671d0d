"""Dask arrays of CuPy (or NumPy) chunks: each array function maps its call over the
blocks. Rows must lie within one chunk along the reduced axis (a row's divisor, a dot
product's K), so that axis is rechunked where it is split, as Dask's own reductions
do; the other axes keep their chunks. Dask itself is optional: nothing here imports
it unless the caller passed a Dask array."""
from __future__ import annotations

import math
import sys
import uuid

from ._array import native


def is_dask(x) -> bool:
    da = sys.modules.get("dask.array")
    return da is not None and isinstance(x, da.Array)


def whole(x, axis: int):
    """``x`` with ``axis`` in one chunk (rechunked only where it is split)."""
    return x if len(x.chunks[axis]) == 1 else x.rechunk({axis: -1})


def sample(x, shape):
    """An uninitialised array of ``x``'s chunk type (CuPy or NumPy) and dtype: what the
    op's checks run on before the graph is built, so that bad arguments fail at the
    call, not at compute time."""
    if any(math.isnan(n) for n in shape):
        raise ValueError("x: a Dask array of unknown chunk sizes; call x.compute_chunk_sizes() "
                         "first")
    xp = sys.modules[type(x._meta).__module__.split(".")[0]]
    return xp.empty(shape, dtype=x.dtype)


def map_blocks(fn, x, *args, name: str, chunks=None):
    """``x.map_blocks(fn, *args)`` into blocks of x's chunk type and dtype (``chunks``: the
    result's, default x's). The meta is given, so Dask never calls ``fn`` on empty arrays
    to guess it, and so is a unique name, so Dask never hashes the arguments (it would
    copy GPU weights to the host to do so)."""
    chunks = chunks or x.chunks
    dtype = native(x.dtype)  # (the blocks' results are native, as NumPy's)
    return x.map_blocks(fn, *args, dtype=dtype, chunks=chunks,
                        meta=sample(x, (0,) * len(chunks)).astype(dtype),
                        name=f"cupykern-{name}-{uuid.uuid4().hex}")


def no_out(out) -> None:
    if out is not None:
        raise ValueError("out: not supported for Dask arrays (a Dask array is computed "
                         "later, never written into); use the returned array")


def blocks(x) -> list:
    """``x``'s blocks along axis 0 as delayed objects (x has one chunk along the others)."""
    return list(x.to_delayed().ravel())


def compute(*values):
    import dask

    return dask.compute(*values)


def delayed(fn):
    import dask

    return dask.delayed(fn)
