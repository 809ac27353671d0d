"""GPU-free check of the cached launch plans: with the device faked (CPU tensors stand in
for CUDA tensors, launches are recorded instead of made), a call whose plan is cached
must launch exactly what the first, fully validated call launched, with every pointer
taken from the new call's own arrays. Catches a plan that keeps a stale pointer or
size, in CI where no GPU is present."""
import sys

import pytest
import torch

import cupykern
import cupykern.torch.matmul_sum_max_mean_logsumexp
from cupykern import _array, _loader, _tma

MODULES = [_array] + [sys.modules[f"cupykern.{m}"] for m in (
    "normalize", "gemm", "gemm_checks", "gemm_kernels", "gemm_operands", "gemm_route", "gemm_vendor",
    "gemm_scale_batchnorm", "gemm_scale_batchnorm_backward", "matmul_sum_max_mean_logsumexp",
    "torch.matmul_sum_max_mean_logsumexp")]


@pytest.fixture(params=[90, 75], ids=["sm_90", "sm_75"])
def launches(monkeypatch, request):
    """(recorded launches (kernel name, grid, block, args, shared memory), address ranges
    the ops allocated), on a faked Hopper (wgmma, clusters) and a faked Turing (CUDA-core
    GEMM, no clusters)."""
    log = []
    fresh = []  # (start, end) of every array the ops allocate: outputs, scratch, copies
    real_operand, real_empty, real_contiguous = _array.operand, _array.empty, _array.contiguous

    def operand(x, name, dtypes=_array.FLOAT_DTYPES):
        o = real_operand(x, name, dtypes)
        if o.torch and o.kind == "cpu":  # a CPU tensor plays a CUDA tensor on device 0
            o.kind, o.device, o.ptr = "torch", 0, x.data_ptr()
        return o

    def signature(x):
        if type(x) in (torch.Tensor, torch.nn.Parameter):
            return (x.dtype, 0, x.shape, x.stride(), x.data_ptr() & 15)
        return None if x is None else _array.UNPLANNED

    def new(a):
        fresh.append((a.data_ptr(), a.data_ptr() + max(a.nbytes, 1)))
        return a

    def empty(like, shape, dtype=None):
        return new(real_empty(like, shape, dtype))

    def contiguous(a, copy=False):
        c = real_contiguous(a, copy)
        return c if c is a.obj else new(c)

    def launch_all(place, calls, zero=()):
        log.extend(("memset", (), (), (ptr, nbytes), 0) for ptr, nbytes in zero)
        log.extend((fn, tuple(grid), tuple(block), tuple(args), smem)
                   for fn, grid, block, args, smem in calls)

    for m in MODULES:
        for name, fake in (("operand", operand), ("signature", signature),
                           ("launch_all", launch_all), ("empty", empty),
                           ("contiguous", contiguous)):
            if hasattr(m, name):
                monkeypatch.setattr(m, name, fake)
    monkeypatch.setattr(_loader, "function", lambda file, expr, dev, smem=0: expr)
    monkeypatch.setattr(_loader, "device_cc", lambda dev: request.param)
    monkeypatch.setattr(_loader, "sm_count", lambda dev: 132)
    # our kernels at these small shapes, which the dispatcher would give to the vendor
    monkeypatch.setattr(sys.modules["cupykern.gemm_route"], "_FORCED", ["ours"])
    # a tensor map as what it encodes (the driver's encoder needs a GPU), kept apart from
    # the maps real launches share
    monkeypatch.setattr(_tma.Rows2D, "_encode",
                        lambda self, ptr: ("tensor map", ptr, *map(list, self._args[2:5])))
    monkeypatch.setattr(_tma, "row_maps", lambda *geometry: _tma.Rows2D(*geometry))
    for m in MODULES:
        for name in _plan_caches(m):
            monkeypatch.setattr(m, name, {})
    return log, fresh


def _plan_caches(m):
    """Names of module ``m``'s launch-plan caches (dicts named ``*_plans``)."""
    return [n for n, v in vars(m).items() if n.endswith("_plans") and isinstance(v, dict)]


def _cached_plans() -> int:
    return sum(len(getattr(m, n)) for m in MODULES for n in _plan_caches(m))


def _reach(a) -> int:
    """The bytes from ``a``'s data pointer to the end of its last element (0 if empty)."""
    if a.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride()))) * a.element_size()


def _named(launches, arrays):
    """The log with each array's data pointer replaced by its position in ``arrays`` (a
    pointer inside one by (position, offset)) and a pointer into a fresh allocation
    (output, scratch) by ("new", offset)."""
    log, fresh = launches
    names = {a.data_ptr(): i for i, a in enumerate(arrays) if isinstance(a, torch.Tensor)}
    # (the bytes a view reaches, not nbytes: an expanded view's numel covers a fresh
    # allocation that lands just past its one element)
    spans = [(i, a.data_ptr(), a.data_ptr() + _reach(a)) for i, a in enumerate(arrays)
             if isinstance(a, torch.Tensor)]

    def name(v):
        if type(v) is tuple:  # a faked tensor map
            return tuple(map(name, v))
        if type(v) is not int:
            return v
        if v in names:
            return names[v]
        inside = next(((i, v - lo) for i, lo, hi in spans if lo < v < hi), None)
        return inside or next((("new", v - lo) for lo, hi in fresh if lo <= v < hi), v)

    out = [(fn, g, b, tuple(map(name, args)), s) for fn, g, b, args, s in log]
    log.clear()
    fresh.clear()
    return out


def _calls():
    """(label, fn(arrays), make_arrays(), plans it caches) for each op; arrays of one
    geometry."""
    gs = sys.modules["cupykern.gemm_scale_batchnorm"]
    gsb = sys.modules["cupykern.gemm_scale_batchnorm_backward"]
    m4 = sys.modules["cupykern.matmul_sum_max_mean_logsumexp"]
    r = torch.randn
    nz = cupykern.normalize
    yield "normalize", lambda a: nz.normalize(a[0], 2, 1), lambda: [r(6, 100)[:, 2:98]], 1
    yield "normalize short scalar rows", lambda a: nz.normalize(a[0], 1, 1), lambda: [r(300, 7)], 1
    yield "normalize cluster rows", lambda a: nz.normalize(a[0], 2, 1), lambda: [r(40, 3000)], 1
    # few long rows: chunks over every SM, two passes and a scratch buffer of partial sums
    yield "normalize chunked", lambda a: nz.normalize(a[0], 2, 1), lambda: [r(2, 140002)[:, 1:]], 1
    for shape in ((300, 7), (40, 3000), (2, 140000)):
        yield (f"normalize backward {shape}", lambda a: nz.normalize_backward(a[0], a[1], 2, 1),
               lambda s=shape: [r(s), r(s)], 1)
    # dy the stride-0 gradient of y.sum(): copied by the plan, then the kernel
    yield ("normalize backward expanded dy", lambda a: nz.normalize_backward(a[0], a[1], 2, 1),
           lambda: [r(40, 3000), torch.ones(()).expand(40, 3000)], 1)
    yield "linear", lambda a: cupykern.gemm.linear_core(*a, "high"), lambda: [r(5, 24), r(7, 24), r(7)], 1
    # x read transposed (copied by a launch of the plan: 130 outputs a row), weight in place
    yield ("linear transposed x", lambda a: cupykern.gemm.linear_core(*a, "highest"),
           lambda: [r(24, 5).t(), r(130, 24), None], 1)
    yield "matmul", lambda a: cupykern.gemm.matmul_core(*a, "highest"), lambda: [r(5, 24), r(24, 7)], 1
    # a broadcast stack: b's transpose copied once, one launch per matrix at its offsets
    yield ("matmul stack", lambda a: cupykern.gemm.matmul_core(*a, "highest"),
           lambda: [r(3, 1, 5, 24), r(2, 24, 8)], 1)
    # stacks read in place (Hopper: one launch, planned): b row-major (the swapped
    # product) and b K-major (a transposed view)
    yield ("matmul stack, b row-major", lambda a: cupykern.gemm.matmul_core(*a, "highest"),
           lambda: [r(3, 70, 64), r(3, 64, 140)], 1)
    yield ("matmul stack, b K-major", lambda a: cupykern.gemm.matmul_core(*a, "high"),
           lambda: [r(3, 70, 64), r(3, 140, 64).mT], 1)
    yield ("matmul folded stack", lambda a: cupykern.gemm.matmul_core(*a, "highest"),
           lambda: [r(3, 5, 24), r(24, 8)], 1)
    yield ("mm transposed a", lambda a: cupykern.gemm_operands.mm(*a, "highest"),
           lambda: [r(24, 5).t(), r(24, 130)], 1)
    # dx = dy @ W where W's transposed copy pays: on Hopper "high" read in place (below)
    yield "mm dy @ W", lambda a: cupykern.gemm_operands.mm(*a, "high"), lambda: [r(130, 300), r(300, 40)], 1
    for training in (True, False):
        yield (f"gemm_scale_batchnorm training={training}",
               lambda a, t=training: gs.gemm_scale_batchnorm_core(*a, t, 0.1, 1e-5, "highest"),
               lambda: [r(9, 24), r(8, 24), r(8), r(8), r(8), r(8), r(8), r(8).abs(),
                        torch.zeros((), dtype=torch.int64)], 1)
    # the synchronized path's first pass (no plan: every call builds its launches)
    yield ("gemm_statistics", lambda a: gs.gemm_statistics(*a, "high"),
           lambda: [r(300, 24), r(40, 24)], 0)
    # the fused backward, its dx and dW GEMMs planned within it
    for training in (True, False):
        yield (f"gemm_scale_batchnorm backward training={training}",
               lambda a, t=training: gsb.backward(*a, t, 1e-5, "highest"),
               lambda: [r(9, 8), r(9, 8), r(4, 8).abs(), r(9, 24), r(8, 24), r(8), r(8), r(8),
                        r(8)], 1)
    yield ("gemm_scale_batchnorm backward, no bias or bn_weight, dW only",
           lambda a: gsb.backward(*a, None, True, 1e-5, "high", False, True),
           lambda: [r(9, 8), r(9, 8), r(4, 8).abs(), r(9, 24), r(8, 24), None, r(8), None], 1)

    def m4_call(a):
        from cupykern.torch.matmul_sum_max_mean_logsumexp import _check
        return m4.apply_cached(*a, _check)

    yield ("matmul_sum_plan", lambda a: m4.build_plan_cached(*a, m4.check_weights),
           lambda: [r(8, 24), r(8)], 1)
    yield ("matmul_sum_max_mean_logsumexp", m4_call,
           lambda: [r(5, 24), r(8, 24), r(8), torch.empty(24 + m4.PLAN_TAIL, dtype=torch.float64)], 1)


CALLS = list(_calls())


@pytest.mark.parametrize("label, call, make, plans", CALLS, ids=[c[0] for c in CALLS])
def test_cached_plan_launches_with_the_new_arrays(launches, label, call, make, plans):
    first, second = make(), make()
    call(first)
    planned = _named(launches, first)
    assert planned, "nothing was launched"
    assert _cached_plans() == plans  # planned once, cached
    call(second)  # a cache hit: same signatures
    assert _named(launches, second) == planned


def test_kernel_arguments_fill_their_slots():
    """Each scalar kernel argument fills one 8-byte cuLaunchKernel parameter slot, typed
    as :func:`cupykern._array.scalar` documents: ints as long long, int32, float64; a
    tensor map its 128 bytes on a 64-byte boundary; the parameter array points at each.
    Any other type is a TypeError, never a misread argument."""
    import ctypes
    import struct

    import numpy as np

    tmap = _tma.TensorMap(bytes(range(128)))
    args = (0x7F0012345678, -3, np.int32(-7), tmap, np.float64(0.5))
    fmt = _array._format(tuple(map(type, args)))
    assert _array._OFFSETS[fmt] == [0, 8, 16, 64, 192]
    buf = bytearray(struct.calcsize(fmt))
    struct.pack_into(fmt, buf, 0, *args)
    slots = np.frombuffer(bytes(buf[:16]), np.int64)
    assert slots[0] == 0x7F0012345678 and slots[1] == -3
    assert np.frombuffer(bytes(buf[16:20]), np.int32)[0] == -7
    assert bytes(buf[64:192]) == tmap
    assert np.frombuffer(bytes(buf[192:200]), np.float64)[0] == 0.5
    arena = _array._arena()
    params = np.ctypeslib.as_array((ctypes.c_uint64 * 5).from_address(_array._param_array(arena, fmt)))
    assert list(params - arena[2]) == [0, 8, 16, 64, 192] and arena[2] % 64 == 0
    for bad in (float, np.float32, bool, bytes):
        with pytest.raises(TypeError, match="kernel arguments"):
            _array._format((int, bad))


def test_dx_reads_w_in_place_on_hopper(launches):
    """mm(dy, W) "high" at a batch where copying W's transpose pays (130 rows) and with
    enough tiles not to split K (34 of 128 rows of W^T): on Hopper the GEMM reads W's own
    storage as its transposed A (TMA boxes of 32 x 32 of the 300 x 4352 rows) and stores
    W^T @ dy^T (4352, 130) transposed, straight into the (130, 4352) result, or with K
    split (a small W) into float slabs of the (130, 40) result that splitk_reduce adds;
    elsewhere, or at a batch below 128, W's transpose is copied first."""
    dy, w = torch.randn(130, 300), torch.randn(300, 4352)
    cupykern.gemm_operands.mm(dy, w, "high")
    log = _named(launches, [dy, w])
    names = [fn.split("<")[0] for fn, *_ in log]
    if _loader.device_cc(0) == 90:
        assert names == ["gemm_wgmma"]
        gemm = log[0]
        assert gemm[0].startswith("gemm_wgmma<float, 1, true, false, true, 64,")  # TA, TC
        assert gemm[3][:3] == (1, 0, ("new", 0))  # A = W, B = dy, C = the result
        assert gemm[3][3:6] == (4352, 130, 300) and gemm[3][9] == 4352  # M, N, K; ldc
        assert gemm[3][-9] == ("tensor map", 1, [4352, 300], [4352 * 4], [32, 32])
        assert gemm[3][-7:] == (0, 0, 0, 1, 0, 0, 1)  # one product: no stack strides, count 1
    else:
        assert names[0] == "transpose_copy" and log[0][3][0] == 1  # W's transpose, copied
    cupykern.gemm_operands.mm(dy, w[:, :40], "high")  # 1 tile: K split
    raw = list(launches[0])
    log = _named(launches, [dy, w])
    if _loader.device_cc(0) != 90:
        assert log[0][0].startswith("transpose_copy") and log[0][3][0] == 1
        return
    (gemm, grid, _, args, _), (reduce, _, _, rargs, _) = log
    assert gemm.startswith("gemm_wgmma<float, 1, true, false, true, 64,") and grid == (1, 1, 2)
    assert args[:6] == (1, 0, ("new", 0), 40, 130, 300) and args[6] == 160  # chunks of 160
    assert args[9] == 40  # the slabs: (130, 40) each, rows of 40
    assert reduce.startswith("splitk_reduce<float, float,")
    assert rargs[:6] == (("new", 0), 2, 130, 40, ("new", 0), 40)  # slabs -> the result
    assert raw[1][3][0] == raw[0][3][2] != raw[1][3][4]


def test_dw_copies_only_x_on_hopper(launches):
    """mm(dy^T, x), linear's dW, where copying a transposed operand pays: on Hopper the GEMM
    reads dy's own storage as its transposed A by TMA, so only x's transpose (its B) is
    copied; elsewhere both are."""
    dy, x = torch.randn(512, 256), torch.randn(512, 384)
    cupykern.gemm_operands.mm(dy.t(), x, "highest")
    log = _named(launches, [dy, x])
    copied = [args[0] for fn, _, _, args, _ in log if fn.startswith("transpose_copy")]
    if _loader.device_cc(0) != 90:
        assert sorted(copied) == [0, 1]
        return
    assert copied == [1]
    gemm = next(launch for launch in log if launch[0].startswith("gemm_wgmma"))
    assert gemm[0].startswith("gemm_wgmma<float, 0, true, false, false, 64,")  # TA by TMA
    assert gemm[3][:2] == (0, ("new", 0))  # A: dy itself; B: x's copy
    assert gemm[3][3:6] == (256, 384, 512)  # M, N, K


@pytest.mark.parametrize("dtype, ctype, map_type", [("float16", "half_t", _tma.FLOAT16),
                                                     ("bfloat16", "bf16_t", _tma.BFLOAT16)])
def test_16_bit_aligned_products_choose_wgmma_on_hopper(monkeypatch, dtype, ctype, map_type):
    """On sm_90, float16 / bfloat16 products of K-major 16-byte aligned rows run
    gemm_wgmma's 16-bit mode (MODE 3): A and B by TMA in boxes of 64 rows x 64 elements
    (one 128-byte swizzled row) of the dtype's maps, clusters of two CTAs where the M
    tiles pair up, K split into whole 64-element slices (float slabs) where the tiles
    fill at most a quarter of the SMs, or half of them with K >= 2048. Misaligned or transposed operands, and other GPUs,
    keep gemm_mma's 16-bit mode (never split)."""
    from cupykern import gemm_kernels

    op = _fake_hopper(monkeypatch, dtype)

    cfg = gemm_kernels._WGMMA[gemm_kernels._HALF]
    bm, bn = cfg["BM"], cfg["BN"]
    a, b = op(8 * bm, 1024), op(9 * bn, 1024)  # 72 tiles: no split
    choice = gemm_kernels._choose(a, b, "highest")
    assert choice.expr == (f"gemm_wgmma<{ctype}, 3, false, false, false, 64, 2, 128, 256, 384, 4, "
                           f"{cfg['SMEM']}, 64>") and choice.cluster == 2
    assert choice.maps(0x10000, 0x20000) == (
        ("tensor map", 0x10000, map_type, [1024, 8 * bm], [2048], [64, 64]),
        ("tensor map", 0x20000, map_type, [1024, 9 * bn], [2048], [64, 64]), 0, 0, 0, 1, 0, 0, 1)
    kernel = gemm_kernels.gemm_kernel(a, b, "highest")
    assert (kernel.grid, kernel.block, kernel.smem, kernel.bm, kernel.splits) == ((72,), (384,), cfg["SMEM"], bm, 1)
    assert gemm_kernels._choose(op(3 * bm, 1024), b, "high").cluster == 1  # an odd count of M tiles
    assert gemm_kernels._choose(op(1, 8), op(1, 8), "high").expr.startswith(f"gemm_wgmma<{ctype}, 3,")
    # 1 tile: 16 chunks of 512 (float32 slabs, 32-row tiles of statistics); 6 tiles of K 4104:
    # 13 chunks of 320, the last 264 (whole 64-element slices but the very last)
    split = gemm_kernels.gemm_kernel(op(bm, 8192), op(bn, 8192), "highest")
    assert (split.grid, split.splits, split.kchunk, split.bm, split.workspace, split.reduce) == (
        (1, 1, 16), 16, 512, 32, 16 * bm * bn, "kernel")
    split = gemm_kernels.gemm_kernel(op(3 * bm, 4104), op(2 * bn, 4104), "highest")
    assert (split.grid, split.splits, split.kchunk) == ((6, 1, 13), 13, 320)
    split = gemm_kernels.gemm_kernel(op(4 * bm, 4096), op(9 * bn, 4096), "highest")  # 36 tiles: 3 chunks
    assert (split.grid, split.splits, split.kchunk) == ((36, 1, 3), 3, 1408)
    a_, b_ = op(4 * bm, 1984), op(9 * bn, 1984)  # K < 2048: a quarter of the SMs at most
    assert gemm_kernels._choose(a_, b_, "highest").expr.startswith(f"gemm_wgmma<{ctype}, 3,")
    assert gemm_kernels.gemm_kernel(a_, b_, "highest").splits == 1
    for a_, b_ in ((op(256, 1024, ptr=0x10002), b),  # rows start off 16 bytes
                   (op(256, 1024, ld=1028), b),  # rows of 2056 bytes
                   (op(256, 1020), op(512, 1020)),  # K % 8
                   (op(256, 1024, transposed=True), b), (a, op(512, 1024, transposed=True))):
        assert gemm_kernels._choose(a_, b_, "highest").expr.startswith(f"gemm_mma<{ctype}, 3,")
    monkeypatch.setattr(_loader, "device_cc", lambda dev: 80)
    assert gemm_kernels._choose(a, b, "highest").expr.startswith(f"gemm_mma<{ctype}, 3, true,")


def test_stack_copies_and_multiplies_in_one_launch_each(launches):
    """A float32 stack on ours, (4, 256, 100) @ (4, 100, 300): b's transpose is copied
    K-major for every matrix in one launch of the tiled copy (grid y: the matrix); then on
    Hopper one gemm_wgmma launch multiplies the whole stack (grid y: the matrix; strides of
    a, the copy and the output last), elsewhere a launch per matrix at its offsets. (K =
    100 keeps Hopper off the swapped stack, see the next test.)"""
    from cupykern import gemm

    log, _ = launches
    a, b = torch.randn(4, 256, 100), torch.randn(4, 100, 300)
    out = gemm.matmul_core(a, b, "highest")
    copy, *products = log
    assert copy[0] == "transpose_copy<float, 32, 256>" and copy[1] == (40, 4)
    assert copy[3][0] == b.data_ptr() and copy[3][2:] == (300, 100, 1, 300, 100, 100 * 300, 300 * 100)
    if _loader.device_cc(0) == 90:
        (name, grid, _, args, _), = products
        assert name.startswith("gemm_wgmma<float, 0,") and grid == (2 * 3, 4)
        assert args[:3] == (a.data_ptr(), copy[3][1], out.data_ptr())
        assert args[-7:] == (256 * 100, 100 * 300, 256 * 300, 4, 0, 0, 4)
    else:
        assert len(products) == 4 and all(p[1] == products[0][1] for p in products)
        assert [p[3][0] - a.data_ptr() for p in products] == [i * 256 * 100 * 4 for i in range(4)]


def test_stack_of_row_major_b_runs_swapped_on_hopper(launches):
    """A float32 stack (4, 256, 128) @ (4, 128, 300), b row-major: on Hopper one gemm_wgmma
    launch computes each (b_i^T a_i^T)^T, reading b's matrices as transposed A by TMA (one
    map over the stack's 4 x 128 K rows) and storing each product transposed into the
    (256, 300) outputs, with no copy, its CTAs persistent over the stack's 4 x 6 tiles; a
    b already K-major (a transposed view) runs unswapped, also without a copy. Elsewhere
    b's transpose is copied first."""
    from cupykern import gemm

    log, _ = launches
    a, b = torch.randn(4, 256, 128), torch.randn(4, 128, 300)
    out = gemm.matmul_core(a, b, "highest")
    if _loader.device_cc(0) != 90:
        assert log[0][0].startswith("transpose_copy") and log[0][3][0] == b.data_ptr()
        return
    (name, grid, _, args, _), = log
    assert name.startswith("gemm_wgmma<float, 0, true, false, true, 64,")  # TA by TMA, TC
    assert grid == (4 * 3 * 2, 1)  # 4 x (300 / 128) x (256 / 128) tiles, persistent CTAs
    assert args[:3] == (b.data_ptr(), a.data_ptr(), out.data_ptr())
    assert args[3:6] == (300, 256, 128) and args[9] == 300  # M, N, K of b^T a^T; ldc
    assert args[-9] == ("tensor map", b.data_ptr(), [300, 4 * 128], [300 * 4], [32, 32])
    assert args[-8] == ("tensor map", a.data_ptr(), [128, 4 * 256], [128 * 4], [32, 64])
    assert args[-7:] == (128 * 300, 256 * 128, 256 * 300, 4, 0, 0, 4)
    log.clear()
    bt = torch.randn(4, 300, 128).mT  # K-major already
    out = gemm.matmul_core(a, bt, "highest")
    (name, grid, _, args, _), = log
    assert name.startswith("gemm_wgmma<float, 0, false, false, false,") and grid == (2 * 3, 4)
    assert args[:3] == (a.data_ptr(), bt.data_ptr(), out.data_ptr())


def _fake_hopper(monkeypatch, dtype):
    """An sm_90 GPU of 132 SMs where nothing compiles and tensor maps are tuples of their
    geometry; returns ``op(rows, k, ptr, ld, transposed)``: a 2-D Operand of ``dtype``."""
    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)
    monkeypatch.setattr(_loader, "sm_count", lambda dev: 132)
    monkeypatch.setattr(_loader, "function", lambda *args: "kernel")  # (nothing compiled)
    monkeypatch.setattr(_tma.Rows2D, "_encode", lambda self, ptr: (
        "tensor map", ptr, self._args[0], *map(list, self._args[2:5])))
    monkeypatch.setattr(_tma, "row_maps", lambda *geometry: _tma.Rows2D(*geometry))

    def op(rows, k, ptr=0x10000, ld=None, transposed=False):
        strides = (1, ld or rows) if transposed else (ld or k, 1)
        return _array.Operand(None, "torch", dtype, (rows, k), strides, ptr, 0, "a", True)
    return op


@pytest.mark.parametrize("precision, tiles, k, splits", [
    ("highest", (6, 6), 4096, 3),  # 36 tiles: 3 chunks fill 108 of 132 SMs
    ("highest", (8, 8), 2048, 2),  # 64: 2 chunks
    ("highest", (8, 8), 1024, 1),  # K < 2048: a quarter of the SMs at most
    ("highest", (4, 8), 1024, 4),  # (32 tiles: a quarter)
    ("highest", (8, 9), 4096, 1),  # 72: more than half the SMs
    ("high", (6, 6), 4096, 1),  # TF32 (128 x 256 tiles): 36, more than a quarter
])
def test_float32_products_split_k_on_hopper(monkeypatch, precision, tiles, k, splits):
    """On sm_90 a 2-D 3xTF32 product with K >= 2048 splits K wherever two chunks of its
    tiles fit on the SMs (at most half of them); a shorter K, and TF32, where they fill at
    most a quarter. A stack keeps the quarter: 36 tiles in all stay one launch."""
    from cupykern import gemm_kernels
    from cupykern.gemm_kernels import Stack

    op = _fake_hopper(monkeypatch, "float32")
    cfg = gemm_kernels._WGMMA[gemm_kernels._MODE[precision]]
    a, b = op(tiles[0] * cfg["BM"], k), op(tiles[1] * cfg["BN"], k)
    assert gemm_kernels.gemm_kernel(a, b, precision).splits == splits
    if precision == "highest" and tiles == (6, 6):
        stack = Stack(2, 2, (0, 0), (0, 0))
        assert gemm_kernels.batched_call(op(3 * cfg["BM"], k), b, precision, stack) is not None


def test_stack_is_one_launch_on_hopper(monkeypatch):
    """A stack of float32 "highest" products runs gemm_wgmma once, the matrix in the
    grid's y: its tensor maps span every matrix's rows (matrix i's at row i * stride /
    ld) and the kernel takes the stack strides (a broadcast operand's is 0). A stack
    whose tiles split K, whose matrices start past a row's room, or that runs on another
    kernel is None (one launch per matrix)."""
    from cupykern import gemm_kernels
    from cupykern.gemm_kernels import Stack

    def stack(count, sa, sb, inner=None, outer=(0, 0)):
        return Stack(count, inner or count, (sa, outer[0]), (sb, outer[1]))

    op = _fake_hopper(monkeypatch, "float32")
    bm, bn = gemm_kernels._WGMMA[0]["BM"], gemm_kernels._WGMMA[0]["BN"]
    a, b = op(512, 1024), op(2048, 1024, ptr=0x20000)  # (128, 512, 1024) @ (128, 1024, 2048)^T
    call = gemm_kernels.batched_call(a, b, "highest", stack(128, 512 * 1024, 0))
    (fn, grid, block, args, smem), = call(0x10000, 0x20000, 0x30000)
    assert grid == (512 // bm * 2048 // bn, 128) and block == (384,)
    assert args[:3] == (0x10000, 0x20000, 0x30000)
    assert args[-7:] == (512 * 1024, 0, 512 * 2048, 128, 0, 0, 128)
    assert args[-9] == ("tensor map", 0x10000, _tma.FLOAT32, [1024, 128 * 512], [4096], [32, 64])
    assert args[-8] == ("tensor map", 0x20000, _tma.FLOAT32, [1024, 2048], [4096], [32, 64])
    split = stack(2, 0, 0)
    assert gemm_kernels.batched_call(op(128, 1024), op(128, 1024), "highest", split) is None
    partial = stack(128, 512 * 1024 + 4, 0)  # matrix i starts 4i columns on: past its row's room
    assert gemm_kernels.batched_call(a, b, "highest", partial) is None
    assert gemm_kernels.batched_call(op(512, 1022), op(2048, 1022), "highest",
                                     stack(128, 0, 0)) is None  # mma.sync
    bt = op(2048, 1024, ptr=0x20000, transposed=True)  # a row-major b as the swapped A
    swapped = stack(128, 1024 * 2048, 512 * 1024)
    assert gemm_kernels.batched_call(bt, a, "highest", swapped) is None
    (fn, grid, block, args, smem), = gemm_kernels.batched_call(
        bt, a, "highest", swapped, transposed_c=True)(0x20000, 0x10000, 0x30000)
    assert grid == (132, 1) and args[9] == 2048  # persistent; ldc: the stored (512, 2048)
    assert args[-9] == ("tensor map", 0x20000, _tma.FLOAT32, [2048, 128 * 1024], [8192], [32, 32])
    bt = op(2048, 1000, ptr=0x20000, transposed=True)  # K % 32: a slice would cross matrices
    assert gemm_kernels.batched_call(bt, op(512, 1000), "highest", stack(128, 1000 * 2048, 0),
                                     transposed_c=True) is None


def test_two_level_stack_is_one_launch_on_hopper(monkeypatch):
    """Attention's (batch, head) views of one projection (B, T, 3, H, D): head h of batch
    i starts h * D columns and i * T rows on, so the stack takes two levels of strides and
    its maps reach every head's columns (K a multiple of the K slice: no slice reads the
    next head's). A K that is not, or a head that runs past its row's end, is None."""
    from cupykern import gemm_kernels
    from cupykern.gemm_kernels import Stack

    op = _fake_hopper(monkeypatch, "float32")
    B, T, H, D = 8, 512, 12, 64
    ld = 3 * H * D
    q, k = op(T, D, ld=ld), op(T, D, ptr=0x20000, ld=ld)  # q @ k^T, heads in the grid
    heads = Stack(B * H, H, (D, T * ld), (D, T * ld))
    (fn, grid, block, args, smem), = gemm_kernels.batched_call(q, k, "highest", heads)(
        0x10000, 0x20000, 0x30000)
    assert grid[1] == B * H and args[-7:] == (D, D, T * T, B * H, T * ld, T * ld, H)
    rows, cols = B * T, H * D  # every batch's rows, every head's columns
    assert args[-9] == ("tensor map", 0x10000, _tma.FLOAT32, [cols, rows], [ld * 4], [32, 64])
    assert args[-8] == ("tensor map", 0x20000, _tma.FLOAT32, [cols, rows], [ld * 4], [32, 64])
    odd = Stack(B * H, H, (40, T * ld), (40, T * ld))  # K = 40: a slice would read the next head
    assert gemm_kernels.batched_call(op(T, 40, ld=ld), op(T, 40, ptr=0x20000, ld=ld), "highest",
                                     odd) is None
    wide = Stack(B * H, H, (D, T * 700), (D, T * 700))  # head 11's 64 columns past a row of 700
    assert gemm_kernels.batched_call(op(T, D, ld=700), op(T, D, ptr=0x20000, ld=700), "highest",
                                     wide) is None


@pytest.mark.parametrize("g", ["transposed", "expanded"])
def test_backward_copies_once_a_call(launches, monkeypatch, g):
    """A backward call whose g must be copied (rows not contiguous: a transposed view, or
    the stride-0 gradient of ``out.sum()``) copies it once: on the first call, which
    validates and plans, as on every later one, which takes the plan without validating."""
    gs = sys.modules["cupykern.gemm_scale_batchnorm_backward"]
    copies, fake, checks, check = [], _array.contiguous, [], gs._check_backward

    def counting(a, copy=False):
        c = fake(a, copy)
        if c is not a.obj:
            copies.append(a.name)
        return c

    monkeypatch.setattr(_array, "contiguous", counting)
    monkeypatch.setattr(gs, "_check_backward", lambda *a: checks.append(1) or check(*a))
    r = torch.randn
    g = r(8, 9).t() if g == "transposed" else torch.ones(()).expand(9, 8)
    args = [g, r(9, 8), r(4, 8).abs(), r(9, 24), r(8, 24), r(8), r(8), r(8), None]
    for i in range(3):
        copies.clear()
        gs.backward(*args, True, 1e-5, "highest")
        assert copies == ["g"]
    assert len(checks) == 1


def _cpu_calls():
    """(module, name of its check, call) for each op whose plan cache a NumPy call misses."""
    import numpy as np

    r = np.random.default_rng(0).random
    yield "gemm_operands", "check_mm", lambda m: m.mm(r((3, 4)), r((4, 5)))
    yield "gemm", "check", lambda m: m.linear_core(r((3, 4)), r((5, 4)), r(5))
    yield "normalize", "check", lambda m: m.normalize(r((3, 4)), 2, -1)
    yield "gemm_scale_batchnorm", "check", lambda m: m.gemm_scale_batchnorm_core(
        r((6, 4)), r((5, 4)), r(5), r(5), r(5), r(5), r(5), r(5) + 1, None, True, 0.1, 1e-5,
        "highest")


@pytest.mark.parametrize("stem, name, call", list(_cpu_calls()),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_cpu_call_validates_once(monkeypatch, stem, name, call):
    """A call the plan cache cannot describe (NumPy: the reference path) validates its
    arguments once, not once to try a plan and again on the general path."""
    m = sys.modules[f"cupykern.{stem}"]
    calls, real = [], getattr(m, name)
    monkeypatch.setattr(m, name, lambda *a: calls.append(a) or real(*a))
    for _ in range(2):
        calls.clear()
        call(m)
        assert len(calls) == 1


# The normalize dispatcher's table (cupykern/normalize.py, _route), pinned: H100/H200
# (132 SMs, sm_90), then a Turing without clusters.
ROUTES = [
    ((262144, 7, "float32"), (0, 4, 2, 4, False)),  # under 2 vectors: scalar units
    ((2000000, 5, "bfloat16"), (0, 2, 4, 4, False)),
    ((100, 15, "bfloat16"), (0, 8, 2, 4, False)),
    ((524288, 16, "bfloat16"), (0, 2, 1, 2, True)),  # 2 vectors: 2 lanes, 16-byte units
    ((1048576, 32, "float32"), (0, 8, 1, 4, True)),
    ((65536, 256, "bfloat16"), (0, 32, 1, 2, True)),
    ((100000, 300, "bfloat16"), (0, 32, 2, 2, True)),  # unaligned rows: head/tail scalars
    ((1024, 1024, "float32"), (0, 32, 8, 1, True)),  # 256 vectors: the short kernel's last
    ((1024, 1028, "float32"), (1, 128, 4)),  # 257 vectors: a CTA per row
    ((32768, 65535, "float32"), (4, 512, 8)),  # the benchmark shape: unchanged
    ((32768, 65535, "bfloat16"), (4, 512, 4, False)),
    ((300, 50000, "float32"), (4, 512, 8)),
    ((2, 65535, "float32"), (4, 512, 8)),  # few rows: still a cluster per row
    ((2, 8000, "float32"), (1, 512, 4)),
    ((2, 140001, "float32"), (-1, 1024)),  # 35000 vectors: no cluster holds it
    ((1, 4194304, "float32"), (-1, 1024)),  # ~8 items per SM, chunks of >= 1024 vectors
    ((3, 2000001, "float32"), (-1, 1421)),
    ((4, 4194304, "float32"), (-2,)),  # up to 16 rows of >= 32 MB: the few-rows kernel
    ((8, 4194304, "float32"), (-3,)),  # 3+ rows, 128 MB: pipelined
    ((24, 4194304, "float32"), (-3,)),
    ((16, 2097152, "float32"), (-3,)),
    ((12, 2097152, "float32"), (-2,)),  # (96 MB)
    ((100, 200000, "float32"), (-3,)),  # more than 16 rows, from 40 MiB: pipelined
    ((1, 2**24, "float32"), (-2,)),  # (one row of 64 MB)
    ((1, 2**24, "bfloat16"), (-1, 1986)),  # (one row under 64 MB: two passes)
    ((30, 200000, "float32"), (-1, 1389)),  # longer than any cluster holds, 24 MB
]


@pytest.mark.parametrize("geometry, want", ROUTES, ids=lambda v: str(v))
def test_normalize_dispatcher_table(geometry, want):
    nz = sys.modules["cupykern.normalize"]
    assert nz._route(*geometry, 90, 132) == want
    # -1 chunked or few rows (the backward's own bounds: below), 0 short rows, 1 clusters
    # (the backward's own sizes)
    family = min(max(want[0], -1), 1)
    backward = nz._route(*geometry, 90, 132, backward=True)
    if want[0] == 0 and want[4] and nz._row_vectors(*geometry[1:]) > 128:
        assert backward == (1, 128, 4, False)  # the backward's short rows end at 128 vectors
    else:
        assert min(max(backward[0], -1), 1) == family


@pytest.mark.parametrize("geometry, want", [
    ((4, 4194304, "float32"), (-2,)),  # x of 32 to 64 MB: the few-rows kernel
    ((2, 4194304, "float32"), (-2,)),
    ((1, 2**24, "float32"), (-2,)),  # (one row too)
    ((1, 2**24, "bfloat16"), (-2,)),
    ((8, 4194304, "float32"), (-1, 7944)),  # over 64 MB: two passes
    ((16, 2097152, "float32"), (-1, 7944)),
    ((1, 4194304, "float32"), (-1, 1024)),  # under 32 MB
    ((17, 1048576, "float32"), (-1, 4162)),  # more than 16 rows
])
def test_normalize_backward_few_rows(geometry, want):
    """The backward's few-rows bounds (RESIDENT_MIN_BYTES to RESIDENT_BACKWARD_MAX_BYTES of
    x, up to RESIDENT_MAX_ROWS rows)."""
    nz = sys.modules["cupykern.normalize"]
    assert nz._route(*geometry, 90, 132, backward=True) == want


@pytest.mark.parametrize("geometry, want", [
    ((1048576, 32, "bfloat16"), (0, 4, 1, 2, True)),  # 4 vectors: 2 rows in flight, not 4
    ((1048576, 32, "float32"), (0, 8, 1, 2, True)),
    ((524288, 16, "bfloat16"), (0, 2, 1, 2, True)),
    ((65536, 512, "float32"), (0, 32, 4, 1, True)),  # 128 vectors: the backward's last
    ((65536, 516, "float32"), (1, 128, 4, False)),
    ((262144, 7, "float32"), (0, 4, 2, 4, False)),  # single elements: the forward's
])
def test_normalize_backward_short_rows(geometry, want):
    """The backward's short-row table (SHORT_VECTOR_BACKWARD): x and dy in flight, so at
    most 2 rows a lane; cluster kernels past 128 vectors."""
    nz = sys.modules["cupykern.normalize"]
    assert nz._route(*geometry, 90, 132, backward=True) == want


def test_normalize_dispatcher_without_clusters():
    nz = sys.modules["cupykern.normalize"]
    assert nz._route(32768, 65535, "float32", 75, 40) == (-1, 16383)  # no cluster: a chunk a row
    assert nz._route(64, 4000, "float32", 75, 40) == (1, 256, 4)
    assert nz._route(64, 1000, "float32", 75, 40) == (0, 32, 8, 1, True)
