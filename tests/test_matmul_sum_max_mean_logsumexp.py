"""matmul_sum_max_mean_logsumexp, MatmulSumPlan and the MatmulSumMaxMeanLogSumExp module
against the documented PyTorch model (nan/inf, odd shapes, stale caches, autograd)."""
import copy

import numpy as np
import pytest
import torch

import cupykern
from cupykern.models import matmul_sum_max_mean_logsumexp as model4
from cupykern.torch import MatmulSumMaxMeanLogSumExp
from cupykern.torch import matmul_sum_max_mean_logsumexp as tmr
from support import assert_grad_close, m4_torch as chain  # the model, written out from MODELS.md

# allclose tolerance (atol = rtol) against the same-dtype PyTorch model. PyTorch rounds
# each of the N Linear outputs to bfloat16 (half-ulp 2**-9 relative) before summing, so
# its own error grows like sqrt(N) * 2**-9 * |z|: 5e-2 keeps these shapes clear of it.
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
gpu = pytest.mark.gpu


def assert_same(got, want, tol):
    """Same shape and dtype, the same nan/+inf/-inf positions, finite values allclose."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.cpu().double(), want.cpu().double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    assert torch.equal(torch.isposinf(got), torch.isposinf(want)), (got, want)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), (got, want)
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], atol=tol, rtol=tol)


def rand(*shape, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def specials(device="cpu", dtype=torch.float32):
    """x, W, b (B=6, K=4, N=3) with inf/nan in some rows of x and the cancellation traps."""
    inf, nan = float("inf"), float("nan")
    x = rand(6, 4, dtype=torch.float64)
    x[1, 0] = inf            # W[:, 0] sums to 0.501 (identity: inf) but torch sums +-inf: nan
    x[2, 2] = nan
    x[3, 1] = -inf
    x[4, 3] = 3e38           # finite, but z overflows float32 with opposite signs: nan
    w = rand(3, 4, dtype=torch.float64, seed=1)
    w[:, 0] = torch.tensor([1.0, -0.999, 0.5])
    w[:, 3] = torch.tensor([2.0, -2.0, 0.5])
    b = rand(3, dtype=torch.float64, seed=2)
    return x.to(dtype).to(device), w.to(dtype).to(device), b.to(dtype).to(device)


# ------------------------------------------------------------------- CPU (no GPU needed)

@pytest.mark.parametrize("shape", [(5, 7, 3), (1, 1, 1), (0, 4, 3), (3, 0, 2), (3, 4, 0), (64, 300, 33)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_numpy_path_matches_torch(shape, with_bias):
    bsz, k, n = shape
    x, w, b = rand(bsz, k), rand(n, k, seed=1), rand(n, seed=2) if with_bias else None
    got = cupykern.matmul_sum_max_mean_logsumexp(x.numpy(), w.numpy(), None if b is None else b.numpy())
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (bsz, 1)
    assert_same(torch.from_numpy(got), chain(x, w, b), 1e-4)
    want64 = chain(x.double(), w.double(), None if b is None else b.double())
    assert_same(torch.from_numpy(got).double(), want64, 1e-5)


def test_numpy_float16_rounds_like_torch():
    """Small integers, so that every product and sum is exact in float32: the NumPy path's
    float16 result is PyTorch's bit for bit. PyTorch's Linear stores each output in
    float16 (odd integers past 2048 round to even) before the sum; summing the unrounded
    outputs changes some of these rows."""
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randint(0, 11, shape, generator=g).half() for shape in ((256, 100), (4, 100)))
    b = torch.randint(-3, 4, (4,), generator=g).half()
    got = cupykern.matmul_sum_max_mean_logsumexp(x.numpy(), w.numpy(), b.numpy())
    want = chain(x, w, b).numpy()
    assert got.dtype == np.float16 and np.isfinite(want).all()
    np.testing.assert_array_equal(got.view(np.int16), want.view(np.int16))


def test_numpy_path_nan_inf_like_torch():
    x, w, b = specials()
    got = cupykern.matmul_sum_max_mean_logsumexp(x.numpy(), w.numpy(), b.numpy())
    assert_same(torch.from_numpy(got), chain(x, w, b), 1e-4)
    for wb in ((w.clone().index_put_((torch.tensor([0]), torch.tensor([1])), torch.tensor(float("inf"))), b),
               (w, torch.tensor([1.0, float("nan"), 0.0]))):
        got = cupykern.matmul_sum_max_mean_logsumexp(x.numpy(), wb[0].numpy(), wb[1].numpy())
        assert_same(torch.from_numpy(got), chain(x, *wb), 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_cpu_grads_of_nan_inf_rows_like_torch(dtype):
    """The op's backward on torch CPU tensors against autograd of the model: rows whose
    output is +-inf or nan pass nan to every gradient they reach, as PyTorch's tail
    (max, mean, logsumexp) does; finite rows' gradients match."""
    x, w, b = (t.requires_grad_() for t in specials(dtype=dtype))
    g = rand(6, 1, dtype=dtype, seed=3)
    got = cupykern.matmul_sum_max_mean_logsumexp(x, w, b)
    want = chain(x, w, b)
    assert_same(got.detach(), want.detach(), 0)
    assert not torch.isfinite(want).all()
    for a, b_ in zip(torch.autograd.grad((got * g).sum(), (x, w, b)),
                     torch.autograd.grad((want * g).sum(), (x, w, b))):
        assert_same(a, b_, 1e-12 if dtype == torch.float64 else 1e-5)


def test_dot_overflows_before_the_bias_like_torch():
    # torch rounds x . W[j] to float32 (inf here) before adding bias[j]
    x, w, b = torch.tensor([[3e38, 1.0]]), torch.tensor([[2.0, 0.0], [1.0, 1.0]]), torch.tensor([-3e38, 0.0])
    assert torch.isposinf(chain(x, w, b)).all()
    got = cupykern.matmul_sum_max_mean_logsumexp(x.numpy(), w.numpy(), b.numpy())
    assert_same(torch.from_numpy(got), chain(x, w, b), 0)
    if torch.cuda.is_available():
        got = cupykern.matmul_sum_max_mean_logsumexp(x.cuda(), w.cuda(), b.cuda())
        assert_same(got, chain(x.cuda(), w.cuda(), b.cuda()), 0)


@pytest.mark.gpu
def test_weight_sums_of_rows_near_float32_maximum():
    """W's column sums (the plan) over rows near float32's maximum, whose float32 partial
    sums of a few rows overflow where every z = x . W[j] is far from it: the chain's
    finite result (the kernel once summed 8 rows in float32 first: inf)."""
    x, w = torch.zeros(2, 4), torch.zeros(64, 4)
    x[:, 0] = torch.tensor([1e-30, -2e-30])
    w[0, 0] = w[32, 0] = 2e38
    w[1:32, 1] = 1.0
    want = chain(x, w, None)
    assert torch.isfinite(want).all()
    got = cupykern.matmul_sum_max_mean_logsumexp(x.cuda(), w.cuda())
    assert_same(got.cpu(), want, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_cpu_tensors_and_plan(dtype, with_bias):
    x, w = rand(4, 6, dtype=dtype), rand(5, 6, dtype=dtype, seed=1)
    b = rand(5, dtype=dtype, seed=2) if with_bias else None
    plan = cupykern.prepare_matmul_sum(w, b)
    got = cupykern.matmul_sum_max_mean_logsumexp(x, w, b, plan=plan)
    assert isinstance(got, torch.Tensor) and got.dtype == dtype
    # against float64 (not the package's own expression, which is the CPU path)
    want = chain(x.double(), w.double(), None if b is None else b.double()).to(dtype)
    assert_same(got, want, TOL[dtype])
    assert_same(plan(x), got, 0)
    with pytest.raises(ValueError, match="plan: was prepared from other weight"):
        cupykern.matmul_sum_max_mean_logsumexp(x, w.clone(), b, plan=plan)


def test_module_cpu_matches_model_and_state_dict():
    torch.manual_seed(3)
    ref = model4.Model(10, 5)
    torch.manual_seed(3)
    new = model4.ModelNew(10, 5)
    assert list(new.state_dict()) == ["linear.weight", "linear.bias"]
    for (ka, va), (kb, vb) in zip(ref.state_dict().items(), new.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    x = torch.randn(128, 10)
    assert_same(new(x), ref(x), 1e-6)
    # checkpoints load both ways
    other = MatmulSumMaxMeanLogSumExp(10, 5)
    other.load_state_dict(ref.state_dict())
    ref2 = model4.Model(10, 5)
    ref2.load_state_dict(new.state_dict())
    assert_same(other(x), ref2(x), 0)
    assert copy.deepcopy(new).plan() is not new.plan()  # copies do not carry the cached plan
    assert model4.get_init_inputs() == [8192, 8192] and len(model4.CASES) >= 2


def _plan_rebuilt(module, change):
    """Whether the module's plan (its public ``plan()``) is rebuilt after ``change``."""
    before = module.plan()
    change(module)
    return module.plan() is not before


def _sgd_step(m):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(4, 8)).sum().backward()
    opt.step()


def _adam_step(m):
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(4, 8)).sum().backward()
    opt.step()


def _no_grad(fn):
    def run(m):
        with torch.no_grad():
            fn(m)
    return run


STALE = {
    "sgd_step": _sgd_step,
    "adam_step": _adam_step,
    "load_state_dict": lambda m: m.load_state_dict(MatmulSumMaxMeanLogSumExp(8, 3).state_dict()),
    "load_state_dict_assign": lambda m: m.load_state_dict(MatmulSumMaxMeanLogSumExp(8, 3).state_dict(),
                                                          assign=True),
    "weight_copy_": _no_grad(lambda m: m.linear.weight.copy_(torch.randn(3, 8))),
    "weight_mul_": _no_grad(lambda m: m.linear.weight.mul_(2)),
    "bias_mul_": _no_grad(lambda m: m.linear.bias.mul_(2)),
    "row_view_add_": _no_grad(lambda m: m.linear.weight[1].add_(1)),
    "to_float64": lambda m: m.to(torch.float64),
    "replace_weight": lambda m: setattr(m.linear, "weight", torch.nn.Parameter(torch.randn(3, 8))),
    "replace_bias_none": lambda m: setattr(m.linear, "bias", None),
    "data_assign": _no_grad(lambda m: setattr(m.linear.weight, "data", torch.randn(3, 8))),
}


@pytest.mark.parametrize("name", STALE)
def test_plan_is_rebuilt_after_every_weight_change(name):
    assert _plan_rebuilt(MatmulSumMaxMeanLogSumExp(8, 3), STALE[name])


def test_plan_is_reused_until_the_weights_change():
    m = MatmulSumMaxMeanLogSumExp(8, 3)
    p = m.plan()
    m(torch.randn(2, 8))
    assert m.plan() is p
    with torch.no_grad():
        m.linear.weight.mul_(1.0)
    assert m.plan() is not p


def test_plan_is_rebuilt_after_an_optimizer_step_past_the_version_counter():
    """An optimizer whose step writes .data (no version bump, as fused optimizers): the
    next plan is the new weights' (every optimizer step invalidates cached plans)."""
    class DataStep(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(1.0)

    m = MatmulSumMaxMeanLogSumExp(6, 4).double()
    m.plan()
    DataStep(m.parameters()).step()
    w, b = m.linear.weight.detach(), m.linear.bias.detach()
    torch.testing.assert_close(m.plan()[:6], w.sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.plan()[6], b.sum(), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------- bad input

def test_bad_input_errors():
    x, w, b = np.ones((4, 3), np.float32), np.ones((2, 3), np.float32), np.ones(2, np.float32)
    f = cupykern.matmul_sum_max_mean_logsumexp
    with pytest.raises(ValueError, match=r"x: has 4 features .* in_features = 3"):
        f(np.ones((4, 4), np.float32), w, b)
    assert f(np.ones((2, 4, 3), np.float32), w, b).shape == (2, 1, 2)  # N-D, as nn.Linear
    with pytest.raises(ValueError, match=r"x: has 4 features \(x.shape\[-1\]\)"):
        f(np.ones((2, 4, 4), np.float32), w, b)
    with pytest.raises(ValueError, match=r"x: expected a 2-D array .* or more dimensions"):
        f(np.ones(3, np.float32), w, b)
    with pytest.raises(ValueError, match="weight: expected a 2-D array"):
        f(x, np.ones(3, np.float32), b)
    with pytest.raises(ValueError, match=r"bias: expected shape \(2,\)"):
        f(x, w, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="weight: dtype float64 does not match x's dtype float32"):
        f(x, w.astype(np.float64), None)
    with pytest.raises(TypeError, match="bias: dtype float16 does not match weight's dtype float32"):
        f(x, w, b.astype(np.float16))
    with pytest.raises(TypeError, match="x: unsupported dtype int64"):
        f(x.astype(np.int64), w, b)
    with pytest.raises(TypeError, match="weight: expected a cupy.ndarray"):
        f(x, w.tolist(), b)
    with pytest.raises(TypeError, match="weight: is a torch CPU tensor but x is a NumPy array"):
        f(x, torch.from_numpy(w), None)


# ------------------------------------------------------------------------------------- GPU

def cuda_pair(k, n, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    ref = model4.Model(k, n).to("cuda", dtype)
    torch.manual_seed(seed)
    new = model4.ModelNew(k, n).to("cuda", dtype)
    return ref, new


@gpu
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(1024, 8192, 8192), (37, 1000, 130), (1, 1, 1), (3, 5, 2), (0, 8, 4),
                                   (1029, 64, 1), (5, 3, 4000)])
def test_module_matches_model(dtype, shape):
    bsz, k, n = shape
    # PyTorch rounds each of the N outputs to 16 bits before summing, so at large N its
    # own error exceeds the 16-bit tolerance: there, compare with the float64 chain only.
    vs_torch = dtype in (torch.float32, torch.float64) or (bsz * k * n <= 2**26 and n <= 1000)
    ref, new = cuda_pair(k, n, dtype)
    with torch.no_grad():
        for seed in range(3):
            x = torch.rand(bsz, k, device="cuda").to(dtype)
            if vs_torch:
                assert_same(new(x), ref(x), TOL[dtype])
            # against the exact (float64) chain: within rounding of the output (float32:
            # W.sum(0) adds 8 rows at a time in float32, ~1e-7 relative)
            want64 = chain(x.double(), ref.linear.weight.double(), ref.linear.bias.double())
            tol64 = {torch.float32: 2e-5, torch.float64: 1e-10}.get(dtype, 1e-2)
            assert_same(new(x).double(), want64.to(dtype).double(), tol64)


@gpu
def test_float32_accuracy_at_k65536():
    ref, new = cuda_pair(65536, 256)
    with torch.no_grad():
        x = torch.rand(64, 65536, device="cuda")
        assert_same(new(x), ref(x), 1e-4)
        want = chain(x.double(), ref.linear.weight.double(), ref.linear.bias.double())
        assert_same(new(x).double(), want, 1e-5)


@gpu
@pytest.mark.parametrize("dtype", list(TOL))
def test_nan_inf_like_torch(dtype):
    x, w, b = specials("cuda", torch.float64)
    if dtype == torch.float16:
        x[4, 3] = 6e4  # z = +-1.2e5 overflows float16 with opposite signs: nan
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    f = cupykern.matmul_sum_max_mean_logsumexp
    assert_same(f(x, w, b), chain(x, w, b), TOL[dtype])
    assert_same(f(x, w, None), chain(x, w, None), TOL[dtype])
    for i, j, v in ((0, 1, float("inf")), (2, 0, float("nan")), (1, 2, float("-inf"))):
        w2 = w.clone()
        w2[i, j] = v
        assert_same(f(x, w2, b), chain(x, w2, b), TOL[dtype])
    for v in (float("inf"), float("nan")):
        b2 = b.clone()
        b2[1] = v
        assert_same(f(x, w, b2), chain(x, w, b2), TOL[dtype])


@gpu
def test_cupy_inputs_odd_layouts_and_streams():
    import cupy

    rng = cupy.random.default_rng(0)
    big = rng.standard_normal((40, 103), dtype=cupy.float32)
    x = big[:, 1:101]                     # row stride 103, not 16-byte aligned
    w = rng.standard_normal((100, 70), dtype=cupy.float32).T  # non-contiguous weight
    b = rng.standard_normal(70, dtype=cupy.float32)
    want = chain(torch.from_dlpack(cupy.ascontiguousarray(x)), torch.from_dlpack(cupy.ascontiguousarray(w)),
                 torch.from_dlpack(b))
    with cupy.cuda.Stream():
        got = cupykern.matmul_sum_max_mean_logsumexp(x, w, b)
        assert isinstance(got, cupy.ndarray) and got.shape == (40, 1) and got.dtype == cupy.float32
        assert_same(torch.from_dlpack(got), want, 1e-4)
        plan = cupykern.prepare_matmul_sum(w, b)
        got = cupykern.matmul_sum_max_mean_logsumexp(x, w, b, plan=plan)
        assert_same(torch.from_dlpack(got), want, 1e-4)
    xt = torch.from_dlpack(cupy.ascontiguousarray(x)).t().contiguous().t()  # column-major x
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        got = cupykern.matmul_sum_max_mean_logsumexp(xt, torch.from_dlpack(cupy.ascontiguousarray(w)),
                                                     torch.from_dlpack(b))
    s.synchronize()
    assert_same(got, want, 1e-4)


@gpu
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("n, k, offset", [
    (8192, 8192, 0),   # 128-byte column tiles, two row chunks per tile
    (4000, 3, 0),      # one tile of unaligned rows: many row chunks, added by the last block
    (70001, 5, 1),     # offset rows; the chunk sum takes more than one batch of 8
    (3, 1001, 0),      # a partial last tile, one chunk
    (0, 7, 0), (5, 0, 0), (1, 1, 0)])
def test_plan_matches_float64(dtype, n, k, offset):
    """The plan [W.sum(0), b.sum(), max|W|, max|b|] of one matmul_sum_plan launch against
    float64 sums (W.sum(0) adds 8 rows at a time in the accumulation type: rounding of
    that type on 8 values), max|.| exact; repeated builds bitwise equal."""
    g = torch.Generator(device="cuda").manual_seed(0)
    store = torch.randn(n * k + offset, generator=g, device="cuda", dtype=torch.float64)
    w = store[offset:].view(n, k).to(dtype)
    b = torch.randn(n, generator=g, device="cuda", dtype=torch.float64).to(dtype)
    plan = tmr.plan_op(w, b)
    wd, bd = w.double(), b.double()
    want = torch.cat([wd.sum(0), bd.sum().reshape(1), wd.abs().amax().reshape(1) if w.numel()
                      else wd.new_zeros(1), bd.abs().amax().reshape(1) if n else bd.new_zeros(1)])
    # float32 accumulation: 8 roundings of 8 values; float64: a few hundred additions
    rel = 512 * 2**-52 if dtype == torch.float64 else 8 * 2**-23
    assert (plan[:k] - want[:k]).abs().le(rel * wd.abs().sum(0)).all()
    torch.testing.assert_close(plan[k], want[k], atol=1e-12 * max(bd.abs().sum().item(), 1),
                               rtol=1e-12)
    assert torch.equal(plan[k + 1:], want[k + 1:])
    assert torch.equal(tmr.plan_op(w, b), plan)
    if w.numel():
        for v in (float("inf"), float("nan")):
            w2 = w.clone()
            w2[n // 2, k // 2] = v
            got = tmr.plan_op(w2, b)[k + 1].item()
            assert got == float("inf") if v == float("inf") else got != got


@gpu
def test_deterministic():
    ref, new = cuda_pair(4096, 2048)
    x = torch.rand(333, 4096, device="cuda")
    with torch.no_grad():
        a = new(x)
        p1 = cupykern.MatmulSumPlan(new.linear.weight.detach(), new.linear.bias.detach())
        p2 = cupykern.MatmulSumPlan(new.linear.weight.detach(), new.linear.bias.detach())
        assert torch.equal(p1.data, p2.data)
        for _ in range(3):
            assert torch.equal(new(x), a)
            assert torch.equal(p1(x), a)


@gpu
@pytest.mark.parametrize("name", [n for n in STALE if "step" not in n])
def test_stale_cache_gpu(name):
    ref, new = cuda_pair(8, 3)
    x = torch.randn(16, 8, device="cuda")
    with torch.no_grad():
        new(x)  # builds and caches the plan
        assert new.plan() is new.plan()
    STALE[name](new)
    for p in new.parameters():  # replacements above are created on the CPU
        if not p.is_cuda:
            p.data = p.data.cuda()
    with torch.no_grad():
        xx = x.to(new.linear.weight.dtype)
        want = tmr.reference(xx, new.linear.weight, new.linear.bias)
        assert_same(new(xx), want, 1e-5)


@gpu
@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_stale_cache_optimizer_step(opt):
    ref, new = cuda_pair(64, 32)
    kw = {"fused": True} if opt is torch.optim.AdamW else {}
    o_ref, o_new = opt(ref.parameters(), lr=0.05, **kw), opt(new.parameters(), lr=0.05, **kw)
    for step in range(3):
        x = torch.rand(8, 64, device="cuda")
        for m, o in ((ref, o_ref), (new, o_new)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
        with torch.no_grad():
            assert_same(new(x), ref(x), 1e-4)


@gpu
def test_stale_cache_device_and_dtype_moves():
    ref, new = cuda_pair(32, 16)
    x = torch.rand(8, 32, device="cuda")
    with torch.no_grad():
        new(x)
        new.cpu()
        assert_same(new(x.cpu()), ref.cpu()(x.cpu()), 1e-6)
        new.cuda()
        ref.cuda()
        new.linear.weight.mul_(3)
        ref.linear.weight.mul_(3)
        assert_same(new(x), ref(x), 1e-4)
        new.half()
        ref.half()
        assert_same(new(x.half()), ref(x.half()), 1e-2)
        if torch.cuda.device_count() > 1:
            new.to("cuda:1")
            ref.to("cuda:1")
            assert_same(new(x.to("cuda:1").half()), ref(x.to("cuda:1").half()), 1e-2)


@gpu
def test_gradcheck_float64():
    x = torch.randn(5, 7, device="cuda", dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 7, device="cuda", dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(tmr.matmul_sum_max_mean_logsumexp, (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: tmr.matmul_sum_max_mean_logsumexp(x, w), (x, w))


@gpu
@pytest.mark.parametrize("special", [False, True])
def test_grads_match_model_float32(special):
    ref, new = cuda_pair(300, 70)
    x = torch.rand(50, 300, device="cuda")
    if special:
        x[3, 4] = float("inf")
        x[7, 0] = float("nan")
    xr, xn = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn(50, 1, device="cuda")
    (ref(xr) * g).sum().backward()
    (new(xn) * g).sum().backward()
    for a, b_ in ((xn.grad, xr.grad), (new.linear.weight.grad, ref.linear.weight.grad),
                  (new.linear.bias.grad, ref.linear.bias.grad)):
        assert_same(a, b_, 1e-4)


@gpu
def test_inplace_change_between_forward_and_backward_raises_like_torch():
    ref, new = cuda_pair(8, 3)
    x = torch.rand(4, 8, device="cuda", requires_grad=True)
    y = new(x).sum()
    with torch.no_grad():
        new.linear.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@gpu
def test_bad_input_gpu():
    ref, new = cuda_pair(8, 3)
    with pytest.raises(TypeError, match="weight: is a torch CUDA tensor but x is a torch CPU tensor"):
        new(torch.rand(4, 8))
    with pytest.raises(TypeError, match="weight: dtype float32 does not match x's dtype float16"):
        new(torch.rand(4, 8, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="x: has 9 features"):
        new(torch.rand(4, 9, device="cuda"))
    with pytest.raises(ValueError, match="x: expected a 2-D array"):
        new(torch.rand(8, device="cuda"))
    with pytest.raises(ValueError, match="x: has 9 features"):
        new(torch.rand(2, 4, 9, device="cuda"))  # N-D: checked as 2-D x is
    with pytest.raises(TypeError, match="weight: dtype float32 does not match x's dtype float16"):
        new(torch.rand(2, 4, 8, device="cuda", dtype=torch.float16))
    with pytest.raises(TypeError, match="bias: is a"):
        cupykern.matmul_sum_max_mean_logsumexp(torch.rand(4, 8, device="cuda"),
                                               torch.rand(3, 8, device="cuda"), torch.rand(3))


@gpu
def test_planned_calls_follow_every_change():
    """Calls after a module's first reuse its plan and launch plan without the checks: each
    must still be the reference model's, gradients included, through the changes those
    checks see (hooks, a new Linear, no bias, dtype, grad mode, x's layout)."""
    ref, new = cuda_pair(64, 32)
    handles = []

    def hook(m):
        handles.append(m.linear.register_forward_hook(lambda mod, inp, out: out * 2))

    def relinear(m):
        torch.manual_seed(1)
        m.linear = torch.nn.Linear(64, 32).cuda()

    steps = [("first", lambda m: None), ("hook", hook), ("unhook", lambda m: handles.pop(0).remove()),
             ("new linear", relinear), ("no bias", lambda m: setattr(m.linear, "bias", None)),
             ("float64", lambda m: m.double())]
    for name, change in steps:
        for m in (ref, new):
            change(m)
        dtype = new.linear.weight.dtype
        for transposed in (False, True):
            for grad in (True, False, True):
                base = torch.rand(64, 16, device="cuda", dtype=dtype)
                x = base.t() if transposed else base.t().contiguous()
                xr, xn = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
                with torch.set_grad_enabled(grad):
                    r, n = ref(xr), new(xn)
                assert_same(n.detach(), r.detach(), 1e-4)
                assert n.requires_grad == r.requires_grad == grad, name
                if grad:
                    r.sum().backward()
                    n.sum().backward()
                    assert_grad_close(xn.grad, xr.grad, 1e-5, what=name)
        for p, q in zip(new.parameters(), ref.parameters()):
            assert_grad_close(p.grad, q.grad, 1e-5, what=name)


# ------------------------------------------------------- N-D x, as nn.Linear takes it
# The reference reduces over dim 1 each time: for (B, S, ..., K) its Linear gives (B, S,
# ..., N), the sum reduces over S and the rest over dims of size 1: (B, 1, ..., N).

ND_SHAPES = [(3, 4), (2, 3, 4), (3, 1), (3, 0), (0, 4), (1, 1), (2, 5, 3)]  # x.shape[:-1]
ND_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def nd_pair(k, n, dtype=torch.float32, device="cpu", seed=5):
    torch.manual_seed(seed)
    ref = model4.Model(k, n).to(device, dtype)
    torch.manual_seed(seed)
    new = model4.ModelNew(k, n).to(device, dtype)
    return ref, new


def nd_grads(model, x, g):
    """Output and the gradients of x, weight and bias for ``(model(x) * g).sum()``."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = model(x)
    (out * g).sum().backward()
    return out.detach(), x.grad, model.linear.weight.grad, model.linear.bias.grad


def test_reference_shape_of_nd_input():
    """What the reference itself gives, the semantics the N-D path follows."""
    ref = model4.Model(10, 5)
    x = torch.randn(3, 4, 10)
    assert ref(x).shape == (3, 1, 5) and ref(torch.randn(2, 3, 4, 10)).shape == (2, 1, 4, 5)
    z = ref.linear(x)
    torch.testing.assert_close(ref(x), z.sum(1, keepdim=True), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ND_DTYPES)
@pytest.mark.parametrize("lead", ND_SHAPES)
def test_module_nd_cpu_matches_model_with_grads(dtype, lead):
    k, n = 10, 5
    ref, new = nd_pair(k, n, dtype)
    x = rand(*lead, k, dtype=dtype, seed=7)
    for xi in (x, x.transpose(0, 1) if x.dim() > 2 else x):  # (a non-contiguous x too)
        want = ref(xi)
        assert want.shape == (*xi.shape[:1], 1, *xi.shape[2:-1], n)
        g = rand(*want.shape, dtype=dtype, seed=8)
        for a, b_ in zip(nd_grads(new, xi, g), nd_grads(ref, xi, g)):
            assert a.shape == b_.shape and a.dtype == b_.dtype
            assert torch.equal(a, b_)  # on the CPU the module runs the reference's ops


@pytest.mark.parametrize("dtype", ND_DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_function_nd_torch_cpu_matches_chain_with_grads(dtype, with_bias):
    x = rand(2, 3, 4, 6, dtype=dtype).requires_grad_(True)
    w = rand(5, 6, dtype=dtype, seed=1).requires_grad_(True)
    b = rand(5, dtype=dtype, seed=2).requires_grad_(True) if with_bias else None
    leaves = [t for t in (x, w, b) if t is not None]
    plan = cupykern.prepare_matmul_sum(w, b)
    for how in ("plain", "plan"):
        got = cupykern.matmul_sum_max_mean_logsumexp(x, w, b, plan=plan if how == "plan" else None)
        want = chain(x, w, b)
        assert got.shape == want.shape == (2, 1, 4, 5)
        g = rand(*want.shape, dtype=dtype, seed=3)
        ga = torch.autograd.grad((got * g).sum(), leaves)
        gb = torch.autograd.grad((want * g).sum(), leaves)
        assert torch.equal(got, want) and all(torch.equal(p, q) for p, q in zip(ga, gb)), how
    assert torch.equal(plan(x), chain(x, w, b))


def test_function_nd_gradcheck_float64():
    x = rand(2, 3, 4, dtype=torch.float64).requires_grad_(True)
    w = rand(5, 4, dtype=torch.float64, seed=1).requires_grad_(True)
    b = rand(5, dtype=torch.float64, seed=2).requires_grad_(True)
    assert torch.autograd.gradcheck(tmr.matmul_sum_max_mean_logsumexp, (x, w, b))


@pytest.mark.parametrize("np_dtype, tol", [(np.float64, 1e-12), (np.float32, 1e-5), (np.float16, 1e-2)])
@pytest.mark.parametrize("lead", ND_SHAPES)
def test_numpy_nd_matches_float64_chain(np_dtype, tol, lead):
    x, w, b = rand(*lead, 6), rand(5, 6, seed=1), rand(5, seed=2)
    xn, wn, bn = (t.numpy().astype(np_dtype) for t in (x, w, b))
    want = chain(*(torch.from_numpy(a).double() for a in (xn, wn, bn)))
    for how in ("plain", "plan"):
        plan = cupykern.prepare_matmul_sum(wn, bn) if how == "plan" else None
        got = cupykern.matmul_sum_max_mean_logsumexp(xn, wn, bn, plan=plan)
        assert isinstance(got, np.ndarray) and got.dtype == np_dtype and got.shape == want.shape
        assert_same(torch.from_numpy(got.astype(np.float64)), want, tol)
    if np_dtype == np.float32:  # against PyTorch's own float32 chain too
        assert_same(torch.from_numpy(got), chain(x, w, b), 1e-4)


def test_numpy_nd_nan_inf_like_torch():
    x, w, b = specials()
    x3 = torch.stack([x, x.flip(0)], 1)  # (6, 2, 4): a row's specials meet another row's
    got = cupykern.matmul_sum_max_mean_logsumexp(x3.numpy(), w.numpy(), b.numpy())
    assert_same(torch.from_numpy(got), chain(x3, w, b), 1e-4)


def test_dask_nd_matches_numpy():
    da = pytest.importorskip("dask.array")
    x, w, b = (t.numpy() for t in (rand(6, 5, 3, 8), rand(4, 8, seed=1), rand(4, seed=2)))
    want = cupykern.matmul_sum_max_mean_logsumexp(x, w, b)
    dx = da.from_array(x, chunks=(2, 2, 2, 3))  # split along the summed dim 1 and K too
    got = cupykern.matmul_sum_max_mean_logsumexp(dx, w, b)
    assert got.shape == want.shape == (6, 1, 3, 4)
    np.testing.assert_allclose(got.compute(), want, rtol=1e-6, atol=1e-6)


def test_nd_bad_input_errors():
    torch.manual_seed(0)
    new = MatmulSumMaxMeanLogSumExp(6, 5)
    with pytest.raises(ValueError, match=r"x: has 7 features \(x.shape\[-1\]\) but weight has in_features = 6"):
        new(torch.ones(2, 3, 7))
    with pytest.raises(ValueError, match=r"x: expected a 2-D array .* or more dimensions"):
        new(torch.ones(6))
    with pytest.raises(TypeError, match="weight: dtype float32 does not match x's dtype float64"):
        new(torch.ones(2, 3, 6, dtype=torch.float64))
    w = torch.ones(5, 6)
    with pytest.raises(ValueError, match="x: has 7 features"):
        cupykern.matmul_sum_max_mean_logsumexp(torch.ones(2, 3, 7), w)
    with pytest.raises(ValueError, match="x: has 7 features"):
        cupykern.prepare_matmul_sum(w.numpy())(np.ones((2, 3, 7), np.float32))


@gpu
@pytest.mark.parametrize("dtype", ND_DTYPES)
@pytest.mark.parametrize("lead", [(3, 4), (2, 3, 4), (3, 1), (3, 0), (0, 4), (64, 33)])
def test_module_nd_gpu_matches_model_with_grads(dtype, lead):
    k, n = 300, 70
    ref, new = nd_pair(k, n, dtype, "cuda")
    x = rand(*lead, k, dtype=dtype, device="cuda", seed=7)
    new(rand(4, k, dtype=dtype, device="cuda"))  # a 2-D call first: the plan cache exists
    for _ in range(2):  # the second call: from the cache's (None) entry for this x
        want = ref(x)
        assert want.shape == (lead[0], 1, *lead[2:], n)
        g = rand(*want.shape, dtype=dtype, device="cuda", seed=8)
        for a, b_ in zip(nd_grads(new, x, g), nd_grads(ref, x, g)):
            assert_same(a, b_, TOL[dtype])
    x2 = rand(5, k, dtype=dtype, device="cuda", seed=9)  # 2-D still the fused path
    assert new(x2).shape == (5, 1)
    assert_same(new(x2), ref(x2), TOL[dtype])


@gpu
def test_function_nd_gpu_torch_and_cupy():
    import cupy

    x, w, b = rand(4, 6, 300, device="cuda"), rand(70, 300, device="cuda", seed=1), rand(70, device="cuda", seed=2)
    want = chain(x, w, b)
    assert_same(cupykern.matmul_sum_max_mean_logsumexp(x, w, b), want, 1e-4)
    plan = cupykern.prepare_matmul_sum(w, b)
    assert_same(plan(x), want, 1e-4)
    for dt, tol in ((cupy.float32, 1e-4), (cupy.float64, 1e-10), (cupy.float16, None)):
        xc, wc, bc = (cupy.asarray(t.cpu().numpy()).astype(dt) for t in (x, w, b))
        tdt = getattr(torch, cupy.dtype(dt).name)
        want = chain(*(torch.from_dlpack(a).to(tdt) for a in (xc, wc, bc)))
        exact = chain(*(torch.from_dlpack(a).double() for a in (xc, wc, bc)))
        got = cupykern.matmul_sum_max_mean_logsumexp(xc, wc, bc)
        assert isinstance(got, cupy.ndarray) and got.shape == (4, 1, 70) and got.dtype == dt
        for got in (got, cupykern.prepare_matmul_sum(wc, bc)(xc)):
            got = torch.from_dlpack(got)
            if tol is not None:
                assert_same(got, want, tol)
            else:  # float16: a sum of 6 rounded rows; judged against float64 with torch's own error
                ours, theirs = ((t.double() - exact).abs().max().item() for t in (got, want))
                assert ours <= 2 * theirs + 1e-3 * exact.abs().max().item(), (ours, theirs)


@gpu
def test_module_nd_gpu_compiles():
    ref, new = nd_pair(64, 16, device="cuda")
    x = rand(3, 5, 64, device="cuda")
    got = torch.compile(new, fullgraph=True)(x)
    assert_same(got, ref(x), 1e-4)
