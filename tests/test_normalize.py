"""l1_normalize / l2_normalize and the L1Norm / L2Norm modules against PyTorch."""
import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cupykern
from cupykern.models import l1norm, l2norm
from cupykern.torch import L1Norm, L2Norm
from support import normalize_torch

FUNCS = {"l1": cupykern.l1_normalize, "l2": cupykern.l2_normalize}
# allclose tolerance (atol = rtol) against the same-dtype PyTorch expression.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = list(TOL)


def torch_ref(x, kind, dim=1):
    return normalize_torch(x, kind, dim)


def assert_matches(got, want, dtype):
    tol = TOL[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=tol, rtol=tol, equal_nan=True)


# ---------------------------------------------------------------- CPU (no GPU)
@pytest.mark.parametrize("kind", FUNCS)
def test_gradient_of_zero_inf_nan_rows_as_torch_cpu(kind):
    """Special rows' gradients as autograd of PyTorch's own ops gives them (nan)."""
    x = torch.randn(4, 5, dtype=torch.float64)
    x[1], x[2, 0], x[3, 4] = 0, float("inf"), float("nan")
    g = torch.randn(4, 5, dtype=torch.float64)
    xr, xw = x.clone().requires_grad_(), x.clone().requires_grad_()
    (got,) = torch.autograd.grad(FUNCS[kind](xr), xr, g)
    (want,) = torch.autograd.grad(torch_ref(xw, kind), xw, g)
    torch.testing.assert_close(got, want, equal_nan=True)



@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", FUNCS)
def test_cpu_paths_accumulate_wide_and_keep_lone_elements(kind, dtype, lib):
    """The CPU paths (NumPy, torch) sum 16-bit rows in float32, as PyTorch does: squares
    of |x| > 256 pass float16's maximum. A length-1 L2 row of +-3e38 is +-1 (its square
    overflows float32; PyTorch's norm of one element is |x|)."""
    if lib == "numpy" and dtype == torch.bfloat16:
        pytest.skip("NumPy has no bfloat16")
    as_lib = (lambda t: t.numpy()) if lib == "numpy" else (lambda t: t)
    x = (torch.randn(4, 2000, generator=torch.Generator().manual_seed(5)) * 64).to(dtype)
    got = torch.as_tensor(FUNCS[kind](as_lib(x)))
    want = torch_ref(x.double(), kind)
    assert got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * float(want.abs().max()))
    big = torch.tensor([[3e38], [-3e38]])
    assert torch.as_tensor(FUNCS[kind](as_lib(big))).tolist() == [[1.0], [-1.0]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ops_take_p_of_1_or_2_only(device):
    """The custom ops' p (the public functions pass 1 or 2): any other is a ValueError
    naming it, never the L2 result."""
    x = torch.randn(4, 6, device=device)
    for p in (0, 3, 7, -1):
        with pytest.raises(ValueError, match="^p: expected 1"):
            torch.ops.cupykern.normalize(x, p, 1, None)
        with pytest.raises(ValueError, match="^p: expected 1"):
            torch.ops.cupykern.normalize_backward(x, x, p, 1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-17, 1e-15, 1e12, 1e15, 1e20, 2e38])
@pytest.mark.parametrize("kind", FUNCS)
def test_gradient_of_rows_of_extreme_norm(kind, scale, dtype, device):
    """Rows of finite elements whose norm cubed leaves float32's range: overflows (from
    7e12) or, flushed to zero in the kernels, underflows (L2 under 2.3e-13); a row of
    equal elements among them (whose gradient is all cancellation). The gradient torch's
    autograd of its own ops gives (0 where the float32 norm overflows: L2 at 1e20; at 2e38
    both, and there dy . x overflows too)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(3, 100, generator=gen) + 0.5) * scale
    x[2] = scale
    x, g = x.to(device, dtype), torch.rand(3, 100, generator=gen).to(device, dtype)
    grads = []
    for fn in (FUNCS[kind], lambda t: torch_ref(t, kind)):
        xi = x.clone().requires_grad_()
        grads.append(torch.autograd.grad(fn(xi), xi, g)[0].float())
    got, want = grads
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=TOL[dtype] * float(want.abs().max()))


@pytest.mark.parametrize("kind", FUNCS)
def test_numpy_float16_rounds_like_torch(kind):
    """Rows of small integers, whose sums are exact in float32 in any order: the NumPy
    path's float16 result is PyTorch's bit for bit. PyTorch stores the mean or norm in x's
    dtype before dividing; dividing by the unrounded divisor changes an ulp in over a
    hundred of these elements."""
    x = torch.randint(-40, 41, (256, 5), generator=torch.Generator().manual_seed(0)).half()
    x[7] = 0  # a zero row: nan, as x / 0
    got, want = FUNCS[kind](x.numpy()), torch_ref(x, kind).numpy()
    assert got.dtype == np.float16
    nan = np.isnan(want)
    assert nan[7].all() and np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.int16), want[~nan].view(np.int16))


@pytest.mark.parametrize("kind", FUNCS)
@pytest.mark.parametrize("shape,axis", [((4, 7), 1), ((4, 7), 0), ((3, 4, 5), -1), ((9,), 0),
                                        ((1, 1), 1), ((0, 3), 1)])
def test_numpy_path_matches_float64(kind, shape, axis):
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    got = FUNCS[kind](x, axis=axis)
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    want = torch_ref(torch.from_numpy(x).double(), kind, dim=axis).numpy() if x.size else x
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", FUNCS)
def test_torch_cpu_tensor_and_out(kind):
    x = torch.randn(5, 33, dtype=torch.bfloat16)
    got = FUNCS[kind](x)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert_matches(got, torch_ref(x, kind), torch.bfloat16)
    tol = TOL[torch.bfloat16]  # (and float64's, which is no CPU path's own expression)
    torch.testing.assert_close(got.double(), torch_ref(x.double(), kind), rtol=tol, atol=tol)
    out = np.empty((5, 33), np.float64)
    xn = x.double().numpy()
    assert FUNCS[kind](xn, out=out) is out
    np.testing.assert_allclose(out, torch_ref(torch.from_numpy(xn), kind).numpy(), rtol=1e-12)


def test_zero_nan_inf_rows_cpu():
    x = np.array([[0, 0, 0], [1, np.inf, 2], [1, np.nan, 2], [-np.inf, np.inf, 1]], np.float32)
    for kind in FUNCS:
        want = torch_ref(torch.from_numpy(x), kind).numpy()
        np.testing.assert_array_equal(FUNCS[kind](x), want)


@pytest.mark.parametrize("bad,exc,msg", [
    (np.arange(6).reshape(2, 3), TypeError, "x: unsupported dtype int64"),
    (np.ones((2, 3), np.complex64), TypeError, "x: unsupported dtype complex64"),
    ([[1.0, 2.0]], TypeError, "x: expected a cupy.ndarray"),
    (np.float32(3.0), TypeError, "x: expected"),
    (np.array(3.0), ValueError, "0-d"),
])
def test_bad_input(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        cupykern.l1_normalize(bad)


def test_bad_axis_and_out():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="axis: 2 is out of range"):
        cupykern.l2_normalize(x, axis=2)
    with pytest.raises(TypeError, match="axis: expected an int"):
        cupykern.l2_normalize(x, axis=1.0)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 3\)"):
        cupykern.l2_normalize(x, out=np.empty((3, 2), np.float32))
    with pytest.raises(TypeError, match="out: expected dtype float32"):
        cupykern.l2_normalize(x, out=np.empty((2, 3), np.float64))
    with pytest.raises(TypeError, match="do not mix"):
        cupykern.l2_normalize(x, out=torch.empty(2, 3))


@pytest.mark.parametrize("mod", [l1norm, l2norm])
def test_modules_on_cpu_match_reference(mod):
    x = torch.randn(16, 300)
    torch.testing.assert_close(mod.ModelNew()(x), mod.Model()(x))
    assert mod.get_init_inputs() == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cpu_l1_gradient_uses_the_rounded_divisor(dtype):
    """L1Norm's 16-bit backward on the CPU differentiates the forward as computed: the
    divisor rounded to x's dtype (autograd of the float32 model with that rounding in its
    graph, rounded to dtype), within an ulp of |dy / d| + |dx|."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 300, generator=g) * 3).to(dtype)
    dy = torch.randn(256, 300, generator=g).to(dtype)
    xr = x.clone().requires_grad_()
    L1Norm()(xr).backward(dy)
    xf = x.float().requires_grad_()
    d = xf.abs().mean(1, keepdim=True).to(dtype).float()
    (xf / d).backward(dy.float())
    want = xf.grad.to(dtype).float()
    bound = torch.finfo(dtype).eps * ((dy.float() / d.detach()).abs() + want.abs())
    assert ((xr.grad.float() - want).abs() <= bound).all()


# ---------------------------------------------------------------- GPU

SHAPES = [(1, 1), (1, 7), (7, 1), (3, 5), (33, 129), (16, 16384), (4, 65535), (3, 65537),
          (2, 140001), (2, 300000)]  # the last two exceed a cluster's registers (two-pass path)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", FUNCS)
def test_matches_torch(kind, shape, dtype):
    x = torch.randn(shape, device="cuda").to(dtype)
    got = FUNCS[kind](x)
    assert isinstance(got, torch.Tensor) and got.device == x.device
    assert_matches(got, torch_ref(x, kind), dtype)
    assert torch.equal(FUNCS[kind](x), got)  # deterministic, bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FUNCS)
@pytest.mark.parametrize("shape,axis", [((5, 6, 7), 0), ((5, 6, 7), 1), ((5, 6, 7), -1),
                                        ((11,), 0), ((300, 40), 0)])
def test_any_axis(kind, shape, axis):
    x = torch.randn(shape, device="cuda", dtype=torch.float64)
    assert_matches(FUNCS[kind](x, axis=axis), torch_ref(x, kind, dim=axis), torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FUNCS)
def test_non_contiguous_views(kind):
    base = torch.randn(64, 1001, device="cuda")
    for view in (base.t(), base[:, 1:], base[:, 3:900], base[::3], base[1:, :-1].t(),
                 base.view(64, 7, 143)[:, 2]):
        before = base.clone()
        assert_matches(FUNCS[kind](view), torch_ref(view, kind), torch.float32)
        assert torch.equal(base, before)  # input untouched


@pytest.mark.gpu
def test_cupy_in_cupy_out_and_out_argument():
    import cupy as cp

    x = cp.random.standard_normal((37, 3001), dtype=cp.float32)
    want = torch_ref(torch.from_dlpack(x), "l2")
    got = cupykern.l2_normalize(x)
    assert isinstance(got, cp.ndarray)
    assert_matches(torch.from_dlpack(got), want, torch.float32)
    out = cp.empty_like(x)
    assert cupykern.l2_normalize(x, out=out) is out
    assert_matches(torch.from_dlpack(out), want, torch.float32)
    misaligned = cp.empty(37 * 3001 + 1, cp.float32)[1:].reshape(37, 3001)
    assert cupykern.l2_normalize(x, out=misaligned) is misaligned
    assert_matches(torch.from_dlpack(misaligned), want, torch.float32)
    with pytest.raises(TypeError, match="do not mix"):
        cupykern.l2_normalize(x, out=torch.empty(37, 3001, device="cuda"))
    with pytest.raises(TypeError, match="do not mix"):
        cupykern.l2_normalize(x, out=np.empty((37, 3001), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FUNCS)
def test_in_place_out(kind):
    x = torch.randn(9, 70000, device="cuda")
    want = torch_ref(x, kind)
    assert FUNCS[kind](x, out=x) is x
    assert_matches(x, want, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FUNCS)
@pytest.mark.parametrize("ncols", [3, 4096, 65535, 300000])
def test_zero_nan_inf_rows(kind, ncols):
    x = torch.rand(6, ncols, device="cuda")
    x[0] = 0
    x[1, ncols // 2] = float("inf")
    x[2, 0] = float("nan")
    x[3, 0], x[3, -1] = float("inf"), float("-inf")
    x[4] = 3e38  # sum overflows to inf in float32, as in torch
    x[5] = 1e-30  # divisor far below 1: reciprocal path
    assert_matches(FUNCS[kind](x), torch_ref(x, kind), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0,), (2, 0, 3)])
def test_empty(shape):
    x = torch.empty(shape, device="cuda")
    for f in FUNCS.values():
        got = f(x, axis=-1)
        assert type(got) is torch.Tensor and got.shape == x.shape and got.dtype == x.dtype
        out = torch.empty_like(x)
        assert f(x, axis=-1, out=out) is out


@pytest.mark.gpu
def test_torch_side_stream_and_bad_gpu_input():
    x = torch.randn(64, 50000, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = cupykern.l1_normalize(x)
        want = torch_ref(x, "l1")
    s.synchronize()
    assert_matches(got, want, torch.float32)
    with pytest.raises(TypeError, match="unsupported dtype int32"):
        cupykern.l1_normalize(torch.ones(3, 3, dtype=torch.int32, device="cuda"))
    with pytest.raises(TypeError, match="do not mix"):
        cupykern.l1_normalize(x, out=torch.empty(64, 50000))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_second_device():
    x = torch.randn(17, 5000, device="cuda:1")
    got = cupykern.l2_normalize(x)
    assert got.device == x.device
    assert_matches(got, torch_ref(x, "l2"), torch.float32)
    with pytest.raises(ValueError, match="cuda:0"):
        cupykern.l2_normalize(x, out=torch.empty(17, 5000, device="cuda:0"))
    import cupy as cp

    with cp.cuda.Device(1):
        xc = cp.random.standard_normal((17, 5000), dtype=cp.float32)
    got = cupykern.l1_normalize(xc)  # launched on the array's device, whatever is current
    assert got.device.id == 1
    assert_matches(torch.from_dlpack(got), torch_ref(torch.from_dlpack(xc), "l1"), torch.float32)


@pytest.mark.gpu
@pytest.mark.slow(gib=48)  # (peak ~36 GiB: three float16 and three float32 copies of 2**31)
def test_more_than_2_31_elements():
    x = torch.rand(32769, 65537, device="cuda", dtype=torch.float16)  # 2**31 + 98305 elements
    assert x.numel() > 2**31
    for kind in FUNCS:
        got = FUNCS[kind](x)
        for rows in (slice(0, 4), slice(32700, 32769)):  # last rows sit past 2**31
            assert_matches(got[rows], torch_ref(x[rows], kind), torch.float16)
        del got
    del x
    one_row = torch.rand(1, 2**31 + 5, device="cuda", dtype=torch.float16)  # chunked path
    got = cupykern.l1_normalize(one_row)
    d = one_row.float().abs().mean().half().float()
    assert_matches(got[:, -1000:], (one_row[:, -1000:].float() / d).half(), torch.float16)
    del got
    # the chunked backward: dx = g / d - sign(x) * sum(g * x) / (d * d * n), its last elements
    g = torch.rand_like(one_row)
    dx = _core().normalize_backward(one_row, g, 1, 1)
    s = (one_row.float() * g.float()).sum().double()  # (64-bit indexing; cuBLAS dot has not)
    d, n = float(d), one_row.shape[1]
    xt, gt = one_row[0, -1000:].double(), g[0, -1000:].double()
    want = gt / d - xt.sign() * s / (d * d * n)
    torch.testing.assert_close(dx[0, -1000:].double(), want, rtol=2e-3, atol=2e-3 * 2 / d)
    del one_row, g, dx  # (conftest's slow fixture then empties the caches)


@pytest.mark.gpu
@pytest.mark.parametrize("mod,cls", [(l1norm, L1Norm), (l2norm, L2Norm)])
def test_modules_cuda_and_autograd(mod, cls):
    m = cls()  # built on the CPU, then moved: no parameters, still must work
    m = m.to("cuda")
    x = torch.randn(16, 16384, device="cuda", requires_grad=True)
    y = m(x)
    y_ref = mod.Model()(x)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (gx_ref,) = torch.autograd.grad(y_ref, x, g)
    torch.testing.assert_close(gx, gx_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(8, 256, 8), (8, 512, 4, True, 1), (4, 512, 8, True, 16),
                                    (8, 256, 8, False), (8, 512, 4, False, 3), (1, 1024, 4)],
                         ids=str)
@pytest.mark.parametrize("kind", FUNCS)
def test_every_kernel_path(kind, config):
    """Each cluster shape and rows-per-cluster setting of the row kernel."""
    ncols = 16383 if config == (1, 1024, 4) else 65535
    x = torch.randn(37, ncols, device="cuda")
    x[5] = 0
    got = getattr(cupykern, f"{kind}_normalize")(x, config=config)
    assert_matches(got, torch_ref(x, kind), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(8, 256, 8, True, 16), (8, 512, 4, True), (8, 512, 4, False, 8),
                                    (8, 256, 8, False), (1, 256, 4)], ids=str)
def test_rows_walked_by_each_cluster(config):
    """Clusters that walk several rows (the prefetch buffers swap and the double-buffered
    partial sums are reused): forward and fused backward, against float64."""
    core = __import__("sys").modules["cupykern.normalize"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(12 * sms + 5, 1001, device="cuda", generator=gen)  # 3+ rows per cluster
    g = torch.randn(x.shape, device="cuda", generator=gen)
    x[7], x[8, 3] = 0, float("nan")
    assert_matches(cupykern.l2_normalize(x, config=config), torch_ref(x, "l2"), torch.float32)
    got = core.normalize_backward(x, g, 2, 1, config)
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(torch_ref(xr, "l2"), xr, g)  # zero and nan rows
    for row in (7, 8):
        assert torch.equal(got[row].isnan(), want[row].isnan()), row
        assert torch.equal(got[row].isinf(), want[row].isinf()), row
    want = _grad64(x[9:], g[9:], "l2")
    scale = float((g[9:].double() / x[9:].double().norm(2, 1, keepdim=True)).abs().max())
    torch.testing.assert_close(got[9:].double(), want, rtol=TOL[torch.float32],
                               atol=TOL[torch.float32] * scale)


@pytest.mark.parametrize("config", [(8, 256, 8, True, 16, 1), (8, 256), (8, 256, 8, True, 0),
                                    (-2, 512, 3, 4), (-3, 512, 16, 4)], ids=str)
def test_malformed_config_is_a_value_error(config):
    """A tuning config of the wrong length, or with fewer than one row per cluster, is
    refused by the forward and the fused backward alike (before any GPU work)."""
    core = __import__("sys").modules["cupykern.normalize"]
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="config: "):
        cupykern.l2_normalize(x, config=config)
    with pytest.raises(ValueError, match="config: "):
        core.normalize_backward(x, x, 2, 1, config)


def test_few_rows_kernel_is_routed():
    """Rows too long for a cluster: the pipelined few-rows kernel forward (3 rows or more,
    x of at least 128 MB; more than 16 rows from 40 MiB), the few-rows kernel forward (up
    to 16 rows, at most one an SM, of at least 32 MB; one row of at least 64 MB) and
    backward (x of 32 to 64 MB, one row too), the chunked two-pass kernels for the rest; a
    forward configuration given to the backward is refused, before any GPU work."""
    core = _core()
    assert core._route(4, 4194304, "float32", 90, 132) == (-2,)
    # 3 rows or more, x of at least 128 MB: pipelined, forward only
    assert core._route(8, 4194304, "float32", 90, 132) == (-3,)
    assert core._route(9, 4194303, "float32", 90, 132) == (-3,)
    assert core._route(32, 4194304, "float32", 90, 132) == (-3,)
    assert core._route(3, 2**23, "float64", 90, 132) == (-3,)
    assert core._route(12, 2796203, "float32", 90, 132) == (-3,)  # (rows of 11 MB)
    assert core._route(128, 262144, "float32", 90, 132) == (-3,)  # (rows of 1 MB)
    assert core._route(2, 2**24, "float32", 90, 132) == (-2,)  # (two rows)
    assert core._route(6, 4194304, "float32", 90, 132) == (-2,)  # (96 MB)
    assert core._route(7, 4194304, "float32", 90, 132) == (-2,)  # (112 MB)
    # more rows than the few-rows kernel takes: from 40 MiB
    assert core._route(64, 262144, "float32", 90, 132) == (-3,)
    assert core._route(17, 2**20, "float32", 90, 132) == (-3,)
    assert core._route(40, 262144, "float32", 90, 132) == (-3,)
    assert core._route(40, 262144 - 4, "float32", 90, 132)[0] == -1  # (just under 40 MiB)
    assert core._route(16, 2**20, "float32", 90, 132) == (-2,)  # (16 rows, 64 MB)
    assert core._route(16, 140001 * 2, "float64", 80, 132) == (-2,)
    assert core._route(17, 140001 * 2, "float64", 90, 132)[0] == -1
    assert core._route(4, 2**22, "float32", 90, 3)[0] == -1  # (more rows than SMs)
    assert core._route(8, 4194304, "float32", 90, 132, backward=True)[0] == -1  # (128 MB)
    assert core._route(4, 4194304, "float32", 90, 132, backward=True) == (-2,)  # (64 MB)
    assert core._route(1, 2**23, "float32", 90, 132, backward=True) == (-2,)  # (one row, 32 MB)
    assert core._route(2, 2**22 - 4, "float32", 90, 132, backward=True)[0] == -1
    assert core._route(17, 2**20, "float32", 90, 132, backward=True)[0] == -1
    assert core._route(1, 2**24, "float32", 90, 132) == (-2,)  # (one row of 64 MB)
    assert core._route(1, 2**24 - 4, "float32", 90, 132)[0] == -1  # (one row under 64 MB)
    assert core._route(2, 2**22 - 4, "float32", 90, 132)[0] == -1  # (under 32 MB)
    assert core._route(8, 65535, "float32", 90, 132)[0] > 0  # (a cluster holds the row)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="few-rows configurations"):
        core.normalize_backward(x, x, 2, 1, (-2,) + core.RESIDENT[4])
    with pytest.raises(ValueError, match="forward's only"):
        core.normalize_backward(x, x, 2, 1, (-3,))
    assert core.normalize_backward(x, x, 2, 1, (-2,) + core.RESIDENT_BACKWARD[4]) is None  # (CPU)


def test_pipelined_row_groups():
    """The pipelined kernel's row groups on 132 SMs (banks of 11264 vectors, float32's):
    as many groups as the SMs make of the CTAs a row needs, for the fewest rounds, then
    as few as take the rows in them; one group where a row needs more than half the SMs."""
    core = _core()
    groups = functools.partial(core._row_groups, dtype="float32", sms=132, bank=11264)
    assert groups(128, 262144) == (22, 6)  # (1 MB rows: 6 CTAs; 6 rounds)
    assert groups(16, 2**20) == (4, 33)  # (4 MB rows: at most 5 groups; 4 rounds of 4)
    assert groups(32, 2**20) == (5, 26)
    assert groups(3, 2**20) == (3, 44)  # (a group a row)
    assert groups(8, 4194304) == (1, 132)  # (16 MB rows: 94 CTAs, more than half)
    assert groups(3, 2**24) == (1, 132)  # (past what the chip holds)
    assert groups(1, 1) == (1, 132)
    assert groups(200, 4) == (100, 1)  # (a CTA a row: 2 rounds)


@settings(max_examples=400, deadline=None)
@given(nrows=st.integers(1, 5000), ncols=st.integers(1, 2**26),
       dtype=st.sampled_from(["float32", "bfloat16", "float64"]), sms=st.integers(1, 200),
       bank=st.integers(1, 4096).map(lambda b: 8 * b))
def test_pipelined_row_groups_properties(nrows, ncols, dtype, sms, bank):
    """_row_groups at any geometry: the groups fill at most the SMs; where a row needs at
    most half of them, a group's CTAs hold its rows (every chunk within a bank), in the
    fewest rounds, with no group that could be dropped without another round; else one
    group of every SM."""
    core = _core()
    groups, cpr = core._row_groups(nrows, ncols, dtype, sms, bank)
    assert 1 <= groups <= nrows and cpr == sms // groups and groups * cpr <= sms
    line = core.RESIDENT_CHUNK_VECTORS
    need = -(-(core._row_vectors(ncols, dtype) + line - 1) // bank)  # (CTAs a row needs)
    if 2 * need > sms:
        assert groups == 1
        return
    assert cpr >= need
    rounds = -(-nrows // groups)
    assert rounds == -(-nrows // min(nrows, sms // need))
    assert groups == 1 or -(-nrows // (groups - 1)) > rounds


def _grad64(x, g, kind):
    """dx of the model in float64, from autograd on the reference."""
    x64 = x.detach().to(torch.float64, copy=True).requires_grad_()
    (gx,) = torch.autograd.grad(torch_ref(x64, kind), x64, g.double())
    return gx


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 65535), (5, 1000), (1, 7), (3, 1), (2, 4096)], ids=str)
@pytest.mark.parametrize("kind", FUNCS)
def test_fused_backward_matches_float64(kind, shape, dtype):
    """The fused backward kernel (x and dy read once, dx written once) against autograd of
    the reference in float64: errors within the dtype's tolerance of max|dy/d|; zero, inf
    and nan rows as PyTorch's own ops give them (the same formula in x's dtype)."""
    core = __import__("sys").modules["cupykern.normalize"]
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    g = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    assert core.normalize_backward(x, g, 1 if kind == "l1" else 2, 1) is not None  # the kernel
    xr = x.clone().requires_grad_()
    (got,) = torch.autograd.grad(FUNCS[kind](xr), xr, g)
    want = _grad64(x, g, kind)
    tol = TOL[dtype]
    # dx's two terms are each about |dy| / d and cancel (fully for one column): their size
    # is the scale of the error
    xd = x.double()
    d = xd.abs().mean(1, keepdim=True) if kind == "l1" else xd.norm(2, 1, keepdim=True)
    scale = float((g.double() / d).abs().max())
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale)
    if shape[0] >= 5:  # special rows: zero, inf, nan
        x[1], x[2, 0], x[3, -1] = 0, float("inf"), float("nan")
        xr = x.clone().requires_grad_()
        (got,) = torch.autograd.grad(FUNCS[kind](xr), xr, g)
        (want,) = torch.autograd.grad(torch_ref(xr, kind), xr, g)
        for row in (1, 2, 3):
            assert torch.equal(got[row].isnan(), want[row].isnan()), row
            assert torch.equal(got[row].isinf(), want[row].isinf()), row
            assert torch.equal(got[row][got[row].isinf()], want[row][want[row].isinf()]), row
            fin = want[row].isfinite()
            assert torch.equal(got[row][fin], want[row][fin]) or torch.allclose(
                got[row][fin].double(), want[row][fin].double(), rtol=tol, atol=tol), row


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FUNCS)
def test_backward_layouts_outside_the_kernel_match(kind):
    """Gradients the fused kernel does not take (an expanded dy from .sum(), a transposed
    x, axis 0, a create_graph backward) are still right."""
    x = torch.randn(6, 300, device="cuda", dtype=torch.float64)
    for xx, axis in ((x, 1), (x.t(), 0), (x[:, 1:], 1)):
        xr = xx.detach().requires_grad_()
        (got,) = torch.autograd.grad(FUNCS[kind](xr, axis=axis).sum(), xr)
        (want,) = torch.autograd.grad(torch_ref(xr, kind, dim=axis).sum(), xr)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    xr = x.detach().requires_grad_()
    assert torch.autograd.gradgradcheck(FUNCS[kind], (x[:3, :20].clone().requires_grad_(),))


@pytest.mark.gpu
def test_given_config_too_small_for_the_row():
    """A forced configuration whose cluster holds fewer 16-byte vectors than a row is a
    ValueError naming it, in the forward and in the fused backward alike."""
    core = __import__("sys").modules["cupykern.normalize"]
    x = torch.randn(4, 4096, device="cuda")  # 1024 vectors; (1, 128, 4) holds 512
    small = (1, 128, 4)
    assert small in core.CONFIGS[4]
    with pytest.raises(ValueError, match=r"config: \(1, 128, 4\) holds 512 16-byte vectors"):
        cupykern.l2_normalize(x, config=small)
    with pytest.raises(ValueError, match=r"config: \(1, 128, 4\) holds 512 16-byte vectors"):
        core.normalize_backward(x, torch.randn_like(x), 2, 1, config=small)


@pytest.mark.gpu
@pytest.mark.parametrize("dy", ["expanded", "transposed", "offset"])
@pytest.mark.parametrize("kind", FUNCS)
def test_fused_backward_copies_dy_off_rows(kind, dy):
    """A dy that is no row view aligned like x (the stride-0 gradient of y.sum(), a
    transposed view, rows one element off 16 bytes) is copied and goes through the kernel,
    not the PyTorch fallback: dx as for the same dy contiguous, bit for bit, and through
    autograd as the reference model's within the tolerance."""
    core = _core()
    x = torch.randn(37, 1000, device="cuda")
    g = {"expanded": torch.ones((), device="cuda").expand(37, 1000),
         "transposed": torch.randn(1000, 37, device="cuda").t(),
         "offset": torch.randn(37 * 1000 + 1, device="cuda")[1:].view(37, 1000)}[dy]
    got = core.normalize_backward(x, g, core.P[kind], 1)
    assert got is not None
    assert torch.equal(got, core.normalize_backward(
        x, g.clone(memory_format=torch.contiguous_format), core.P[kind], 1))
    xr = x.clone().requires_grad_()
    FUNCS[kind](xr).backward(g)
    assert torch.equal(xr.grad, got)
    torch.testing.assert_close(got.double(), _grad64(x, g, kind), rtol=TOL[torch.float32],
                               atol=TOL[torch.float32] * float(g.abs().max()))


# ---------------------------------------------------------------- short rows and chunks

def _core():
    return __import__("sys").modules["cupykern.normalize"]


def _check_forward_backward(x, g, kind, dtype, config, what):
    """Forward and fused backward under ``config`` on contiguous x and g: against PyTorch
    (forward) and float64 autograd (backward), and bit-identical on a second run."""
    core = _core()
    y = FUNCS[kind](x, config=config)
    assert_matches(y, torch_ref(x, kind), dtype)
    assert torch.equal(FUNCS[kind](x, config=config), y), what  # deterministic
    dx = core.normalize_backward(x, g, core.P[kind], 1, config)
    assert dx is not None, what
    want = _grad64(x, g, kind)
    xd = x.double()
    d = xd.abs().mean(1, keepdim=True) if kind == "l1" else xd.norm(2, 1, keepdim=True)
    scale = float((g.double() / d).abs().max())
    tol = TOL[dtype]
    torch.testing.assert_close(dx.double(), want, rtol=tol, atol=tol * scale, msg=what)
    assert torch.equal(core.normalize_backward(x, g, core.P[kind], 1, config), dx), what


def _check_offset_rows(x, kind, dtype, config, what):
    """The forward on rows one element past a 16-byte boundary, written straight into an
    ``out`` laid out alike (head and tail scalars in every row)."""
    base = torch.empty(x.shape[0], x.shape[1] + 3, dtype=dtype, device="cuda")
    xo, out = base.clone()[:, 1:1 + x.shape[1]], base[:, 1:1 + x.shape[1]]
    xo.copy_(x)
    assert FUNCS[kind](xo, out=out, config=config) is out
    assert_matches(out, torch_ref(x, kind), dtype)


def _short_configs():
    core = _core()
    return [(dt, (0,) + c) for dt in (torch.float32, torch.bfloat16)
            for c in core._short_table(dt.itemsize)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,config", _short_configs(), ids=str)
def test_short_row_kernel_edges(config, dtype):
    """Every short-row configuration at its edge lengths (1, 2, 31, 32, 33 where they fit,
    lane and vector boundaries, its full capacity), on contiguous and offset rows (head
    and tail scalars), with a row count that leaves the last step part empty."""
    _, g, units, rows, vec = config
    n = 16 // dtype.itemsize if vec else 1
    cap = g * units * n  # elements a group holds (vector units: plus < 2 vectors of scalars)
    lens = {1, 2, 31, 32, 33, g * n, g * n + 1, cap - 1, cap, cap + n - 1}
    lens = sorted(c for c in lens if c >= 1 and (c // n if vec else c) <= g * units)
    nrows = (256 // g) * rows * 2 + 3
    gen = torch.Generator(device="cuda").manual_seed(7)
    for ncols in lens:
        x = torch.randn(nrows, ncols, device="cuda", generator=gen).to(dtype)
        gy = torch.randn(nrows, ncols, device="cuda", generator=gen).to(dtype)
        for kind in FUNCS:
            _check_forward_backward(x, gy, kind, dtype, config, f"{kind} ncols {ncols}")
            _check_offset_rows(x, kind, dtype, config, f"{kind} ncols {ncols} offset")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_rows_edges(dtype):
    """The chunked two-pass kernels: chunks of a few vectors (a row over many chunks, its
    last chunk partial), rows starting off 16-byte boundaries (head and tail scalars in
    chunk 0), rows shorter than one vector, and the dispatcher's own chunk size."""
    core = _core()
    gen = torch.Generator(device="cuda").manual_seed(11)
    n = 16 // dtype.itemsize
    for ncols, vc in ((1, 1), (7, 1), (33, 2), (1001, 3), (4096 + 5, 64), (80000, None)):
        x = torch.randn(5, ncols, device="cuda", generator=gen).to(dtype)
        gy = torch.randn(5, ncols, device="cuda", generator=gen).to(dtype)
        vc = vc or core._chunk_vectors(5, ncols, str(dtype)[6:], 132)
        assert vc * 2 < ncols // n or ncols < 64
        for kind in FUNCS:
            _check_forward_backward(x, gy, kind, dtype, (-1, vc), f"{kind} ncols {ncols}")
            _check_offset_rows(x, kind, dtype, (-1, vc), f"{kind} ncols {ncols} offset")


def _few_rows_shapes(dtype):
    """(nrows, ncols) for the few-rows kernel on 132 SMs: chunks within a thread's registers,
    into shared memory, past what the chip holds (the rest re-read); one row an SM."""
    n = 16 // dtype.itemsize
    return [(1, 1), (1, 7), (2, 33), (5, 1001), (1, 2**18 * n + 3), (132, 1024 * n + 5),
            (3, 2**20 * n + 5), (1, 2**22 * n + 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_few_rows_kernel_edges(dtype):
    """The few-rows kernels (one cooperative launch, each chunk's front kept on chip: rows
    side by side (-2), or one after another in row groups over every SM (-3)) and their
    tuning configurations, against PyTorch: rows from one element to 2**22 vectors, more
    rows than SMs (-3), row groups walking uneven row counts (-3), on contiguous rows, rows
    off 16-byte boundaries (head and tail scalars) and in place; bit-identical on a second
    run."""
    core = _core()
    gen = torch.Generator(device="cuda").manual_seed(17)
    configs = [(-2,), (-3,)] + [(-2,) + c for c in core.RESIDENT_TUNING]
    n = 16 // dtype.itemsize
    # (50 rows of 1 MB, (-3): float32 17 row groups of 7 CTAs, one walking a row fewer)
    for shape in _few_rows_shapes(dtype) + [(140, 4096 * n + 3), (50, 2**16 * n + 3)]:
        x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        x[0, -1] = 1  # (a row of one element, not zero: bit-identical compares no nan)
        for kind in FUNCS:
            what = f"{kind} {shape}"
            want = torch_ref(x, kind)
            for cfg in configs if shape[1] < 2**20 else configs[:2]:
                if shape[0] > 132 and cfg[0] == -2:
                    continue  # (at most a row an SM: refused below)
                y = FUNCS[kind](x, config=cfg)
                assert_matches(y, want, dtype)
                assert torch.equal(FUNCS[kind](x, config=cfg), y), f"{what} {cfg}"
            for cfg in ((-2,), (-3,)) if shape[0] <= 132 else ((-3,),):
                _check_offset_rows(x, kind, dtype, cfg, f"{what} offset {cfg}")
                y, xi = FUNCS[kind](x, config=cfg), x.clone()
                assert FUNCS[kind](xi, out=xi, config=cfg) is xi
                assert torch.equal(xi, y), f"{what} in place {cfg}"
        del x, xi, y, want
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match="at most"):
        cupykern.l2_normalize(torch.ones(sms + 1, 64, device="cuda", dtype=dtype), config=(-2,))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_few_rows_backward_kernel_edges(dtype):
    """The few-rows kernel's backward (x and dy held on chip) against autograd of the
    reference in float64, at the few-rows shapes: rows from one element to past what the
    chip holds, of odd lengths (rows after the first start off 16 bytes: head and tail
    scalars); bit-identical on a second run; zero, inf and nan rows as PyTorch gives them;
    and through autograd where the dispatcher routes it."""
    core = _core()
    gen = torch.Generator(device="cuda").manual_seed(29)
    tol = TOL[dtype]

    def check(x, g, kind, what):
        dx = core.normalize_backward(x, g, core.P[kind], 1, (-2,))
        want = _grad64(x, g, kind)
        xd = x.double()
        d = xd.abs().mean(1, keepdim=True) if kind == "l1" else xd.norm(2, 1, keepdim=True)
        scale = float((g.double() / d).abs().max())
        torch.testing.assert_close(dx.double(), want, rtol=tol, atol=tol * scale, msg=what)
        assert torch.equal(core.normalize_backward(x, g, core.P[kind], 1, (-2,)), dx), what

    for shape in _few_rows_shapes(dtype):
        x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        g = torch.randn(shape, device="cuda", generator=gen).to(dtype)
        x[0, -1] = 1
        for kind in FUNCS:
            check(x, g, kind, f"{kind} {shape}")
        del x, g
    x = torch.randn(5, 1001, device="cuda", generator=gen).to(dtype)
    g = torch.randn(5, 1001, device="cuda", generator=gen).to(dtype)
    x[1], x[2, 0], x[3, -1] = 0, float("inf"), float("nan")
    for kind in FUNCS:
        got = core.normalize_backward(x, g, core.P[kind], 1, (-2,))
        xr = x.clone().requires_grad_()
        (want,) = torch.autograd.grad(torch_ref(xr, kind), xr, g)
        for row in (1, 2, 3):
            assert torch.equal(got[row].isnan(), want[row].isnan()), (kind, row)
            assert torch.equal(got[row].isinf(), want[row].isinf()), (kind, row)
    shape = (2, 2**24 // dtype.itemsize + 5)  # (32 MB of x: routed to it)
    assert core._route(*shape, str(dtype).removeprefix("torch."), 90, 132, backward=True) == (-2,)
    x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    g = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    for kind in FUNCS:
        xr = x.clone().requires_grad_()
        (got,) = torch.autograd.grad(FUNCS[kind](xr), xr, g)
        assert torch.equal(got, core.normalize_backward(x, g, core.P[kind], 1, (-2,))), kind


@pytest.mark.gpu
def test_few_rows_kernel_in_a_cuda_graph_and_on_two_streams():
    """The few-rows kernel's cooperative launch, its zeroed counters and its workspace
    captured in a CUDA graph and replayed on new values; and calls on two streams at once
    (each launch's CTAs all resident: no hang), each result as on one stream."""
    gen = torch.Generator(device="cuda").manual_seed(19)
    x = torch.randn(3, 2**22 + 3, device="cuda", generator=gen)
    assert _core()._route(3, 2**22 + 3, "float32", 90, 132) == (-2,)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cupykern.l2_normalize(x)  # (warm: plans and compiles outside the capture)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cupykern.l2_normalize(x)
    for _ in range(2):
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        assert_matches(y, torch_ref(x, "l2"), torch.float32)
    xs = [torch.randn(5, 2**21 + 1, device="cuda", generator=gen) for _ in range(2)]
    want = [cupykern.l1_normalize(v) for v in xs]
    streams = [torch.cuda.Stream() for _ in xs]
    got = [[] for _ in xs]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(4):
        for v, s, out in zip(xs, streams, got):
            with torch.cuda.stream(s):
                out.append(cupykern.l1_normalize(v))
    torch.cuda.synchronize()
    for w, outs in zip(want, got):
        assert all(torch.equal(o, w) for o in outs)


@pytest.mark.gpu
def test_few_rows_kernel_falls_back_where_its_grid_cannot_be_resident(monkeypatch):
    """Where the driver refuses the cooperative grid (too few SMs are the process's: an MPS
    client's share, a green context), the call runs the two-pass kernels instead: their
    very results, and later calls of that plan go to them without trying again."""
    import cupy
    from cupykern import _array
    core = _core()
    api = _array._api()
    refused = []

    def refuse(*args):
        refused.append(args)
        raise cupy.cuda.driver.CUDADriverError(core._COOPERATIVE_LAUNCH_TOO_LARGE)

    x = torch.randn(2, 2**22 + 5, device="cuda", generator=torch.Generator(device="cuda").manual_seed(23))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    two_pass = (-1, core._chunk_vectors(2, x.shape[1], "float32", sms))
    assert core._route(2, x.shape[1], "float32", 90, sms) == (-2,)
    monkeypatch.setattr(_array, "_API", api[:5] + (refuse,))
    for kind in FUNCS:
        want = FUNCS[kind](x, config=two_pass)
        for _ in range(2):
            assert torch.equal(FUNCS[kind](x), want), kind
    assert len(refused) == len(FUNCS)  # (one refusal a plan)


ROUTED = [(4096, 7), (2049, 5), (1000, 33), (513, 64), (300, 255), (100, 300), (64, 1024),
          (40, 1025), (3, 100000), (2, 140001), (1, 2**20 + 3), (2, 65535)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROUTED, ids=str)
def test_dispatched_shapes_forward_backward(shape, dtype):
    """Shapes that the dispatcher sends to each family (short scalar and vector, cluster,
    chunked for few long rows), through the public functions and autograd."""
    gen = torch.Generator(device="cuda").manual_seed(13)
    x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    g = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    x[0, 0] = 0  # (a zero somewhere: nothing special)
    for kind in FUNCS:
        _check_forward_backward(x, g, kind, dtype, None, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FUNCS)
@pytest.mark.parametrize("ncols", [1, 7, 33, 300, 140001], ids=str)
def test_special_rows_in_every_family(kind, ncols):
    """Zero, inf, nan and overflowing rows as PyTorch gives them, forward and backward, in
    the short-row (1, 7, 33, 300) and chunked (140001: also the few-rows) kernels."""
    torch.manual_seed(0)
    x = torch.rand(6, ncols, device="cuda")
    g = torch.randn(6, ncols, device="cuda")
    # Known limitation (README): L1's fused backward forms g * x, which overflows to nan
    # on a row near float32's maximum where |g| > ~1.13, while PyTorch's (x / d) / d gives
    # a finite value; the overflowing row's gradient is checked for |g| <= 1.
    g[4].clamp_(-1, 1)
    x[0] = 0
    x[1, ncols // 2] = float("inf")
    x[2, 0] = float("nan")
    x[3, 0], x[3, -1] = float("inf"), float("-inf")
    x[4] = 3e38
    x[5] = 1e-30
    assert_matches(FUNCS[kind](x), torch_ref(x, kind), torch.float32)
    if ncols == 140001:  # (and the few-rows kernel's forward)
        assert_matches(FUNCS[kind](x, config=(-2,)), torch_ref(x, kind), torch.float32)
    xr = x.clone().requires_grad_()
    (got,) = torch.autograd.grad(FUNCS[kind](xr), xr, g)
    (want,) = torch.autograd.grad(torch_ref(xr, kind), xr, g)
    # (row 5 for L1, whose d^2 n, flushed to zero, once made it inf; L2's norm there is 0
    # in both, where PyTorch's nan and our inf are both a division by it)
    for row in range(6 if kind == "l1" else 5):
        assert torch.equal(got[row].isnan(), want[row].isnan()), row
        assert torch.equal(got[row].isinf(), want[row].isinf()), row
    for row in (4, 5):  # the finite values, each row at its own scale (-ftz: a floor):
        # its largest gradient or |g| / d, the size of the terms that cancel (L1 over one
        # column: a true gradient of 0, both formulas' rounding of g / d - g / d)
        both = got[row].isfinite() & want[row].isfinite()
        d = x[row].abs().mean() if kind == "l1" else x[row].norm()
        scale = max(float(want[row][both].abs().max()) if both.any() else 0.0,
                    float((g[row] / d).abs().max()))
        atol = TOL[torch.float32] * scale + torch.finfo(torch.float32).smallest_normal
        torch.testing.assert_close(got[row][both], want[row][both], rtol=TOL[torch.float32],
                                   atol=atol, msg=f"row {row}")


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, "scalar", (0, 8, 1, 4, True), (0, 32, 8, 1, True),
                                    (1, 128, 4), (-1, 3), (-2,)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nothing_written_outside_the_view(config, dtype):
    """x and out inside nan-filled buffers (rows of a wider array, one element past a
    16-byte boundary): x untouched, out written only inside its view, in every family
    ("scalar": the short-row kernel's first single-element configuration)."""
    from support import Layout, guarded

    if config == "scalar":
        config = (0,) + _core().SHORT_SCALAR[dtype.itemsize][0] + (False,)
    ncols = {None: 37, (0, 8, 1, 4, True): 30, (0, 32, 8, 1, True): 1000, (1, 128, 4): 1500,
             (-1, 3): 1001, (-2,): 1001}.get(config, 7)
    shape = (70, ncols)
    lay = Layout.make(shape, pads=(0, 5), misalign=1)
    vals = torch.randn(shape, dtype=torch.float64).to(dtype)
    for kind in FUNCS:
        x = guarded(vals, lay, "torch")
        out = guarded(torch.zeros(shape, dtype=dtype), lay, "torch")
        assert FUNCS[kind](x.view, out=out.view, config=config) is out.view
        x.check_unchanged("x")
        out.check_outside_unchanged("out")
        assert_matches(out.view, torch_ref(x.view, kind), dtype)
