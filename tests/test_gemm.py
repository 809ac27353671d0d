"""cupykern.linear: every precision against float64 and PyTorch, odd shapes, bad input."""
import numpy as np
import pytest

import cupykern
from cupykern.gemm_checks import reference

torch = pytest.importorskip("torch")
from support import MATMUL_TOL as REL_BOUND, assert_grad_close  # noqa: E402
from support import check_mm as _check_mm, col_major as _col_major, gemm_data as _data  # noqa: E402
from support import gemm_errors as _errors, hopper as _hopper  # noqa: E402

pytestmark = pytest.mark.usefixtures("our_kernels")

# (M, N, K): tile edges, K = 1, M = 1, K not a multiple of the 16-byte chunk, big K.
# Rows of 16-byte multiples take the Hopper wgmma kernel, the others mma.sync; the
# aligned ones include M = 1, N = 1, K = 4 (one partial 32-wide K slice) and edges of
# its 128x128 and 128x256 tiles. On a GPU of 132 SMs, K is split (float32, float64)
# where a grid of at most 33 tiles meets K >= 256: 256x384x1024, 200x136x4100,
# 513x129x8192 and 67x45x1001 (unaligned rows, a partial last chunk); 1100x1030x260 is
# not split (81 / 45 tiles). 3xTF32 on Hopper also splits at most 66 tiles with K >=
# 2048: 768x768x4096 (36 tiles, 3 chunks) and 1000x900x2100 (64 tiles, 2 chunks, the
# last shorter).
SHAPES = [(1, 1, 1), (1, 7, 5), (3, 9, 1), (37, 23, 50), (128, 128, 128), (130, 257, 33),
          (256, 384, 1024), (200, 136, 4100), (513, 129, 8192), (1, 300, 64), (5, 1, 4),
          (129, 520, 36), (67, 45, 1001), (1100, 1030, 260), (768, 768, 4096),
          (1000, 900, 2100)]
def test_numpy_reference_path():
    xt, wt, bt = _data(5, 4, 3, torch.float32)
    want = torch.nn.functional.linear(xt.double(), wt.double(), bt.double())  # (float64)
    got = cupykern.linear(*(t.numpy() for t in (xt, wt, bt)))
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)
    got = cupykern.linear(xt, wt, bt)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad, exc, match", [
    (lambda x, w, b: cupykern.linear(x, w[:, :-1], b), ValueError, "in_features"),
    (lambda x, w, b: cupykern.linear(x, w.astype(np.float64), b), TypeError, "dtype"),
    (lambda x, w, b: cupykern.linear(x, w[0], b), ValueError, "2-D"),
    (lambda x, w, b: cupykern.linear(x, w, b[:-1]), ValueError, "bias"),
    (lambda x, w, b: cupykern.linear(x, torch.from_numpy(w), b), TypeError, "do not mix"),
    (lambda x, w, b: cupykern.linear(x, w, b, precision="low"), ValueError, "precision"),
    (lambda x, w, b: cupykern.linear(x.astype(np.int32), w, b), TypeError, "dtype"),
])
def test_bad_input(bad, exc, match):
    x, w, b = (t.numpy() for t in _data(5, 4, 3, torch.float32))
    with pytest.raises(exc, match=match):
        bad(x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_highest_matches_sgemm(shape):
    x, w, b = (t.cuda() for t in _data(*shape, torch.float32))
    out = cupykern.linear(x, w, b, precision="highest")
    ref = torch.nn.functional.linear(x, w, b)  # cuBLAS, TF32 off by default
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    err, mag = _errors(out, x, w, b)
    err_cublas, _ = _errors(ref, x, w, b)
    # At small K SGEMM is nearly exact; allow a few fp32 ulps of |x| @ |w|.T there.
    assert err <= 2 * err_cublas + 5e-7 * mag, (err, err_cublas)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1000, 3000])
@pytest.mark.parametrize("aligned", [True, False], ids=["wgmma-rows", "unaligned-rows"])
@pytest.mark.parametrize("rows", [198, 9000], ids=["split-K", "whole-K"])
def test_highest_same_sign_drift(k, aligned, rows):
    """Same-sign data (x, w, b uniform in [0, 1)): the tensor core truncates its running
    sum toward zero, so 3xTF32 drifts one way there. 198 rows (2 tiles) split K into
    chunks of 6 slices or fewer; 9000 rows (71 tiles: more than half of a Hopper GPU's
    SMs, more than a quarter of any GPU's up to 284) keep the whole-K chain. H200, these
    cases with 5120 rows (40 tiles: whole K then, before 3xTF32 split at half the SMs
    from K = 2048; 4 seeds, max over
    them): aligned rows (wgmma) max |error| 0.22-0.94x SGEMM's, mean error (bias)
    8.4e-8 to 9.1e-8 of max |result|, since A's big halves are rounded to nearest
    (split_tf32); with them truncated 0.22-1.19x and 1.5e-7 to 1.6e-7 (which the bias
    bound fails). Unaligned rows (mma.sync, both halves rounded) 0.20-0.83x, bias 9e-9 to
    4.9e-8. Before the running sum's fixes (kernels_cu/gemm.cu): 2.2-2.4x / 4.9e-7 and
    1.6-1.9x / 2e-7."""
    worst, bias = 0.0, 0.0
    for seed in range(4):
        g = torch.Generator(device="cuda").manual_seed(seed)
        kk = k + (0 if aligned else 1)
        x, w = (torch.rand(r, kk, device="cuda", generator=g) for r in (rows, 50))
        b = torch.rand(50, device="cuda", generator=g)
        if not aligned:
            x, w = x[:, 1:], w[:, 1:]
        ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
        out = cupykern.linear(x, w, b, precision="highest").double()
        sgemm = torch.nn.functional.linear(x, w, b).double()  # TF32 off by default
        worst = max(worst, (out - ref).abs().max().item() / (sgemm - ref).abs().max().item())
        bias = max(bias, abs((out - ref).mean().item()) / ref.abs().max().item())
    assert worst <= 1.5, worst
    assert bias <= (1.2e-7 if aligned else 5e-8), bias


@pytest.mark.gpu
@pytest.mark.parametrize("aligned", [True, False], ids=["wgmma-rows", "unaligned-rows"])
def test_highest_nan_and_zero_rows(aligned):
    """Rows of x that are nan (the quiet NaN, and all bits set, whose big half the integer
    rounding of split_tf32 wraps to 0: its small half carries the nan) give nan rows, a
    zero row a zero row, as SGEMM; the other rows are untouched by them."""
    k = 1024 + (0 if aligned else 1)
    x, w = torch.randn(198, k, device="cuda"), torch.randn(130, k, device="cuda")
    x[3] = float("nan")
    x[5] = torch.full((k,), -1, dtype=torch.int32, device="cuda").view(torch.float32)
    x[7] = 0
    if not aligned:
        x, w = x[:, 1:], w[:, 1:]
    out = cupykern.linear(x, w, precision="highest")
    assert out[[3, 5]].isnan().all()
    assert (out[7] == 0).all()
    rest = [i for i in range(198) if i not in (3, 5, 7)]
    torch.testing.assert_close(out[rest], torch.nn.functional.linear(x[rest], w),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["high", "medium"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reduced_precision(shape, precision):
    x, w, b = (t.cuda() for t in _data(*shape, torch.float32))
    err, mag = _errors(cupykern.linear(x, w, b, precision=precision), x, w, b)
    assert err <= REL_BOUND[precision] * mag


# (shape, how x's rows sit): 16-byte aligned; a C-contiguous view 4 bytes past alignment
# (2-D or 3-D); rows of stride K + 1. 256x384x1024 splits K 8 ways. A misaligned x is read
# in place by mma.sync where N < gemm_operands._COPY_WORK, else (on Hopper) copied aligned for wgmma.
ROUNDING_CASES = [((512, 1024, 3000), "aligned"), ((256, 384, 1024), "aligned"),
                  ((1100, 1030, 260), "aligned"), ((512, 1024, 3000), "offset"),
                  ((2048, 96, 3000), "offset"), ((2048, 96, 3000), "strided"),
                  ((64, 256, 3000), "offset 3-D")]


@pytest.mark.gpu
@pytest.mark.parametrize("shape, rows", ROUNDING_CASES, ids=lambda v: "x".join(map(str, v))
                         if isinstance(v, tuple) else v)
def test_high_rounds_like_cublas_tf32(shape, rows):
    """"high" rounds both operands to TF32 as cuBLAS's TF32 GEMM does (the copy engine on
    Hopper's wgmma path, cvt.rna on mma.sync's): on mixed-sign data its error against
    float64 is cuBLAS TF32's, not the 2.7x of operands truncated by the tensor cores."""
    m, n, k = shape
    x, w, _ = (t.cuda() for t in _data(m, n, k, torch.float32))
    if rows.startswith("offset"):
        x = torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(m, k)
        if rows.endswith("3-D"):  # rows of a batch (rows_2d, then copied aligned)
            x = x.view(2, m // 2, k)
    elif rows == "strided":
        x = torch.nn.functional.pad(x, (1, 0))[:, 1:]
    ref = x.double() @ w.double().T
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        theirs = (x @ w.T).double()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    ours = cupykern.linear(x, w, precision="high").double()
    e_ours, e_theirs = ((o - ref).abs().mean().item() for o in (ours, theirs))
    assert e_ours <= 1.2 * e_theirs, (e_ours, e_theirs)


# K % 4 != 0: on Hopper, float32 operands of such K are copied where copying
# pays (N >= gemm_operands._COPY_WORK for x, M >= it for W: 130 x 257 has both) into
# 16-byte rows of K rounded up to 4 (gemm_operands.padded_ld), zeros past K, that its
# wgmma reads by TMA: x row-major, transposed (the tiled copy from its columns) or 4 bytes
# off alignment, W row-major or transposed. Elsewhere the transposed ones are copied
# unpadded and the others read in place. K = 4097 splits K (6 tiles).
PADDED_K = [1, 3, 5, 4097]


def _laid_out(t, how):
    """``t`` (2-D) as row-major rows ("rows"), column by column ("transposed"), or rows
    starting 4 bytes past a 16-byte boundary ("offset")."""
    if how == "transposed":
        return _col_major(t)
    if how == "offset":
        return torch.cat([t.new_zeros(1), t.reshape(-1)])[1:].view(t.shape)
    return t


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["highest", "high"])
@pytest.mark.parametrize("w_how", ["rows", "transposed"])
@pytest.mark.parametrize("x_how", ["rows", "transposed", "offset"])
@pytest.mark.parametrize("k", PADDED_K)
def test_k_off_16_byte_rows(k, x_how, w_how, precision):
    """linear (planned: the copies are launches of its plan; and with ``out``: copied by
    gemm_operands.matrix) and matmul (mm's plan) of K % 4 != 0, with bias, within the
    precision's bound of float64; each copy holds the operand's K columns bit for bit in
    rows of padded_ld (K rounded up to 4 on Hopper), zeros past K."""
    from cupykern import gemm_operands
    from cupykern._array import operand
    m, n = 130, 257
    x, w, b = (t.cuda() for t in _data(m, n, k, torch.float32))
    x, w = _laid_out(x, x_how), _laid_out(w, w_how)
    outs = (cupykern.linear(x, w, b, precision=precision),
            cupykern.linear(x, w, b, precision=precision, out=torch.empty(m, n, device="cuda")),
            cupykern.matmul(x, w.t(), precision=precision) + b)
    for out in outs:
        assert out.shape == (m, n)
        err, mag = _errors(out, x, w, b)
        assert err <= REL_BOUND[precision] * mag, (err, mag)
    work = m * n * k
    for t in (x, w):
        o = operand(t, "t")
        ld = gemm_operands.padded_ld(o)
        assert ld == (-(-k // 4) * 4 if _hopper() else k)
        c = gemm_operands.matrix(o, work)
        if gemm_operands.read_mode(o, work)[0] == "view":
            assert c is o and not _hopper()  # (off Hopper: rows read in place)
            continue
        assert c.shape == (t.shape[0], k) and c.strides == (ld, 1) and c.ptr % 16 == 0
        assert torch.equal(c.obj, t)
        assert not torch.as_strided(c.obj, (t.shape[0], ld), (ld, 1))[:, k:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES[:7], ids=lambda s: "x".join(map(str, s)))
def test_other_dtypes(shape, dtype):
    x, w, b = (t.cuda() for t in _data(*shape, dtype))
    out = cupykern.linear(x, w, b)
    assert out.dtype == dtype
    err, mag = _errors(out, x, w, b)
    assert err <= (1e-12 if dtype == torch.float64 else 1.6e-2) * mag


@pytest.mark.gpu
def test_precision_follows_torch():
    x, w, b = (t.cuda() for t in _data(64, 64, 4096, torch.float32))
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        tf32 = cupykern.linear(x, w, b)
    finally:
        torch.set_float32_matmul_precision(old)
    assert torch.equal(tf32, cupykern.linear(x, w, b, precision="high"))
    assert not torch.equal(tf32, cupykern.linear(x, w, b))


@pytest.mark.gpu
def test_layouts_and_out():
    x, w, b = (t.cuda() for t in _data(70, 40, 64, torch.float32))
    ref = torch.nn.functional.linear(x, w, b)
    big = torch.zeros(70, 80, device="cuda")
    big[:, 3:67] = x
    sliced = big[:, 3:67]                      # row-strided, rows not 16-byte aligned
    transposed = x.t().contiguous().t()        # column-major
    for xv in (sliced, transposed):
        assert torch.allclose(cupykern.linear(xv, w, b), ref, atol=1e-4, rtol=1e-4)
    x3 = x.reshape(7, 10, 64)
    assert torch.allclose(cupykern.linear(x3, w, b), ref.reshape(7, 10, 40), atol=1e-4, rtol=1e-4)
    assert torch.allclose(cupykern.linear(x[0], w, b), ref[0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(cupykern.linear(x, w), ref - b, atol=1e-4, rtol=1e-4)
    out = torch.empty(70, 40, device="cuda")
    assert cupykern.linear(x, w, b, out=out) is out
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)
    wt = w.t().contiguous().t()
    assert torch.allclose(cupykern.linear(x, wt, b), ref, atol=1e-4, rtol=1e-4)
    # K = 0: only the bias; M = 0: empty
    assert torch.equal(cupykern.linear(x[:, :0], w[:, :0], b), b.expand(70, 40))
    assert cupykern.linear(x[:0], w, b).shape == (0, 40)


@pytest.mark.gpu
def test_cupy_in_cupy_out():
    cp = pytest.importorskip("cupy")
    x, w, b = (t.numpy() for t in _data(33, 20, 48, torch.float32))
    out = cupykern.linear(cp.asarray(x), cp.asarray(w), cp.asarray(b))
    assert isinstance(out, cp.ndarray)
    np.testing.assert_allclose(cp.asnumpy(out), reference(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_device_mismatch():
    x, w, b = _data(5, 4, 3, torch.float32)
    with pytest.raises(TypeError, match="do not mix"):
        cupykern.linear(x.cuda(), w, b.cuda())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_second_device():
    x, w, b = (t.to("cuda:1") for t in _data(130, 257, 33, torch.float32))
    out = cupykern.linear(x, w, b, precision="highest")
    assert out.device == x.device
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cuda:0"):
        cupykern.linear(x, w.to("cuda:0"), b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:7], ids=lambda s: "x".join(map(str, s)))
def test_below_sm80_every_dtype_on_cuda_cores(as_sm75, shape, dtype):
    x, w, b = (t.cuda() for t in _data(*shape, dtype))
    for precision in ("highest", "medium"):  # float32 accumulation whatever is asked
        out = cupykern.linear(x, w, b, precision=precision)
        assert out.dtype == dtype
        err, mag = _errors(out, x, w, b)
        assert err <= (1e-6 if dtype == torch.float32 else 1.6e-2) * mag


def test_numpy_float16_linear_accumulates_in_float32():
    """The NumPy path's float16 linear sums K = 4096 products in float32 and rounds once:
    within an ulp of the float64 product rounded to float16 (a float16 accumulation put
    a quarter of these outputs up to 2 ulp off)."""
    rng = np.random.default_rng(0)
    x, w = (rng.standard_normal(s).astype(np.float16) for s in ((64, 4096), (32, 4096)))
    b = rng.standard_normal(32).astype(np.float16)
    want = (x.astype(np.float64) @ w.astype(np.float64).T + b).astype(np.float16)
    got = cupykern.linear(x, w, b)
    assert got.dtype == np.float16
    assert (np.abs(got.astype(np.float64) - want) <= np.spacing(np.abs(want))).all()


# ---- float16 / bfloat16 on Hopper's wgmma (gemm_wgmma MODE 3): K-major rows, 16-byte
# aligned, loaded by TMA; 128 x 256 tiles, K slices of 64 elements, clusters of two CTAs
# where the M tiles pair up (129, 130, 255, 256 and 1000 rows; 1, 128, 257 and 384 rows
# run alone). Shapes: M, N of 1, tile edges +-1, K below, at and past one slice, a
# partial last slice (4104 = 64 * 64 + 8). On 132 SMs K is split (float slabs, then
# splitk_reduce) at 1x300x4104 (13 chunks of 320, the last 264), 130x257x1000 and
# 257x511x1000 (6 chunks of 192, the last 40) and 384x300x4104. On other GPUs the same
# checks run gemm_mma's 16-bit mode.
HALF_SHAPES = [(1, 1, 8), (1, 256, 64), (1, 300, 4104), (127, 255, 56), (128, 256, 64),
               (129, 257, 72), (130, 257, 1000), (256, 512, 128), (255, 260, 136),
               (257, 511, 1000), (384, 300, 4104), (1000, 1030, 520)]
# max |error| / max(|x| @ |w|.T + |b|) against float64: the output's rounding to the dtype
# (2^-12, 2^-9 of it) and fp32 sums, with room
HALF_BOUND = {torch.float16: 2e-3, torch.bfloat16: 8e-3}
HALF_DTYPES = [torch.float16, torch.bfloat16]


def _our_gemm(x, w, bias=None, alpha=None, beta=None, stats=False, ldc=None, offset=0,
              precision="highest"):
    """``epilogue(x @ w.T)`` by the kernel gemm_kernels.gemm_kernel chooses (x, w: 2-D CUDA tensors
    read in place; a split K's NaN-poisoned float32 workspace), into columns :N of a
    NaN-poisoned (M, ldc) buffer that starts ``offset`` elements into its allocation (whose
    first ``offset`` must stay NaN), and with ``stats`` the epilogue's per-M-tile (mean,
    M2, min, max) into a NaN-poisoned ``part``: (c, part, the buffer, the tile height of
    part, the kernel's template instantiation)."""
    from cupykern import gemm_kernels
    from cupykern._array import launch_all, operand
    a, b = operand(x, "x"), operand(w, "weight")
    (m, _), n = x.shape, w.shape[0]
    expr = gemm_kernels._choose(a, b, precision).expr
    kernel = gemm_kernels.gemm_kernel(a, b, precision)
    ws = torch.full((kernel.workspace,), float("nan"), device=x.device) if kernel.workspace else None
    flat = torch.full((offset + m * (ldc or n),), float("nan"), dtype=x.dtype, device=x.device)
    buf = flat[offset:].view(m, ldc or n)
    part = None
    if stats:
        part = torch.full((-(-m // kernel.bm), gemm_kernels.PART_ROWS, n), float("nan"), device=x.device)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    call = gemm_kernels.gemm_call(kernel, a, b, buf.stride(0))
    launch_all(a, call(x.data_ptr(), w.data_ptr(), buf.data_ptr(), ptr(bias), ptr(alpha), ptr(beta),
                       ptr(part), ptr(ws)))
    torch.cuda.synchronize()  # (ws is freed on return)
    assert flat[:offset].isnan().all(), "written before the output"
    return buf[:, :n], part, buf, kernel.bm, expr


def _check_written(c, buf, ref, mag, bound):
    """c within ``bound`` * mag of the float64 ``ref``, every element written, nothing
    written to the buffer's columns past c's."""
    assert not c.isnan().any(), "an output element was not written"
    assert buf[:, c.shape[1]:].isnan().all(), "written past the output's columns"
    err = (c.double() - ref).abs().max().item()
    assert err <= bound * mag, (err, mag)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_half_wgmma_epilogues(shape, dtype):
    """float16 / bfloat16 aligned K-major products (on Hopper: wgmma by TMA) against
    float64: plain into contiguous rows, + bias into rows padded by 4 elements (8-byte
    vector stores), alpha * z + beta (BatchNorm's eval epilogue, float32 vectors) into rows
    padded by 3 (element stores)."""
    m, n, k = shape
    x, w, b = (t.cuda() for t in _data(m, n, k, dtype))
    g = torch.Generator(device="cuda").manual_seed(1)
    alpha, beta = (torch.randn(n, device="cuda", generator=g) for _ in range(2))
    ref = x.double() @ w.double().T
    mag = (x.double().abs() @ w.double().abs().T).max().item()
    c, _, buf, _, expr = _our_gemm(x, w)
    if _hopper():
        assert expr.startswith(f"gemm_wgmma<{'bf16_t' if dtype == torch.bfloat16 else 'half_t'}, 3,")
    _check_written(c, buf, ref, mag, HALF_BOUND[dtype])
    c, _, buf, _, _ = _our_gemm(x, w, bias=b, ldc=n + 4)
    _check_written(c, buf, ref + b.double(), mag + b.double().abs().max().item(),
                   HALF_BOUND[dtype])
    c, _, buf, _, _ = _our_gemm(x, w, alpha=alpha, beta=beta, ldc=n + 3)
    a64, b64 = alpha.double(), beta.double()
    _check_written(c, buf, a64 * ref + b64, (a64.abs() * mag + b64.abs()).max().item(),
                   HALF_BOUND[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype, precision", [(torch.float32, "highest"), (torch.float32, "high"),
                                              (torch.bfloat16, "highest")], ids=str)
def test_rows_off_vector_alignment(dtype, precision, offset):
    """Output rows that start off the epilogue's 4-element vectors (an odd row stride, an
    output at an offset; on Hopper wgmma's wg_store, which stores such rows element by
    element): every column written once, with its bias, nothing before the output or in
    the row padding. 600 columns: past two N tiles of 256 ("high", bf16) or four of 128
    ("highest"), the last partial; a row stride of 601 starts the rows at every offset
    modulo 4."""
    m, n, k = 130, 600, 200
    x, w, b = (t.cuda() for t in _data(m, n, k, dtype))
    ref = x.double() @ w.double().T + b.double()
    mag = (x.double().abs() @ w.double().abs().T).max().item() + b.double().abs().max().item()
    c, _, buf, _, expr = _our_gemm(x, w, bias=b, ldc=n + 1, offset=offset, precision=precision)
    if _hopper():
        assert expr.startswith("gemm_wgmma<")
    bound = {"highest": 1e-6, "high": 2e-3}[precision] if dtype == torch.float32 else HALF_BOUND[dtype]
    _check_written(c, buf, ref, mag, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("shape", HALF_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_half_wgmma_statistics(shape, dtype):
    """GemmScaleBatchNorm's partial statistics from the 16-bit epilogue: per M tile and
    column, (mean, M2, min, max) of the products as stored (rounded to the dtype, so that
    they agree with what BatchNorm normalises): min and max exactly the output's, mean and
    M2 within float32 sums of it; every tile's every column written."""
    m, n, k = shape
    x, w, _ = (t.cuda() for t in _data(m, n, k, dtype))
    c, part, _, bm, _ = _our_gemm(x, w, stats=True)
    assert not c.isnan().any() and not part.isnan().any()
    z = c.double()
    for mt in range(part.shape[0]):
        t = z[mt * bm:(mt + 1) * bm]
        p = part[mt].double()
        mean = t.mean(0)
        m2 = ((t - mean) ** 2).sum(0)
        big = t.abs().max(0).values
        assert torch.equal(p[2], t.min(0).values) and torch.equal(p[3], t.max(0).values), mt
        assert ((p[0] - mean).abs() <= 1e-5 * big + 1e-30).all(), mt
        assert ((p[1] - m2).abs() <= 1e-4 * m2 + 1e-5 * t.shape[0] * big ** 2 + 1e-30).all(), mt


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["offset", "strided", "x transposed", "w transposed", "K % 8",
                                  "K = 1"])
def test_half_off_tma_falls_back(case, dtype):
    """16-bit operands TMA cannot read as K-major 16-byte aligned rows (rows starting off
    16 bytes, strides off 16 bytes, column-major, K not a multiple of 8 elements) run
    gemm_mma's 16-bit mode, read in place, with the same results."""
    m, n, k = (300, 260, 1 if case == "K = 1" else 200)
    x, w, b = (t.cuda() for t in _data(m, n, k + (3 if case == "K % 8" else 0), dtype))
    if case == "offset":
        x = torch.cat([x.new_zeros(1), x.reshape(-1)])[1:].view(m, k)
    elif case == "strided":
        x = torch.nn.functional.pad(x, (1, 0))[:, 1:]
    elif case == "x transposed":
        x = _col_major(x)
    elif case == "w transposed":
        w = _col_major(w)
    c, _, buf, _, expr = _our_gemm(x, w, bias=b, ldc=n + 1)
    assert expr.startswith("gemm_mma<")
    ref = x.double() @ w.double().T + b.double()
    mag = (x.double().abs() @ w.double().abs().T + b.double().abs()).max().item()
    _check_written(c, buf, ref, mag, HALF_BOUND[dtype])


# (dtype, precision, max |error| / (|a| @ |b|)) of the backward GEMM checks below.
MM_CASES = [(torch.float32, "highest", 1e-6), (torch.float32, "high", REL_BOUND["high"]),
            (torch.float32, "medium", REL_BOUND["medium"]), (torch.float16, None, 1.6e-2),
            (torch.bfloat16, None, 1.6e-2), (torch.float64, None, 1e-12)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision, bound", MM_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("shape", SHAPES + [(60, 70, 3000), (100, 90, 8200)],
                         ids=lambda s: "x".join(map(str, s)))
def test_mm_either_layout(shape, dtype, precision, bound):
    """The backward's GEMM: a @ b with each operand row- or column-major, against float64
    (every tile edge, K = 1, unaligned rows and columns; column-major operands read in
    place by the small products and the last two, copied by the others, or, for a
    column-major b on Hopper (3x)TF32 with enough tiles, read in place by the swapped
    product (b^T a^T)^T)."""
    m, n, k = shape
    a, bt, _ = (t.cuda() for t in _data(m, n, k, dtype))
    _check_mm(a, bt.t(), precision, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("precision, bound", [("high", REL_BOUND["high"]), ("highest", 1e-6)])
@pytest.mark.parametrize("shape, cols, swap", [
    ((128, 5120, 512), None, True), ((136, 4228, 600), None, True),  # partial tiles, K slice
    ((136, 4229, 600), 4232, True),  # a column slice: b's rows aligned, the output's not
    ((128, 136, 300), None, True), ((256, 384, 1024), None, True),  # few tiles: split K
    ((256, 200, 65536), None, True),  # long K: a chunk per SM, slabs of the stored transpose
    ((130, 257, 4100), None, False),  # b's rows not aligned
    ((520, 6397, 300), 6400, True)],  # 150 tiles: persistent CTAs take two (H100, H200: 132 SMs)
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_mm_row_major_b(shape, cols, swap, precision, bound):
    """mm(a, b) with b row-major (``cols`` wide, sliced to n columns), as dx = dy @ W: on
    Hopper float32, at a batch of at least 128 with 16-byte aligned rows of b, the product
    runs swapped, (b^T a^T)^T, reading b in place and storing the product transposed (a
    split K's slabs too); otherwise b's transpose is copied. Against float64."""
    from cupykern import gemm_operands
    from cupykern._array import operand
    from cupykern.torch.gemm import mm_op as mm
    m, n, k = shape
    a, bt, _ = (t.cuda() for t in _data(m, cols or n, k, torch.float32))
    b = bt.t().contiguous()[:, :n]
    swapped = gemm_operands._swaps(operand(a, "a"), operand(b.T, "b"), m * n * k, precision)
    assert swapped == (swap and torch.cuda.get_device_capability() == (9, 0))
    ref = a.double() @ b.double()
    mag = (a.double().abs() @ b.double().abs()).max().item()
    out = mm(a, b, precision)
    assert out.shape == (m, n) and out.is_contiguous()
    assert (out.double() - ref).abs().max().item() <= bound * mag


@pytest.mark.gpu
def test_mm_strided_views_and_copies():
    a, bt, _ = (t.cuda() for t in _data(70, 50, 90, torch.float32))
    big = torch.randn(200, 200, device="cuda")
    _check_mm(big[3:73, 5:95], bt.t(), "highest", 1e-6)        # row stride 200, offset
    _check_mm(big.t()[7:77, 2:92], bt.t(), "highest", 1e-6)    # column stride 200
    _check_mm(big.t()[7:77, 2:92], big[:90, 10:160], "highest", 1e-6)  # the same, copied (N 150)
    _check_mm(a, big[1:91, 9:59], "highest", 1e-6)
    _check_mm(big[::2, ::2][:70, :90], bt.t(), "highest", 1e-6)  # neither: copied
    _check_mm(a, big[::2, ::3][:90, :50], "highest", 1e-6)
    _check_mm(a, torch.randn(90, 1, device="cuda").expand(90, 50), "highest", 1e-6)
    from cupykern.torch.gemm import mm_op as mm
    assert mm(a[:0], bt.t(), "highest").shape == (0, 50)
    assert torch.equal(mm(a[:, :0], bt.t()[:0], "high"), torch.zeros(70, 50, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mm_below_sm80(as_sm75, dtype):
    a, bt, _ = (t.cuda() for t in _data(130, 70, 50, dtype))
    _check_mm(a, bt.t(), "highest", 1e-6 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("precision, bound", [("highest", 1e-4), ("high", 2e-2)])
@pytest.mark.parametrize("shape", [(3, 7, 5), (130, 257, 33), (256, 384, 1024), (2, 99, 3000),
                                   (4096, 768, 768)], ids=lambda s: "x".join(map(str, s)))
def test_linear_gradients_on_our_gemm(shape, precision, bound):
    """dx, dW, db of cupykern.linear against float64 autograd, relative to max |grad|
    (the training issue's tolerance for "highest"). 4096x768x768: dW = g^T @ x, 768 x 768
    over K = 4096, splits K in 3 chunks on an H200 in "highest"."""
    m, n, k = shape
    x, w, b = (t.cuda().requires_grad_() for t in _data(m, n, k, torch.float32))
    g = torch.randn(m, n, device="cuda")
    cupykern.linear(x, w, b, precision=precision).backward(g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(x64, w64, b64).backward(g.double())
    for name, ours, ref in (("x", x.grad, x64.grad), ("w", w.grad, w64.grad), ("b", b.grad, b64.grad)):
        assert ours.dtype == torch.float32
        assert_grad_close(ours, ref, bound, what=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision, bound", [(torch.bfloat16, "highest", 2e-2),
                                                     (torch.float16, "highest", 4e-3),
                                                     (torch.float32, "high", 2e-2)], ids=str)
@pytest.mark.parametrize("wants", ["x, w, b", "w, b", "x"])
def test_linear_gradients_of_a_padded_grad(dtype, precision, bound, wants, monkeypatch):
    """An N off 16-byte rows where cupykern.gemm_route.padded_grad pads (its work bound lowered
    for a small product): linear's backward copies g (here of a 3-D x, and not
    row-contiguous) once into rows of `cols`, pads W, and its products read those; dx,
    dW, db against float64 autograd, whichever are wanted; x, W and g untouched."""
    from cupykern import gemm, gemm_route
    from cupykern.torch import gemm as torch_gemm
    monkeypatch.setitem(gemm_route._ROUTE, "PADDED_GRAD_MIN_WORK", 2 ** 20)
    monkeypatch.setattr(gemm, "eager_plan", lambda *args: (None, False))  # (the op, every call)
    bs, s, n, k = 4, 96, 1025, 512
    cols = 1032 if dtype.itemsize == 2 else 1028
    assert gemm_route.padded_grad(bs * s, n, k, str(dtype)[6:], precision) == cols
    x, w, b = (t.cuda() for t in _data(bs * s, n, k, dtype))
    x = x.view(bs, s, k)
    g = torch.randn(n, s, bs, device="cuda").to(dtype).permute(2, 1, 0)  # (bs, s, n)
    kept = [t.clone() for t in (x, w, g)]
    seen, real = [], torch_gemm.matmul_op
    monkeypatch.setattr(torch_gemm, "matmul_op", lambda a, b_, p: seen.append(
        (tuple(a.shape), a.stride(), tuple(b_.shape))) or real(a, b_, p))
    for t, name in ((x, "x"), (w, "w"), (b, "b")):
        t.requires_grad_(name in wants)
    cupykern.linear(x, w, b, precision=precision).backward(g)
    assert all(torch.equal(a, c) for a, c in zip((x, w, g), kept))
    want_seen = [((bs * s, cols), (cols, 1), (cols, k))] if "x" in wants else []
    want_seen += [((n, bs * s), (1, cols), (bs * s, k))] if "w" in wants else []
    assert seen == want_seen
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    torch.nn.functional.linear(x64, w64, b64).backward(g.double())
    for name, ours, ref in (("x", x.grad, x64.grad), ("w", w.grad, w64.grad), ("b", b.grad, b64.grad)):
        if name not in wants:
            assert ours is None
            continue
        assert ours.dtype == dtype and ours.shape == ref.shape
        assert_grad_close(ours, ref, bound, what=name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("x_shape, w_shape", [((3, 4), (0, 4)), ((3, 0), (5, 0)), ((0, 4), (5, 4)),
                                              ((2, 0, 4), (5, 4))], ids=str)
def test_gradients_of_empty_products(x_shape, w_shape, device):
    """An empty product (N, K or the rows 0) has the gradients torch gives, of linear (its
    own backward) and of matmul with W transposed."""
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(*s, generator=g).to(device) for s in (x_shape, w_shape))
    b = torch.randn(w_shape[0], generator=g).to(device)
    calls = ((cupykern.linear, torch.nn.functional.linear, (x, w, b)),
             (lambda a, b_: cupykern.matmul(a, b_.t()), lambda a, b_: a @ b_.t(), (x, w)))
    for ours, ref, args in calls:
        mine, want = ([t.clone().requires_grad_() for t in args] for _ in range(2))
        out = ours(*mine)
        out.backward(torch.ones_like(out))
        ref(*want).backward(torch.ones_like(out))
        for a, r in zip(mine, want):
            assert a.grad.shape == r.grad.shape and torch.equal(a.grad, r.grad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("precision", [["high"], "low", 3], ids=str)
def test_bad_precision_of_tensors(precision, device):
    """A precision that is not one of PRECISIONS (a list, which no plan can be keyed by,
    included) gets the checks' ValueError naming it, from linear and matmul on tensors."""
    x, w, b = (t.to(device) for t in _data(5, 4, 3, torch.float32))
    for call in (lambda: cupykern.linear(x, w, b, precision=precision),
                 lambda: cupykern.matmul(x, w.t(), precision=precision)):
        with pytest.raises(ValueError, match="precision"):
            call()
