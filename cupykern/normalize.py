"""L1 / L2 row normalisation: ``x / mean(|x|)`` and ``x / sqrt(sum(x*x))`` along an axis.

GPU design (kernels_cu/normalize.cu): one thread-block cluster per row keeps the
row in registers between the reduction and the scaling, so x is read from DRAM
once and y written once (copy-bandwidth bound); the next row loads into shared memory
meanwhile. Rows longer than a cluster can
hold fall back to a deterministic two-pass kernel (reads x twice).
"""
from __future__ import annotations

import numpy as np

from . import _dask, _loader
from ._array import (CTYPE, ITEMSIZE, Place, cached, cached_checked, check_out, contiguous,
                     copy_into, data_ptr, empty, is_torch, launch, moveaxis, normalize_axis,
                     operand, same_place, signature, torch_layer)
from ._geometry import acc_dtype, cdiv, co_aligned, row_stride

_FILE = "normalize.cu"
P = {"l1": 1, "l2": 2}
# Kernel configurations (cluster CTAs, threads per CTA, 16-byte vectors per thread[, prefetch
# [, rows per cluster]]), smallest first. A row of ncols elements needs C*T*V >= ncols //
# (16 // itemsize) vectors. Prefetch stages the next row in shared memory (cp.async)
# while registers hold this one. Per item size, measured at 32768x65535, same runs:
# float32 4-CTA clusters of 512 x 8 with prefetch, one CTA per SM (H200 1.135x copy
# time, H100 1.067x; 8 x 256 x 8 with 16 rows per cluster 1.164x / 1.103x); 2-byte types
# 512 x 4 without prefetch, three CTAs per SM (float16 H200 1.05-1.09x, H100 1.05x).
# The cluster's row sums travel by st.async onto mbarriers (ClusterSum): with a cluster
# barrier per row instead, 1.20-1.22x (float16 1.14-1.16x).
# Rows stay on chip: bulk tensor-copy (TMA) loads into a ring of 2-6 shared-memory row
# buffers per CTA timed >= 1.26x copy time forward (backward >= 1.55x its ceiling) on
# H200, and no SM-issued copy, TMA or not, came under 1.08x the driver's memcpy.
_SINGLE = ((1, 128, 4), (1, 256, 4), (1, 512, 4), (1, 1024, 4))
CONFIGS = {2: _SINGLE + ((2, 512, 4, False), (4, 512, 4, False), (8, 512, 4, False)),
           4: _SINGLE + ((2, 256, 8), (4, 256, 8), (4, 512, 8), (8, 512, 8)),
           8: _SINGLE + ((2, 256, 8), (4, 256, 8), (8, 256, 8), (8, 512, 8))}
# Alternatives the benchmark sweeps (benchmarks/normalize.py); a 4th entry False
# drops the next-row prefetch (no shared-memory staging).
TUNING_CONFIGS = {2: ((4, 512, 4), (4, 256, 8, False)),
                  4: ((8, 512, 4), (4, 1024, 4), (8, 256, 8, True, 16), (8, 256, 8, False), (8, 512, 4, False)),
                  8: ()}
# The fused backward holds x and dy: its own configurations, in the same form, picked
# the same way; clusters prefetch x and dy (2 x 32 KB of shared memory per 512 x 4 CTA,
# two CTAs per SM). At 32768x65535 float32 on H200: 512 x 4 1.09-1.10x its ceiling,
# 1.13-1.15x without prefetch (1.20-1.22x with a cluster barrier per row, no prefetch).
_NO_PREFETCH = tuple(c + (False,) for c in _SINGLE)
BACKWARD_CONFIGS = {
    2: _NO_PREFETCH + ((2, 512, 4), (4, 512, 4), (8, 512, 4)),
    4: _NO_PREFETCH + ((2, 512, 4), (4, 512, 4), (8, 512, 4), (8, 512, 8)),
    8: _NO_PREFETCH + ((2, 256, 8), (4, 256, 8), (8, 256, 8), (8, 512, 8))}
_ROWS_PER_CLUSTER = 4  # each cluster walks ~4 rows: its next row loads while it scales one
_TWO_PASS = {"THREADS": 256, "CHUNK": 65536, "MAX_CHUNKS": 1024}


def _kernel_of(cfg) -> tuple:
    """(cluster CTAs, threads, vectors, prefetch) of a configuration: prefetch defaults to
    on, and a 5th entry (rows per cluster) changes the launch, not the kernel."""
    return tuple(cfg[:3]) + (bool(cfg[3]) if len(cfg) > 3 else True,)


def _staging(cfg, arrays: int) -> int:
    """Dynamic shared memory of a configuration's kernel: with prefetch, the next row's
    16-byte vectors of ``arrays`` arrays (x; the backward x and dy) for each thread."""
    c, t, v, prefetch = _kernel_of(cfg)
    return arrays * t * v * 16 if prefetch else 0


def _cluster_expr(p, dtype, cfg):
    c, t, v, prefetch = _kernel_of(cfg)
    return f"normalize_rows<{p}, {CTYPE[dtype]}, {c}, {t}, {v}, {'true' if prefetch else 'false'}>"


def _two_pass_exprs(p, dtype):
    t = _TWO_PASS["THREADS"]
    return (f"normalize_partials<{p}, {CTYPE[dtype]}, {t}>", f"normalize_apply<{p}, {CTYPE[dtype]}, {t}>")


def _backward_expr(p, dtype, cfg):
    c, t, v, prefetch = _kernel_of(cfg)
    return (f"normalize_backward_rows<{p}, {CTYPE[dtype]}, {c}, {t}, {v}, "
            f"{'true' if prefetch else 'false'}>")


for _p in P.values():
    for _dt in CTYPE:
        _loader.register(_FILE, _two_pass_exprs(_p, _dt))
        _isz = ITEMSIZE[_dt]
        for _cfg in CONFIGS[_isz] + TUNING_CONFIGS[_isz]:
            _loader.register(_FILE, [_cluster_expr(_p, _dt, _cfg)], min_cc=90 if _cfg[0] > 1 else 0)
        for _cfg in BACKWARD_CONFIGS[_isz] + CONFIGS[_isz] + TUNING_CONFIGS[_isz]:
            _loader.register(_FILE, [_backward_expr(_p, _dt, _cfg)], min_cc=90 if _cfg[0] > 1 else 0)


def l1_normalize(x, axis: int = 1, *, out=None, config=None):
    """``x / mean(abs(x), axis, keepdims=True)``, computed in one fused pass.

    Args:
        x: CuPy array, torch tensor (CUDA or CPU) or NumPy array of float16,
            bfloat16, float32 or float64, any ndim >= 1.
        axis: the axis to reduce (negative counts from the end).
        out: optional array of x's kind, device, shape and dtype to write into
            (may be ``x`` itself).
        config: for tuning and tests on the GPU: force one kernel configuration, a
            tuple (cluster CTAs, threads, 16-byte vectors per thread[, prefetch[, rows
            per cluster]]) from :data:`CONFIGS` or :data:`TUNING_CONFIGS` whose capacity
            C*T*V holds a row. ``None`` (default) picks the measured best, or the
            two-pass kernel for rows longer than any configuration holds.

    Returns an array of x's kind (torch in -> torch out, on x's device and
    torch's current stream). torch tensors go through the custom op
    ``torch.ops.cupykern.normalize`` (autograd, torch.compile, CUDA graphs). A Dask
    array (CuPy or NumPy chunks) gives a Dask array normalized block by block, ``axis``
    rechunked into one chunk where it is split (``out`` not supported).
    Sums accumulate in float32 (float64 for float64) and the mean is rounded to
    x's dtype before dividing, as PyTorch does. A row of zeros gives nan (0/0);
    inf and nan propagate as in PyTorch.

    Copies: none when ``axis`` is the last axis, elements along it are
    contiguous and the rows are evenly strided (any C-contiguous array, or a
    slice such as ``x[:, :n]``); otherwise x is first copied to a contiguous
    array with ``axis`` last, and the result is returned as a view in x's axis
    order. x is also copied when ``out`` does not share its 16-byte alignment.
    """
    return _dispatch(x, 1, axis, out, config)


def l2_normalize(x, axis: int = 1, *, out=None, config=None):
    """``x / sqrt(sum(x * x, axis, keepdims=True))`` (no eps: a zero row gives nan).

    Arguments, return value, accumulation and copies as in :func:`l1_normalize`.
    """
    return _dispatch(x, 2, axis, out, config)


def _dispatch(x, p, axis, out, config):
    """torch tensors to the custom op, Dask arrays block by block, the rest here."""
    if is_torch(x):
        return torch_layer("normalize").normalize(x, p, axis, out, config)
    if _dask.is_dask(x):
        _dask.no_out(out)
        ax = check(_dask.sample(x, (0,) * x.ndim), p, axis, None, config)[1]
        x = _dask.whole(x, ax)
        return _dask.map_blocks(normalize, x, p, ax, None, config, name=f"l{p}_normalize")
    return normalize(x, p, axis, out, config)


def reference(x: np.ndarray, axis: int, p: int) -> np.ndarray:
    """NumPy reference with PyTorch's rounding: reduce in float32/float64, round the
    divisor to x's dtype, divide."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    xa = x.astype(acc)
    with np.errstate(all="ignore"):
        if p == 1:
            # (sum / n, not np.mean: a length-0 row gives nan as torch.mean does, without
            # NumPy's "Mean of empty slice" warning)
            d = np.sum(np.abs(xa), axis=axis, keepdims=True) / acc(xa.shape[axis])
        else:
            d = np.sqrt(np.sum(xa * xa, axis=axis, keepdims=True))
        return (xa / d.astype(x.dtype).astype(acc)).astype(x.dtype)


def check(x, p: int, axis, out=None, config=None):
    """Validate the arguments once: (x's Operand, axis in range, p, out's Operand or None,
    config). torch.norm of one element is |x| (sqrt(x*x) would overflow), so p=2 over a
    length-1 axis becomes p=1."""
    a = operand(x, "x")
    if a.ndim == 0:
        raise ValueError("x: expected an array with at least 1 dimension, got a 0-d array")
    ax = normalize_axis(axis, a.ndim)
    if p == 2 and a.shape[ax] == 1:
        p = 1
    o = check_out(out, a, a.shape, inputs=(a,), in_place=True) if out is not None else None
    if config is not None:
        config = config_tuple(config)
        _require_config(config, a.dtype)
    return a, ax, p, o, config


def config_tuple(config) -> tuple:
    """``config`` as a tuple of ints; TypeError for a string or another non-sequence."""
    if isinstance(config, (str, bytes)) or not hasattr(config, "__iter__"):
        raise TypeError(f"config: expected a tuple (cluster CTAs, threads, vectors[, prefetch[, "
                        f"rows per cluster]]), got {config!r}")
    return tuple(config)


def _require_config(config, dtype, backward=False):
    """ValueError unless ``config`` names a known kernel configuration of ``dtype``,
    optionally with a 5th entry (rows per cluster, >= 1: it changes only the launch)."""
    if not 3 <= len(config) <= 5:
        raise ValueError(f"config: expected (cluster CTAs, threads, vectors[, prefetch[, rows "
                         f"per cluster]]), got {config}")
    if len(config) == 5 and config[4] < 1:
        raise ValueError(f"config: rows per cluster (5th entry) must be >= 1, got {config[4]}")
    isz = ITEMSIZE[dtype]
    known = (BACKWARD_CONFIGS[isz] if backward else ()) + CONFIGS[isz] + TUNING_CONFIGS[isz]
    if _kernel_of(config) not in {_kernel_of(c) for c in known}:
        raise ValueError(f"config: {config} is not one of the {dtype} configurations "
                         f"{known} (optionally with a rows-per-cluster 5th entry)")


_plans: dict = {}  # (signature(x), p, axis) -> run(x) for a fresh output, or None


def normalize(x, p: int, axis, out=None, config=None):
    """``x / d`` with d the row's L1 mean (p=1) or L2 norm (p=2) along ``axis``, for
    CuPy arrays, NumPy arrays and (from the torch layer) torch tensors: the array
    functions' core, after :func:`l1_normalize` / :func:`l2_normalize` have sent torch
    tensors to their custom op."""
    checked = None
    if out is None and config is None and type(axis) is int:  # the common call: cached
        run, checked = cached_checked(_plans, (signature(x), p, axis), check, _fresh, (x, p, axis))
        if run is not None:
            return run(x)
    a, ax, p, o, config = checked or check(x, p, axis, out, config)
    if a.kind == "cpu":
        res = reference(x, ax, p)
        return res if o is None else _fill(out, res)
    if a.size == 0:  # laid out as any result: contiguous with the axis last, viewed back
        if o is not None:
            return out
        shape = list(a.shape)
        shape.append(shape.pop(ax))
        return moveaxis(empty(a, tuple(shape)), -1, ax)

    isz = ITEMSIZE[a.dtype]
    xs = _rows(a, ax)
    os_ = _rows(o, ax) if o is not None else None
    if xs is not None and os_ is not None and co_aligned(a.ptr, xs, o.ptr, os_, isz):
        _plan(a, xs, os_, p, config)(a, a.ptr, o.ptr)
        return out  # straight into out, no copies

    src = a if xs is not None else operand(contiguous(operand(moveaxis(x, ax, -1), "x")), "x")
    dst = operand(empty(src, src.shape), "out")
    ss, ds = _rows(src, src.ndim - 1), src.shape[-1]
    if not co_aligned(src.ptr, ss, dst.ptr, ds, isz):  # e.g. x = big[:, 1:] vs a fresh buffer
        src = operand(contiguous(src, copy=True), "x")
        ss = ds
    _plan(src, ss, ds, p, config)(src, src.ptr, dst.ptr)
    res = dst.obj if xs is not None else moveaxis(dst.obj, -1, ax)
    return res if o is None else _fill(out, res)


def _fill(out, res):
    copy_into(out, res)
    return out


def _fresh(checked, x, p, axis):
    """``run(x) -> y`` for calls like this one without ``out`` (``checked``: their
    validation): one allocation and the kernel(s), no copies; None where the call needs
    the general path (CPU, empty, or x not read in place as aligned rows)."""
    a, ax, p, _, _ = checked
    if a.kind == "cpu" or a.size == 0:
        return None
    xs = _rows(a, ax)
    if xs is None or not co_aligned(a.ptr, xs, 0, a.shape[-1], ITEMSIZE[a.dtype]):
        return None  # (a fresh output is 16-byte aligned)
    plan, place, shape = _plan(a, xs, a.shape[-1], p), Place(a), a.shape

    def run(x):
        y = empty(place, shape)
        plan(place, place.ptr(x), place.ptr(y))
        return y

    return run


def _rows(a, ax):
    """Row stride of ``a`` as rows along axis ``ax``, or None unless ``ax`` is the last
    axis and ``a`` is a row view (see :func:`cupykern._geometry.row_stride`)."""
    return row_stride(a.shape, a.strides) if ax == a.ndim - 1 else None


def _row_vectors(ncols: int, dtype: str) -> int:
    """16-byte vectors a row of ``ncols`` holds (the rest are head/tail scalars)."""
    return ncols // (16 // ITEMSIZE[dtype])


def _pick_config(ncols: int, dtype: str, cc: int, table=CONFIGS):
    nvec = _row_vectors(ncols, dtype)
    for cfg in table[ITEMSIZE[dtype]]:
        if (cfg[0] == 1 or cc >= 90) and cfg[0] * cfg[1] * cfg[2] >= nvec:
            return cfg
    return None


def _clusters(cfg, nrows: int, device: int) -> int:
    """Clusters to launch for ``nrows`` rows: each walks about ``cfg``'s 5th entry (default
    _ROWS_PER_CLUSTER) rows, so that its next row loads while it scales one; at least 4
    per SM while there are rows (small row counts: one row per cluster)."""
    per = cfg[4] if len(cfg) > 4 else _ROWS_PER_CLUSTER
    return min(nrows, max(cdiv(nrows, per), 4 * _loader.sm_count(device)), (2**31 - 1) // cfg[0])


def _check_capacity(cfg, ncols: int, dtype: str) -> None:
    """ValueError unless a cluster of ``cfg`` holds a whole row (only a given config can
    be short: :func:`_pick_config` picks one that holds it)."""
    held = cfg[0] * cfg[1] * cfg[2]
    if held < _row_vectors(ncols, dtype):
        raise ValueError(f"config: {cfg} holds {held} 16-byte vectors per row, fewer than "
                         f"a row of {ncols} {dtype} needs")


def _plan(src, xs, ys, p, config=None):
    """A callable ``plan(src, x_ptr, y_ptr)`` launching the kernel(s) for this geometry."""
    ncols = src.shape[-1]
    nrows = src.size // ncols
    dt, dev = src.dtype, src.device
    cfg = config or _pick_config(ncols, dt, _loader.device_cc(dev))
    if cfg is not None:
        _check_capacity(cfg, ncols, dt)
        c, t = cfg[:2]
        smem = _staging(cfg, 1)
        fn = _loader.function(_FILE, _cluster_expr(p, dt, cfg), dev, smem)
        nclusters = _clusters(cfg, nrows, dev)
        tail = (nrows, ncols, xs, ys)
        return lambda a, x, y: launch(a, fn, (nclusters * c,), (t,), (x, y) + tail, smem)

    # Two passes; at most MAX_CHUNKS chunks per row so pass 2's partial sums stay cheap.
    chunk = max(_TWO_PASS["CHUNK"], cdiv(ncols, _TWO_PASS["MAX_CHUNKS"]))
    nchunks = cdiv(ncols, chunk)
    k1, k2 = (_loader.function(_FILE, e, dev) for e in _two_pass_exprs(p, dt))
    grid, block = (min(nrows * nchunks, 1 << 20),), (_TWO_PASS["THREADS"],)

    def two_pass(a, x, y):
        partial = empty(a, (nrows * nchunks,), acc_dtype(dt))
        pp = data_ptr(partial)
        launch(a, k1, grid, block, (x, pp, nrows, ncols, xs, chunk, nchunks))
        launch(a, k2, grid, block, (x, y, pp, nrows, ncols, xs, ys, chunk, nchunks))

    return two_pass


def normalize_backward(x, dy, p: int, axis, config=None):
    """dx for ``y = normalize(x, p, axis)`` and the gradient ``dy`` of y, GPU arrays of one
    kind, shape and dtype: one read of x and dy and one write of dx (the divisor is
    recomputed from x, so a forward need keep only x). Returns None where the kernel does
    not apply (CPU or empty arrays, ``axis`` not the last, x or dy not row views whose
    rows start alike modulo 16 bytes, rows longer than a cluster holds); the caller then
    computes dx another way. ``config``: for tuning, a configuration as the forward's
    (cluster CTAs, threads, vectors[, prefetch[, rows per cluster]]) from
    :data:`BACKWARD_CONFIGS`, :data:`CONFIGS` or :data:`TUNING_CONFIGS`."""
    run = cached(_plans, ("backward", signature(x), signature(dy), p, axis, config),
                 lambda: _backward_fresh(x, dy, p, axis, config))
    return None if run is None else run(x, dy)


def _backward_fresh(x, dy, p, axis, config):
    """``run(x, dy) -> dx`` for calls like this one, or None (see normalize_backward)."""
    a, ax, p, _, _ = check(x, p, axis)
    if config is not None:
        config = config_tuple(config)
        _require_config(config, a.dtype, backward=True)
    g = operand(dy, "dy")
    same_place(a, g)
    if (g.dtype, tuple(g.shape)) != (a.dtype, tuple(a.shape)):
        raise ValueError(f"dy: expected {a.dtype} {tuple(a.shape)} like x, got {g.dtype} "
                         f"{tuple(g.shape)}")
    if a.kind == "cpu" or a.size == 0:
        return None
    ncols, isz = a.shape[-1], ITEMSIZE[a.dtype]
    xs, gs = _rows(a, ax), _rows(g, ax)
    if (xs is None or gs is None or not co_aligned(a.ptr, xs, g.ptr, gs, isz)
            or not co_aligned(a.ptr, xs, 0, ncols, isz)):  # (dx: fresh, aligned)
        return None
    cfg = config or _pick_config(ncols, a.dtype, _loader.device_cc(a.device), BACKWARD_CONFIGS)
    if cfg is None:
        return None
    _check_capacity(cfg, ncols, a.dtype)
    c, t = cfg[:2]
    smem = _staging(cfg, 2)
    fn = _loader.function(_FILE, _backward_expr(p, a.dtype, cfg), a.device, smem)
    nrows = a.size // ncols
    grid, block, tail = (_clusters(cfg, nrows, a.device) * c,), (t,), (nrows, ncols, xs, gs, ncols)
    place, shape = Place(a), a.shape

    def run(x, dy):
        dx = empty(place, shape)
        launch(place, fn, grid, block, (place.ptr(x), place.ptr(dy), place.ptr(dx)) + tail, smem)
        return dx

    return run
