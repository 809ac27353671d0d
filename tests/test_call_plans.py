"""Shape-keyed plans of linear / matmul on torch tensors (cupykern/torch/gemm.py): a call
that the routing table gives the vendor whatever its layout is planned by its shapes,
dtype, device and precision, and later calls run torch's own op with nothing else in
between. These tests check that such a plan never answers a call it does not fit: bad
input still gets its clear error, another layout, precision, TF32 switch, dtype or device
plans again, and the plans hold across threads, CUDA graphs and torch.compile."""
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import cupykern  # noqa: E402
from cupykern.torch import gemm as tgemm  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def plans():
    """The shape-keyed plans, emptied before and after the test."""
    for table in tgemm._SHAPE_PLANS.values():
        table.clear()
    yield tgemm._SHAPE_PLANS
    for table in tgemm._SHAPE_PLANS.values():
        table.clear()


def _operands(M=64, K=512, N=512, dtype=torch.float32, bias=True):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(N, device="cuda", dtype=dtype, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_repeat_calls_run_torchs_op(plans, dtype):
    """A small product: planned once by its shapes, then torch's own F.linear, bit for bit."""
    x, w, b = _operands(dtype=dtype)
    for _ in range(2):  # (the first call plans the op; the second finds it torch's)
        cupykern.linear(x, w, b)
    assert len(plans["linear"]) == 1
    for _ in range(3):
        x = torch.randn_like(x)
        assert torch.equal(cupykern.linear(x, w, b), F.linear(x, w, b))
    assert len(plans["linear"]) == 1


def test_bad_input_on_a_planned_shape_is_named(plans):
    """Arguments of a planned call's shapes that the op refuses: the full path's errors."""
    x, w, b = _operands()
    cupykern.linear(x, w, b)
    with pytest.raises(TypeError, match="^weight"):
        cupykern.linear(x, w.double(), b)
    with pytest.raises(TypeError, match="^bias"):
        cupykern.linear(x, w, b.half())
    with pytest.raises(TypeError, match="do not mix"):
        cupykern.linear(x, w.cpu(), b)
    with pytest.raises(ValueError, match="^precision"):
        cupykern.linear(x, w, b, precision="fastest")
    with pytest.raises(TypeError, match="^x"):
        cupykern.linear(x.to(torch.int32), w, b)
    cupykern.matmul(x, w.T)
    with pytest.raises(TypeError, match="^b"):
        cupykern.matmul(x, w.T.to(torch.int32))
    for precision in (torch.ones(2), np.ones(2)):  # (no truth value: not read by a plan key)
        with pytest.raises(ValueError, match="^precision"):
            cupykern.linear(x, w, b, precision=precision)
        with pytest.raises(ValueError, match="^precision"):
            cupykern.matmul(x, w.T, precision=precision)
    # A NumPy weight shares a planned tensor's key (torch.Size is a tuple); bf16's plan
    # reads the weight's layout first
    xh, wh = x.bfloat16(), w.bfloat16()
    cupykern.linear(xh, wh)
    with pytest.raises(TypeError, match="^weight"):
        cupykern.linear(xh, wh.float().cpu().numpy())


def test_layout_storage_and_inplace_weights(plans):
    """Another layout of the same shapes, new storage and weights changed in place: each
    call computes with the arrays it is given."""
    x, w, b = _operands()
    cupykern.linear(x, w, b)
    xt = torch.randn(x.shape[1], x.shape[0], device="cuda").T  # same shape, transposed
    # SGEMM ("highest", TF32 off): F.linear on the views as given, bit for bit
    torch.testing.assert_close(cupykern.linear(xt, w, b), F.linear(xt, w, b), rtol=0, atol=0)
    # TF32: as F.linear computes the same values laid out contiguously (the vendor's form
    # copies a transposed x first: TF32's error depends on cuBLAS's layout-chosen kernel)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        cupykern.linear(x, w, b)
        torch.testing.assert_close(cupykern.linear(xt, w, b), F.linear(xt.contiguous(), w, b),
                                   rtol=0, atol=0)
    finally:
        torch.set_float32_matmul_precision(before)
    offset = torch.randn(x.numel() + 1, device="cuda")[1:].view(x.shape)  # 4-byte offset
    torch.testing.assert_close(cupykern.linear(offset, w, b), F.linear(offset, w, b), rtol=0, atol=0)
    with torch.no_grad():
        w.mul_(2)
        b.zero_()
    torch.testing.assert_close(cupykern.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)


def test_linear_module_runs_the_plan_and_keeps_pytorchs_errors(plans):
    """cupykern.torch.Linear tries the shape-keyed plan before its own checks: a planned
    signature computes as F.linear, a weight replaced by one of another shape plans again,
    and what the plan's op refuses still gets nn.Linear's behaviour (PyTorch's error for
    mixed dtypes, F.linear for complex)."""
    from cupykern.torch import Linear

    m = Linear(512, 384, device="cuda")
    x = torch.randn(64, 512, device="cuda")
    with torch.no_grad():
        for _ in range(2):
            m(x)
        assert len(plans["linear"]) == 1
        assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
        with pytest.raises(RuntimeError):  # (no plan of float64 x: nn.Linear's own error)
            m(x.double())
        m.weight.data = torch.randn(256, 512, device="cuda")  # same object, new shape
        m.bias.data = torch.randn(256, device="cuda")
        for _ in range(2):  # (planned by the first call or the second, as any signature)
            assert torch.equal(m(x), F.linear(x, m.weight, m.bias))
        assert len(plans["linear"]) == 2
    c = Linear(8, 4, device="cuda", dtype=torch.complex64)
    xc = torch.randn(2, 8, device="cuda", dtype=torch.complex64)
    torch.testing.assert_close(c(xc), F.linear(xc, c.weight, c.bias))


def test_precision_and_tf32_switch_plan_again(plans):
    """float32's plan depends on the precision asked and torch's TF32 switch: each setting
    gets its own plan and computes as torch does under it."""
    x, w, b = _operands(M=256, K=1024, N=1024)
    old = torch.get_float32_matmul_precision()
    try:
        for setting in ("highest", "high", "highest"):
            torch.set_float32_matmul_precision(setting)
            for _ in range(2):
                got = cupykern.linear(x, w, b)
                assert torch.equal(got, F.linear(x, w, b)), setting
        assert len(plans["linear"]) == 2
    finally:
        torch.set_float32_matmul_precision(old)


def test_grad_after_a_plan_without(plans):
    """A plan made without grad serves a call autograd records: torch's own gradients."""
    x, w, b = _operands()
    cupykern.linear(x, w, b)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    g = torch.randn(x.shape[0], w.shape[0], device="cuda")
    cupykern.linear(xs, ws, bs).backward(g)
    F.linear(xr, wr, br).backward(g)
    for got, want in ((xs, xr), (ws, wr), (bs, br)):
        assert torch.equal(got.grad, want.grad)


def test_attention_stack_is_planned_apart_when_recorded(plans):
    """An attention-sized stack ((batch, head) views, 2**30.6 multiply-adds) that one
    planned launch of ours takes unrecorded is torch's matmul when autograd records it
    (gemm_route's STACK_GRAD_MIN_WORK): the shape-keyed plans hold the recorded call
    alone (no plan lookup a call), and an unrecorded call of the same shapes still runs
    ours; both match float64 and the recorded one gives torch's gradients."""
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(8, 512, 3, 12, 64, device="cuda", generator=g)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4)
    want = q.double() @ k.mT.double()
    for _ in range(2):
        torch.testing.assert_close(cupykern.matmul(q, k.mT).double(), want, atol=1e-4, rtol=0)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert not plans["matmul"] or not hopper  # (unrecorded: ours, planned by signature)
    leaf = qkv.clone().requires_grad_()
    q2, k2, _ = leaf.permute(2, 0, 3, 1, 4)
    ref = qkv.clone().requires_grad_()
    q3, k3, _ = ref.permute(2, 0, 3, 1, 4)
    gy = torch.randn(want.shape, device="cuda", generator=g)
    for _ in range(2):
        leaf.grad = None
        out = cupykern.matmul(q2, k2.mT)
        out.backward(gy)
    torch.matmul(q3, k3.mT).backward(gy)
    assert torch.equal(out, torch.matmul(q3, k3.mT)) and torch.equal(leaf.grad, ref.grad)
    recorded = [key[5] for key in plans["matmul"]]  # (the key's recorded part)
    assert recorded == ([True] if hopper else [False, True])  # (elsewhere both torch's)
    assert set(plans["matmul"].values()) == {torch.matmul}


def test_matmul_shapes_and_promotion(plans):
    a = torch.randn(3, 40, 64, device="cuda")
    b = torch.randn(64, 24, device="cuda")
    for _ in range(2):
        assert torch.equal(cupykern.matmul(a, b), torch.matmul(a, b))
    v = torch.randn(64, device="cuda")
    assert torch.equal(cupykern.matmul(a, v), torch.matmul(a, v))
    for _ in range(2):  # same shapes, another dtype: torch.matmul refuses the plan, then promoted
        got = cupykern.matmul(a, b.double())
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, torch.matmul(a.double(), b.double()))


def test_threads_share_plans(plans):
    x, w, b = _operands()
    want = F.linear(x, w, b)
    errors = []

    def work():
        try:
            for _ in range(50):
                if not torch.equal(cupykern.linear(x, w, b), want):
                    errors.append("mismatch")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_cuda_graph_capture_of_a_planned_call(plans):
    x, w, b = _operands()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cupykern.linear(x, w, b)  # planned before the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cupykern.linear(x, w, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, F.linear(x, w, b))


def test_compile_after_eager_warm_up(plans):
    x, w, b = _operands()
    cupykern.linear(x, w, b)
    cupykern.matmul(x, w.T)
    f = torch.compile(lambda x: cupykern.linear(x, w, b) + cupykern.matmul(x, w.T), fullgraph=True)
    torch.testing.assert_close(f(x), F.linear(x, w, b) + x @ w.T)
