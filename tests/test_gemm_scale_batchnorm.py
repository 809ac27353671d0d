"""GemmScaleBatchNorm: outputs, running statistics, eval, errors, against PyTorch."""
import contextlib
import importlib
import sys
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupykern  # noqa: E402
from cupykern.models import gemm_scale_batchnorm as model3  # noqa: E402
from cupykern.torch import GemmScaleBatchNorm  # noqa: E402
from support import assert_grad_close, gsbn_torch, matmul_precision  # noqa: E402


def _modules():
    """The forward's module and the backward's (``core``, ``bwd``)."""
    return (importlib.import_module("cupykern.gemm_scale_batchnorm"),
            importlib.import_module("cupykern.gemm_scale_batchnorm_backward"))


def _pair(fin, fout, seed=0, **kw):
    torch.manual_seed(seed)
    ref = model3.Model(fin, fout, (fout,), **kw)
    torch.manual_seed(seed)
    new = GemmScaleBatchNorm(fin, fout, (fout,), **kw)
    return ref, new


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_step_with_a_gradient_of_stride_0_rows(mode):
    """(out * c).sum() hands the backward g = c expanded over the rows (row stride 0):
    copied inside the cached plan; every gradient as the reference model's, on the call
    that plans and on the plan's replay."""
    torch.manual_seed(0)
    ref, ours = _pair(64, 48)
    ours, ref = ours.cuda(), ref.cuda()
    getattr(ours, mode)(), getattr(ref, mode)()
    x = torch.randn(32, 64, device="cuda")
    c = torch.randn(48, device="cuda")
    for _ in range(2):
        grads = []
        for m in (ours, ref):
            m.zero_grad()
            xr = x.clone().requires_grad_()
            (m(xr) * c).sum().backward()
            grads.append([xr.grad] + [p.grad for p in m.parameters()])
        for got, want in zip(*grads):
            # (training mode: BatchNorm cancels a per-column constant g, the gradients
            # are rounding; judged against the largest one)
            scale = max(w.abs().max().item() for w in grads[1])
            assert_grad_close(got, want, 1e-4, atol=1e-4 * scale if mode == "train" else 0.0)


def test_same_parameters_and_state_dict():
    ref, new = _pair(16, 8)
    sr, sn = ref.state_dict(), new.state_dict()
    assert list(sr) == list(sn)
    assert all(torch.equal(sr[k], sn[k]) for k in sr)
    new.load_state_dict(sr)
    ref.load_state_dict(sn)


def test_cpu_reference_path_and_numpy():
    ref, new = _pair(12, 6)
    x = torch.randn(10, 12)
    for _ in range(2):
        assert torch.allclose(new(x), ref(x), atol=1e-5)
    assert torch.allclose(new.bn.running_var, ref.bn.running_var)
    # NumPy port against torch
    ref2, _ = _pair(12, 6)
    bn = ref2.bn
    args = [t.detach().numpy().copy() for t in (ref2.gemm.weight, ref2.gemm.bias, ref2.scale,
                                                  bn.weight, bn.bias, bn.running_mean, bn.running_var)]
    nbt = np.zeros((), np.int64)
    out = cupykern.gemm_scale_batchnorm(x.numpy(), *args, nbt, training=True)
    with torch.no_grad():
        expect = ref2(x)
    np.testing.assert_allclose(out, expect.numpy(), atol=1e-5)
    np.testing.assert_allclose(args[5], bn.running_mean.numpy(), atol=1e-6)
    np.testing.assert_allclose(args[6], bn.running_var.numpy(), atol=1e-6)
    assert nbt == 1


@pytest.mark.parametrize("momentum", [0.1, None, 0.5])
def test_cpu_paths_train_like_the_model(momentum):
    """Three training batches, then eval, through the function on torch CPU tensors (the
    op's CPU implementation) and on NumPy arrays, each with buffers of its own, against
    the documented model: outputs, running statistics and the counter (momentum None:
    the cumulative average, by the counter). (The module on torch CPU tensors runs the
    model itself.)"""
    ref, _ = _pair(12, 6, momentum=momentum)
    m = _pair(12, 6, momentum=momentum)[0]
    params = [t.detach().clone() for t in (m.gemm.weight, m.gemm.bias, m.scale, m.bn.weight,
                                          m.bn.bias)]
    kinds = {"torch": params + [m.bn.running_mean.clone(), m.bn.running_var.clone(),
                                torch.zeros((), dtype=torch.int64)],
             "numpy": [t.numpy().copy() for t in params]
             + [m.bn.running_mean.numpy().copy(), m.bn.running_var.numpy().copy(),
                np.zeros((), np.int64)]}
    gen = torch.Generator().manual_seed(3)
    for training in (True, True, True, False):
        ref.train(training)
        x = torch.randn(10, 12, generator=gen) * 2 + 1  # (means and variances far from 0 and 1)
        with torch.no_grad():
            want = ref(x)
        for name, args in kinds.items():
            xk = x if name == "torch" else x.numpy()
            got = torch.as_tensor(cupykern.gemm_scale_batchnorm(xk, *args, training=training,
                                                                momentum=momentum))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
            for buf, theirs in zip(args[5:7], (ref.bn.running_mean, ref.bn.running_var)):
                torch.testing.assert_close(torch.as_tensor(buf), theirs, atol=1e-6, rtol=1e-6,
                                           msg=name)
            assert int(args[7]) == int(ref.bn.num_batches_tracked), name


def test_numpy_eval_takes_an_eps_of_zero():
    """eps = 0 in eval mode (a non-negative eps is valid there): (y - mean) / sqrt(var)
    with the running statistics, in float64."""
    rng = np.random.default_rng(1)
    x, w, s = rng.standard_normal((8, 5)), rng.standard_normal((3, 5)), rng.standard_normal(3)
    rm, rv = rng.standard_normal(3), rng.random(3) + 0.5
    got = cupykern.gemm_scale_batchnorm(x, w, None, s, None, None, rm, rv, training=False, eps=0.0)
    np.testing.assert_allclose(got, (x @ w.T * s - rm) / np.sqrt(rv), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["z rounds", "y rounds", "z overflows"])
def test_float16_cpu_paths_use_the_stored_products(case):
    """PyTorch's model stores z = x W^T + b and y = z * scale in float16 before BatchNorm:
    rows that round to one value have a batch variance of 0 (an output of 0), and a z past
    65504 is inf (a nan column). The NumPy, Dask and torch CPU paths normalise the stored
    values too (the NumPy reference and the Dask blocks had kept z and y in float32:
    outputs of +-1, or finite)."""
    x, w, s = {  # (z = 625 and 625.0625; y = 620.8 and 621.1, both 621; z = 80000)
        "z rounds": ([[500.0, 500.0], [500.0, 500.25]], [[1.0, 0.25]], [1.0]),
        "y rounds": ([[914.0], [914.5]], [[1.0]], [0.6792]),
        "z overflows": ([[200.0, 200.0], [1.0, 2.0], [3.0, 1.0]], [[200.0, 200.0]], [1.0]),
    }[case]
    x, w, s = (np.array(a, np.float16) for a in (x, w, s))
    b = np.zeros(1, np.float16)
    t = [torch.from_numpy(a) for a in (x, w, b, s)]
    want = torch.nn.functional.batch_norm(torch.nn.functional.linear(*t[:3]) * t[3], None, None,
                                          training=True).numpy()
    kinds = {"numpy": x, "torch": t[0]}
    if importlib.util.find_spec("dask"):
        import dask.array as da
        kinds["dask"] = da.from_array(x, chunks=(1, -1))
    for name, xk in kinds.items():
        args = [torch.from_numpy(a) for a in (w, b, s)] if name == "torch" else [w, b, s]
        got = np.asarray(cupykern.gemm_scale_batchnorm(xk, *args, None, None))
        np.testing.assert_allclose(got, want, atol=1e-3, err_msg=name)


def test_batch_of_one_raises_like_torch():
    ref, new = _pair(12, 6)
    x = torch.randn(1, 12)
    with pytest.raises(ValueError) as e_ref:
        ref(x)
    with pytest.raises(ValueError) as e_new:
        new(x)
    assert str(e_new.value) == str(e_ref.value)


def test_bad_input():
    _, new = _pair(12, 6)
    with pytest.raises(ValueError, match="in_features"):
        new(torch.randn(4, 11))
    with pytest.raises(ValueError, match="2-D"):
        new(torch.randn(2, 4, 12))
    with pytest.raises(TypeError, match="dtype"):
        new(torch.randn(4, 12, dtype=torch.float64))


# (1000 and 1100 rows: 8 and 9 M-tiles, the most the apply pass merges, and one more)
SHAPES = [(37, 50, 23), (128, 1024, 512), (300, 96, 130), (2, 8, 8), (1000, 64, 40), (1100, 64, 40)]


@pytest.mark.gpu
@pytest.mark.parametrize("momentum", [0.1, None, -0.5])  # (negative: as PyTorch)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_training_steps_and_eval(shape, momentum):
    m, fin, fout = shape
    ref, new = _pair(fin, fout, momentum=momentum)
    ref, new = ref.cuda(), new.cuda()
    for step in range(3):
        x = torch.randn(m, fin, device="cuda") + step
        with torch.no_grad():
            r, n = ref(x), new(x)
        assert torch.allclose(n, r, atol=1e-4, rtol=1e-4), (n - r).abs().max()
    for name in ("running_mean", "running_var"):
        a, b = getattr(new.bn, name), getattr(ref.bn, name)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, (a - b).abs().max())
    assert new.bn.num_batches_tracked.item() == ref.bn.num_batches_tracked.item() == 3
    ref.eval(), new.eval()
    x = torch.randn(m, fin, device="cuda")
    with torch.no_grad():  # (a negative momentum can leave a negative running_var: nan)
        assert torch.allclose(new(x), ref(x), atol=1e-4, rtol=1e-4, equal_nan=True)
    with torch.no_grad():  # eval also works on one row
        assert torch.allclose(new(x[:1]), ref(x[:1]), atol=1e-4, rtol=1e-4, equal_nan=True)


# The forward's BatchNorm pass per dtype: float64 of the dtype's rounded inputs within these
FORWARD_BOUND = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 5e-3,
                 torch.bfloat16: 4e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(FORWARD_BOUND), ids=str)
@pytest.mark.parametrize("shape", [(64, 96, 512), (200, 64, 136), (37, 50, 23), (256, 128, 1032)],
                         ids=lambda s: "x".join(map(str, s)))
def test_coefficients_in_the_apply_pass_match_their_own_pass(monkeypatch, shape, dtype):
    """A batch of few M-tiles merges its column statistics in the apply pass
    (bn_train_apply: a thread's 16-byte vector of columns side by side); more tiles, in a
    pass of their own (bn_train_coef, then bn_apply). Both give the same bits (outputs
    and running statistics), and the reference's result within the dtype's bound."""
    import importlib
    core = importlib.import_module("cupykern.gemm_scale_batchnorm")
    m, fin, fout = shape
    results = []
    for tiles in (core._FUSED_TILES, 0):
        monkeypatch.setattr(core, "_FUSED_TILES", tiles)
        core._plans.clear()
        ref, new = _pair(fin, fout)
        ref, new = ref.cuda().to(dtype), new.cuda().to(dtype)
        torch.manual_seed(1)
        x = torch.randn(m, fin, device="cuda", dtype=dtype) + 0.5
        with torch.no_grad():
            results.append((new(x), new.bn.running_mean.clone(), new.bn.running_var.clone()))
    core._plans.clear()
    for a, b in zip(*results):
        assert torch.equal(a, b)
    ref64 = model3.Model(fin, fout, (fout,))
    ref64.load_state_dict(ref.state_dict())
    with torch.no_grad():
        want = ref64.double().cuda()(x.double())
    bound = FORWARD_BOUND[dtype]
    assert torch.allclose(results[0][0].double(), want, atol=bound, rtol=bound), \
        (results[0][0].double() - want).abs().max()
    for got, name in zip(results[0][1:], ("running_mean", "running_var")):
        assert torch.allclose(got.double(), getattr(ref64.bn, name), atol=bound, rtol=bound), name


def test_chunks_of_column_reductions():
    """bn_train_coef's and bn_grad_coef's chunks of threads per column: a power of 2
    dividing the block, each run of at least MIN_RUN tiles, one below 2 * MIN_RUN tiles
    (every tile in order), at most WIDE_CHUNKS unless N's columns fill fewer blocks than
    the SMs (then at most half the block); as many as those rules allow; the grid covers
    N's columns."""
    core = importlib.import_module("cupykern.gemm_scale_batchnorm")
    cfg, threads, sms = core._CHUNKED, core._CHUNKED["THREADS"], 132
    for tiles in [1, 8, 15, 16, 17, 130, 515, 2048, 10**6]:
        for n in (1, 14, 16, 256, 4097, 65536):
            c, ((grid,), (block,)) = core._chunks(tiles, n, sms)
            assert c & (c - 1) == 0 and threads % c == 0 and block == threads
            assert (grid - 1) * (block // c) < n <= grid * (block // c)
            assert c == 1 or tiles // c >= cfg["MIN_RUN"]
            few = -(-n // (threads // (c // 2 or 1))) < sms  # (the grid before the last doubling)
            assert c <= cfg["WIDE_CHUNKS"] or (c < threads and few)
            more = 2 * c <= cfg["WIDE_CHUNKS"] or (2 * c < threads and grid < sms)
            assert 2 * c > tiles // cfg["MIN_RUN"] or not more
    assert core._chunks(2 * cfg["MIN_RUN"] - 1, 16, sms)[0] == 1
    assert core._chunks(2048, 16, sms)[0] == 256  # (2 blocks at 64 chunks)
    assert core._chunks(2048, 4096, sms)[0] == cfg["WIDE_CHUNKS"]


def test_narrow_rows_lie_side_by_side_in_the_apply_pass():
    """bn_apply's block lays ``lanes`` rows side by side where a row has fewer 16-byte
    vectors (or elements) than the block has threads; the grid covers every row and
    column."""
    import types
    core = importlib.import_module("cupykern.gemm_scale_batchnorm")
    threads, rows = core._APPLY["THREADS"], core._APPLY["ROWS"]
    for dtype, n, want in [("float32", 16, (4, 32)), ("float32", 23, (1, 4)),
                           ("bfloat16", 64, (8, 16)), ("float64", 2, (2, 128)),
                           ("float32", 1, (1, 128)), ("float32", 512, (4, 1)),
                           ("float16", 4096, (8, 1)), ("float32", 129, (1, 1))]:
        place = types.SimpleNamespace(dtype=dtype, device=0)
        vec, lanes = core._apply_shape(place, n)
        assert (vec, lanes) == want
        across, vectors = threads // lanes, -(-n // vec)
        assert lanes == 1 or across >= vectors > across // 2
        for m in (1, 31, 32 * lanes + 1, 200000, 2**31 - 1):
            with mock.patch.object(core._loader, "function", lambda file, expr, dev: expr):
                expr, (gx, gy), (block,), sizes = core._apply_launch(place, m, n)
            assert expr == core._row_pass_expr(dtype, vec) and block == threads
            assert sizes[0] == n and [int(v) for v in sizes[1:]] == [m, n, lanes]
            assert gx * across >= vectors > (gx - 1) * across
            # (row tiles past the grid's 65535 rows of blocks: its blocks loop over them)
            assert gy == min(-(-m // (rows * lanes)), 65535)


def test_backward_row_passes_by_width():
    """bn_grad_partials: a column per thread, ``lanes`` rows side by side where N is at
    most half a block; tiles of _GRAD["ROWS"] * lanes rows, one per grid row, at most
    65535 of them (the blocks loop over the rest); the partials hold every tile. The dz
    pass: bn_grad_dz_rows laid out alike (it takes lanes too), but where it would store
    dz^T from fewer than _DZ_ROWS_MIN_LANES lanes the staged bn_grad_dz, a row per block."""
    core, bwd = _modules()
    rows, threads = core._GRAD["ROWS"], core._GRAD["THREADS"]

    def check(launch, m, n, lanes, expr):
        fn, (gx, gy), (block,), sizes = launch
        across = threads // lanes
        assert fn.startswith(expr + "<float") and block == threads
        assert gy == min(-(-m // (rows * lanes)), 65535)
        assert gx * across >= n > (gx - 1) * across
        assert [int(v) for v in sizes] == ([m, n, lanes] if expr != "bn_grad_dz" else [m, n])

    with mock.patch.object(core._loader, "function", lambda file, expr, dev: expr):
        for m, n, lanes in [(1, 1, 128), (64, 128, 1), (65, 129, 1), (4194240, 3, 32),
                            (4194305, 2, 64), (2**31 - 1, 65, 1), (9001, 64, 2), (9001, 14, 8),
                            (9001, 16, 8), (9001, 17, 4)]:
            for transposed in (True, False):
                tiles, partials, dz = bwd._grad_rows(m, n, "float32", 0, transposed)
                assert tiles == -(-m // (rows * lanes))
                check(partials, m, n, lanes, "bn_grad_partials")
                if lanes >= bwd._DZ_ROWS_MIN_LANES or (lanes > 1 and not transposed):
                    check(dz, m, n, lanes, "bn_grad_dz_rows")
                else:
                    check(dz, m, n, 1, "bn_grad_dz")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(FORWARD_BOUND), ids=str)
@pytest.mark.parametrize("shape", [(200003, 16), (4099, 3), (77, 200), (5, 1), (1, 8),
                                   (2097153, 65)], ids=lambda s: "x".join(map(str, s)))
def test_apply_pass_over_narrow_rows(shape, dtype):
    """out = ca * (z - cm) + cb over every row and column, with several rows side by
    side in a block (narrow z) or one (wide; 2097153 rows: 65537 tiles of 32, more than
    a grid's y holds): against float64, z untouched."""
    gs = sys.modules["cupykern.gemm_scale_batchnorm"]
    m, n = shape
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.Generator(device="cuda").manual_seed(3)
    z = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    ca, cm, cb = (torch.randn(n, device="cuda", generator=g).to(acc) for _ in range(3))
    z0 = z.clone()
    out = gs.apply_coefficients(z, ca, cm, cb)
    want = ca.double() * (z.double() - cm.double()) + cb.double()
    bound = FORWARD_BOUND[dtype] * 4
    assert out.shape == (m, n) and out.dtype == dtype and torch.equal(z, z0)
    assert torch.allclose(out.double(), want, atol=bound, rtol=bound), (out.double() - want).abs().max()


@pytest.mark.gpu
def test_row_passes_loop_past_the_grid(monkeypatch):
    """A row pass's blocks loop over the tiles past its grid's y (MAX_GRID_Y, 65535: fewer
    than a few million rows' tiles). With grids of at most 3 rows of blocks, every pass
    still covers every tile: bn_column_stats and bn_apply (a vendor product), bn_train_apply
    (few tiles), bn_grad_partials, bn_grad_dz_rows and bn_grad_dz (a span of tiles per
    grid row; three launches), against float64."""
    core, bwd = _modules()
    for module in (core, bwd):
        monkeypatch.setattr(module, "grid_rows", lambda tiles: min(tiles, 3))
    monkeypatch.setattr(core, "_ROW_STATS_FROM", 0)
    monkeypatch.setitem(core._GRAD_FUSED, "ROWS", 0)
    core._plans.clear()
    bwd._backward_plans.clear()
    try:
        _check_many_tiles((200709, 64, 16), torch.float32)
        _check_many_tiles((1000, 40, 200), torch.float32)
        for training in (True, False):
            for shape in ((9001, 40, 14), (9001, 40, 200)):  # (bn_grad_dz_rows; bn_grad_dz)
                _check_backward(shape, training)
    finally:
        core._plans.clear()
        bwd._backward_plans.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("fout", [2, 65])
def test_backward_over_a_few_million_rows(fout):
    """4194305 rows. 65 columns: 65537 tiles of the backward's 64 rows at a row per block,
    past the 65535 a grid holds on y (once a failed launch); 2 columns: 64 rows side by
    side. Every gradient against float64, within 1e-4 of the largest or twice PyTorch's
    own float32 error (sums over 4 million rows)."""
    _check_backward((4194305, 3, fout), True, torch_relative=True)


def _check_backward(shape, training, precision="highest", bound=1e-4, torch_relative=False):
    """Every gradient of the model at ``shape`` (batch, in, out) against float64, within
    ``bound`` of the largest (``torch_relative``: or within twice PyTorch's own float32
    error, where that is larger)."""
    batch, fin, fout = shape
    ref, new = _pair(fin, fout)
    _running_stats(ref, new)
    new = new.cuda().train(training)
    x = torch.randn(batch, fin, device="cuda", requires_grad=True)
    g = torch.randn(batch, fout, device="cuda")
    want = _grads_float64(ref, x, g, training)
    theirs = [None] * len(want)
    if torch_relative:
        ref = ref.cuda().train(training)
        xr = x.detach().clone().requires_grad_()
        with matmul_precision(precision):
            ref(xr).backward(g)
        theirs = [xr.grad] + [p.grad for p in ref.parameters()]
    with matmul_precision(precision):
        new(x).backward(g)
    ours = [x.grad] + [p.grad for p in new.parameters()]
    names = ["x"] + [n for n, _ in new.named_parameters()]
    for name, o, r, t in zip(names, ours, want, theirs):
        assert o.dtype == torch.float32, name
        rel = bound
        if t is not None:  # (PyTorch's error relative to the largest gradient)
            rel = max(bound, 2 * (t.double() - r).abs().max().item() / r.abs().max().item())
        assert_grad_close(o, r, rel, 1e-6, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(FORWARD_BOUND), ids=str)
@pytest.mark.parametrize("shape, row_stats", [
    ((16465, 126, 14), False), ((16465, 126, 14), True), ((4133, 64, 40), None),
    ((2600, 24, 700), None), ((140001, 40, 9), True), ((200709, 64, 16), True)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else
    {False: "splitk-stats", True: "row-stats", None: "as-dispatched"}[v])
def test_statistics_of_many_tiles(monkeypatch, shape, row_stats, dtype):
    """Many M-tiles: bn_train_coef merges a column's runs of tiles side by side, then the
    runs (of unequal length, and some empty, at these shapes); the reference's result
    within the dtype's bound, the same bits twice. Narrow products (N = 9, 14, 16) are
    the vendor's, their statistics splitk_reduce's or, from _ROW_STATS_FROM tiles (the
    last two shapes, the last with a last tile of 5 rows for 32 lanes) or forced,
    bn_column_stats's; the others' our GEMM's epilogue (16-bit: the vendor's there too,
    with splitk_reduce's statistics)."""
    core = importlib.import_module("cupykern.gemm_scale_batchnorm")
    if row_stats and shape[0] < 20000:
        monkeypatch.setattr(core, "_ROW_STATS_FROM", 0)
    tiles = []
    real = core._vendor_statistics
    monkeypatch.setattr(core, "_vendor_statistics",
                        lambda *a: tiles.append(real(*a)[1]) or real(*a))
    core._plans.clear()
    try:
        _check_many_tiles(shape, dtype)
    finally:
        core._plans.clear()
    assert all((t == core.STATS_BM) != bool(row_stats) for t in tiles)
    assert tiles or row_stats is None


def _check_many_tiles(shape, dtype):
    m, fin, fout = shape
    ref, new = _pair(fin, fout)
    ref, new = ref.cuda().to(dtype), new.cuda().to(dtype)
    torch.manual_seed(2)
    x = torch.randn(m, fin, device="cuda", dtype=dtype) * 3 + 1
    ref64 = model3.Model(fin, fout, (fout,))
    ref64.load_state_dict(ref.state_dict())
    ref64 = ref64.double().cuda()
    with torch.no_grad():
        got, want = new(x), ref64(x.double())
        again, _ = new(x), ref64(x.double())  # (both modules' buffers updated twice)
    assert torch.equal(got, again)
    bound = FORWARD_BOUND[dtype]
    assert torch.allclose(got.double(), want, atol=bound, rtol=bound), (got.double() - want).abs().max()
    for name in ("running_mean", "running_var"):
        a, b = getattr(new.bn, name).double(), getattr(ref64.bn, name)
        assert torch.allclose(a, b, atol=bound, rtol=bound), (name, (a - b).abs().max())


def test_vendor_statistics_by_tiles():
    """GPU-free: a vendor product's column statistics come from splitk_reduce in tiles of
    STATS_BM rows below _ROW_STATS_FROM such tiles, from bn_column_stats (tiles of ROWS *
    lanes rows, lanes as bn_apply lays them) from there."""
    import types
    core = importlib.import_module("cupykern.gemm_scale_batchnorm")
    from cupykern import _loader
    place = types.SimpleNamespace(dtype="float32", device=0)
    calls = []
    orig = _loader.function
    try:
        _loader.function = lambda file, expr, dev, *a: calls.append(expr) or expr
        below = core.STATS_BM * (core._ROW_STATS_FROM - 1)  # (the most rows below)
        assert core._vendor_statistics(place, below, 16)[1] == core.STATS_BM
        assert calls[-1].startswith("splitk_reduce<float, float")
        assert core._vendor_statistics(place, below + 1, 16)[1] == core._APPLY["ROWS"] * 32
        assert calls[-1] == core._row_pass_expr("float32", 4, "stats")
    finally:
        _loader.function = orig


@pytest.mark.gpu
def test_vendor_zero_bias_outlives_plans():
    """The zero bias the vendor's fused product adds (Vendor.zero_bias) is process-long
    per device and dtype: a plan made again reads zeros at the same address, a longer one
    keeps the shorter alive (a captured graph may read it), and while a graph is captured
    none is made (its fill would only be recorded): the plan then goes without."""
    from cupykern.torch.gemm import Vendor, _KEPT
    proto = torch.empty(0, device="cuda")
    a, b = Vendor.zero_bias(proto, 10), Vendor.zero_bias(proto, 5)
    assert a.data_ptr() == b.data_ptr() and not a.any() and a.shape == (10,)
    longer = Vendor.zero_bias(proto, 1 << 22)
    assert not longer.any() and any(k.data_ptr() == a.data_ptr() for k in _KEPT)
    x = torch.ones(4, device="cuda")
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = x * 2
        during = Vendor.zero_bias(proto, 1 << 24)
    assert during is None
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, 2 * x)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_captured_float64_plans_follow_the_route(monkeypatch, training):
    """A float64 GemmScaleBatchNorm planned while a CUDA graph is captured takes the
    vendor's products (fused_vendor's ``captured``), forward and backward, where eager
    calls keep ours; the graph's replay gives what eager calls give, on new inputs."""
    core, bwd = _modules()
    seen = []
    real = core.fused_vendor

    def spy(*args, **kw):
        seen.append((kw.get("captured", False), real(*args, **kw)))
        return seen[-1][1]
    monkeypatch.setattr(core, "fused_vendor", spy)
    monkeypatch.setattr(sys.modules["cupykern.gemm_route"], "fused_vendor", spy)
    core._plans.clear()
    bwd._backward_plans.clear()
    m, fin, fout = 267, 157, 129
    ref, new = _pair(fin, fout)
    ref, new = ref.cuda().double().train(training), new.cuda().double().train(training)
    x = torch.randn(m, fin, device="cuda", dtype=torch.float64, requires_grad=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # (warm-up, eager)
            new(x).sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    assert seen and not any(c or v for c, v in seen)
    seen.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = new(x)
        out.sum().backward()
    assert seen and all(c and v for c, v in seen)
    grads = [x.grad] + [p.grad for _, p in sorted(new.named_parameters())]
    ref.load_state_dict(new.state_dict())
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
        for g in grads:
            g.zero_()
    graph.replay()
    torch.cuda.synchronize()
    xr = x.detach().clone().requires_grad_()
    want = ref(xr)
    want.sum().backward()
    assert torch.allclose(out, want, atol=1e-10, rtol=1e-10)
    wants = [xr.grad] + [p.grad for _, p in sorted(ref.named_parameters())]
    for got, w in zip(grads, wants, strict=True):
        assert torch.allclose(got, w, atol=1e-9, rtol=1e-9), (got - w).abs().max()
    if training:
        for name in ("running_mean", "running_var"):
            assert torch.allclose(getattr(new.bn, name), getattr(ref.bn, name), atol=1e-12)
    core._plans.clear()
    bwd._backward_plans.clear()


@pytest.mark.gpu
def test_deterministic_and_precisions():
    ref, new = _pair(1024, 512)
    ref, new = ref.cuda(), new.cuda()
    x = torch.randn(1000, 1024, device="cuda")
    with torch.no_grad():
        r = ref(x)
        a, b = new(x), new(x)
    assert torch.equal(a, b)
    old = torch.get_float32_matmul_precision()
    try:
        for prec in ("high", "medium"):
            torch.set_float32_matmul_precision(prec)
            with torch.no_grad():
                assert torch.allclose(new(x), r, atol=1e-2 if prec == "high" else 5e-2, rtol=1e-2)
    finally:
        torch.set_float32_matmul_precision(old)


@pytest.mark.gpu
def test_float64_and_cupy():
    cp = pytest.importorskip("cupy")
    ref, new = _pair(40, 24)
    ref, new = ref.cuda().double(), new.cuda().double()
    x = torch.randn(50, 40, device="cuda", dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(new(x), ref(x), atol=1e-10, rtol=1e-10)
    assert torch.allclose(new.bn.running_var, ref.bn.running_var, atol=1e-12)
    # CuPy arrays in, CuPy out, buffers updated in place
    ref, _ = _pair(40, 24)
    ref = ref.cuda()
    bn = ref.bn
    c = [cp.asarray(t.detach().cpu().numpy()) for t in (ref.gemm.weight, ref.gemm.bias, ref.scale,
                                                         bn.weight, bn.bias, bn.running_mean, bn.running_var)]
    xc = torch.randn(50, 40, device="cuda")
    nbt = cp.zeros((), cp.int64)
    out = cupykern.gemm_scale_batchnorm(cp.asarray(xc.cpu().numpy()), *c, nbt)
    with torch.no_grad():
        expect = ref(xc)
    assert isinstance(out, cp.ndarray)
    np.testing.assert_allclose(cp.asnumpy(out), expect.cpu().numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(c[6]), bn.running_var.cpu().numpy(), atol=1e-5)
    assert int(nbt) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["ours", "vendor", "by role"])
def test_float64_training_on_either_route(monkeypatch, route):
    """float64 products run on ours up to cupykern.gemm_route.FUSED_F64_WORK[role]
    multiply-adds, on cuBLAS above: every product ours, every product cuBLAS's (forced by
    moving the boundaries), and at 2**29 by role (a forward alone cuBLAS's, a training
    step's forward ours, its backward products cuBLAS's), each at a shape of its own so
    that no cached plan of another is reused, match the float64 reference: output,
    running statistics and every gradient, in training and eval mode."""
    from cupykern import gemm, gemm_route
    from cupykern._array import operand

    if route == "vendor":
        monkeypatch.setattr(gemm_route, "FUSED_F64_WORK", dict.fromkeys(gemm_route.FUSED_F64_WORK, 0))
    rows, fin, fout = {"ours": (71, 40, 36), "vendor": (70, 40, 36),
                       "by role": (512, 1024, 1024)}[route]
    ref, new = _pair(fin, fout)
    ref, new = ref.cuda().double(), new.cuda().double()
    x = torch.randn(rows, fin, device="cuda", dtype=torch.float64)
    for grad in (False, True):
        want = route == "vendor" or (route == "by role" and not grad)
        assert gemm_route.fused_vendor(operand(x, "x"), operand(new.gemm.weight, "w"), "highest",
                                 grad=grad) == want
    if route == "by role":  # (the backward products: dx = dz @ W, dW = dz^T @ x)
        assert gemm_route.fused_vendor(operand(x, "x"), operand(new.gemm.weight, "w"), "highest",
                                 batch=rows)
    xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    r, n = ref(xr), new(xn)
    torch.testing.assert_close(n, r, atol=1e-10, rtol=1e-10)
    g = torch.randn_like(r)
    r.backward(g)
    n.backward(g)
    for a, b in zip([xn.grad] + [p.grad for p in new.parameters()],
                    [xr.grad] + [p.grad for p in ref.parameters()]):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    for buf in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(new.bn, buf), getattr(ref.bn, buf), atol=1e-12, rtol=1e-12)
    ref.eval(), new.eval()  # eval mode: the affine map in the GEMM's epilogue, or a pass of its own
    xr, xn = x.clone().requires_grad_(), x.clone().requires_grad_()
    r, n = ref(xr), new(xn)
    torch.testing.assert_close(n, r, atol=1e-10, rtol=1e-10)
    r.backward(g)
    n.backward(g)
    torch.testing.assert_close(xn.grad, xr.grad, atol=1e-9, rtol=1e-9)
    with torch.no_grad():
        torch.testing.assert_close(new(x), ref(x), atol=1e-10, rtol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_module_on_second_device():
    ref, new = (m.to("cuda:1") for m in _pair(96, 40))
    x = torch.randn(64, 96, device="cuda:1")
    with torch.no_grad():
        out = new(x)
        assert out.device == x.device
        assert torch.allclose(out, ref(x), atol=1e-4, rtol=1e-4)
    assert torch.allclose(new.bn.running_var, ref.bn.running_var, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_below_sm80_trains_and_evaluates(as_sm75, dtype):
    ref, new = _pair(130, 96)
    ref, new = ref.cuda().to(dtype), new.cuda().to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for _ in range(2):
        x = torch.randn(37, 130, device="cuda", dtype=dtype)
        with torch.no_grad():
            assert torch.allclose(new(x).float(), ref(x).float(), atol=tol, rtol=tol)
    assert torch.allclose(new.bn.running_var.float(), ref.bn.running_var.float(), atol=tol, rtol=tol)
    assert new.bn.num_batches_tracked.item() == 2
    ref.eval(), new.eval()
    with torch.no_grad():
        assert torch.allclose(new(x).float(), ref(x).float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["native", "sm_75"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_training_where_the_scaled_product_overflows(request, dtype, arch):
    """The fused kernels never form y = s*(x @ W.T + b); where the reference's y overflows
    the dtype in some row, that column's outputs are nan as in PyTorch, and its running
    statistics are not finite (PyTorch's are nan or +-inf depending on its kernels; ours:
    the mean +-inf, nan if both signs overflow). Columns: +inf only, -inf only, both, none."""
    if arch == "sm_75":
        request.getfixturevalue("as_sm75")
    ref, new = _pair(8, 4)
    ref, new = ref.cuda().to(dtype), new.cuda().to(dtype)
    big = torch.finfo(dtype).max / 4  # finite in z, overflows once scaled by 8
    x = 0.1 * torch.randn(6, 8, device="cuda", dtype=dtype)
    x[0, 0], x[1, 1] = big, -big
    w = torch.zeros(4, 8, device="cuda", dtype=dtype)
    w[:, 2:] = 0.1
    w[0, 0] = w[1, 0] = w[2, 0] = w[2, 1] = 1
    with torch.no_grad():
        for m in (ref, new):
            m.gemm.weight.copy_(w)
            m.scale.copy_(torch.tensor([8.0, -8.0, 8.0, 1.0]))
    with torch.no_grad():
        want, got = ref(x), new(x)
    assert got.isnan().equal(want.isnan()) and want[:, :3].isnan().all()
    torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2, equal_nan=True)
    assert new.bn.running_mean[:3].tolist()[:2] == [float("inf"), float("-inf")]
    for name in ("running_mean", "running_var"):
        ours, theirs = getattr(new.bn, name).float(), getattr(ref.bn, name).float()
        assert not ours[:3].isfinite().any() and not theirs[:3].isfinite().any()
        torch.testing.assert_close(ours[3], theirs[3], atol=5e-2, rtol=5e-2)


def _grads_float64(ref, x, g, training=True):
    """Gradients of x and every parameter of the reference model, in float64."""
    ref64 = model3.Model(ref.gemm.in_features, ref.gemm.out_features, tuple(ref.scale.shape))
    ref64.load_state_dict(ref.state_dict())
    ref64 = ref64.double().to(x.device).train(training)
    x64 = x.detach().double().requires_grad_()
    ref64(x64).backward(g.double())
    return [x64.grad] + [p.grad for p in ref64.parameters()]


def test_backward_closed_form_matches_autograd():
    """The fused backward's algebra (its CPU implementation, in float64) against autograd."""
    from cupykern.torch.gemm_scale_batchnorm import backward_op

    torch.manual_seed(0)
    x, w, b = torch.randn(9, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    s, gamma, beta = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    eps = 1e-3
    z = x @ w.T
    inv = torch.rsqrt(s * s * z.var(0, unbiased=False) + eps)
    coefs = torch.stack([gamma * s * inv, z.mean(0), beta, inv])
    g = torch.randn(9, 5, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, s, gamma, beta)]
    xr, wr, br, sr, gr, ber = leaves
    gsbn_torch(xr, wr, br, sr, gr, ber, None, None, True, 0.1, eps).backward(g)
    dx, dw, dvec = backward_op(g, z, coefs, x, w, b, s, gamma, None, True, eps, "highest", True,
                               True)
    grads = (dx, dw, *dvec)
    for ours, ref in zip(grads, (xr.grad, wr.grad, br.grad, sr.grad, gr.grad, ber.grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    assert not grads[2].any()  # the bias cancels in training mode: exactly 0
    dx, dw = backward_op(g, z, coefs, x, w, b, s, gamma, None, True, eps, "highest", False,
                         False)[:2]
    assert dx.numel() == dw.numel() == 0  # not wanted: not computed
    # eval mode: out = ca z + cb with the running statistics' ca, cb (coefs' cm row: 0)
    rm, rv = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.5
    inv = torch.rsqrt(rv + eps)
    coefs = torch.stack([gamma * s * inv, torch.zeros(5, dtype=torch.float64), beta, inv])
    for t in leaves:
        t.grad = None
    gsbn_torch(xr, wr, br, sr, gr, ber, rm, rv, False, 0.1, eps).backward(g)
    dx, dw, dvec = backward_op(g, z, coefs, x, w, b, s, gamma, rm, False, eps, "highest", True,
                               True)
    for ours, ref in zip((dx, dw, *dvec), (xr.grad, wr.grad, br.grad, sr.grad, gr.grad, ber.grad)):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


def _running_stats(ref, new):
    """Non-trivial running statistics, the same in both models (for eval mode)."""
    n = ref.bn.num_features
    ref.bn.running_mean.copy_(torch.randn(n))
    ref.bn.running_var.copy_(torch.rand(n) + 0.5)
    new.load_state_dict(ref.state_dict())


def test_eval_backward_matches_autograd():
    """The eval-mode backward's algebra (column sums of g and g z, dz = c s g) in float64
    on the CPU, through the op, against autograd of the same formula."""
    torch.manual_seed(0)
    r = lambda *shape: torch.randn(*shape, dtype=torch.float64)  # noqa: E731
    rm, rv = r(5), torch.rand(5, dtype=torch.float64) + 0.5
    for affine in (True, False):  # with gemm bias and bn weight / bias, and with neither
        x, w, s, g = r(9, 7), r(5, 7), r(5), r(9, 5)
        b, gamma, beta = (r(5), r(5), r(5)) if affine else (None, None, None)
        for fn in (cupykern.gemm_scale_batchnorm, lambda *a, training: (
                gsbn_torch(*a, training, 0.1, 1e-5))):
            leaves = [t.clone().requires_grad_() if t is not None else None
                      for t in (x, w, b, s, gamma, beta)]
            fn(*leaves, rm, rv, training=False).backward(g)
            grads = [t.grad if t is not None else None for t in leaves]
            if fn is cupykern.gemm_scale_batchnorm:
                ours = grads
        for o, want in zip(ours, grads):
            if want is not None:
                torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
        if affine:  # double backward: the differentiable PyTorch-ops form
            assert torch.autograd.gradgradcheck(
                lambda *a: cupykern.gemm_scale_batchnorm(*a, rm, rv, training=False),
                [t.clone().requires_grad_() for t in (x, w, b, s, gamma, beta)])


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("precision, bound", [("highest", 1e-4), ("high", 2e-2)])
@pytest.mark.parametrize("shape", [(2, 5, 3), (37, 50, 23), (130, 300, 257), (512, 64, 33),
                                   (513, 64, 33), (1024, 512, 384), (9001, 40, 14)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fused_backward_matches_float64(shape, precision, bound, training):
    """Every gradient of the model (training mode's fused backward: column sums, dz, our
    GEMMs; eval mode's: column sums of g and g z, our GEMMs) against float64 autograd, relative
    to max |grad| (the training issue's rule). 9001 rows: the column sums' 141 tiles added
    in chunks of threads."""
    _check_backward(shape, training, precision, bound)


@pytest.mark.gpu
@pytest.mark.parametrize("frozen", ["x", "weight"])
@pytest.mark.parametrize("batch", [37, 256, 2001])
def test_fused_backward_one_product(frozen, batch):
    """Only dW (x without grad: the backward writes dz's transpose alone, or dz alone where
    the vendor's dW reads it transposed) or only dx (a frozen weight: dz alone), at a batch whose rows of dz^T take 16-byte stores (256)
    and one whose rows do not (37), both in one launch, and in three (2001 rows of 24
    columns): each gradient still matches float64."""
    ref, new = _pair(40, 24)
    new = new.cuda().train()
    new.gemm.weight.requires_grad_(frozen != "weight")
    x = torch.randn(batch, 40, device="cuda", requires_grad=frozen != "x")
    g = torch.randn(batch, 24, device="cuda")
    want = _grads_float64(ref, x, g)
    with matmul_precision("highest"):
        new(x).backward(g)
    assert (x.grad is None) == (frozen == "x")
    assert (new.gemm.weight.grad is None) == (frozen == "weight")
    ours = [x.grad] + [p.grad for p in new.parameters()]
    for name, o, r in zip(["x"] + [n for n, _ in new.named_parameters()], ours, want):
        if o is not None:
            assert_grad_close(o, r, 1e-4, 1e-6, name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_backward_passes_either_launch(dtype, training):
    """The backward's passes in one launch (bn_grad_fused, up to _GRAD_FUSED["ROWS"]
    rows) and in three give the same gradients, within rounding of the sums' order, at
    batches that leave a warp several 32-row chunks or a part of one, N of one column and
    of a partial 32-column block, and g with rows wider than N (a sliced view)."""
    core, bwd = _modules()
    for batch, fout in ((300, 1), (300, 33), (45, 70)):
        ref, new = _pair(20, fout)
        _running_stats(ref, new)
        new = new.cuda().to(dtype).train(training)
        x = torch.randn(batch, 20, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn(batch, fout + 3, device="cuda", dtype=dtype)[:, :fout]
        grads = []
        for rows in (core._GRAD_FUSED["ROWS"], 0):  # (0: three launches at any batch)
            core._plans.clear()  # (a forward plan keeps the backward plans it began)
            bwd._backward_plans.clear()
            old, core._GRAD_FUSED["ROWS"] = core._GRAD_FUSED["ROWS"], rows
            try:
                for p in [x, *new.parameters()]:
                    p.grad = None
                with matmul_precision("highest"):
                    new(x).backward(g)
            finally:
                core._GRAD_FUSED["ROWS"] = old
                core._plans.clear()
                bwd._backward_plans.clear()
            grads.append([x.grad] + [p.grad for p in new.parameters()])
        want = _grads_float64(ref, x, g, training)
        for name, one, three, r in zip(["x"] + [n for n, _ in new.named_parameters()],
                                       *grads, want):
            assert_grad_close(one, r, 1e-4, 1e-6, name)
            assert_grad_close(one, three, 1e-5 if dtype == torch.float32 else 1e-12, 0, name)


@pytest.mark.gpu
def test_backward_plan_follows_each_step():
    """One module's training steps with x a row view, through changes of g's layout, the
    gradients wanted, torch's TF32 switch and saved-tensor hooks (save_on_cpu gives the
    saved x back contiguous: a backward plan of the first step's layout would read it
    with the view's row stride): each step gives float64's gradients. 1024 rows: dW =
    dz^T @ x on our GEMM (FUSED_VENDOR_BATCH), which reads x in place."""
    ref, new = _pair(48, 40)
    new = new.cuda().train()
    x = torch.randn(1024, 56, device="cuda")[:, :48]  # (rows of stride 56)
    g = torch.randn(1024, 40, device="cuda")
    plain = contextlib.nullcontext
    cases = [(True, g, "highest", plain), (True, g.t().contiguous().t(), "highest", plain),
             (False, g, "highest", plain), (True, g, "high", plain),
             (True, g, "highest", torch.autograd.graph.save_on_cpu), (True, g, "highest", plain)]
    for grad_x, gi, precision, hooks in cases:
        xi = x.detach().requires_grad_(grad_x)
        for p in new.parameters():
            p.grad = None
        ref.load_state_dict(new.state_dict())  # (running statistics moved on)
        want = _grads_float64(ref, xi, gi)
        with matmul_precision(precision), hooks():
            new(xi).backward(gi)
        bound = 1e-4 if precision == "highest" else 2e-2
        assert (xi.grad is not None) == grad_x
        ours = [xi.grad] + [p.grad for p in new.parameters()]
        for name, o, r in zip(["x"] + [n for n, _ in new.named_parameters()], ours, want):
            if o is not None:
                assert_grad_close(o, r, bound, 1e-6, name)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False])
def test_backward_plans_from_the_planned_forward(training, monkeypatch):
    """After the module's planned forward, the backward plans from that forward's plan
    only where it gets the very arrays the forward saved, on their storage: each case
    gives float64's gradients, says whether that lookup ran, and leaves nothing held by
    the node. The general lookup where a hook on the node's own saved tensors gives x back
    in another layout (a row view's contiguous copy), where x.data moved to a contiguous
    copy after the forward, under save_on_cpu, where torch cannot say which hooks are in
    force (before 2.8), for a create_graph backward and for a retained graph's second
    backward. 1024 rows: dW = dz^T @ x on our GEMM, which reads x in place
    (FUSED_VENDOR_BATCH), so a plan of x's old layout would give a wrong dW."""
    from cupykern.torch import gemm_scale_batchnorm as layer

    ref, new = _pair(48, 40)
    new = new.cuda().train(training)
    ref.train(training)
    x = torch.randn(1024, 56, device="cuda")[:, :48]  # (rows of stride 56)
    g = torch.randn(1024, 40, device="cuda")
    linked = []
    real = layer.backward_run_after
    monkeypatch.setattr(layer, "backward_run_after",
                        lambda *a: linked.append(1) or real(*a))

    def hooked_x(out, xi):  # x is the first saved tensor (_saved)
        out.grad_fn._raw_saved_tensors[0].register_hooks(lambda t: t, lambda t: t.contiguous())

    def moved_x(out, xi):
        xi.data = xi.data.contiguous()

    def flipped_tf32(out, xi):  # (the backward keeps the forward's "highest")
        torch.set_float32_matmul_precision("high")

    def once(out):
        out.backward(g)

    def twice(out):
        out.backward(g, retain_graph=True)
        out.backward(g)

    plain, no_query = contextlib.nullcontext, "no hook query"
    query = layer.top_saved_tensors_hooks is not None  # (torch >= 2.8; before: nothing kept)
    # (name, around the forward, after it, backward, backward_run_after calls, grad factor)
    cases = [("plain", plain, None, once, 1, 1), ("plain again", plain, None, once, 1, 1),
             ("node's hook", plain, hooked_x, once, 0, 1),
             ("x.data moved", plain, moved_x, once, 0, 1),
             ("TF32 switch flipped", plain, flipped_tf32, once, 1, 1),
             ("save_on_cpu", torch.autograd.graph.save_on_cpu, None, once, 0, 1),
             (no_query, plain, None, once, 0, 1),
             ("create_graph", plain, None, lambda out: out.backward(g, create_graph=True), 0, 1),
             ("retained graph", plain, None, twice, 1, 2)]
    with matmul_precision("highest"):  # (the first call plans: later ones run the plan)
        new(x.detach().requires_grad_()).backward(g)
    for name, around, after, backward, calls, factor in cases:
        xi = x.detach().requires_grad_()
        for p in new.parameters():
            p.grad = None
        ref.load_state_dict(new.state_dict())
        want = _grads_float64(ref, xi, g, training)
        linked.clear()
        with monkeypatch.context() as m, matmul_precision("highest"):
            if name == no_query:
                m.setattr(layer, "top_saved_tensors_hooks", None)
            with around():
                out = new(xi)
            planned = out.grad_fn.planned
            assert isinstance(planned, layer._PlannedForward), name
            kept = query and around is plain and name != no_query
            assert (planned.saved is not None) == kept, name
            if after is not None:
                after(out, xi)
            backward(out)
        assert len(linked) == (calls if query else 0), name
        assert "planned" not in vars(out.grad_fn), name  # (nothing held past the backward)
        # (create_graph: the backward in PyTorch ops, float32 as eager's: in training mode
        # the bias gradient, 0 in float64, is their float32 sum's ~3e-5)
        atol = 1e-4 if name == "create_graph" else 1e-6
        ours = [xi.grad] + [p.grad for p in new.parameters()]
        for pname, o, r in zip(["x"] + [n for n, _ in new.named_parameters()], ours, want):
            assert_grad_close(o.detach() / factor, r, 1e-4, atol, f"{name}: {pname}")


@pytest.mark.gpu
def test_eval_empty_batch_with_grad():
    """An empty batch in eval mode with gradients on: nothing kept, empty and zero grads."""
    _, new = _pair(16, 8)
    new = new.cuda().eval()
    x = torch.randn(0, 16, device="cuda", requires_grad=True)
    out = new(x)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad.shape == (0, 16)
    assert new.gemm.weight.grad.shape == (8, 16) and not new.gemm.weight.grad.any()


@pytest.mark.gpu
def test_fused_backward_gradcheck_float64_on_gpu():
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).cuda().requires_grad_()  # noqa: E731
    args = (r(6, 5), r(4, 5), r(4), r(4), r(4), r(4))
    rm, rv = torch.zeros(4, dtype=torch.float64, device="cuda"), torch.ones(4, dtype=torch.float64, device="cuda")
    assert torch.autograd.gradcheck(lambda *a: cupykern.gemm_scale_batchnorm(*a, rm.clone(), rv.clone()), args)
    rm, rv = rm + 0.3, rv + 0.5
    assert torch.autograd.gradcheck(lambda *a: cupykern.gemm_scale_batchnorm(*a, rm, rv, training=False), args)
    assert torch.autograd.gradgradcheck(lambda *a: cupykern.gemm_scale_batchnorm(*a, rm, rv, training=False), args)
    assert torch.autograd.gradcheck(lambda *a: cupykern.gemm_scale_batchnorm(*a), args)
    assert torch.autograd.gradgradcheck(lambda *a: cupykern.gemm_scale_batchnorm(*a), args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_backward_16_bit(dtype):
    ref, new = _pair(64, 96)
    new = new.cuda().to(dtype).train()
    x = torch.randn(200, 64, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(200, 96, device="cuda", dtype=dtype)
    want = _grads_float64(ref.to(dtype).float(), x, g)
    new(x).backward(g)
    for o, r in zip([x.grad] + [p.grad for p in new.parameters()], want):
        assert o.dtype == dtype
        assert_grad_close(o, r, 3e-2, 1e-3)


@pytest.mark.gpu
def test_planned_calls_follow_every_change():
    """Calls after a module's first reuse its launch plan without the checks: each must
    still be the reference model's (output, x's gradient, running statistics) through the
    changes those checks see: mode, momentum, eps, hooks, a new BatchNorm1d, no running
    statistics, grad mode and the float32 matmul precision."""
    ref, new = _pair(64, 48)
    ref, new = ref.cuda(), new.cuda()
    handles = []

    def no_stats(m):
        m.bn.track_running_stats = False
        m.bn.running_mean = m.bn.running_var = m.bn.num_batches_tracked = None

    steps = [("first", lambda m: None), ("eval", lambda m: m.eval()), ("train", lambda m: m.train()),
             ("momentum", lambda m: setattr(m.bn, "momentum", 0.3)),
             ("momentum None", lambda m: setattr(m.bn, "momentum", None)),
             ("eps", lambda m: setattr(m.bn, "eps", 1e-3)),
             ("hook", lambda m: handles.append(m.gemm.register_forward_hook(
                 lambda mod, inp, out: out * 2))),
             ("unhook", lambda m: handles.pop(0).remove()),
             ("new bn", lambda m: setattr(m, "bn", torch.nn.BatchNorm1d(48).cuda())),
             ("no running stats", no_stats)]
    for name, change in steps:
        for m in (ref, new):
            change(m)
        for grad in (True, False, True):
            x = torch.randn(32, 64, device="cuda")
            xr, xn = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                r, n = ref(xr), new(xn)
            torch.testing.assert_close(n, r, atol=1e-4, rtol=1e-4, msg=name)
            if grad:
                g = torch.randn_like(r)
                r.backward(g)
                n.backward(g)
                assert_grad_close(xn.grad, xr.grad, 1e-4, what=name)
        for buf in ("running_mean", "running_var", "num_batches_tracked"):
            a, b = getattr(new.bn, buf), getattr(ref.bn, buf)
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    new.eval()
    x = torch.randn(32, 64, device="cuda")
    with torch.no_grad():
        highest = [new(x) for _ in range(2)]
        with matmul_precision("high"):
            high = [new(x) for _ in range(2)]
    assert torch.equal(*highest) and torch.equal(*high)
    assert not torch.equal(highest[0], high[0])  # the planned call follows the precision


def test_passes_for_statistics_from_elsewhere_take_gpu_arrays_only():
    """The synchronized path's entry points (GEMM with epilogue statistics, apply, column
    sums, dz) name what they expect when given host arrays."""
    gs, bwd = _modules()
    x, w, v = np.ones((4, 3), np.float32), np.ones((5, 3), np.float32), np.ones(5, np.float32)
    with pytest.raises(ValueError, match="x, weight: expected GPU arrays"):
        gs.gemm_statistics(x, w, "highest")
    z = np.ones((4, 5), np.float32)
    for call in (lambda: gs.apply_coefficients(z, v, v, v), lambda: bwd.grad_partials(z, z, v),
                 lambda: bwd.grad_dz(z, z, np.ones((3, 5), np.float32), v)):
        with pytest.raises(ValueError, match="z: expected a contiguous, 16-byte aligned"):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_big_products_under_autocast_run_the_reference(dtype, training):
    """In a 16-bit CUDA autocast region a product of AUTOCAST_VENDOR_WORK multiply-adds or
    more runs PyTorch's own composition (its Linear in the region's dtype): the reference
    model's outputs, gradients and running statistics; smaller ones stay fused."""
    from cupykern.torch import gemm_scale_batchnorm as tgsbn

    for rows, fin, fout in ((1024, 8192, 4096), (64, 512, 512)):
        assert (rows * fin * fout >= tgsbn.AUTOCAST_VENDOR_WORK) == (rows == 1024)
        ref, new = _pair(fin, fout)
        ref.cuda().train(training)
        new.cuda().train(training)
        x = torch.rand(rows, fin, device="cuda", requires_grad=True)
        g = torch.randn(rows, fout, device="cuda")
        results = {id(ref): [], id(new): []}
        for m in (ref, new, ref, new):  # (the second call of ours may take the planned path)
            x.grad = None
            with torch.autocast("cuda", dtype=dtype):
                out = m(x)
            out.backward(g)
            results[id(m)].append((out.detach(), x.grad, m.gemm.weight.grad))
            m.zero_grad(set_to_none=True)
        for want, got in zip(results[id(ref)], results[id(new)]):
            for a, b in zip(want, got):
                assert a.dtype == b.dtype
                # the same composition: alike up to the order of any atomic sum; fused:
                # float32 data and a TF32 GEMM, within 16-bit matmul tolerance
                tol = 1e-5 if rows == 1024 else 3e-2
                scale = a.float().abs().max().item()
                torch.testing.assert_close(b.float(), a.float(), atol=tol * scale, rtol=tol)
        for buf in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(new.bn, buf), getattr(ref.bn, buf),
                                       atol=1e-5 if rows == 1024 else 3e-2, rtol=1e-5)


@pytest.mark.gpu
def test_forward_plan_follows_the_tf32_switch():
    """A float32 forward that Hopper runs off wgmma (K % 4) is the vendor's GEMM, whose
    precision follows torch's TF32 switch when it runs: the forward's plan is keyed on the
    switch too, so an explicit "highest" stays fp32-accurate after the switch is turned on
    (a plan keyed without it replayed F.linear on TF32)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    m, k, n = 1024, 1027, 512
    x, w = (torch.randn(r, k, device="cuda", generator=g) for r in (m, n))
    b, s, gamma, beta = (torch.randn(n, device="cuda", generator=g) for _ in range(4))
    want = gsbn_torch(*(t.double() for t in (x, w, b, s, gamma, beta)), None, None, True, 0.1,
                      1e-5)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for tf32 in (False, True, False):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            out = cupykern.gemm_scale_batchnorm(x, w, b, s, gamma, beta, precision="highest")
            err = (out.double() - want).abs().max().item()
            assert err <= 1e-4 * want.abs().max().item(), (tf32, err)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False])
def test_tiny_scale_on_a_wide_product(training):
    """scale 1e-19 on z of std ~1e17 (y of std ~0.03): BatchNorm's coefficients as
    PyTorch's, whose s * s alone would flush to zero in the kernels (once outputs several
    times too large, and a batch variance of 0 in running_var), and the gradients of the
    scale and the rest as float64's."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(16, 8, generator=gen, dtype=torch.float64) * 1e17
    scale = torch.full((16,), 1e-19, dtype=torch.float64)
    rm, rv = torch.zeros(16, dtype=torch.float64), torch.full((16,), 1e-3, dtype=torch.float64)
    g = torch.randn(64, 16, generator=gen, dtype=torch.float64)
    results = []
    for dt, dev in ((torch.float32, "cuda"), (torch.float64, "cpu")):
        args = [t.to(dev, dt) for t in (x, w, scale)]
        for t in args:
            t.requires_grad_()
        stats = [t.to(dev, dt) for t in (rm, rv)]
        with matmul_precision("highest"):
            out = cupykern.gemm_scale_batchnorm(args[0], args[1], None, args[2], None, None,
                                                *stats, training=training)
        grads = torch.autograd.grad(out, args, g.to(dev, dt))
        results.append([t.detach().double().cpu() for t in (out, *stats, *grads)])
    for name, got, want in zip(("out", "running_mean", "running_var", "dx", "dW", "dscale"),
                               *results):
        scale_ = float(want.abs().max()) or 1.0
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * scale_, msg=name)
