"""cupykern.matmul: NumPy's matmul semantics (1-D, 2-D, batched with broadcasting) on the
dispatcher's two paths (our kernels, the vendor's), every dtype and float32 precision,
against float64; autograd (gradcheck); bad input."""
import numpy as np
import pytest

import cupykern

torch = pytest.importorskip("torch")
from support import assert_grad_close  # noqa: E402

# (a shape, b shape): vectors, matrices, stacks, broadcast batch dims (either side, size-1
# dims), a vector against a stack.
SEMANTICS = [((5,), (5,)), ((5,), (5, 3)), ((4, 5), (5,)), ((4, 5), (5, 3)),
             ((2, 4, 5), (5, 3)), ((4, 5), (2, 5, 3)), ((2, 1, 4, 5), (3, 5, 6)),
             ((5,), (2, 5, 3)), ((2, 3, 4, 5), (5,)), ((1, 4, 5), (3, 5, 2))]


def _pair(sa, sb, dtype=torch.float64, seed=0, same_sign=False):
    g = torch.Generator().manual_seed(seed)
    draw = torch.rand if same_sign else torch.randn
    a = draw(*sa, generator=g, dtype=torch.float64)
    b = draw(*sb, generator=g, dtype=torch.float64) / sa[-1] ** 0.5
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("sa, sb", SEMANTICS, ids=str)
def test_numpy_semantics(sa, sb):
    a, b = (t.numpy() for t in _pair(sa, sb, torch.float32))
    got = cupykern.matmul(a, b)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))  # (float64, NumPy's shapes)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    ta, tb = _pair(sa, sb)
    got = cupykern.matmul(ta, tb)
    assert got.shape == want.shape and got.dtype == ta.dtype
    torch.testing.assert_close(got.double(), torch.as_tensor(np.matmul(ta.numpy(), tb.numpy())),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sa, sb", SEMANTICS, ids=str)
def test_gradcheck_cpu(sa, sb):
    a, b = (t.requires_grad_() for t in _pair(sa, sb))
    assert torch.autograd.gradcheck(lambda a, b: cupykern.matmul(a, b), (a, b))


@pytest.mark.parametrize("bad, exc, match", [
    (lambda a, b: cupykern.matmul(a, b[:-1]), ValueError, "b: its rows"),
    (lambda a, b: cupykern.matmul(a, b[0]), ValueError, "b: its length"),
    (lambda a, b: cupykern.matmul(np.float32(1), b), TypeError, "a: expected"),
    (lambda a, b: cupykern.matmul(a, np.zeros((), np.float32)), ValueError, "b: expected at least 1"),
    (lambda a, b: cupykern.matmul(np.zeros((), np.float32), b), ValueError, "a: expected at least 1"),
    (lambda a, b: cupykern.matmul(np.zeros((2, 4, 5), np.float32), np.zeros((3, 5, 2), np.float32)),
     ValueError, "b: batch dimensions"),
    (lambda a, b: cupykern.matmul(a, b.astype(np.int64)), TypeError, "b: unsupported dtype"),
    (lambda a, b: cupykern.matmul(a.astype(np.int32), b), TypeError, "a: unsupported dtype"),
    (lambda a, b: cupykern.matmul(a, torch.from_numpy(b)), TypeError, "do not mix"),
    (lambda a, b: cupykern.matmul(a, b, precision="low"), ValueError, "precision"),
    (lambda a, b: cupykern.matmul(a, b, out=np.zeros((4, 2), np.float32)), ValueError, "out: expected shape"),
    (lambda a, b: cupykern.matmul(a, b, out=np.zeros((4, 3), np.float64)), TypeError, "out: expected dtype"),
])
def test_bad_input(bad, exc, match):
    a, b = (t.numpy() for t in _pair((4, 5), (5, 3), torch.float32))
    with pytest.raises(exc, match=match):
        bad(a, b)


def test_out_cpu():
    a, b = (t.numpy() for t in _pair((2, 4, 5), (5, 3), torch.float32))
    out = np.empty((2, 4, 3), np.float32)
    assert cupykern.matmul(a, b, out=out) is out
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-6)


# (M, K, N) on the GPU: M, N, K of 1; tile edges +-1 (128x128 mma.sync, 128x256 wgmma TF32
# tiles, the 32-float K slice); K split (few tiles, long K); a product big enough for our
# 3xTF32 ("highest") and TF32 ("high") kernels under the dispatcher.
GPU_SHAPES = [(1, 1, 1), (1, 64, 300), (300, 64, 1), (5, 4, 1), (127, 33, 129), (128, 32, 128),
              (129, 31, 255), (257, 129, 256), (64, 4100, 200), (1024, 1024, 1024)]
# (dtype, precision, max |error| / max (|a| @ |b|)).
CASES = [(torch.float32, "highest", 1e-6), (torch.float32, "high", 4e-3),
         (torch.float16, None, 1.6e-2), (torch.bfloat16, None, 1.6e-2),
         (torch.float64, None, 1e-12)]


def _check(got, a, b, bound, sgemm=None):
    ref = torch.matmul(a.double(), b.double())
    mag = torch.matmul(a.double().abs(), b.double().abs()).max().item() if ref.numel() else 0.0
    assert got.shape == ref.shape and got.dtype == a.dtype
    err = (got.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= bound * mag + 1e-30, (err, mag)
    if sgemm is not None:  # "highest": at least SGEMM's accuracy (a few ulps at tiny K)
        err_sgemm = (sgemm.double() - ref).abs().max().item()
        assert err <= 2 * err_sgemm + 5e-7 * mag, (err, err_sgemm)


def _sgemm(a, b):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return torch.matmul(a, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(params=["ours", "dispatched"])
def path(request):
    """Every GPU check twice: our kernels forced, then where the dispatcher sends it."""
    from cupykern import gemm_route
    if request.param == "dispatched":
        yield request.param
        return
    with gemm_route.forced_route(gemm_route.OURS):
        yield request.param


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision, bound", CASES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_2d(shape, dtype, precision, bound, path):
    m, k, n = shape
    a, b = (t.cuda() for t in _pair((m, k), (k, n), dtype))
    sgemm = _sgemm(a, b) if precision == "highest" else None
    _check(cupykern.matmul(a, b, precision=precision), a, b, bound, sgemm)
    # misaligned rows (a view 1 element past the start) and a transposed b
    a_off = torch.cat([a.new_zeros(1), a.reshape(-1)])[1:].view(m, k)
    _check(cupykern.matmul(a_off, b.t().contiguous().t(), precision=precision), a, b, bound, sgemm)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision, bound", CASES, ids=str)
@pytest.mark.parametrize("sa, sb", SEMANTICS + [((32, 512, 64), (32, 64, 512)),
                                                ((3, 1, 130, 300), (2, 300, 70))], ids=str)
def test_batched_and_vectors(sa, sb, dtype, precision, bound, path):
    a, b = (t.cuda() for t in _pair(sa, sb, dtype))
    sgemm = _sgemm(a, b) if precision == "highest" else None
    _check(cupykern.matmul(a, b, precision=precision), a, b, bound, sgemm)


# Stacks whose b is row-major (as a batched b usually is): on Hopper (3x)TF32 one launch
# of the swapped product reads b's matrices in place (transposed A by TMA) and stores each
# product transposed; K not a multiple of 32, or b's rows off 16 bytes, copy b's
# transpose instead. (a shape, b shape, b's row padding: a column slice at an offset)
SWAPPED_STACKS = [((1, 130, 64), (1, 64, 200), 0),  # batch 1
                  ((5, 130, 96), (1, 96, 264), 0),  # b broadcast (stride 0)
                  ((1, 70, 32), (6, 32, 132), 0),  # a broadcast
                  ((2, 3, 33, 4096), (2, 3, 4096, 36), 0),  # long K, a narrow N
                  ((3, 257, 160), (3, 160, 4), 0),  # N = 4: one 16-byte row
                  ((2, 1, 64), (2, 64, 1), 0),  # M = N = 1
                  ((3, 130, 64), (3, 64, 260), 8),  # b a column slice (offset 16 bytes)
                  ((3, 129, 100), (3, 100, 128), 0),  # K % 32: copied
                  ((3, 64, 128), (3, 128, 301), 0)]  # b's rows off 16 bytes: copied


@pytest.mark.gpu
@pytest.mark.parametrize("precision, bound", [("highest", 1e-6), ("high", 4e-3)])
@pytest.mark.parametrize("sa, sb, pad", SWAPPED_STACKS, ids=str)
def test_stack_of_row_major_b(sa, sb, pad, precision, bound):
    from cupykern import gemm_route
    a, b = (t.cuda() for t in _pair(sa, sb, torch.float32))
    if pad:  # b's matrices as a column slice of wider rows, 4 floats in
        wide = torch.zeros(*sb[:-1], sb[-1] + pad, device="cuda")
        wide[..., 4:4 + sb[-1]] = b
        b = wide[..., 4:4 + sb[-1]]
    sgemm = _sgemm(a, b) if precision == "highest" else None
    with gemm_route.forced_route(gemm_route.OURS):
        _check(cupykern.matmul(a, b, precision=precision), a, b, bound, sgemm)
    _check(cupykern.matmul(a, b, precision=precision), a, b, bound, sgemm)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(198, 3000, 256), (2, 5000, 3)], ids=str)
def test_highest_same_sign(shape, path):
    """Same-sign data, where the tensor core's truncating sums would drift: "highest" stays
    as accurate as SGEMM (a stack of two, each matrix on ours or on SGEMM)."""
    m, k, n = shape
    a, b = (t.cuda() for t in _pair((2, m, k), (k, n), torch.float32, same_sign=True))
    _check(cupykern.matmul(a, b, precision="highest"), a, b, 1e-6, _sgemm(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_cupy(dtype, path):
    cp = pytest.importorskip("cupy")
    for sa, sb in (((70, 48), (48, 33)), ((2, 1, 70, 48), (3, 48, 33)), ((48,), (48, 33))):
        a, b = (t.cuda() for t in _pair(sa, sb, getattr(torch, dtype)))
        for precision in (("highest", "high") if dtype == "float32" else (None,)):
            got = cupykern.matmul(cp.from_dlpack(a), cp.from_dlpack(b), precision=precision)
            assert isinstance(got, cp.ndarray)
            bound = {"highest": 1e-6, "high": 4e-3}.get(precision, 1e-12 if dtype == "float64" else 1.6e-2)
            _check(torch.from_dlpack(got), a, b, bound)


@pytest.mark.gpu
def test_gradcheck_gpu(path):
    for sa, sb in (((2, 1, 4, 5), (3, 5, 6)), ((5,), (5, 3)), ((4, 5), (5,)), ((5,), (5,))):
        a, b = (t.cuda().requires_grad_() for t in _pair(sa, sb))
        assert torch.autograd.gradcheck(lambda a, b: cupykern.matmul(a, b), (a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("precision, bound", [("highest", 1e-4), ("high", 2e-2)])
def test_gradients_float32(precision, bound, path):
    a, b = (t.cuda().requires_grad_() for t in _pair((3, 130, 300), (300, 70), torch.float32))
    g = torch.randn(3, 130, 70, device="cuda")
    cupykern.matmul(a, b, precision=precision).backward(g)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    torch.matmul(a64, b64).backward(g.double())
    assert_grad_close(a.grad, a64.grad, bound, what="a")
    assert_grad_close(b.grad, b64.grad, bound, what="b")


@pytest.mark.gpu
def test_out_and_empty(path):
    a, b = (t.cuda() for t in _pair((2, 4, 5), (5, 3), torch.float32))
    out = torch.empty(2, 4, 3, device="cuda")
    assert cupykern.matmul(a, b, out=out) is out
    _check(out, a, b, 1e-6)
    with pytest.raises(ValueError, match="out: overlaps"):
        cupykern.matmul(a, b, out=a[..., :3])
    assert cupykern.matmul(a[:, :0], b).shape == (2, 0, 3)
    assert torch.equal(cupykern.matmul(a[..., :0], b[:0]), torch.zeros(2, 4, 3, device="cuda"))
    with pytest.raises(ValueError, match="autograd"):
        cupykern.matmul(a.requires_grad_(), b, out=out)


@pytest.mark.gpu
def test_compile_fullgraph(path):
    a, b = (t.cuda() for t in _pair((2, 130, 300), (300, 70), torch.float32))
    fn = torch.compile(lambda a, b: cupykern.matmul(a, b, precision="highest") * 2, fullgraph=True)
    _check(fn(a, b) / 2, a, b, 1e-6)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("sa, sb", [((2, 1, 4, 5), (3, 5, 6)), ((5,), (5, 3))], ids=str)
def test_opcheck(sa, sb, device):
    """torch.library.opcheck of cupykern::matmul: schema, fake tensor, autograd
    registration, and its AOT dispatch."""
    import cupykern.torch.gemm  # noqa: F401  (registers the op)
    a, b = (t.to(device).requires_grad_() for t in _pair(sa, sb))
    torch.library.opcheck(torch.ops.cupykern.matmul.default, (a, b, "highest"))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=str)
def test_more_than_2_to_the_31_outputs(path, dtype):
    """65537 x 32768 outputs (> 2**31; 4.3 GB of float16, 17 GB of float64 on DMMA):
    every offset 64-bit; rows and columns at both ends against float64."""
    bound = 1.6e-2 if dtype == torch.float16 else 1e-12
    a = torch.randn(65537, 8, device="cuda", dtype=dtype)
    b = torch.randn(8, 32768, device="cuda", dtype=dtype)
    out = cupykern.matmul(a, b)
    assert out.shape == (65537, 32768) and out.numel() > 2 ** 31
    rows, cols = [0, 1, 32768, 65535, 65536], [0, 1, 16384, 32766, 32767]
    want = a[rows].double() @ b.double()
    assert (out[rows].double() - want).abs().max().item() <= bound * want.abs().max().item()
    want = a.double() @ b[:, cols].double()
    assert (out[:, cols].double() - want).abs().max().item() <= bound * want.abs().max().item()
    del out


@pytest.mark.parametrize("da, db", [("float32", "float64"), ("float64", "float32"),
                                    ("float16", "float32")])
def test_mixed_dtypes_promote_as_numpy_and_torch(da, db):
    """float32 @ float64 is float64, as NumPy's, CuPy's and torch's promotion rules say
    (torch.matmul itself refuses the mix); the values are those of the promoted product."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)).astype(da), rng.standard_normal((7, 3)).astype(db)
    got = cupykern.matmul(a, b)
    want = np.matmul(a, b)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    ta, tb = torch.from_numpy(a).requires_grad_(), torch.from_numpy(b).requires_grad_()
    tgot = cupykern.matmul(ta, tb)
    assert tgot.dtype == torch.promote_types(ta.dtype, tb.dtype)
    tgot.sum().backward()
    assert ta.grad.dtype == ta.dtype and tb.grad.dtype == tb.dtype


def test_mixed_dtypes_promote_past_a_planned_shape(monkeypatch):
    """A shape-keyed plan of the same shapes in a's dtype (stored here under the CPU call's
    key, as eager CUDA calls store theirs) is torch.matmul, which refuses two dtypes: a
    call of two dtypes skips the plans (no key built, nothing tried), is promoted, and
    computes the float64 product; once the promoted signature has a plan, the promoted
    call runs it."""
    from cupykern.torch import gemm as tgemm

    a, b = torch.randn(5, 7), torch.randn(7, 3, dtype=torch.float64)
    tried, promoted = [], []
    monkeypatch.setitem(tgemm._MATMUL_PLANS, tgemm._matmul_shape_key(a, b, None, False),
                        lambda *x: tried.append(1) or torch.matmul(*x))
    got = cupykern.matmul(a, b)
    assert tried == [] and got.dtype == torch.float64
    torch.testing.assert_close(got, a.double() @ b, rtol=0, atol=0)
    monkeypatch.setitem(tgemm._MATMUL_PLANS, tgemm._matmul_shape_key(a.double(), b, None, False),
                        lambda *x: promoted.append([t.dtype for t in x]) or torch.matmul(*x))
    got = cupykern.matmul(a, b)
    assert tried == [] and promoted == [[torch.float64, torch.float64]]
    torch.testing.assert_close(got, a.double() @ b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("a_shape", [(4, 64, 256), (2, 3, 40, 256)])
def test_stack_times_a_matrix_is_one_product(a_shape):
    """A stack times a matrix (b 2-D): a's rows fold into one product on ours, with both
    gradients (db one product over every row too), against float64."""
    from cupykern import gemm, gemm_route

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(a_shape, device="cuda", generator=g, requires_grad=True)
    b = torch.randn(256, 96, device="cuda", generator=g, requires_grad=True)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    with gemm_route.forced_route(gemm_route.OURS):
        assert gemm._folded(*(cupykern._array.operand(t.detach(), n) for t, n in ((a, "a"), (b, "b")))) is not None
        y = cupykern.matmul(a, b, precision="highest")
        y64 = a64 @ b64
        torch.testing.assert_close(y.double(), y64, atol=1e-4, rtol=1e-4)
        gy = torch.randn_like(y)
        y.backward(gy)
    y64.backward(gy.double())
    for got, want in ((a.grad, a64.grad), (b.grad, b64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-4 * want.abs().max().item(), rtol=0)


def test_torch_a_with_numpy_b_names_b():
    with pytest.raises(TypeError, match="^b: .*do not mix"):
        cupykern.matmul(torch.ones(2, 2), np.ones((2, 2), np.float32))


def test_stack_strides(monkeypatch):
    """GPU-free: a stack runs on one launch where each operand's matrices, as the GEMM
    reads them (K-major: a copy's where not), lie one stride apart, or two (an outer and
    an inner level of batch dims): broadcast dims give 0, size-1 dims do not count, and a
    broadcast against a stepped dim leaves no one stride but two levels."""
    from cupykern import _array, _loader, gemm

    assert gemm._stack_stride((2, 3), (15, 5)) == 5
    assert gemm._stack_stride((4,), (0,)) == 0 and gemm._stack_stride((), ()) == 0
    assert gemm._stack_stride((2, 1, 3), (30, 7, 10)) == 10
    assert gemm._stack_stride((2, 3), (0, 5)) is None and gemm._stack_stride((2, 3), (5, 0)) is None
    a = torch.randn(2, 3, 128, 64)
    first, strides = gemm._as_read(a, (2, 3))
    assert strides == (3 * 8192, 8192) and first.shape == (128, 64) and first.strides == (64, 1)
    first, strides = gemm._as_read(a.mT, (2, 3))  # (a C-contiguous copy's)
    assert strides == (3 * 8192, 8192) and first.shape == (64, 128) and first.strides == (128, 1)
    assert gemm._as_read(torch.randn(3, 128, 64), (2, 3))[1] == (0, 8192)
    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)
    monkeypatch.setattr(_loader, "sm_count", lambda dev: 132)
    ao = _array.operand(a, "a")
    assert gemm._one_launch(ao, a, torch.randn(2, 3, 64, 128), "highest")[0] == 6
    # b one matrix for all: stride 0
    assert gemm._one_launch(ao, a, torch.randn(1, 1, 64, 128), "highest")[0] == 6
    # b's (0, 8192) over (2, 3): no one stride, two levels
    assert gemm._one_launch(ao, a, torch.randn(3, 64, 128), "highest")[0] == 6
    # (2, 1) against (1, 3)
    assert gemm._one_launch(ao, a[:, :1], torch.randn(1, 3, 64, 128), "highest")[0] == 6
    steps = gemm._stack_steps((2, 3), ((3 * 8192, 0), (0, 8192)), 4)
    assert steps == (6, 3, (0, 3 * 8192), (8192, 0))  # count, inner, (step, outer) each
    assert gemm._stack_steps((2, 3), ((3 * 8192, 8192), (3 * 8192, 8192)), 4) == (
        6, 6, (8192, 0), (8192, 0))  # one level where one walks all
    # (2, 3, 4) over three levels: no two walk it
    assert gemm._stack_steps((2, 3, 4), ((0, 4096, 0), (0, 0, 8192)), 4) is None
    # attention's q, k (B, T, 3, H, D) -> (B, H, T, D): heads along a row, batches over rows
    qkv = torch.randn(2, 128, 3, 4, 64)
    q, k = qkv.permute(2, 0, 3, 1, 4)[:2]
    assert gemm._one_launch(_array.operand(q, "a"), q, k.mT, "highest") == (8, True)  # planned
    # a backward's q^T ds: q^T copied K-major (M 64 <= N 256), ds read swapped; p^T g
    # (M 128 > N 64): no planned launch (its copy would move more than the product reads)
    parts, copy = gemm._planned_stack(_array.operand(q.mT, "a"), q.mT, torch.randn(2, 4, 128, 256),
                                      "highest", (2, 4))
    assert copy and parts[3] and parts[2].count == 8
    p = torch.randn(2, 4, 128, 128)
    assert gemm._planned_stack(_array.operand(p.mT, "a"), p.mT, k, "highest", (2, 4)) is None
    monkeypatch.setattr(_loader, "device_cc", lambda dev: 80)
    assert gemm._one_launch(ao, a, torch.randn(2, 3, 64, 128), "highest")[0] == 1  # Hopper's wgmma only


def test_stack_one_launch_only_where_batched_call_plans_it(monkeypatch):
    """GPU-free: the route counts a stack as one launch only where
    :func:`cupykern.gemm_kernels.batched_call` plans it so; else it judges each product
    alone (here the vendor's): more matrices than a grid's y (65535), a split K, matrices
    off the first's 16-byte alignment, another kernel than wgmma."""
    from cupykern import _array, _loader, gemm

    monkeypatch.setattr(_loader, "device_cc", lambda dev: 90)
    monkeypatch.setattr(_loader, "sm_count", lambda dev: 132)

    def count(a, b):
        return gemm._one_launch(_array.operand(a, "a"), a, b, "highest")[0]

    assert count(torch.empty(1, 64, 128).expand(70000, 64, 128),
                 torch.empty(1, 128, 128).expand(70000, 128, 128)) == 1
    assert count(torch.empty(1, 64, 128).expand(60000, 64, 128),
                 torch.empty(1, 128, 128).expand(60000, 128, 128)) == 60000
    assert count(torch.empty(2, 128, 4096), torch.empty(2, 4096, 128)) == 1  # few tiles: K splits
    # the second matrix 4 bytes past 16-byte steps
    assert count(torch.empty(2 * 8193).as_strided((2, 128, 64), (8193, 64, 1)),
                 torch.empty(2, 64, 128)) == 1
    assert count(torch.empty(2, 128, 64), torch.empty(2, 64, 128)) == 2
    f64 = torch.float64  # (on DMMA)
    assert count(torch.empty(2, 128, 64, dtype=f64), torch.empty(2, 64, 128, dtype=f64)) == 1


def _stack_case(kind):
    """(a, b, one launch expected) on the GPU, float32, for :func:`test_stack_on_one_launch`;
    those of one launch have tiles enough (over 33 of 132 SMs) not to split K."""
    g = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=g)
    if kind == "batch 1":
        return rand(1, 1030, 256), rand(1, 256, 1100), True
    if kind == "b broadcast (stride 0)":
        return rand(5, 300, 256), rand(1, 256, 600).expand(5, 256, 600), True
    if kind == "a broadcast (stride 0)":
        return rand(1, 96, 128).expand(4, 96, 128), rand(4, 128, 200), True
    if kind == "two batch dims":
        return rand(2, 3, 260, 256), rand(2, 3, 256, 300), True
    if kind == "N 1, 3, 5, 4097":
        return rand(3, 70, 256), rand(3, 256, 4097 + 4)[..., :4097], True
    if kind == "transposed b":
        return rand(4, 200, 96), rand(4, 300, 96).mT, True
    if kind == "offset 16 bytes":  # every matrix 16-byte aligned: TMA
        buf = rand(4 + 3 * 100 * 64)
        return buf[4:].view(3, 100, 64), rand(3, 64, 250), True
    if kind == "stride of partial rows":  # matrices 4 floats apart past their rows: a launch each
        buf = rand(3 * (100 * 64 + 4))
        return buf.as_strided((3, 100, 64), (100 * 64 + 4, 64, 1)), rand(3, 64, 250), False
    if kind == "broadcast in two dims":  # (2, 1) against (3,): no one stride, two levels (b's
        return rand(2, 1, 300, 256), rand(3, 256, 602), True  # rows of 602: its K-major copy)
    if kind.startswith("attention"):  # (batch, head) views of one projection: two levels
        q, k, v = rand(2, 130, 3, 4, 64).permute(2, 0, 3, 1, 4)
        if kind == "attention QK^T":
            return q, k.mT, True
        if kind == "attention q^T ds":  # a backward's: q^T copied K-major, ds read swapped
            return q[..., :128, :].mT, rand(2, 4, 128, 256), True
        return rand(2, 4, 130, 128), v[..., :128, :], True  # PV: b read swapped
    if kind == "K 3":  # copied into rows of 4 (zeros past K), read by TMA
        return rand(3, 70, 3), rand(3, 3, 140), True
    if kind == "K 1025":
        return rand(4, 300, 1025), rand(4, 1025, 600), True
    raise ValueError(kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["batch 1", "b broadcast (stride 0)", "a broadcast (stride 0)",
                                  "two batch dims", "N 1, 3, 5, 4097", "transposed b",
                                  "offset 16 bytes", "stride of partial rows",
                                  "broadcast in two dims", "K 3", "K 1025",
                                  "attention QK^T", "attention PV", "attention q^T ds"])
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_stack_on_one_launch(kind, precision, monkeypatch):
    """A stack of products on ours: on Hopper, one launch with the matrix in the grid
    where each operand's matrices lie one stride apart (broadcast: 0), else a launch per
    matrix; against float64 either way (each result row and column of every matrix).
    A row-major b whose rows start and step on 16 bytes, with K a multiple of 32, runs
    swapped (b read in place, each product stored transposed)."""
    from cupykern import gemm, gemm_kernels, gemm_route

    a, b, one = _stack_case(kind)
    swapped = kind in ("batch 1", "b broadcast (stride 0)", "a broadcast (stride 0)", "two batch dims",
                       "attention PV", "attention q^T ds")
    if kind.startswith("N 1"):
        for n in (1, 3, 5):
            with gemm_route.forced_route(gemm_route.OURS):
                _check(cupykern.matmul(a, b[..., :n], precision=precision), a, b[..., :n],
                       1e-6 if precision == "highest" else 4e-3)
    stacks = []  # (plan, transposed_c) of each batched_call
    real = gemm_kernels.batched_call
    monkeypatch.setattr(gemm, "batched_call", lambda *args, transposed_c=False: stacks.append(
        (real(*args, transposed_c=transposed_c), transposed_c)) or stacks[-1][0])
    with gemm_route.forced_route(gemm_route.OURS):
        got = cupykern.matmul(a, b, precision=precision)
    _check(got, a, b, 1e-6 if precision == "highest" else 4e-3)
    if torch.cuda.get_device_capability() == (9, 0):
        assert any(s is not None for s, _ in stacks) == one, kind
        assert any(s is not None and t for s, t in stacks) == swapped, kind


@pytest.mark.gpu
@pytest.mark.slow(gib=40)
def test_stack_of_more_than_2_to_the_31_outputs():
    """(2, 32768, 32) @ (2, 32, 32768) on one launch: 2**31 outputs (8 GiB), the second
    matrix's offsets past int32; rows and columns at both ends against float64."""
    from cupykern import gemm_route

    a = torch.randn(2, 32768, 32, device="cuda")
    b = torch.randn(2, 32, 32768, device="cuda")
    with gemm_route.forced_route(gemm_route.OURS):
        out = cupykern.matmul(a, b, precision="highest")
    assert out.numel() == 2 ** 31
    for i in (0, 1):
        rows, cols = [0, 1, 16384, 32766, 32767], [0, 1, 16384, 32766, 32767]
        want = a[i, rows].double() @ b[i].double()
        torch.testing.assert_close(out[i, rows].double(), want, atol=1e-4, rtol=1e-5)
        want = a[i].double() @ b[i][:, cols].double()
        torch.testing.assert_close(out[i][:, cols].double(), want, atol=1e-4, rtol=1e-5)
    del out
