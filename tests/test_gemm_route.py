"""The GEMM dispatcher: the routing table's boundaries (GPU-free), where each product goes
(ours or the vendor's) for plain and fused products, the vendor's own forms, and how an
eager call reaches its plan; the kernel choice behind ``aligned`` (wgmma rows, clusters)."""
import numpy as np
import pytest

import cupykern
from cupykern.gemm_route import GemmProblem

torch = pytest.importorskip("torch")
from support import MATMUL_TOL as REL_BOUND, assert_grad_close, check_mm as _check_mm  # noqa: E402
from support import col_major as _col_major, gemm_data as _data, gemm_errors as _errors  # noqa: E402
from support import hopper as _hopper  # noqa: E402

pytestmark = pytest.mark.usefixtures("our_kernels")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["linear", "matmul"])
def test_recorded_calls_below_the_grad_bound_are_torch_own(op, dispatched, grad_bounds):
    """A bf16 product of an N off 16-byte rows that ours computes alone (cupykern.gemm_route.route)
    but that autograd records below MISALIGNED_GRAD_MIN_WORK runs as torch's own op, with
    torch's own backward: the same output and gradients as torch's, bit for bit. Lower the
    bound, and the call runs ours (the op's backward)."""
    from cupykern import gemm, gemm_route, gemm_vendor
    if not _hopper():
        pytest.skip("the rule that gives ours a 16-bit product of a misaligned N is Hopper's")
    m, n, k = 1024, 1025, 1024
    x, w, b = (t.cuda() for t in _data(m, n, k, torch.bfloat16))
    call = ((lambda x, w: cupykern.linear(x, w, b)) if op == "linear"
            else (lambda x, w: cupykern.matmul(x, w.t())))
    ref = ((lambda x, w: torch.nn.functional.linear(x, w, b)) if op == "linear"
           else (lambda x, w: torch.matmul(x, w.t())))
    with torch.no_grad():
        call(x, w)  # (plans ours)
    planned = gemm.eager_plan if op == "linear" else gemm.eager_plan_matmul
    state = gemm_vendor.vendor_state(x)
    plans, key = ((gemm._plans, gemm._linear_key(x, w, b, "highest", state)) if op == "linear"
                  else (gemm._matmul_plans, gemm._matmul_key(x, w.t(), "highest", state)))
    assert plans.get(key) is not None and type(plans.get(key)) is not gemm_vendor.VendorPlan  # ours
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for bound, ours in ((gemm_route._ROUTE["MISALIGNED_GRAD_MIN_WORK"], False), (2 ** 20, True)):
        grad_bounds(bound)
        xs, ws = (t.clone().requires_grad_() for t in (x, w))
        xr, wr = (t.clone().requires_grad_() for t in (x, w))
        out, want = call(xs, ws), ref(xr, wr)
        args = (xs, ws, b) if op == "linear" else (xs, ws.t())
        assert planned(*args, "highest", state, True)[1] != ours
        assert (type(out.grad_fn) is type(want.grad_fn)) != ours
        out.backward(g)
        want.backward(g)
        if not ours:
            assert torch.equal(out, want) and torch.equal(xs.grad, xr.grad)
            assert torch.equal(ws.grad, wr.grad)
        else:
            assert_grad_close(xs.grad.float(), xr.grad.float(), 2e-2, what="x")
            assert_grad_close(ws.grad.float(), wr.grad.float(), 2e-2, what="w")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["linear", "matmul"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_eager_calls_run_ours_plan_through_the_op(op, grad, monkeypatch):
    """In plain eager mode a call that a first call planned on ours runs that plan through
    Op.call_planned (cupykern.gemm.eager_plan), without the op's implementation: the same
    output and gradients, bit for bit, as the first call through the op."""
    from cupykern import gemm
    m, n, k = 100, 130, 70
    x, w, b = (t.cuda() for t in _data(m, n, k, torch.float32))
    call = ((lambda x, w: cupykern.linear(x, w, b, precision="highest")) if op == "linear"
            else (lambda x, w: cupykern.matmul(x, w.t(), precision="highest")))
    core = "linear_core" if op == "linear" else "matmul_core"
    calls, real = [], getattr(gemm, core)  # (forwards only: the backward's products are matmuls)
    monkeypatch.setattr(gemm, core, lambda *a: calls.append(a[0].shape == (m, k)) or real(*a))
    g = torch.randn(m, n, device="cuda")
    outs, grads = [], []
    for _ in range(2):
        xs, ws = (t.clone().requires_grad_(grad) for t in (x, w))
        out = call(xs, ws)
        if grad:
            out.backward(g)
            grads.append((xs.grad, ws.grad))
        outs.append(out)
    assert sum(calls) == 1  # (the first call only: the second ran the plan)
    assert torch.equal(outs[0], outs[1])
    if grad:
        assert all(torch.equal(a, c) for a, c in zip(*grads))
        assert_grad_close(grads[1][0], g @ w, 1e-5, what="x")


@pytest.mark.parametrize("op", ["linear", "matmul"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_eager_call_hands_ours_plan_to_the_op(op, grad, monkeypatch):
    """GPU-free, with a fake plan: where cupykern.gemm.eager_plan answers ours' plan, the
    torch layer runs it through Op.call_planned with the op's arguments and resolved
    precision, and autograd records the op's backward; where it answers nothing, the op."""
    from cupykern import gemm
    x, w, b = _data(5, 3, 4, torch.float64)
    args = (x, w, b) if op == "linear" else (x, w.t())
    ref = torch.nn.functional.linear if op == "linear" else torch.matmul
    seen = []

    def run(*a):
        seen.append(a[-1])
        return ref(*a[:-1])
    for plan in (run, None):
        monkeypatch.setattr(gemm, "eager_plan" if op == "linear" else "eager_plan_matmul",
                            lambda *a, plan=plan: (plan, False))
        leaves = [t.clone().requires_grad_(grad) for t in args[:2]]
        call_args = (*leaves, *args[2:])
        out = getattr(cupykern, op)(*call_args, precision="high")
        torch.testing.assert_close(out, ref(*call_args), rtol=1e-12, atol=1e-12)
        assert (out.grad_fn is not None) == grad
        if grad:
            assert type(out.grad_fn).__name__ == f"{op}Backward"  # (the op's node, not torch's)
            out.sum().backward()
            dx = torch.ones_like(out) @ w  # (x @ w.T either way)
            torch.testing.assert_close(leaves[0].grad, dx, rtol=1e-12, atol=1e-12)
    assert seen == ["high"]  # (the fake plan's call only, with the op's precision)


def test_padded_vendor_forms_leave_recorded_calls_to_torch(monkeypatch):
    """The vendor's padded forms (cupykern.gemm_route.padded_n) compute a call that autograd does
    not record padded, and one it records as torch's plain op (their pad and copy would
    add backward ops): the same values either way."""
    from cupykern.torch import gemm as torch_gemm
    pads, real = [], torch_gemm.F.pad
    monkeypatch.setattr(torch_gemm.F, "pad", lambda t, p: pads.append(p) or real(t, p))
    x, w, b = _data(6, 5, 4, torch.float32)
    want = torch.nn.functional.linear(x, w, b)
    for grad in (False, True):
        xs = x.clone().requires_grad_(grad)
        out = torch_gemm._padded_linear(xs, w, b, pad=3)
        torch.testing.assert_close(out, want)
        assert (type(out.grad_fn).__name__ == "AddmmBackward0") == grad
        out = torch_gemm._padded_matmul(xs, w.t(), pad=3)
        torch.testing.assert_close(out, x @ w.t())
        assert (type(out.grad_fn).__name__ == "MmBackward0") == grad
        assert pads == ([] if grad else [(0, 3), (0, 0, 0, 3), (0, 3)])  # b, W; b of matmul
        pads.clear()


def test_padded_grad_boundaries():
    """GPU-free: which gradients linear's backward pads (16-bit, or float32 unless
    "highest"; N off 16-byte rows, at least 64 of them; at least 2**34 multiply-adds)."""
    from cupykern.gemm_route import padded_grad
    assert padded_grad(2048, 1025, 8192, "bfloat16", "highest") == 1032
    assert padded_grad(2048, 1025, 8192, "float32", "high") == 1028
    assert padded_grad(2048, 1025, 8192, "float32", "medium") == 1028
    assert padded_grad(2048, 1025, 8192, "float32", "highest") == 1025  # SGEMM: no gain
    assert padded_grad(2048, 1025, 8192, "float64", "highest") == 1025
    assert padded_grad(2048, 1025, 4096, "float16", "highest") == 1025  # 2**33: host-bound steps
    assert padded_grad(2048, 1032, 8192, "float16", "highest") == 1032  # aligned already
    assert padded_grad(2 ** 24, 63, 2 ** 10, "bfloat16", "highest") == 63  # few columns
    assert padded_grad(8192, 50257, 1024, "bfloat16", "highest") == 50264


@pytest.mark.parametrize("cc", [90, 80])
def test_misaligned_rows_copied_for_wgmma_where_it_pays(monkeypatch, cc):
    """GPU-free: float32 rows that Hopper's wgmma cannot read in place (a start or stride
    off 16-byte alignment, or K not a multiple of 4) are copied for its wgmma kernels
    when the product is big against them, by the tiled copy kernel into rows of K rounded
    up to 4 (padded_ld); read in place by mma.sync elsewhere or for small products."""
    from cupykern import _array, _loader, gemm_operands

    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)

    def mode(ptr, ld, k, work, dtype="float32"):
        o = _array.Operand(None, "torch", dtype, (64, k), (ld, 1), ptr, 0, "x", True)
        return gemm_operands.read_mode(o, work)[0]

    big, small = 64 * 64 * gemm_operands._COPY_WORK, 64 * 64 * (gemm_operands._COPY_WORK - 1)
    copied = "copy" if cc == 90 else "view"
    assert mode(0x1004, 64, 64, big) == copied       # starts 4 bytes past alignment
    assert mode(0x1000, 65, 64, big) == copied       # stride of 65 floats
    assert mode(0x1000, 64, 64, big) == "view"       # aligned
    assert mode(0x1004, 64, 64, small) == "view"     # copying does not pay
    assert mode(0x1004, 63, 63, big * 2) == copied   # K % 4: copied into padded rows
    assert mode(0x1000, 64, 63, big * 2) == copied   # (in a 16-byte stride too)
    assert mode(0x1000, 63, 63, 64 * 63 * (gemm_operands._COPY_WORK - 1)) == "view"
    o = _array.Operand(None, "torch", "float32", (64, 63), (65, 1), 0x1000, 0, "x", True)
    assert gemm_operands.read_mode(o, big * 2) == (("copy", 65) if cc == 90 else ("view", None))
    assert gemm_operands.padded_ld(o) == (64 if cc == 90 else 63)
    planned = gemm_operands.planned_operand(o, big * 2)  # (what the GEMM is planned with)
    assert (planned.shape, planned.strides, planned.ptr) == (
        ((64, 63), (64, 1), 0) if cc == 90 else ((64, 63), (65, 1), 0x1000))
    assert mode(0x1002, 64, 64, big, "float16") == "view"
    assert mode(0x1004, 64, 0, 0) == "view"          # K = 0: nothing to read


def test_tf32_tma_kernels_pair_m_tiles_in_clusters(monkeypatch):
    """GPU-free: on Hopper, TF32 products loaded by TMA run in clusters of two CTAs (M
    tiles 2i, 2i + 1 sharing B's slices) where the M tiles pair up; 3xTF32, an odd count
    of M tiles or cp.async loads keep one CTA; the persistent swapped product takes whole
    clusters."""
    from cupykern import _array, _loader, gemm_kernels

    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)
    monkeypatch.setattr(_loader, "sm_count", lambda dev: 133)
    monkeypatch.setattr(_loader, "function", lambda *args: "kernel")  # (nothing compiled)

    def op(rows, k, transposed=False):
        shape, strides = ((rows, k), (1, rows)) if transposed else ((rows, k), (k, 1))
        return _array.Operand(None, "torch", "float32", shape, strides, 0x10000, 0, "a", True)

    bm = gemm_kernels._WGMMA[1]["BM"]
    assert gemm_kernels._choose(op(4 * bm, 256), op(512, 256), "high").cluster == 2
    assert gemm_kernels._choose(op(4 * bm - 1, 256), op(512, 256), "high").cluster == 2  # 4 tiles, the last partial
    assert gemm_kernels._choose(op(3 * bm, 256), op(512, 256), "high").cluster == 1
    assert gemm_kernels._choose(op(4 * bm, 256), op(512, 256), "highest").cluster == 1
    assert gemm_kernels._choose(op(4 * bm, 256), op(512, 256, True), "high").cluster == 1  # B by cp.async
    a, b = op(64 * bm, 256, True), op(1024, 256)  # the swapped product (a transposed A by TMA)
    assert gemm_kernels._choose(a, b, "high", True).cluster == 2
    assert gemm_kernels.gemm_kernel(a, b, "high", transposed_c=True).grid == (132,)  # 133 SMs


# GemmProblem(M, N, K, dtype, precision, kind, compute capability, aligned[, grad]) -> route: the
# table's boundaries, pinned (cupykern.gemm_route.route gives each one's measurement).
ROUTES = [
    (GemmProblem(1024, 8192, 8192, "float16", "highest", "torch", 90, True), "vendor"),
    # "highest" of a short K: the vendor's, but for outputs of 2**26 elements or more
    (GemmProblem(32768, 32768, 64, "float32", "highest", "torch", 90, True), "ours"),
    (GemmProblem(32768, 32768, 32, "float32", "highest", "cupy", 90, True), "ours"),
    (GemmProblem(8192, 8192, 64, "float32", "highest", "torch", 90, True), "ours"),
    (GemmProblem(4096, 8192, 64, "float32", "highest", "torch", 90, True), "vendor"),
    # a stack on one launch: its work counts every matrix, its tiles one
    (GemmProblem(512, 2048, 1024, "float32", "highest", "torch", 90, True, count=128), "ours"),
    (GemmProblem(512, 512, 64, "float32", "highest", "torch", 90, True, count=96), "vendor"),
    (GemmProblem(512, 512, 512, "float32", "highest", "torch", 90, True, count=2), "vendor"),
    # a stack planned in place on one launch: attention's products from 2**29
    (GemmProblem(512, 512, 64, "float32", "highest", "torch", 90, True, count=96,
                 planned_stack=True), "ours"),
    (GemmProblem(512, 64, 512, "float32", "highest", "torch", 90, True, count=96,
                 planned_stack=True), "ours"),
    (GemmProblem(256, 256, 64, "float32", "highest", "torch", 90, True, count=96,
                 planned_stack=True), "vendor"),
    (GemmProblem(512, 32, 512, "float32", "highest", "torch", 90, True, count=96,
                 planned_stack=True), "vendor"),
    (GemmProblem(512, 512, 64, "float32", "highest", "torch", 90, True, True, count=96,
                 planned_stack=True), "vendor"),  # recorded: STACK_GRAD_MIN_WORK
    (GemmProblem(512, 512, 64, "float32", "highest", "torch", 90, False, count=96,
                 planned_stack=True), "vendor"),
    (GemmProblem(1024, 8192, 8192, "bfloat16", "highest", "cupy", 90, True), "ours"),  # no CuPy bf16 GEMM
    (GemmProblem(1024, 8192, 8192, "float16", "highest", "cupy", 90, True), "vendor"),
    (GemmProblem(1, 4096, 4096, "float64", "highest", "cupy", 90, True), "vendor"),
    (GemmProblem(4096, 4096, 4096, "float32", "highest", "torch", 75, True), "vendor"),
    (GemmProblem(1024, 8192, 8192, "float32", "highest", "torch", 90, True), "ours"),
    (GemmProblem(1024, 8192, 8192, "float32", "highest", "cupy", 80, False), "ours"),
    (GemmProblem(1024, 8192, 8192, "float32", "highest", "torch", 90, False), "vendor"),  # off wgmma
    (GemmProblem(64, 4096, 4096, "float32", "highest", "torch", 90, True), "ours"),
    (GemmProblem(63, 4096, 4096, "float32", "highest", "torch", 90, True), "vendor"),
    (GemmProblem(8192, 128, 2048, "float32", "highest", "torch", 90, True), "ours"),
    (GemmProblem(8192, 127, 2048, "float32", "highest", "torch", 90, True), "vendor"),
    (GemmProblem(65536, 128, 128, "float32", "highest", "torch", 90, True), "ours"),
    (GemmProblem(65536, 128, 127, "float32", "highest", "torch", 90, True), "vendor"),
    (GemmProblem(1024, 1024, 1024, "float32", "highest", "torch", 90, True), "ours"),  # 2**30
    (GemmProblem(1024, 1024, 1023, "float32", "highest", "torch", 90, True), "vendor"),
    (GemmProblem(256, 1024, 1024, "float32", "highest", "torch", 90, True), "vendor"),  # 2**28
    (GemmProblem(256, 1024, 1024, "float32", "highest", "cupy", 90, True), "ours"),  # 2**28 (CuPy's)
    (GemmProblem(256, 1024, 1023, "float32", "highest", "cupy", 90, True), "vendor"),
    # K % 4: aligned where wgmma reads the padded copies (route_of): the same bounds
    (GemmProblem(1024, 1024, 1025, "float32", "highest", "torch", 90, True), "ours"),  # 2**30 + 2**20
    (GemmProblem(8205, 5921, 2949, "float32", "highest", "torch", 90, True), "ours"),
    (GemmProblem(231, 4130, 3650, "float32", "highest", "torch", 90, True), "ours"),
    (GemmProblem(231, 4130, 3650, "float32", "highest", "torch", 90, False), "vendor"),  # in place
    (GemmProblem(1000, 1000, 1001, "float32", "highest", "torch", 90, True), "vendor"),  # < 2**30
    (GemmProblem(1024, 8192, 8192, "float32", "high", "torch", 90, True), "vendor"),
    (GemmProblem(4097, 3001, 1000, "float32", "high", "torch", 90, True), "ours"),
    (GemmProblem(4097, 3001, 1000, "float32", "medium", "cupy", 90, True), "ours"),
    (GemmProblem(4097, 3001, 1000, "float32", "high", "torch", 90, False), "vendor"),
    (GemmProblem(4097, 3001, 1000, "float32", "high", "torch", 80, True), "vendor"),
    (GemmProblem(1024, 1025, 1024, "float32", "high", "torch", 90, True), "ours"),  # 2**30
    (GemmProblem(1024, 1023, 1024, "float32", "high", "torch", 90, True), "vendor"),  # < 2**30
    (GemmProblem(512, 1024, 1024, "float32", "high", "torch", 90, True), "vendor"),
    (GemmProblem(256, 1023, 1024, "float32", "high", "torch", 90, True), "vendor"),  # < 2**28
    # 16-bit, N % 8: ours on Hopper's wgmma from 2**30 (operands K-major in place)
    (GemmProblem(1024, 1025, 1024, "float16", "highest", "torch", 90, True), "ours"),  # 2**30 + 2**20
    (GemmProblem(1023, 1025, 1024, "float16", "highest", "torch", 90, True), "vendor"),
    (GemmProblem(128, 1001, 1024, "bfloat16", "highest", "torch", 90, False), "vendor"),
    (GemmProblem(128, 1001, 1024, "bfloat16", "highest", "torch", 80, True), "vendor"),
    (GemmProblem(1100, 1001, 1024, "float16", "highest", "cupy", 90, True), "ours"),
    (GemmProblem(128, 1000, 1024, "bfloat16", "highest", "torch", 90, True), "vendor"),
    (GemmProblem(128 * 1024, 1001, 512, "bfloat16", "highest", "torch", 90, True), "ours"),
    (GemmProblem(128 * 1024, 1001, 511, "bfloat16", "highest", "torch", 90, True), "vendor"),  # short K
    # a call autograd records (grad): the misaligned-N rules from 2**33 only, "highest"'s
    # from 3 * 2**31
    (GemmProblem(2048, 1025, 4096, "bfloat16", "highest", "torch", 90, True, True), "ours"),  # > 2**33
    (GemmProblem(2048, 1023, 4096, "bfloat16", "highest", "torch", 90, True, True), "vendor"),  # < 2**33
    (GemmProblem(2048, 1023, 4096, "bfloat16", "highest", "torch", 90, True, False), "ours"),
    (GemmProblem(4097, 3001, 1000, "float32", "high", "torch", 90, True, True), "ours"),
    (GemmProblem(1024, 1025, 1024, "float32", "high", "torch", 90, True, True), "vendor"),
    (GemmProblem(2048, 1536, 2048, "float32", "highest", "torch", 90, True, True), "ours"),  # 3 * 2**31
    (GemmProblem(2048, 1535, 2048, "float32", "highest", "torch", 90, True, True), "vendor"),
    (GemmProblem(2048, 1535, 2048, "float32", "highest", "torch", 90, True, False), "ours"),
    (GemmProblem(2048, 2048, 1024, "float32", "highest", "torch", 90, True, True), "vendor"),  # 2**32
    (GemmProblem(4096, 2304, 768, "float32", "highest", "torch", 90, True, True), "ours"),  # BERT's QKV
    (GemmProblem(4096, 768, 768, "float32", "highest", "torch", 90, True, True), "vendor"),
    # TF32, N % 4: not for narrow N (few tiles)
    (GemmProblem(4284, 198, 1530, "float32", "high", "torch", 90, True), "vendor"),
    (GemmProblem(2048, 999, 2048, "float32", "high", "torch", 90, True), "vendor"),
    (GemmProblem(2048, 1001, 2048, "float32", "high", "torch", 90, True), "ours"),
]


@pytest.mark.parametrize("args, want", ROUTES, ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else v)
def test_route_table(args, want, dispatched):
    """GPU-free: the dispatcher's choice at each boundary of its table."""
    from cupykern import gemm_route
    assert gemm_route.route(args) == want


def test_forced_route(dispatched):
    from cupykern import gemm_route
    with gemm_route.forced_route("ours"):
        assert gemm_route.route(GemmProblem(1, 1, 1, "float64", "highest", "torch", 90)) == "ours"
    assert gemm_route.route(GemmProblem(1, 1, 1, "float64", "highest", "torch", 90)) == "vendor"
    with pytest.raises(ValueError, match="which"):
        with gemm_route.forced_route("cublas"):
            pass


# (M, N, K) where the dispatcher picks either side, and edges: M, N or K of 1, K = 0.
DISPATCHED = [(1, 300, 64), (4, 2048, 2048), (5, 1, 4), (64, 64, 4096), (130, 257, 33),
              (1024, 1024, 1024), (1100, 1030, 260), (3, 9, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision", [(torch.float32, "highest"), (torch.float32, "high"),
                                              (torch.float16, None), (torch.bfloat16, None),
                                              (torch.float64, None)], ids=str)
@pytest.mark.parametrize("shape", DISPATCHED, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("recorded", ["routed", "as unrecorded"])
def test_dispatched_linear(shape, dtype, precision, recorded, dispatched, grad_bounds):
    """linear wherever the dispatcher sends it: within the precision's bound of float64,
    and "highest" as accurate as SGEMM (the vendor's "highest" is SGEMM itself); twice,
    the second call from the cached plan (the eager call without the op's boundary), a
    call autograd does not record and one it does, with torch's or the op's autograd:
    the latter where route's grad bounds send it ("routed"), or wherever the unrecorded
    call goes (the bounds at 0: "as unrecorded")."""
    if recorded == "as unrecorded":
        grad_bounds(0)
    x, w, b = (t.cuda() for t in _data(*shape, dtype))
    bound = {torch.float64: 1e-12, torch.float32: REL_BOUND["high"] if precision == "high"
             else 1e-6}.get(dtype, 1.6e-2)
    with torch.no_grad():
        err_cublas, _ = _errors(torch.nn.functional.linear(x, w, b), x, w, b)
    for grad in (False, True) * 2:
        xg = x.clone().requires_grad_(grad)
        out = cupykern.linear(xg, w, b, precision=precision)
        assert out.dtype == dtype and out.shape == (shape[0], shape[1])
        err, mag = _errors(out, x, w, b)
        assert err <= bound * mag + (1e-300 if dtype == torch.float64 else 1e-30), (err, mag)
        if precision == "highest":
            assert err <= 2 * err_cublas + 5e-7 * mag, (err, err_cublas)
        if not grad:
            continue
        out.sum().backward()  # dx = ones @ W
        grad_bound = {torch.float64: 1e-10, torch.float32: 1e-4 if precision == "highest"
                      else 2e-2}.get(dtype, 3e-2)
        assert_grad_close(xg.grad, w.double().sum(0).expand(shape[0], -1), grad_bound, 1e-30)


@pytest.mark.gpu
def test_vendor_precision_is_the_asked_one(dispatched):
    """The vendor takes a float32 product only where torch's TF32 switch gives the precision
    asked (it never flips the switch, which other threads would see): there the result is
    torch's own, elsewhere ours (TF32 / 3xTF32) within that precision's bounds. The switch
    is left as it was, and a plan made under one setting is not reused under the other."""
    x, w, b = (t.cuda() for t in _data(4, 2048, 2048, torch.float32))
    F = torch.nn.functional
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for setting in (False, True, False):
            torch.backends.cuda.matmul.allow_tf32 = setting
            theirs = F.linear(x, w, b)
            for precision in ("highest", "high"):
                out = cupykern.linear(x, w, b, precision=precision)
                if (precision == "high") == setting:
                    assert torch.equal(out, theirs), (setting, precision)
                err, mag = _errors(out, x, w, b)
                assert err <= (1e-6 if precision == "highest" else REL_BOUND["high"]) * mag
                assert torch.backends.cuda.matmul.allow_tf32 == setting
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_dispatched_cupy(dtype, dispatched):
    """CuPy arrays on the dispatcher: cuBLAS through CuPy ("highest": SGEMM, as accurate
    as float32 allows; "high": TF32, whatever CUPY_TF32 says) or ours (bfloat16)."""
    cp = pytest.importorskip("cupy")
    tdt = getattr(torch, dtype)
    for shape in ((4, 2048, 2048), (70, 33, 48), (1024, 1024, 1024)):
        x, w, b = _data(*shape, tdt)
        xc, wc, bc = (cp.from_dlpack(t.cuda()) for t in (x, w, b))
        precisions = ("highest", "high") if dtype == "float32" else (None,)
        for precision in precisions:
            out = cupykern.linear(xc, wc, bc, precision=precision)
            assert isinstance(out, cp.ndarray) and out.dtype == xc.dtype
            err, mag = _errors(torch.from_dlpack(out), x.cuda(), w.cuda(), b.cuda())
            bound = {"highest": 1e-6, "high": REL_BOUND["high"], None: 1.6e-2}[precision]
            assert err <= (1e-12 if dtype == "float64" else bound) * mag, (shape, precision, err, mag)
            if precision == "high":  # TF32 really used: not SGEMM's result
                assert err > 1e-6 * mag


@pytest.mark.gpu
def test_dispatched_compiles_without_graph_break(dispatched):
    """linear and matmul on the vendor path inside torch.compile(fullgraph=True): the
    custom ops stay whole (the vendor runs inside their implementation)."""
    x, w, b = (t.cuda() for t in _data(4, 2048, 2048, torch.float32))
    fn = torch.compile(lambda x: cupykern.linear(x, w, b, precision="highest")
                       + cupykern.matmul(x, w.T, precision="highest"), fullgraph=True)
    ref = 2 * torch.nn.functional.linear(x.double(), w.double(), b.double()) - b.double()
    assert torch.allclose(fn(x).double(), ref, atol=1e-4, rtol=1e-4)


def test_half_wgmma_rows(dispatched, monkeypatch):
    """GPU-free, on a pretended Hopper: a 16-bit product of a misaligned N (route's own
    rule) is ours only where our wgmma reads both operands K-major, 16-byte aligned and in
    place (as _choose takes them; a transposed one is copied first, or read by mma.sync);
    float32 operands count as wgmma's also transposed, or copied to aligned rows."""
    from cupykern import _array, _loader, gemm_route

    monkeypatch.setattr(_loader, "device_cc", lambda device: 90)

    def op(dtype, rows=1024, ptr=0x10000, ld=1024, transposed=False):
        shape, strides = ((rows, 1024), (1, rows)) if transposed else ((rows, 1024), (ld, 1))
        return _array.Operand(None, "torch", dtype, shape, strides, ptr, 0, "a", True)

    for dtype in ("float16", "bfloat16"):
        b = op(dtype, rows=1025)  # (N % 8: the rule that gives ours a 16-bit product)
        assert gemm_route.route_of(op(dtype), b, "highest") == gemm_route.OURS
        assert gemm_route.route_of(op(dtype, ptr=0x10002), b, "highest") == gemm_route.VENDOR
        assert gemm_route.route_of(op(dtype, ld=1028), b, "highest") == gemm_route.VENDOR
        assert gemm_route.route_of(op(dtype, transposed=True), b, "highest") == gemm_route.VENDOR
        assert gemm_route.route_of(op(dtype), op(dtype, rows=1025, ptr=0x10002), "highest") == gemm_route.VENDOR
    assert gemm_route._wgmma_rows(op("float32", transposed=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_misaligned_n_16_bit(dtype, dispatched):
    """16-bit products of an N off 16-byte alignment: linear on Hopper runs ours (wgmma,
    any output row), matmul's row-major b and other GPUs' products run padded on the
    vendor (cupykern.gemm_route.padded_n): the N columns, contiguous, within 16-bit rounding of
    float64; a call that autograd records (torch's own op below MISALIGNED_GRAD_MIN_WORK)
    too, and its gradients."""
    from cupykern import gemm_route
    from cupykern._array import operand
    m, n, k = 4096, 1025, 1024
    assert gemm_route.padded_n(m, n, k, str(dtype)[6:]) == 1032
    hopper = torch.cuda.get_device_capability() == (9, 0)
    x, w, b = (t.cuda() for t in _data(m, n, k, dtype))
    assert gemm_route.route_of(operand(x, "x"), operand(w, "w"), "highest") == ("ours" if hopper else "vendor")
    xg = x.clone().requires_grad_()
    for _ in range(2):  # (the second call: the eager path without the op's boundary)
        with torch.no_grad():
            out = cupykern.linear(x, w, b)
        assert out.shape == (m, n) and out.is_contiguous()
        err, mag = _errors(out, x, w, b)
        assert err <= 1.6e-2 * mag
        mm = cupykern.matmul(x, w.t().contiguous())
        assert mm.shape == (m, n) and mm.is_contiguous()
        err, mag = _errors(mm, x, w, torch.zeros_like(b))
        assert err <= 1.6e-2 * mag
    out = cupykern.linear(xg, w, b)
    err, mag = _errors(out, x, w, b)
    assert out.shape == (m, n) and err <= 1.6e-2 * mag
    out.float().sum().backward()
    assert_grad_close(xg.grad, w.double().sum(0).expand(m, -1), 3e-2)


@pytest.mark.parametrize("cc", [75, 80, 86, 89, 90, 100, 120])
def test_float64_on_the_fp64_tensor_cores_where_there_are_some(monkeypatch, cc):
    """GPU-free: float64 GEMMs run DMMA (gemm_dmma) on the GPUs with FP64 tensor cores
    (sm_80, sm_90, sm_100), the CUDA-core kernel elsewhere; every layout, aligned or not."""
    from cupykern import _array, _loader, gemm_kernels

    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)

    def op(ptr=0x10000, transposed=False):
        shape, strides = ((300, 64), (1, 300)) if transposed else ((300, 64), (64, 1))
        return _array.Operand(None, "torch", "float64", shape, strides, ptr, 0, "a", True)

    for a, b, aligned in ((op(), op(), True), (op(0x10008), op(), False), (op(transposed=True), op(), True),
                          (op(transposed=True), op(transposed=True), False)):
        expr = gemm_kernels._choose(a, b, "highest").expr
        if cc in (80, 90, 100):
            assert expr.startswith("gemm_dmma<") and f", {str(aligned).lower()}, 128" in expr, expr
        else:
            assert expr.startswith("gemm_simple<double"), expr


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1, 1), (127, 129, 15), (128, 128, 16), (129, 127, 17),
                                   (257, 255, 33), (64, 64, 4099), (300, 1, 1000), (2, 3, 4097)],
                         ids=lambda s: "x".join(map(str, s)))
def test_float64_tensor_core_gemm_edges(shape):
    """Our float64 GEMM (DMMA where the GPU has FP64 tensor cores) at its tile and K-slice
    edges ±1, split K (64x64x4099), and operands row-major, column-major and starting
    8 bytes off 16-byte alignment, against cuBLAS's float64 within 1e-12 of |a| @ |b|."""
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    wide_a = torch.randn(m, k + 1, device="cuda", dtype=torch.float64, generator=g)
    wide_b = torch.randn(k, n + 1, device="cuda", dtype=torch.float64, generator=g)
    for a in (wide_a[:, :k].contiguous(), wide_a[:, 1:], _col_major(wide_a[:, :k])):
        for b in (wide_b[:, :n].contiguous(), wide_b[:, 1:], _col_major(wide_b[:, :n])):
            _check_mm(a, b, None, 1e-12)


@pytest.mark.parametrize("cc", [90, 80])
def test_fused_16_bit_forward_stays_ours_on_wgmma(monkeypatch, cc, dispatched):
    """GPU-free: a fused op's 16-bit forward GEMM is ours where it runs on Hopper's wgmma
    (K-major, 16-byte aligned operands by TMA), else the vendor's, as its backward
    products are (cupykern.gemm_route.fused_vendor)."""
    from cupykern import _array, _loader, gemm_route

    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)

    def op(rows, cols, dtype="bfloat16", ptr=0x10000):
        return _array.Operand(torch.empty(0), "torch", dtype, (rows, cols), (cols, 1), ptr, 0,
                              "a", True)

    for dtype in ("bfloat16", "float16"):
        x, w = op(64, 512, dtype), op(512, 512, dtype)
        assert gemm_route.fused_vendor(x, w, "highest") == (cc != 90)
        assert gemm_route.fused_vendor(x, w, "highest", batch=64)  # a backward product: route's
    assert gemm_route.fused_vendor(op(64, 512, ptr=0x10002), op(512, 512), "highest")  # misaligned
    assert not gemm_route.fused_vendor(op(64, 512, "float32"), op(512, 512, "float32"), "highest")


@pytest.mark.parametrize("cc", [90, 80])
def test_fused_float32_off_wgmma_follows_the_route(monkeypatch, cc, dispatched):
    """GPU-free: a fused op's float32 forward GEMM whose rows Hopper's wgmma cannot read
    in place (K % 4; the forward copies nothing) follows the dispatcher there (the
    vendor's, as for a plain product); its backward products, whose K % 4 operands are
    copied into 16-byte rows (padded_ld), stay ours, as on other GPUs and where wgmma
    reads the rows."""
    from cupykern import _array, _loader, gemm_route

    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)

    def op(rows, cols):
        return _array.Operand(torch.empty(0), "torch", "float32", (rows, cols), (cols, 1),
                              0x10000, 0, "a", True)

    x, w = op(4099, 5583), op(297, 5583)
    assert gemm_route.fused_vendor(x, w, "highest") == (cc == 90)
    assert not gemm_route.fused_vendor(x, w, "highest", batch=4099)
    assert not gemm_route.fused_vendor(op(4099, 5584), op(297, 5584), "highest")
    # a backward product's b, transposed as routed_mm_plan passes it (N x K of stride 1, N)
    bt = _array.Operand(torch.empty(0), "torch", "float32", (297, 5583), (1, 297), 0x10000, 0,
                        "b", True)
    assert not gemm_route.fused_vendor(x, bt, "highest", batch=4099)


@pytest.mark.parametrize("cc", [90, 80])
def test_narrow_fused_products_follow_the_route(monkeypatch, cc, dispatched):
    """GPU-free: a fused op's product of at most a quarter of our tile's columns (Hopper:
    64 of 256 for "high" and 16-bit, 32 of 128 for "highest"; mma.sync and float64's
    gemm_dmma: 32 of 128), forward and backward, or a forward of at most a quarter of its
    128 rows, follows the dispatcher (the vendor's here, torch's TF32 switch giving the
    precision); wider, it stays ours."""
    from cupykern import _array, _loader, gemm_route

    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)

    def op(rows, cols, dtype="float32"):
        return _array.Operand(torch.empty(0), "torch", dtype, (rows, cols), (cols, 1),
                              0x10000, 0, "a", True)

    quarter = {"high": 64, "highest": 32, "bfloat16": 64} if cc == 90 else \
        {"high": 32, "highest": 32, "bfloat16": 32}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for what, n in quarter.items():
            dtype, prec = ("bfloat16", "highest") if what == "bfloat16" else ("float32", what)
            torch.backends.cuda.matmul.allow_tf32 = prec == "high"
            x = op(65536, 256, dtype)
            assert gemm_route.fused_vendor(x, op(n, 256, dtype), prec), what
            if cc == 90:  # (elsewhere a 16-bit forward is the vendor's at any N)
                assert not gemm_route.fused_vendor(x, op(2 * n, 256, dtype), prec), what
        # dW = dz^T @ x of a 200000-row batch into 16 x 64 (Hopper; 16 x 32 elsewhere):
        # narrow, though a big batch
        torch.backends.cuda.matmul.allow_tf32 = True
        assert gemm_route.fused_vendor(op(16, 200000), op(quarter["high"], 200000), "high", batch=200000)
        assert not gemm_route.fused_vendor(op(512, 200000), op(1024, 200000), "high", batch=200000)
        # a forward of at most a quarter of our tile's 128 rows; float64's too (gemm_dmma)
        assert gemm_route.fused_vendor(op(32, 4096), op(4096, 4096), "high")
        assert not gemm_route.fused_vendor(op(33, 4096), op(4096, 4096), "high")
        assert gemm_route.fused_vendor(op(8, 4398, "float64"), op(288, 4398, "float64"), "highest")
        assert gemm_route.fused_vendor(op(16465, 126, "float64"), op(14, 126, "float64"), "highest")
        assert not gemm_route.fused_vendor(op(64, 512, "float64"), op(512, 512, "float64"), "highest")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("cc", [90, 80])
def test_narrow_rule_reads_any_layout(monkeypatch, cc, dispatched):
    """GPU-free: a backward product's operand that is neither row- nor column-contiguous
    (x[:, ::2], which our GEMM would copy first) is judged narrow by its dtype, precision
    and arch like any other, and follows the route; a wide one stays ours."""
    from cupykern import _array, _loader, gemm_route

    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)
    for dtype in ("float32", "float64"):
        x = _array.Operand(torch.empty(0), "torch", dtype, (4099, 300), (600, 2), 0x10000, 0,
                           "x", True)
        w = _array.Operand(torch.empty(0), "torch", dtype, (16, 300), (300, 1), 0x10000, 0,
                           "w", True)
        want = gemm_route.route_of(x, w, "highest") == gemm_route.VENDOR
        assert gemm_route.fused_vendor(x, w, "highest", batch=4099) == want
        w = _array.Operand(torch.empty(0), "torch", dtype, (1024, 300), (300, 1), 0x10000, 0,
                           "w", True)
        assert not gemm_route._narrow(x, w, "highest", forward=False)


@pytest.mark.parametrize("cc", [90, 80])
def test_captured_float64_products_follow_the_route(monkeypatch, cc, dispatched):
    """GPU-free: a fused op's float64 product of at most FUSED_F64_WORK[role] multiply-adds
    stays ours (host time) unless a CUDA graph is being captured: then it follows the
    dispatcher (the vendor's DGEMM), forward and backward; other dtypes ignore capture."""
    from cupykern import _array, _loader, gemm_route, gemm_vendor

    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)

    def op(rows, cols, dtype="float64"):
        return _array.Operand(torch.empty(0), "torch", dtype, (rows, cols), (cols, 1),
                              0x10000, 0, "a", True)
    for (m, k, n), kw in [((267, 157, 129), {}), ((53, 2829, 152), {"grad": True}),
                          ((4498, 29, 46), {"batch": 4498}), ((64, 512, 512), {})]:
        assert not gemm_route.fused_vendor(op(m, k), op(n, k), "highest", **kw)
        assert gemm_route.fused_vendor(op(m, k), op(n, k), "highest", captured=True, **kw)
    x, w = op(267, 160, "float32"), op(256, 160, "float32")
    assert gemm_route.fused_vendor(x, w, "highest", captured=True) == gemm_route.fused_vendor(x, w, "highest")
    assert not gemm_vendor.float64_capture(torch.empty(3, dtype=torch.float64))  # (not capturing)
    assert not gemm_vendor.float64_capture(np.empty(3))


def test_backward_products_reading_b_transposed_follow_the_route(monkeypatch, dispatched):
    """GPU-free: a fused op's float32 dW = dz^T @ x of few output features reads x
    transposed in place (a copy does not pay: fewer than _COPY_WORK features); it follows
    the dispatcher (SGEMM for "highest" at these sizes) instead of ours, from
    FUSED_VENDOR_BATCH rows on too. With _COPY_WORK features or more x is copied and ours
    keeps it."""
    from cupykern import _array, _loader, gemm_operands, gemm_route

    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)

    def rows(m, k):
        return _array.Operand(torch.empty(0), "torch", "float32", (m, k), (k, 1), 0x10000, 0,
                              "a", True)

    def cols(m, k):  # x^T of a row-major (k, m) x
        return _array.Operand(torch.empty(0), "torch", "float32", (m, k), (1, m), 0x10000, 0,
                              "x", True)

    for batch, feats, fin in [(200000, 16, 64), (200000, 64, 64), (12108, 57, 1961)]:
        dzt, xt = rows(feats, batch), cols(fin, batch)
        assert gemm_route._transposed_b(dzt, xt)
        assert gemm_route.fused_vendor(dzt, xt, "highest", batch)
    dzt, xt = rows(gemm_operands._COPY_WORK, 200000), cols(64, 200000)
    assert not gemm_route._transposed_b(dzt, xt)
    assert not gemm_route.fused_vendor(dzt, xt, "highest", 200000)


def _k4_operands(monkeypatch):
    """A pretended Hopper; ``(col_major(rows, k), row_major(rows, k))``: float32 Operands
    of a transposed view and of C-contiguous rows, 16-byte aligned."""
    from cupykern import _array, _loader

    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)

    def col_major(rows, k):
        return _array.Operand(torch.empty(0), "torch", "float32", (rows, k), (1, rows),
                              0x10000, 0, "a", True)

    def row_major(rows, k):
        return _array.Operand(torch.empty(0), "torch", "float32", (rows, k), (k, 1),
                              0x10000, 0, "a", True)
    return col_major, row_major


def test_copies_of_k4_rows_are_padded(monkeypatch, dispatched):
    """GPU-free: a float32 operand of K % 4 that ours copies on Hopper (a transposed one,
    or rows of K, where copying pays) is planned as a fresh array of 16-byte rows of K
    rounded up to 4 (gemm_operands.padded_ld): wgmma's rows. The product then counts as
    aligned (route_of) exactly where the kernel choice takes those copies on wgmma; an
    operand read in place (a copy that does not pay: W of fewer than 128 rows' product;
    or a fused op's forward) keeps such a product off wgmma, the vendor's for
    "highest"; K % 4 == 0 copies are wgmma's as before."""
    from cupykern import gemm_kernels, gemm_operands, gemm_route

    col_major, row_major = _k4_operands(monkeypatch)
    work = 2048 * 2048 * 4099
    for make, mode in ((col_major, "transpose"), (row_major, "copy")):
        a, b = make(2048, 4099), make(2048, 4099)
        assert gemm_operands.read_mode(a, work)[0] == mode
        pa, pb = (gemm_operands.planned_operand(o, work) for o in (a, b))
        assert (pa.shape, pa.strides, pa.ptr) == ((2048, 4099), (4100, 1), 0)
        assert gemm_route._wgmma_rows(pa) and not gemm_route._wgmma_rows(row_major(2048, 4099))
        on = gemm_kernels._choose(pa, pb, "highest").cfg is gemm_kernels._WGMMA[0]
        assert gemm_route._on_wgmma(a, b, "highest") == on
        assert gemm_route.route_of(a, b, "highest") == ("ours" if on else "vendor")
        # as given: transposed views are wgmma's (4-byte loads), rows of K % 4 are not
        assert gemm_route._on_wgmma(a, b, "highest", copies=False) == (make is col_major)
    for make in (col_major, row_major):
        assert gemm_route.route_of(make(2048, 4100), make(2048, 4100), "highest") == "ours"
    # x's copy pays (N = 4096), W's does not (100 rows: M < _COPY_WORK): W read in place
    x, w = row_major(100, 4099), row_major(4096, 4099)
    assert gemm_operands.read_mode(x, 100 * 4096 * 4099)[0] == "copy"
    assert gemm_operands.read_mode(w, 100 * 4096 * 4099)[0] == "view"
    assert not gemm_route._on_wgmma(x, w, "highest")
    assert gemm_route.route_of(x, w, "highest") == "vendor"
    # a fused op's forward reads x and W in place: off wgmma, the vendor's; its backward
    # products (mm's copies) follow the kernel choice
    x, w = row_major(4099, 5583), row_major(297, 5583)
    assert gemm_route.fused_vendor(x, w, "highest")
    on = gemm_route._on_wgmma(x, w, "highest")
    assert gemm_route.fused_vendor(x, w, "highest", batch=4099) == (not on)


def test_padded_k4_copies_run_on_wgmma(monkeypatch, dispatched):
    """GPU-free: the padded copies of K % 4 operands run on Hopper's wgmma by
    TMA, "highest" and "high", their maps of K columns in rows of K rounded up to 4; such
    a "highest" product of 2**30 multiply-adds or more is then ours (route_of)."""
    from cupykern import gemm_kernels, gemm_operands, gemm_route

    col_major, row_major = _k4_operands(monkeypatch)
    for k in (1025, 2949, 4099):
        work = 2048 * 2048 * k
        for make in (col_major, row_major):
            a, b = (gemm_operands.planned_operand(make(2048, k), work) for _ in range(2))
            for precision, mode in (("highest", 0), ("high", 1)):
                choice = gemm_kernels._choose(a, b, precision)
                assert choice.cfg is gemm_kernels._WGMMA[mode] and choice.tma, (k, precision)
            assert gemm_route.route_of(make(2048, k), make(2048, k), "highest") == "ours"


@pytest.mark.parametrize("cc", [90, 80])
def test_k4_copies_are_launches_of_the_plan(monkeypatch, cc):
    """GPU-free (CPU tensors stand in; nothing is compiled or launched): linear's plan of
    a K % 4 product, x (130, 5) row-major and W (257, 5) transposed, on Hopper launches
    the tiled copy of x's rows and of W's columns into fresh (rows, 8) arrays, zeros past
    K, then the wgmma GEMM reading K = 5 of them in rows of 8 by TMA; elsewhere only W's
    transpose is copied, C-contiguous, x is read in place, and mma.sync reads them."""
    from cupykern import _array, _loader, _tma, gemm_operands

    monkeypatch.setattr(_loader, "device_cc", lambda dev: cc)
    monkeypatch.setattr(_loader, "sm_count", lambda dev: 132)
    monkeypatch.setattr(_loader, "function", lambda file, expr, dev, smem=0: expr)
    monkeypatch.setattr(_tma.Rows2D, "_encode", lambda self, ptr: ("tensor map", ptr))  # (no driver)
    monkeypatch.setattr(_tma, "row_maps", lambda *geometry: _tma.Rows2D(*geometry))
    x, w = torch.randn(130, 5), torch.randn(5, 257).t()
    xo, wo = (_array.Operand(t, "torch", "float32", tuple(t.shape), t.stride(), t.data_ptr(), 0,
                             name, True) for t, name in ((x, "x"), (w, "weight")))
    plan = gemm_operands.planned_gemm(xo, wo, 130 * 257 * 5, "highest", (130, 257))
    launches, held = [], []
    out = plan._stage(x.data_ptr(), w.data_ptr(), 0, launches, held)
    copy = "transpose_copy<float, 32, 256>"
    held = [t for t in held if t is not None]  # (the copies; no split K's workspace)
    ptr = [t.data_ptr() for t in held]
    if cc == 90:
        assert [tuple(t.shape) for t in held] == [(130, 8), (257, 8)]
        assert launches[0] == (copy, (5, 1), (256,), (x.data_ptr(), ptr[0], 130, 5, 5, 1, 8, 0, 130 * 8), 0)
        assert launches[1] == (copy, (9, 1), (256,), (w.data_ptr(), ptr[1], 257, 5, 1, 257, 8, 0, 257 * 8), 0)
        a, b, ld = ptr[0], ptr[1], 8
    else:
        assert [tuple(t.shape) for t in held] == [(257, 5)]
        assert launches[0] == (copy, (9, 1), (256,), (w.data_ptr(), ptr[0], 257, 5, 1, 257, 5, 0, 257 * 5), 0)
        a, b, ld = x.data_ptr(), ptr[0], 5
    gemm = launches[-1][3]
    kernel = "gemm_wgmma<float, 0, false, false, false, 64," if cc == 90 else "gemm_mma<"
    assert len(launches) == (3 if cc == 90 else 2) and launches[-1][0].startswith(kernel)
    assert gemm[:3] == (a, b, out.data_ptr()) and gemm[3:6] == (130, 257, 5) and gemm[7:9] == (ld, ld)


def test_fused_float64_products_stay_ours_up_to_their_work(monkeypatch, dispatched):
    """GPU-free: a fused op's float64 products are ours up to FUSED_F64_WORK[role]
    multiply-adds (a cuBLAS call's host time outweighs our CUDA cores there), the
    vendor's above: 2**26 for a forward alone, 2**30 for a training step's forward, 2**28
    for a backward product."""
    from cupykern import _array, _loader, gemm_route

    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)

    def op(rows, cols):
        return _array.Operand(torch.empty(0), "torch", "float64", (rows, cols), (cols, 1),
                              0x10000, 0, "a", True)

    assert gemm_route.FUSED_F64_WORK == {"forward": 2 ** 26, "forward with grad": 2 ** 30,
                                   "backward": 2 ** 28}
    for kwargs, rows in (({}, 128), ({"grad": True}, 2048), ({"batch": 512}, 512)):
        # (rows x 1024 @ (1024 x 512): rows * 2**19 multiply-adds)
        assert not gemm_route.fused_vendor(op(rows, 1024), op(512, 1024), "highest", **kwargs)
        assert not gemm_route.fused_vendor(op(64, 512), op(512, 512), "highest", **kwargs)
        assert gemm_route.fused_vendor(op(rows + 1, 1024), op(512, 1024), "highest", **kwargs)
        assert gemm_route.fused_vendor(op(256, 4096), op(4096, 4096), "highest", **kwargs)


def test_fused_backward_gemms_follow_the_dispatcher(monkeypatch, dispatched):
    """GPU-free: GemmScaleBatchNorm's backward plans dx / dW on ours only where the
    dispatcher gives the product to ours (else the vendor's product, planned alike)."""
    from cupykern import _array, _loader, gemm_route, gemm_vendor

    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)
    monkeypatch.setattr(_loader, "sm_count", lambda dev: 132)
    monkeypatch.setattr(_loader, "function", lambda *args: "kernel")  # (nothing compiled)

    def op(rows, cols):
        return _array.Operand(torch.empty(0), "torch", "float32", (rows, cols), (cols, 1),
                              0x10000, 0, "a", True)

    def vendor(a, b, precision, batch):
        plan, on_vendor = gemm_route.routed_mm_plan(a, b, precision, batch)
        assert plan is not None and on_vendor == (type(plan) is gemm_vendor.VendorPlan)
        return on_vendor

    assert vendor(op(64, 512), op(512, 512), "highest", 64)
    # "high": the vendor's where torch's TF32 switch is on (as "high" sets it), else ours
    assert not vendor(op(256, 4096), op(4096, 4096), "high", 256)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert vendor(op(256, 4096), op(4096, 4096), "high", 256)
        # from FUSED_VENDOR_BATCH rows on, ours (dW = dz^T @ x: K is the batch)
        assert not vendor(op(4096, 1024), op(1024, 4096), "high", 1024)
        assert vendor(op(4096, 1023), op(1023, 4096), "high", 1023)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert not vendor(op(256, 4096), op(4096, 4096), "highest", 256)


def test_float64_bias_apart_boundaries():
    """GPU-free: the vendor's float64 linear adds its bias apart (mm, then one pass) from
    2**28 multiply-adds with K >= 1024, where torch's addmm runs at half mm's rate."""
    from cupykern import gemm_route
    assert gemm_route.bias_apart(256, 1024, 1024, "float64")
    assert not gemm_route.bias_apart(255, 1024, 1024, "float64")
    assert not gemm_route.bias_apart(1 << 16, 1024, 1023, "float64")
    assert not gemm_route.bias_apart(100000, 64, 64, "float64")
    assert gemm_route.bias_apart(1 << 16, 64, 1024, "float64")
    assert not gemm_route.bias_apart(1 << 16, 63, 1024, "float64")  # (few columns: addmm's)
    assert not gemm_route.bias_apart(4096, 4096, 4096, "float32")


@pytest.mark.parametrize("compute_type, sgemm", [(1, False), (2, False), (7, True)],
                         ids=["default", "pedantic", "tf32"])
def test_cupy_highest_runs_cupy_matmul_unless_tf32(compute_type, sgemm, monkeypatch):
    """GPU-free: CuPy's float32 "highest" vendor product is cupy.matmul (exact SGEMM under
    any compute type but TF32), cupy.cublas.gemm's SGEMM (_sgemm) only where CuPy's float32
    compute type is TF32 (7); other dtypes and precisions are cupy.matmul's."""
    from types import SimpleNamespace
    from cupykern import _loader, gemm_vendor
    calls = []
    fake = SimpleNamespace(matmul=lambda a, b: calls.append("matmul") or a @ b,
                           _core=SimpleNamespace(_routines_linalg=SimpleNamespace(
                               COMPUTE_TYPE_TF32=7)))
    monkeypatch.setattr(_loader, "cupy", lambda: fake)
    monkeypatch.setattr(gemm_vendor._CupyVendor, "state", staticmethod(lambda: compute_type))
    monkeypatch.setattr(gemm_vendor._CupyVendor, "_sgemm",
                        staticmethod(lambda a, b: calls.append("sgemm") or a @ b))
    a, b = np.ones((3, 4), np.float32), np.ones((4, 5), np.float32)
    for dtype, precision, want in ((np.float32, "highest", "sgemm" if sgemm else "matmul"),
                                   (np.float32, "high", "matmul"),
                                   (np.float64, "highest", "matmul")):
        out = gemm_vendor._CupyVendor.matmul(a.astype(dtype), b.astype(dtype), precision)
        np.testing.assert_array_equal(out, np.full((3, 5), 4, dtype))
        assert calls == [want]
        calls.clear()


@pytest.mark.parametrize("compute_type", [1, 7], ids=["default", "tf32"])
def test_cupy_vendor_plans_are_cupys_own_calls(compute_type, monkeypatch):
    """GPU-free: CuPy's vendor plan of a problem is its eager form itself (CuPy has no
    autocast): linear is cupy.matmul of x's rows and w.T (a 2-D x as it is, an N-D x as
    its rows, viewed back), the bias added to the product; matmul is cupy.matmul. Where
    that form does not hold (K == 0; float32 "highest" under CuPy's TF32 compute type, 7:
    SGEMM) the plan is a VendorPlan of the per-call path."""
    from types import SimpleNamespace
    from cupykern import _loader, gemm_vendor
    calls = []
    fake = SimpleNamespace(matmul=lambda a, b: calls.append((a.shape, b.shape)) or a @ b,
                           _core=SimpleNamespace(_routines_linalg=SimpleNamespace(
                               COMPUTE_TYPE_TF32=7)))
    monkeypatch.setattr(_loader, "cupy", lambda: fake)
    monkeypatch.setattr(gemm_vendor._CupyVendor, "state", staticmethod(lambda: compute_type))
    plan = gemm_vendor.vendor_linear("cupy", "highest", (6, 5, 4, "float32"))
    if compute_type == 7:  # SGEMM: the per-call path
        assert type(plan) is gemm_vendor.VendorPlan and plan.eager is None
    else:
        assert type(plan) is not gemm_vendor.VendorPlan
        x, w, b = np.ones((2, 3, 4), np.float32), np.ones((5, 4), np.float32), np.arange(5.0)
        np.testing.assert_array_equal(plan(x, w, b), np.full((2, 3, 5), 4.0) + b)
        np.testing.assert_array_equal(plan(x[0], w, None), np.full((3, 5), 4.0))
        assert calls == [((6, 4), (4, 5)), ((3, 4), (4, 5))]
    assert gemm_vendor.vendor_linear("cupy", "high", (6, 5, 4, "float64")) is not None
    assert type(gemm_vendor.vendor_linear("cupy", "highest", (6, 5, 0, "float64"))) \
        is gemm_vendor.VendorPlan  # (K == 0: zeros, cuBLAS not asked)
    assert gemm_vendor.vendor_matmul("cupy", "high", (6, 5, 4, "float16", True)) is fake.matmul


def test_vendor_eager_forms():
    """GPU-free: the vendor's eager form of a problem (what the torch layer's direct call
    runs once a plan chose the vendor): torch's F.linear / matmul, the padded product of a
    16-bit N that cuBLAS runs slow (padded_n) from 2**32 multiply-adds, float64's bias apart from 2**28; each
    form computes the product, contiguous."""
    import functools

    from cupykern.torch.gemm import (Vendor, _linear_bias_apart, _linear_once, _padded_linear,
                                     _padded_matmul)
    F = torch.nn.functional
    assert Vendor.linear_form(1024, 4096, 4096, "bfloat16") is _linear_once
    padded = Vendor.linear_form(4096, 1025, 1024, "float16")
    assert padded.func is _padded_linear and padded.keywords == {"pad": 7}
    assert Vendor.linear_form(4091, 1025, 1024, "float16") is _linear_once  # (just under 2**32)
    assert Vendor.linear_form(1024, 1025, 1024, "float16") is _linear_once  # (2**30: host-bound)
    assert Vendor.linear_form(4096, 1026, 1024, "float16").keywords == {"pad": 6}  # N % 4 == 2
    assert Vendor.linear_form(4096, 1026, 1026, "float16") is _linear_once  # (K % 8 == 2)
    assert Vendor.linear_form(4096, 1025, 1026, "float16").keywords == {"pad": 7}  # odd N
    assert Vendor.linear_form(4096, 1025, 1028, "bfloat16").keywords == {"pad": 7}  # K % 8 == 4
    assert Vendor.linear_form(4096, 1028, 1024, "float16") is _linear_once  # (8-byte rows: cuBLAS's)
    assert Vendor.linear_form(4096, 1025, 1027, "bfloat16") is _linear_once  # (an odd K)
    assert Vendor.linear_form(511, 1025, 1 << 22, "bfloat16") is _linear_once  # (few rows: M < 512)
    assert Vendor.matmul_form(57, 1961, 12108, "bfloat16", True) is torch.matmul
    assert Vendor.linear_form(1 << 20, 8, 1024, "float64") is F.linear  # (N < 64)
    assert Vendor.linear_form(256, 1024, 1024, "float64") is _linear_bias_apart
    assert Vendor.linear_form(255, 1024, 1024, "float64") is F.linear
    assert Vendor.matmul_form(4096, 1025, 1024, "bfloat16", True).keywords == {"pad": 7}
    # (a 1-D b, whose N of 1 is not a row length: never padded, however big the product)
    assert Vendor.matmul_form(1 << 20, 1, 1 << 20, "bfloat16", True).keywords == {"pad": 7}
    assert Vendor.matmul_form(1 << 20, 1, 1 << 20, "bfloat16", False) is torch.matmul
    x, w, b = _data(6, 5, 4, torch.float64)
    for form in (_linear_bias_apart, functools.partial(_padded_linear, pad=3)):
        out = form(x, w, b)
        assert out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_linear_bias_apart(x, w, None), F.linear(x, w), rtol=1e-12, atol=1e-12)
    out = _padded_matmul(x, w.T.contiguous(), pad=3)
    assert out.is_contiguous()
    torch.testing.assert_close(out, x @ w.T, rtol=1e-12, atol=1e-12)
