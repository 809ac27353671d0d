"""Dask arrays of NumPy chunks (CPU, in CI) and of CuPy chunks (GPU): every array
function gives a Dask array of the chunk type whose computed value is the function's
result on the whole array (row-wise ops: row for row; GemmScaleBatchNorm's batch
statistics: those of all rows, running statistics updated at the call), with the
reduced axis rechunked where a chunk boundary splits it."""
import numpy as np
import pytest
import torch

import cupykern
from support import tolerance, to_kind

da = pytest.importorskip("dask.array", reason="dask is an optional extra: pip install 'cupykern[dask]'")

KINDS = ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float64]


def _data(kind, dtype, *shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return to_kind(torch.randn(*shape, generator=g, dtype=dtype) * scale, kind)


def _dask(a, chunks):
    return da.from_array(a, chunks=chunks, asarray=False)


def _lazy(got, x):
    """A Dask array whose meta (what Dask tells downstream ops of its blocks) is x's type."""
    assert isinstance(got, da.Array) and type(got._meta) is type(x), type(got._meta)
    return got


def _close(got, want, dtype):
    xp = type(want).__module__.split(".")[0]
    assert type(got).__module__.split(".")[0] == xp, "the chunks' kind changed"
    got, want = (np.asarray(a.get() if xp == "cupy" else a, dtype=np.float64) for a in (got, want))
    tol = tolerance(dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [cupykern.l1_normalize, cupykern.l2_normalize])
@pytest.mark.parametrize("axis, chunks", [(1, (5, 40)), (-1, (3, 7)), (0, (4, 9))])
def test_normalize(kind, dtype, fn, axis, chunks):
    x = _data(kind, dtype, 13, 40)
    d = _dask(x, chunks)
    got = _lazy(fn(d, axis=axis), x)
    assert got.shape == x.shape
    _close(got.compute(), fn(x, axis=axis), dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear(kind, dtype):
    x, w, b = _data(kind, dtype, 4, 9, 30), _data(kind, dtype, 11, 30, seed=1), _data(kind, dtype, 11, seed=2)
    got = _lazy(cupykern.linear(_dask(x, (3, 5, 8)), w, b), x)  # K split: rechunked
    assert got.chunks == ((3, 1), (5, 4), (11,))
    _close(got.compute(), cupykern.linear(x, w, b), dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul(kind, dtype):
    """A Dask a (2-D, 3-D; K split: rechunked) by a concrete matrix or vector b."""
    a, b = _data(kind, dtype, 4, 9, 30), _data(kind, dtype, 30, 11, seed=1)
    got = _lazy(cupykern.matmul(_dask(a, (3, 5, 8)), b), a)
    assert got.chunks == ((3, 1), (5, 4), (11,))
    _close(got.compute(), cupykern.matmul(a, b), dtype)
    a2 = a[0]
    got = _lazy(cupykern.matmul(_dask(a2, (4, 30)), b[:, 0]), a2)
    assert got.shape == (9,)
    _close(got.compute(), cupykern.matmul(a2, b[:, 0]), dtype)
    with pytest.raises(TypeError, match="^b: a Dask array"):
        cupykern.matmul(_dask(a2, (4, 30)), _dask(b, (10, 11)))
    with pytest.raises(ValueError, match="^a: with a Dask a"):
        cupykern.matmul(_dask(a2[0], (10,)), b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_sum_max_mean_logsumexp(kind, dtype):
    x, w, b = _data(kind, dtype, 21, 30), _data(kind, dtype, 12, 30, seed=1), _data(kind, dtype, 12, seed=2)
    plan = cupykern.prepare_matmul_sum(w, b)
    d = _dask(x, (8, 30))
    want = cupykern.matmul_sum_max_mean_logsumexp(x, w, b)
    _close(cupykern.matmul_sum_max_mean_logsumexp(d, w, b).compute(), want, dtype)
    got = _lazy(plan(d), x)
    assert got.chunks == ((8, 8, 5), (1,))
    _close(got.compute(), want, dtype)


def _gsbn_args(kind, dtype):
    x = _data(kind, dtype, 37, 24, scale=3.0)
    w, b, s, gamma, beta = (_data(kind, dtype, *shape, seed=i) for i, shape in enumerate(
        [(10, 24), (10,), (10,), (10,), (10,)], start=1))
    return x, (w, b, s, gamma, beta)


def _buffers(kind, dtype):
    return [to_kind(torch.zeros(10, dtype=dtype), kind), to_kind(torch.ones(10, dtype=dtype), kind),
            to_kind(torch.zeros((), dtype=torch.int64), kind)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_gemm_scale_batchnorm_training_uses_all_rows(kind, dtype, momentum):
    x, params = _gsbn_args(kind, dtype)
    ours, want = _buffers(kind, dtype), _buffers(kind, dtype)
    d = _dask(x, (10, 7))  # uneven row blocks, K split
    for _ in range(2):  # (momentum None: the cumulative factor follows num_batches_tracked)
        got = _lazy(cupykern.gemm_scale_batchnorm(d, *params, *ours, training=True,
                                                  momentum=momentum), x)
        ref = cupykern.gemm_scale_batchnorm(x, *params, *want, training=True, momentum=momentum)
        for a, b in zip(ours, want):  # updated at the call, before any compute
            _close(a, b, dtype)
        _close(got.compute(), ref, dtype)
    got = _lazy(cupykern.gemm_scale_batchnorm(d, *params, *ours[:2], training=False), x)
    want_eval = cupykern.gemm_scale_batchnorm(x, *params, *want[:2], training=False)
    # eval mode normalizes with the running statistics of the call, not those of a later one
    cupykern.gemm_scale_batchnorm(d, *params, *ours, training=True)
    _close(got.compute(), want_eval, dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_arguments_fail_at_the_call(kind):
    x, params = _gsbn_args(kind, torch.float32)
    d = _dask(x, (10, 24))
    with pytest.raises(ValueError, match="out: not supported for Dask"):
        cupykern.l2_normalize(d, out=d)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        cupykern.gemm_scale_batchnorm(d[:1], *params, *_buffers(kind, torch.float32))
    with pytest.raises(ValueError, match="x: last dimension 24 does not match"):
        cupykern.linear(d, params[0][:, :20])
    unknown = d[d[:, 0] > 0]  # (rows of unknown count)
    with pytest.raises(ValueError, match="x: a Dask array of unknown chunk sizes"):
        cupykern.linear(unknown.T, params[0].T)
    other = "numpy" if kind == "cupy" else "torch_cpu"
    with pytest.raises(TypeError, match="weight"):  # weights of another kind than the chunks
        cupykern.linear(d, to_kind(torch.zeros(10, 24), other))


def test_gemm_scale_batchnorm_empty_blocks_and_eval_eps():
    """Training over blocks that start with two empty ones (their moments merge as
    nothing: no 0 / 0), and eval mode with the given eps, against BatchNorm written out in
    float64: output and running statistics."""
    rng = np.random.default_rng(2)
    x, w, s = rng.standard_normal((10, 5)), rng.standard_normal((3, 5)), rng.standard_normal(3)
    rm, rv = np.zeros(3), np.ones(3)
    got = cupykern.gemm_scale_batchnorm(_dask(x, ((0, 0, 6, 4), (5,))), w, None, s, None, None,
                                        rm, rv).compute()
    y = x @ w.T * s  # nn.BatchNorm1d written out (momentum 0.1, eps 1e-5)
    mean, var = y.mean(0), y.var(0)
    np.testing.assert_allclose(got, (y - mean) / np.sqrt(var + 1e-5), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rm, 0.1 * mean, rtol=1e-12)
    np.testing.assert_allclose(rv, 0.9 + 0.1 * var * 10 / 9, rtol=1e-12)
    kw = dict(training=False, eps=0.5)
    got = cupykern.gemm_scale_batchnorm(_dask(x, (4, 5)), w, None, s, None, None, rm, rv, **kw)
    np.testing.assert_allclose(got.compute(), (y - rm) / np.sqrt(rv + 0.5), rtol=1e-12)


def test_big_endian_operands_give_native_results():
    """'>f4' operands (read from a big-endian file, say) give results in the machine's byte
    order, as NumPy's own: from NumPy arrays and from Dask arrays of them, whose declared
    dtype is the computed one."""
    x = (np.arange(12).reshape(3, 4) / 7).astype(">f4")
    w, b, s = (np.ones((5, 4)) / 3).astype(">f4"), np.ones(5, ">f4"), np.full(5, 2, ">f4")
    assert x.dtype.str == w.dtype.str == ">f4"
    calls = {
        "matmul": lambda a: cupykern.matmul(a, w.T),
        "linear": lambda a: cupykern.linear(a, w, b),
        "l1_normalize": cupykern.l1_normalize,
        "l2_normalize": cupykern.l2_normalize,
        "matmul_sum_max_mean_logsumexp": lambda a: cupykern.matmul_sum_max_mean_logsumexp(a, w, b),
        "gemm_scale_batchnorm": lambda a: cupykern.gemm_scale_batchnorm(a, w, b, s, None, None),
    }
    native = np.dtype(np.float32)
    for name, call in calls.items():
        want = call(x.astype(native))
        got, lazy = call(x), call(_dask(x, (2, 4)))
        assert got.dtype.str == lazy.dtype.str == native.str, name
        computed = lazy.compute()
        assert computed.dtype.str == native.str, name
        np.testing.assert_array_equal(got, want, err_msg=name)
        np.testing.assert_allclose(computed, want, rtol=1e-6, err_msg=name)
