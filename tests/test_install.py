"""Install smoke tests, run first (tests/conftest.py orders them), so that a broken install
fails within the first minute: cupykern imports, finds its kernel sources, and each
public op runs once at a small shape against a float64 PyTorch reference: the NumPy path
everywhere; on a GPU also CuPy arrays and torch CUDA tensors (NVRTC compiles each
op's kernel for this GPU at its first call)."""
import numpy as np
import pytest
import torch

import cupykern
from cupykern import _loader

B, K, N = 64, 96, 40
EPS, MOMENTUM = 1e-5, 0.1
OPS = ("l1_normalize", "l2_normalize", "linear", "matmul", "gemm_scale_batchnorm",
       "matmul_sum_max_mean_logsumexp")
KINDS = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu),
         pytest.param("torch", marks=pytest.mark.gpu)]


def test_imports_and_finds_its_kernels():
    assert cupykern.__version__
    assert sorted(p.name for p in _loader.kernel_dir().glob("*.cu"))
    for name in OPS:
        assert callable(getattr(cupykern, name)), name


def _inputs():
    rng = np.random.default_rng(0)
    f32 = np.float32
    return dict(x=rng.standard_normal((B, K)).astype(f32),
                w=rng.standard_normal((N, K)).astype(f32),
                b=rng.standard_normal(N).astype(f32), scale=rng.uniform(0.5, 2, N).astype(f32),
                g=rng.uniform(0.5, 2, N).astype(f32), beta=rng.standard_normal(N).astype(f32),
                rm=np.zeros(N, f32), rv=np.ones(N, f32), nbt=np.zeros((), np.int64))


def _as(kind, a):
    if kind == "numpy":
        return a.copy()
    if kind == "torch":
        return torch.from_numpy(a.copy()).cuda()
    import cupy

    return cupy.asarray(a)


def _to_torch64(a):
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().double()
    if isinstance(a, np.ndarray):
        return torch.from_numpy(np.asarray(a)).double()
    return torch.from_numpy(a.get()).double()  # CuPy


def _reference(op, t):
    """The op in float64 PyTorch (t: the inputs as float64 CPU tensors)."""
    x, w, b = t["x"], t["w"], t["b"]
    if op == "l1_normalize":
        return x / x.abs().mean(1, keepdim=True)
    if op == "l2_normalize":
        return x / x.norm(dim=1, keepdim=True)
    if op == "linear":
        return x @ w.T + b
    if op == "matmul":
        return x @ w.T
    if op == "gemm_scale_batchnorm":
        z = (x @ w.T + b) * t["scale"]
        return (z - z.mean(0)) / torch.sqrt(z.var(0, unbiased=False) + EPS) * t["g"] + t["beta"]
    return (x @ w.T + b).sum(1, keepdim=True)  # sum, then max/mean/logsumexp of one column


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", OPS)
def test_each_op_runs(op, kind):
    host = _inputs()
    a = {k: _as(kind, v) for k, v in host.items()}
    fn = getattr(cupykern, op)
    if op in ("l1_normalize", "l2_normalize"):
        got = fn(a["x"])
    elif op == "linear":
        got = fn(a["x"], a["w"], a["b"])
    elif op == "matmul":
        got = fn(a["x"], a["w"].T)
    elif op == "gemm_scale_batchnorm":
        got = fn(a["x"], a["w"], a["b"], a["scale"], a["g"], a["beta"], a["rm"], a["rv"], a["nbt"],
                 training=True, momentum=MOMENTUM, eps=EPS)
    else:
        got = fn(a["x"], a["w"], a["b"])
    t = {k: torch.from_numpy(v).double() for k, v in host.items()}
    want = _reference(op, t)
    assert type(got) is type(a["x"]), (op, kind, type(got))
    torch.testing.assert_close(_to_torch64(got), want, rtol=1e-3, atol=1e-3,
                               msg=lambda m: f"{op} ({kind}): {m}")
    if op == "gemm_scale_batchnorm":  # the running mean, updated in place
        z = (t["x"] @ t["w"].T + t["b"]) * t["scale"]
        torch.testing.assert_close(_to_torch64(a["rm"]), MOMENTUM * z.mean(0), rtol=1e-3, atol=1e-3)
        assert int(_to_torch64(a["nbt"])) == 1
