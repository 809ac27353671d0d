"""The backward of ``gemm_scale_batchnorm`` (:mod:`cupykern.gemm_scale_batchnorm`): from z =
x @ W.T and the (4, N) coefficients its forward saved (``save``), bandwidth passes over g
and z (kernels_cu/gemm_scale_batchnorm_backward.cu: the column sums of g and g * (z - cm),
their ordered merge into the vector gradients, dz and its transpose; one launch for a
small batch, else three), then dx = dz @ W and dW = dz^T @ x on our GEMM or the
vendor's. Also the passes over g and z that the synchronized path runs with column
statistics from every process (:func:`grad_partials`, :func:`grad_dz`).

Its kernels' instantiations and launch shapes (_GRAD, _GRAD_FUSED) are declared by the
forward's module, so that importing the package registers them for the compile check.
"""
from __future__ import annotations

from . import _loader
from ._array import (CTYPE, ITEMSIZE, Place, cached, cached_checked, empty, launch_all, operand,
                     rows_2d, same_place, scalar, signature)
from ._geometry import acc_dtype, cdiv, grid_rows
from .gemm import matmul_core
from .gemm_checks import check_precision, check_vector
from .gemm_operands import fresh_like
from .gemm_route import register_plans, routed_mm_plan
from .gemm_vendor import float64_capture, planned_capture, vendor_state
from .gemm_scale_batchnorm import (_BACKWARD_FILE, _GRAD, _GRAD_FUSED, BatchNormState, _checked_z,
                                   _chunks, _fused_grad_expr, _fused_grad_warps, _grad_exprs,
                                   _side_by_side, check_inputs)

# bn_grad_dz_rows stores dz^T from registers: from 8 lanes (N <= 16 of 128 threads) a
# warp's store covers 2 or more rows of each column it holds (H200, float32, the pass
# with dz^T against bn_grad_dz: N = 2 38.3 / 550.2 us at 4194305 rows, N = 8 49.8 / 213.2
# at 1000000, N = 16 27.7 / 45.8 at 200000); below, a warp spans one row and each
# store would scatter over 32 rows of dz^T, which bn_grad_dz stages into whole runs.
_DZ_ROWS_MIN_LANES = 8


def _grad_rows(M: int, N: int, dtype: str, device, transposed: bool = True):
    """The backward's passes over the rows of (M, N) g and z: ``(tiles, partials, dz)``,
    the last two ``(fn, grid, block, sizes)`` of bn_grad_partials and of the dz pass
    (``transposed``: it writes dz^T too), ``sizes`` their arguments after z (M, N, and
    lanes but for bn_grad_dz). ``lanes`` rows lie side by side (RowSpot) where N is at
    most half a block of columns; a tile is _GRAD["ROWS"] * lanes rows, one per grid row
    (looping past MAX_GRID_Y). (H200, float32 4194305x3->2, one row per block:
    partials 147 us, bn_grad_coef 125 over 65537 tiles, bn_grad_dz 550, eager's whole
    backward 770.) The dz pass is bn_grad_dz_rows laid out alike, or where it would
    store dz^T from fewer than _DZ_ROWS_MIN_LANES lanes, the staged bn_grad_dz."""
    threads = _GRAD["THREADS"]
    exprs = _grad_exprs(CTYPE[dtype])
    mn = (scalar(M, "int"), scalar(N, "int"))

    def launch(expr, lanes):  # -> (tiles, (fn, grid, block, sizes))
        tiles = cdiv(M, _GRAD["ROWS"] * lanes)
        sizes = (*mn, scalar(lanes, "int")) if expr != "dz" else mn
        fn = _loader.function(_BACKWARD_FILE, exprs[expr], device)
        return tiles, (fn, (cdiv(N, threads // lanes), grid_rows(tiles)), (threads,), sizes)

    lanes = _side_by_side(threads, N)
    rows = lanes > 1 and (lanes >= _DZ_ROWS_MIN_LANES or not transposed)
    tiles, partials = launch("partials", lanes)
    return tiles, partials, launch("dz_rows", lanes)[1] if rows else launch("dz", 1)[1]


def _grad_operand(zo, g):
    """g's row Operand for the passes over z's rows (copied if its rows are not
    contiguous)."""
    M, N = zo.shape
    go = _g_rows(g)
    if go.shape != (M, N) or go.dtype != zo.dtype:
        raise ValueError(f"g: expected a ({M}, {N}) {zo.dtype} array, got {go.shape} {go.dtype}")
    same_place(zo, go)
    return go


def grad_partials(g, z, cm):
    """Per (row tile, column) sums of g and g * (z - cm), (tiles, 2, N) of the accumulation
    type (bn_grad_partials): add them over the tiles (axis 0) for the column sums."""
    zo, place, (M, N) = _checked_z(z)
    go = _grad_operand(zo, g)
    tiles, (fn, grid, block, sizes), _ = _grad_rows(M, N, zo.dtype, zo.device)
    part = empty(place, (tiles, 2, N), acc_dtype(zo.dtype))
    launch_all(place, ((fn, grid, block, (go.ptr, go.strides[0], zo.ptr, *sizes, place.ptr(cm),
                                          place.ptr(part)), 0),))
    return part


def grad_dz(g, z, k, cm):
    """dz = k[0] * (g - k[1] - k[2] * (z - cm)), column by column (bn_grad_dz), k (3, N)."""
    zo, place, (M, N) = _checked_z(z)
    go = _grad_operand(zo, g)
    _, _, (fn, grid, block, sizes) = _grad_rows(M, N, zo.dtype, zo.device, transposed=False)
    dz = empty(place, (M, N))
    launch_all(place, ((fn, grid, block, (go.ptr, go.strides[0], zo.ptr, *sizes, place.ptr(k),
                                          place.ptr(cm), place.ptr(dz), 0), 0),))
    return dz


# (signatures, training, eps, precision, input_grad, weight_grad, vendor state, capturing) -> run
_backward_plans: dict = {}
register_plans(_backward_plans)  # (their GEMMs follow the route: forced_route drops them)


def backward(g, z, coefs, x, weight, bias, scale, bn_weight, running_mean, training, eps,
             precision, input_grad=True, weight_grad=True):
    """Gradients of :func:`gemm_scale_batchnorm` from what its forward saved (``save``: z =
    x @ W.T and coefs) in that mode (``training``: batch statistics; otherwise the
    running ones, ``running_mean`` then required): ``(dx, dweight, dvec)``, arrays of
    x's kind (dx None unless ``input_grad``, dweight None unless ``weight_grad``), dvec
    (4, N) holding the gradients of the GEMM bias (0 in training mode: it cancels),
    scale, bn_weight and bn_bias.

    Bandwidth passes (column sums of g and g*(z - mean), their ordered merge into the
    vector gradients, dz and its transpose: one launch for a batch of up to
    _GRAD_FUSED["ROWS"] rows, else three), then dx = dz @ W and dW = dz^T @ x at
    ``precision`` on our GEMM, each reading dz K-major (x is read in place where the GEMM
    can: Hopper TF32 / 3xTF32), or on the vendor's where the dispatcher says so (its dW
    reads dz transposed in place: no dz^T pass). g (B, N) may have any row stride; other
    layouts are copied."""
    arrays = (g, z, coefs, x, weight, bias, scale, bn_weight, running_mean)
    options = (training, eps, precision, input_grad, weight_grad)
    run, checked = backward_run(arrays, options)
    if run is not None:  # (a call that planned: its g as checked, copied if it had to be)
        return run(*arrays) if checked is None else run(checked[0].obj, *arrays[1:])
    checked = checked or _check_backward(*arrays, training)
    run = _backward_plan(checked, _state(checked, training, eps), *options[2:])
    return run(*(None if o is None else o.obj for o in checked))


def backward_run(arrays, options):
    """``(run, checked)`` for :func:`backward`'s 9 arrays and its options (training, eps,
    precision, input_grad, weight_grad): ``run(*arrays)`` the launch plan cached for calls
    like this one, or None (the general path, which reuses ``checked``: the arrays'
    validation where this call made it, else None)."""
    training, eps, precision = options[:3]
    if not (type(training) is bool and type(eps) is float and type(precision) is str):
        return None, None  # (unhashable or unchecked options: the general path checks them)
    z = arrays[1]
    key = tuple(signature(v) for v in arrays) + options + (vendor_state(z), float64_capture(z))
    return cached_checked(_backward_plans, key, _check_backward, _backward_fresh,
                          arrays + (training,), options[1:])


def backward_run_after(forward_plan, arrays, options):
    """:func:`backward_run`'s plan (or None: the general path) for the arrays that the
    forward launch plan ``forward_plan`` (:func:`cupykern.gemm_scale_batchnorm.planned_run`'s,
    with ``save``) read and wrote, as they are: that plan's key fixes every array's
    signature but g's, and the options but the gradients wanted, so this key is the
    forward plan, g's signature, those and the library's state now (one signature read
    where :func:`backward_run` reads nine)."""
    z = arrays[1]
    key = (forward_plan, signature(arrays[0]), *options[3:], vendor_state(z), float64_capture(z))
    return cached(_backward_plans, key, lambda: backward_run(arrays, options)[0])


def _check_backward(g, z, coefs, x, weight, bias, scale, bn_weight, running_mean, training):
    """Validate :func:`backward`'s arrays: Operands of g (2-D, rows contiguous: copied if
    not), z, coefs, x, weight (read as they are), and the vectors bias, scale, bn_weight,
    running_mean (contiguous: copied if not), in that order (``checked``)."""
    go = operand(g, "g")
    zo, co = operand(z, "z"), operand(coefs, "coefs", dtypes=(acc_dtype(go.dtype),))
    M, N = zo.shape
    if go.dtype != zo.dtype:
        raise TypeError(f"g: dtype {go.dtype} does not match z's dtype {zo.dtype}")
    if go.shape != (M, N) or co.shape != (4, N) or not zo.is_c_contiguous():
        raise ValueError(f"g, z, coefs: expected ({M}, {N}) g and z and (4, {N}) coefs, got "
                         f"{tuple(go.shape)}, {tuple(zo.shape)}, {tuple(co.shape)}")
    if co.strides != (N, 1):
        raise ValueError("coefs: expected a contiguous (4, N) array")
    same_place(zo, go)
    same_place(zo, co)
    if zo.kind == "cpu":
        raise TypeError("z: backward takes GPU arrays (CuPy or torch CUDA)")
    xo, wo = check_inputs(x, weight)
    same_place(zo, xo)
    if xo.shape[0] != M or wo.shape[0] != N or xo.dtype != zo.dtype:
        raise ValueError(f"x, weight: expected ({M}, K) x and ({N}, K) weight of z's dtype "
                         f"{zo.dtype}, got {tuple(xo.shape)}, {tuple(wo.shape)} {xo.dtype}")
    if scale is None:
        raise ValueError("scale: required, got None")
    if not training and running_mean is None:
        raise ValueError("running_mean: required in eval mode (training=False)")
    return (rows_2d(go, "g"), zo, co, xo, wo,
            *(check_vector(v, name, zo, N) for name, v in (
                ("bias", bias), ("scale", scale), ("bn_weight", bn_weight),
                ("running_mean", running_mean))))


def _backward_fresh(checked, *arrays_options):
    """``run(*arrays)`` for :func:`backward` calls like this one (``checked``: their
    validated Operands), copying a g whose rows are not contiguous on each call (the
    gradient of ``out.sum()`` is a stride-0 expansion: H200, 64x512->512 training step,
    host time 800 us a step against eager's 371 when such a g took the general path);
    None where another array must be copied first (the general path copies each call)."""
    arrays, (training, eps, *options) = arrays_options[:9], arrays_options[9:]
    if any(o is not None and o.obj is not a for o, a in zip(checked[1:], arrays[1:])):
        return None
    run = _backward_plan(checked, _state(checked, training, eps), *options)
    if checked[0].obj is arrays[0]:
        return run
    return lambda g, *rest: run(_g_rows(g).obj, *rest)  # (as checked)


def _g_rows(g):
    """g as a 2-D row Operand: in place where its rows are contiguous, else a copy."""
    return rows_2d(operand(g, "g"), "g")


def _state(checked, training, eps) -> BatchNormState:
    """The forward's BatchNormState as the backward reads it: running_mean's Operand (from
    :func:`_check_backward`'s ``checked``), the mode and eps (the other fields unused)."""
    return BatchNormState(checked[8], training=training, eps=eps)


def _backward_plan(checked, state, precision, input_grad, weight_grad):
    """``run(g, z, coefs, x, weight, bias, scale, bn_weight, running_mean)`` for validated
    Operands ``checked`` (:func:`_check_backward`'s: g with contiguous rows, vectors
    contiguous) in ``state``'s mode (a BatchNormState: training, eps): the passes
    (:func:`_grad_passes`) and the two GEMMs (:func:`cupykern.gemm.routed_mm_plan`: ours,
    or the vendor's where the dispatcher says so) with their sizes fixed (any other GEMM,
    e.g. of an empty product or of an operand that needs a general copy, is
    :func:`cupykern.gemm.matmul_core`'s call after them)."""
    go, zo, _, xo, wo = checked[:5]
    prec = check_precision(precision)
    M, N = zo.shape
    place, acc = Place(zo), acc_dtype(zo.dtype)  # (run keeps no Operand: they hold arrays)
    ptr = place.ptr
    row = ITEMSIZE[zo.dtype] * N  # bytes of one row of dvec
    # dz for dx = dz @ W, its transpose for dW = dz^T @ x: each read K-major by ours
    has_k = xo.shape[1] > 0
    # (each on ours or, where the dispatcher says so, the vendor's)
    captured = planned_capture(zo)
    dx_plan, _ = (routed_mm_plan(fresh_like(zo, (M, N), "dz"), wo, prec, M, captured)
                  if input_grad and has_k else (None, False))
    dw_plan, dw_vendor = (routed_mm_plan(fresh_like(zo, (N, M), "dzt"), xo, prec, M, captured)
                          if weight_grad and has_k else (None, False))
    # The vendor's dW reads dz transposed in place, and no pass writes dz^T: cuBLAS runs
    # faster kernels for it than for the contiguous dz^T (H200, GemmScaleBatchNorm's dW
    # at 12108x1961->57: float32 "highest" 191 us against 75, bf16 60 against 47).
    wants_dz, wants_dzt = input_grad or dw_vendor, weight_grad and not dw_vendor
    passes, scratch = _grad_passes(go, zo, state, wants_dzt)

    def run(g, z, coefs, x, weight, bias, scale, bn_weight, running_mean):
        # The passes go out in one batch, then each GEMM as soon as it is ready: the
        # GPU, done with the forward, waits for the host until the first GEMM (H200,
        # 1024x8192 "high", benchmarked: 55 us idle before the dz pass when the column
        # sums went out alone; H100, 80 us when the GEMMs' preparation came first).
        dvec = empty(place, (4, N))
        buf = empty(place, (scratch,), acc) if scratch else None  # (held to the launches)
        dz = empty(place, (M, N)) if wants_dz else None
        dzt = empty(place, (N, M)) if wants_dzt else None
        d0 = ptr(dvec)
        launch_all(place, passes(ptr(g), ptr(z), ptr(coefs),
                                 (ptr(bias), ptr(scale), ptr(bn_weight), ptr(running_mean)),
                                 (d0 + row, d0 + 2 * row, d0 + 3 * row, d0), ptr(buf), ptr(dz),
                                 ptr(dzt)))
        dx = dx_plan(dz, weight) if dx_plan else None
        dw = dw_plan(dz.T if dw_vendor else dzt, x) if dw_plan else None
        if input_grad and dx is None:
            dx = matmul_core(dz, weight, prec)
        if weight_grad and dw is None:
            dw = matmul_core(dzt, x, prec)
        return dx, dw, dvec

    return run


def _grad_passes(go, zo, state, transposed):
    """``(passes, scratch)``: the backward's passes over g and z (Operands: g with contiguous
    rows, z contiguous (M, N)) in ``state``'s mode (a BatchNormState: training, eps) as
    ``passes(g, z, coefs, vectors, grads, buf, dz, dzt) -> launches`` (pointers; vectors: bias, scale, bn_weight, running_mean; grads: where
    d scale, d bn_weight, d bn_bias, d bias go; dz / dzt: 0 where not wanted, dzt only
    with ``transposed``), which need a scratch buffer ``buf`` of ``scratch`` elements of
    the accumulation type (0: none)."""
    M, N = zo.shape
    t, dev = CTYPE[zo.dtype], zo.device
    training, eps = state.training, state.eps
    step = N * ITEMSIZE[acc_dtype(zo.dtype)]  # (bytes of one row of coefs)
    m_, n_, eps_, ld = scalar(M, "int"), scalar(N, "int"), scalar(eps, "double"), go.strides[0]
    if M <= _GRAD_FUSED["ROWS"]:
        fused = _loader.function(_BACKWARD_FILE, _fused_grad_expr(zo.dtype, training), dev)
        cols = _GRAD_FUSED["COLS"]
        launch = ((cdiv(N, cols),), (cols * _fused_grad_warps(zo.dtype),))

        def one(g, z, c0, vectors, grads, buf, dz, dzt):  # (coefs: ca, cm, cb, inv)
            return ((fused, *launch, (g, ld, z, m_, n_, c0 + step, *vectors, c0, c0 + 3 * step,
                                      eps_, *grads, dz, dzt), 0),)

        return one, 0
    exprs = _grad_exprs(t)
    train_coef, eval_coef = (_loader.function(_BACKWARD_FILE, exprs[e], dev)
                             for e in ("coef", "eval_coef"))
    tiles, (partials, grid, block, sizes), (dz_fn, dz_grid, _, dz_sizes) = _grad_rows(
        M, N, zo.dtype, dev, transposed)
    chunks, coef_launch = _chunks(tiles, N, _loader.sm_count(dev))
    tiles_ = scalar(tiles, "int"), scalar(chunks, "int")

    def three(g, z, c0, vectors, grads, k, dz, dzt):
        bias, scale, gamma, rmean = vectors
        part = k + 3 * step
        if training:  # (coefs: ca, cm, cb, inv; buf: dz's k, then the partials)
            coef = (train_coef, *coef_launch, (part, *tiles_, m_, n_, scale, gamma, c0 + 3 * step,
                                               eps_, *grads, k), 0)
            dz_args = (g, ld, z, *dz_sizes, k, c0 + step)
        else:  # (coefs: ca, 0, cb, inv; dz = ca * g, k being coefs' first rows)
            coef = (eval_coef, *coef_launch, (part, *tiles_, n_, bias, scale, gamma, rmean, c0,
                                              c0 + 3 * step, *grads), 0)
            dz_args = (g, ld, 0, *dz_sizes, c0, c0 + step)
        return ((partials, grid, block, (g, ld, z, *sizes, c0 + step, part), 0), coef,
                (dz_fn, dz_grid, block, dz_args + (dz, dzt), 0))

    return three, 3 * N + 2 * tiles * N
