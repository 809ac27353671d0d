"""How our GEMM reads its operands: in place, by a transposed copy, or copied
(:func:`read_mode`), planned once per call signature (:class:`Product`), and ``mm``, our
GEMM for the fused ops' backward products (dx = dy @ W, dW = dy^T @ x)."""
from __future__ import annotations

from . import _loader
from ._array import (Operand, Place, cached_checked, contiguous, empty, launch_all, operand,
                     rows_2d, signature)
from ._geometry import cdiv, vector_aligned
from .gemm_checks import check_mm, reference
from .gemm_kernels import (gemm, gemm_call, gemm_kernel, layout, reads_transposed_a, stores_transposed,
                           transpose_kernel, workspace)

_mm_plans: dict = {}  # (signatures, precision) -> run(a, b), or None


def mm(a, b, precision=None):
    """``a @ b`` for 2-D a (M, K) and b (K, N) of one kind, device and dtype: the backward
    passes' GEMMs (dx = dy @ W, dW = dy^T @ x). Each operand is read in place whether
    its rows or its columns are contiguous (a transposed view is never copied where that
    would be slower, see :func:`matrix`); any other layout is copied first. ``precision``
    as in :func:`linear`. Returns a new (M, N) array of a's kind (NumPy: the reference)."""
    checked = None
    if precision is None or type(precision) is str:  # the common call, cached
        key = (signature(a), signature(b), precision)
        run, checked = cached_checked(_mm_plans, key, check_mm, _mm_fresh, (a, b, precision))
        if run is not None:
            return run(a, b)
    ao, bo, prec = checked or check_mm(a, b, precision)
    if ao.kind == "cpu":
        return reference(a, b.T)
    (M, K), N = ao.shape, bo.shape[1]
    if M == 0 or N == 0:
        return empty(ao, (M, N))
    a2 = matrix(ao, M * N * K)
    bt = matrix(operand(b.T, "b"), M * N * K)  # the GEMM's (N, K) operand
    c = operand(empty(ao, (M, N)), "out")
    gemm(a2, bt, c, prec)
    return c.obj


def _mm_fresh(checked, a, b, precision):
    """``run(a, b) -> a @ b`` for calls like this one (``checked``: check_mm's result),
    planned once (a transposed copy :func:`matrix` would make is a launch of the plan);
    None where the call needs the general path (CPU, empty, or an operand copied
    otherwise)."""
    ao, bo, prec = checked
    M, N = ao.shape[0], bo.shape[1]
    if ao.kind == "cpu" or M == 0 or N == 0:
        return None
    return on_arrays(mm_plan(ao, bo, prec))


def mm_plan(a, b, precision: str):
    """The launch plan of :func:`mm` for 2-D GPU Operands ``a`` (M, K) and ``b`` (K, N),
    M, N > 0, and a checked precision: a :class:`Product` (``run(a_ptr, b_ptr, 0)``),
    or None where an operand needs a general copy. An
    Operand may describe an array to be allocated later (pointer 0: 16-byte aligned)."""
    (M, K), N = a.shape, b.shape[1]
    bt = Operand(b.obj, b.kind, b.dtype, b.shape[::-1], b.strides[::-1], b.ptr, b.device,
                 b.name, b.torch)  # the GEMM's (N, K) operand
    work = M * N * K
    if _swaps(a, bt, work, precision):
        return _planned_swapped(a, bt, precision)
    return planned_gemm(a, bt, work, precision, (M, N))


def on_arrays(plan):
    """:func:`mm_plan`'s ``plan`` as ``run(a, b) -> a @ b`` on the arrays themselves (None
    for None)."""
    if plan is None:
        return None
    ptr = plan.place.ptr  # (b.T starts where b does; *_: as _fresh's)
    return lambda a, b, *_: plan(ptr(a), ptr(b), 0)


class Product:
    """A planned GEMM product: calling it with ``(a_ptr, b_ptr, bias_ptr)`` launches it
    and returns its new output. Its ``_stage(a_ptr, b_ptr, bias_ptr, launches, held) ->
    out`` allocates the output (and any operand copies, appended to ``held``, kept until
    the launch) and appends the launches, so that the copies and the GEMM go out in one
    batch. ``place``: where it allocates."""

    __slots__ = ("place", "_stage")

    def __init__(self, place, stage):
        self.place, self._stage = place, stage

    def __call__(self, ap, bp, bias):
        launches, held = [], []
        out = self._stage(ap, bp, bias, launches, held)
        launch_all(self.place, launches)
        return out


def planned_gemm(a, b, work: int, precision: str, shape):
    """The :class:`Product` of a new array of ``shape`` (rows of N) holding ``a @ b.T
    (+ bias)`` for 2-D Operands like ``a`` and ``b`` in a product of ``work``
    multiply-adds: their copies (:func:`_planned_read`; a transposed ``a`` is read in
    place where the kernel loads it by TMA, :func:`_tma_reads_a`), the GEMM and its split
    K, as launches with their sizes fixed. None where an operand needs a general copy."""
    read_b = _planned_read(b, work)
    if read_b is None:
        return None
    b, copy_b = read_b
    read_a = (a, None) if _tma_reads_a(a, b, work, precision) else _planned_read(a, work)
    if read_a is None:
        return None
    a, copy_a = read_a
    kernel, place = gemm_kernel(a, b, precision), Place(a)
    call, ptr = gemm_call(kernel, a, b, b.shape[0]), place.ptr

    def stage(ap, bp, bias, launches, held):
        if copy_a:
            ap = copy_a(ap, launches, held)
        if copy_b:
            bp = copy_b(bp, launches, held)
        out, ws = empty(place, shape), workspace(place, kernel)
        held.append(ws)
        launches.extend(call(ap, bp, ptr(out), bias, 0, 0, 0, ptr(ws)))
        return out

    return Product(place, stage)


def _tma_reads_a(a, b, work: int, precision: str) -> bool:
    """Whether a transposed ``a`` of ``a @ b.T`` that :func:`read_mode` would copy is read
    in place instead: Hopper's TF32 / 3xTF32 kernel loads it by TMA (M-major boxes) where
    ``b``, as the GEMM reads it (after its copy), is K-major: dW = dy^T @ x then copies
    x's transpose alone, not dy's too (the TMA read of a transposed A runs as fast as
    its copy's K-major one, or faster: see :func:`_swaps`)."""
    return read_mode(a, work)[0] == "transpose" and reads_transposed_a(a, b, precision)


def _swaps(a, b, work: int, precision: str) -> bool:
    """Whether ``a @ b.T`` (2-D Operands, ``a`` read in place) is better computed as
    ``(b @ a.T).T``: where ``b``'s rows are not K-contiguous (``b`` is ``W.T`` for mm's
    row-major ``W``, as in dx = dy @ W) and worth a transposed copy (:func:`read_mode`),
    and the GEMM can read ``b`` in place as a transposed A (Hopper TF32 / 3xTF32: TMA
    boxes, fragments in registers) and store the product transposed (its split K's slabs
    too). H200, dx = dy @ W "high" against copying W's transpose first: 0.331 / 0.546
    ms at 1024x8192 @ 8192x8192, 1.429 / 1.570 at 16384x4096 @ 4096x4096, 0.351 / 0.430
    at 4096x4096 @ 4096x4096 (3xTF32: 1.147 / 1.430, 4.991 / 4.989, 1.316 / 1.327)."""
    if read_mode(b, work)[0] != "transpose" or read_mode(a, work)[0] != "view" or layout(a)[0]:
        return False
    return stores_transposed(b, a, precision)


def _planned_swapped(a, b, precision: str):
    """The :class:`Product` of ``a @ b.T`` computed as ``(b @ a.T).T`` (:func:`_swaps`):
    the GEMM stores the (N, M) product transposed, into the (M, N) output. mm's products
    have no bias."""
    M, N = a.shape[0], b.shape[0]
    kernel, place = gemm_kernel(b, a, precision, transposed_c=True), Place(a)
    call, ptr = gemm_call(kernel, b, a, N), place.ptr

    def stage(ap, bp, bias, launches, held):
        assert not bias, "a swapped product has no bias"
        out, ws = empty(place, (M, N)), workspace(place, kernel)
        held.append(ws)
        launches.extend(call(bp, ap, ptr(out), 0, 0, 0, 0, ptr(ws)))
        return out

    return Product(place, stage)


# Multiply-adds per element above which a transposed operand is copied to K-contiguous
# rows first. Its transposed loads (4-byte cp.async, or register gathers for 16-bit) feed
# the tensor cores at a fraction of the K-major rate (H100, 1024x8192x8192: TF32 85
# against 400 TFLOP/s, 3xTF32 32 against 114), while a copy costs about as much as 100
# multiply-adds per element at those rates: small operands of big products (dW's dy and
# x) are copied, a big one read by few rows (W in dx = dy @ W at a small batch) is not.
# The same bound decides whether float32 rows that Hopper's wgmma cannot read in place
# (off 16-byte boundaries, or K % 4 != 0) are copied into 16-byte rows (padded_ld).
# (Hopper TF32 / 3xTF32 read a transposed A by TMA; mm uses that for a row-major b,
# see _swaps, while other transposed operands still follow this bound.)
_COPY_WORK = 128


def _misaligned_rows(o, ld: int) -> bool:
    """Whether ``o``'s K-contiguous float32 rows (stride ``ld``) keep a Hopper GPU off its
    wgmma kernels in place: rows that start or step off 16-byte boundaries, or whose K
    is not a multiple of 4 (the kernel choice reads whole 16-byte rows of K in place; a
    TMA row stride is a multiple of 16 bytes). A copy into 16-byte rows
    (:func:`padded_ld`) then pays for a big product (H200, 1024x8192 @ (8192x8192)^T
    "high", misaligned rows: 4.29 ms on mma.sync, 0.32 ms on wgmma; K % 4, the padded
    copy: 8205x2949x5921 "highest" at 2.44-2.51x eager's SGEMM, which ran at 1.00x on
    mma.sync)."""
    return (o.dtype == "float32" and o.kind != "cpu" and o.size > 0
            and not vector_aligned(o.ptr, ld, o.shape[1], 4) and _loader.device_cc(o.device) == 90)


def padded_ld(o) -> int:
    """The row stride (elements) of the copy ours makes of the Operand ``o`` (..., rows, K):
    on Hopper, float32 rows rounded up to whole 16 bytes (K rounded up to a multiple of
    4), which its TMA reads (the maps' columns stop at K, zero-filled past it; the copy
    also writes zeros there); else K (C-contiguous)."""
    K = o.shape[-1]
    if o.dtype == "float32" and o.kind != "cpu" and _loader.device_cc(o.device) == 90:
        return cdiv(K, 4) * 4
    return K


def read_mode(o, work: int):
    """How the GEMM reads the 2-D Operand ``o`` in a product of ``work`` multiply-adds:
    ``("view", None)`` in place, ``("transpose", column stride)`` by the tiled transpose
    copy (its columns are contiguous and copying pays, ``_COPY_WORK``), ``("copy", row
    stride)`` by the same kernel (K-contiguous rows :func:`_misaligned_rows`, where copying
    pays), or ``("copy", None)`` (neither rows nor columns contiguous: a general copy to
    rows of K, then read as those, :func:`matrix`). The kernel's copies are rows of
    :func:`padded_ld`."""
    lay = layout(o)
    if lay is None:
        return "copy", None
    pays = work >= _COPY_WORK * o.size
    if lay[0] and pays:
        return "transpose", lay[1]
    if not lay[0] and pays and _misaligned_rows(o, lay[1]):
        return "copy", lay[1]
    return "view", None


def matrix(o, work: int):
    """``o`` (..., K) as the GEMM's 2-D (rows, K) operand of a product of ``work``
    multiply-adds (:func:`read_mode`): in place, or copied (transposed, or rows) into a new
    array of rows of :func:`padded_ld`; more dims as rows (:func:`rows_2d`). An operand
    of neither rows nor columns contiguous is first copied to C-contiguous rows, then
    read as such."""
    if o.ndim != 2:
        o = rows_2d(o, o.name)
    mode, ld = read_mode(o, work)
    if mode == "view":
        return o
    if ld is None:  # (a general copy: rows of K, maybe then copied to padded rows)
        return matrix(operand(contiguous(o, copy=True).reshape(o.shape), o.name), work)
    copy = copy_plan(o, ld, mode == "transpose")[1]
    launches, held = [], []
    copy(o.ptr, launches, held)
    launch_all(o, launches)
    return operand(held[0][:, :o.shape[1]], o.name)


def planned_operand(o, work: int):
    """The 2-D Operand ``o`` as the GEMM reads it in a product of ``work`` multiply-adds
    (:func:`matrix`, :func:`_planned_read`): itself, or an Operand describing the copy
    :func:`read_mode` makes (a fresh array: rows of :func:`padded_ld`; a general copy's
    rows of K first, then as those)."""
    mode, ld = read_mode(o, work)
    if mode == "view":
        return o
    if ld is None:
        return planned_operand(fresh_like(o, o.shape, o.name), work)
    return fresh_like(o, o.shape, o.name, padded_ld(o))


def _planned_read(o, work: int):
    """(Operand to plan the GEMM with, copy or None) for the 2-D Operand ``o``
    (:func:`read_mode`); None if it needs a general copy. ``copy`` as
    :func:`copy_plan`'s."""
    mode, ld = read_mode(o, work)
    if mode == "view":
        return o, None
    return None if ld is None else copy_plan(o, ld, mode == "transpose")


def fresh_like(o, shape, name, ld=None):
    """An Operand describing a new 2-D array of ``shape`` beside ``o`` (a fresh allocation:
    16-byte aligned), C-contiguous or in rows of ``ld`` elements (the first ``shape[1]``
    of each), to plan a GEMM that will read it."""
    return Operand(o.obj, o.kind, o.dtype, shape, (ld or shape[1], 1), 0, o.device, name, o.torch)


def copy_plan(o, ld: int, transposed: bool, count: int = 1, step: int = 0):
    """The copy of the 2-D GPU Operand ``o`` whose columns (``transposed``: column stride
    ``ld``) or rows (row stride ``ld``) are contiguous into a new array of rows of
    :func:`padded_ld` (their columns past K zeroed), by the tiled copy kernel (torch's and
    CuPy's strided copies run at a third of copy bandwidth: H100, 8192 x 8192 float32,
    0.56 ms against 0.18 ms for a clone); of a stack of ``count`` such matrices, each
    ``step`` elements past the one before, on the same launch (at most a grid's y: a
    matrix a block row): ``(planned, copy)``, ``planned`` an Operand that describes the
    copy of one matrix for planning (a fresh allocation: 16-byte aligned; shape (rows,
    K), row stride padded_ld), ``copy(src_ptr, launches, held) -> dst_ptr`` allocating it
    (appended to ``held``: (count * rows, padded_ld), the matrices one after another) and
    appending its launch."""
    rows, cols = o.shape
    ldd = padded_ld(o)
    fn, grid, block = transpose_kernel(o.dtype, o.device, rows, cols, ldd, count)
    place = Place(o)
    planned = fresh_like(o, (rows, cols), o.name, ldd)
    strides = (1, ld) if transposed else (ld, 1)  # (src's row and column strides)

    def copy(src, launches, held):
        out = empty(place, (count * rows, ldd))
        held.append(out)
        dst = place.ptr(out)
        launches.append((fn, grid, block, (src, dst, rows, cols, *strides, ldd, step, rows * ldd), 0))
        return dst

    return planned, copy
