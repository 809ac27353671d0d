"""The torch bridge: every ``torch.ops.cupykern`` op passes ``torch.library.opcheck``;
the four modules and the array functions compile with ``fullgraph=True`` (0 graph
breaks) in default, reduce-overhead and dynamic modes, capture in CUDA graphs, export,
and take part in autograd (never silently detached)."""
import copy

import pytest
import torch
import torch.nn.utils.parametrize
import torch.nn.utils.prune
from torch.nn import functional as F

import cupykern
from cupykern.torch import GemmScaleBatchNorm, L1Norm, L2Norm, MatmulSumMaxMeanLogSumExp
from cupykern.torch.gemm import linear_op, linear_out_op, matmul_op, mm_op
from cupykern.torch.gemm_scale_batchnorm import (GemmScaleBatchNormReference, backward_op,
                                                 batch_stats_op, gemm_scale_batchnorm_op)
from cupykern.torch.matmul_sum_max_mean_logsumexp import (MatmulSumMaxMeanLogSumExpReference,
                                                          matmul_sum_op, plan_op)
from cupykern.torch.normalize import (L1NormReference, L2NormReference, normalize_backward_op,
                                      normalize_op, normalize_out_op)
from support import m4_torch, model_pair, normalize_torch

gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]

# (reference class, our class, init args, input shape, atol=rtol against the reference)
MODELS = {
    "L1Norm": (L1NormReference, L1Norm, (), (16, 300), 1e-5),
    "L2Norm": (L2NormReference, L2Norm, (), (16, 300), 1e-5),
    "GemmScaleBatchNorm": (GemmScaleBatchNormReference, GemmScaleBatchNorm, (64, 48, (48,)), (32, 64), 1e-4),
    "MatmulSumMaxMeanLogSumExp": (MatmulSumMaxMeanLogSumExpReference, MatmulSumMaxMeanLogSumExp,
                                  (64, 48), (32, 64), 1e-4),
}


def _opcheck_cases(device):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    x, w, b = r(8, 24), r(16, 24) / 5, r(16)
    v = [r(16) for _ in range(3)]
    rm, rv = r(16), r(16).abs() + 0.5
    nbt = torch.zeros((), dtype=torch.long, device=device)
    yield normalize_op, (x, 1, 1, None)
    yield normalize_op, (x.t(), 2, 0, None)
    yield normalize_op, (r(3, 5, 7)[:, 1:], 2, -1, None)
    yield normalize_out_op, (x, 1, 1, None, torch.empty_like(x))
    yield normalize_backward_op, (x, r(8, 24), 2, 1)
    yield normalize_backward_op, (x.t(), r(24, 8), 1, 0)
    yield linear_op, (x, w, b, "highest")
    yield linear_op, (r(2, 3, 24), w, None, "high")
    yield linear_out_op, (x, w, b, "highest", x.new_empty(8, 16))
    yield mm_op, (x, w.t(), "highest")
    yield mm_op, (x.t(), r(8, 5), "high")
    yield matmul_op, (r(2, 1, 8, 24), r(3, 24, 5), "highest")
    yield matmul_op, (r(24), w.t(), "high")
    save = device == "cuda"  # (the fused backward's saved tensors are a GPU path)
    yield gemm_scale_batchnorm_op, (x, w, b, *v, rm, rv, nbt, True, 0.1, 1e-5, "highest", save)
    yield gemm_scale_batchnorm_op, (x, w, None, *v, rm.clone(), rv.clone(), nbt.clone(), True, None, 1e-5, "highest", False)
    yield gemm_scale_batchnorm_op, (x, w, b, *v, rm, rv, None, False, 0.1, 1e-5, "highest", save)
    yield batch_stats_op, (x, w, b, *v, 1e-5, "highest", save)
    z = r(8, 16)
    coefs = torch.stack([r(16), z.mean(0), r(16), r(16).abs() + 0.5])
    for input_grad, weight_grad in ((True, True), (False, True), (True, False)):
        yield backward_op, (r(8, 16), z, coefs, x, w, b, v[0], v[1], None, True, 1e-5, "highest",
                            input_grad, weight_grad)
    yield backward_op, (r(8, 16), z, coefs, x, w, None, v[0], None, None, True, 1e-5, "high", True,
                        True)
    coefs = torch.stack([r(16), torch.zeros(16, device=device), r(16), r(16).abs() + 0.5])
    yield backward_op, (r(8, 16), z, coefs, x, w, b, v[0], v[1], rm, False, 1e-5, "highest", True,
                        True)
    yield plan_op, (w, b)
    yield matmul_sum_op, (x, w, b, plan_op(w, b))
    yield matmul_sum_op, (x, w, None, plan_op(w, None))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device):
    cases = list(_opcheck_cases(device))
    assert {op.name for op, _ in cases} == {n.split("::")[1] for n in _registered_ops()}
    for op, args in cases:
        torch.library.opcheck(op.op, args)


def _registered_ops():
    return [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("cupykern::")]


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    x, w, b, s, ga, be = r(6, 5), r(4, 5), r(4), r(4), r(4), r(4)
    rm, rv = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    checks = {
        "l1 axis 1": (lambda x: cupykern.l1_normalize(x), (x,)),
        "l2 axis 0": (lambda x: cupykern.l2_normalize(x, axis=0), (x,)),
        "linear": (cupykern.linear, (x, w, b)),
        "gsbn train": (lambda *a: cupykern.gemm_scale_batchnorm(*a, rm.clone(), rv.clone()), (x, w, b, s, ga, be)),
        "gsbn eval": (lambda *a: cupykern.gemm_scale_batchnorm(*a, rm, rv, training=False), (x, w, b, s, ga, be)),
        "matmul_sum": (cupykern.matmul_sum_max_mean_logsumexp, (x, w, b)),
    }
    for name, (fn, args) in checks.items():
        assert torch.autograd.gradcheck(fn, args), name


@pytest.mark.parametrize("device", DEVICES)
def test_array_functions_keep_autograd(device):
    x = torch.randn(8, 24, device=device, requires_grad=True)
    w = torch.randn(16, 24, device=device, requires_grad=True)
    for y in (cupykern.l1_normalize(x), cupykern.l2_normalize(x), cupykern.linear(x, w),
              cupykern.matmul_sum_max_mean_logsumexp(x, w)):
        assert y.requires_grad and y.grad_fn is not None
    with pytest.raises(ValueError, match="no backward"):
        cupykern.l1_normalize(x, out=torch.empty_like(x))


def _compare(got, want, tol):
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("device", DEVICES)
def test_module_forward_backward_matches_reference(name, device):
    ref_cls, ours_cls, init, shape, tol = MODELS[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, device)
    x = torch.randn(*shape, device=device, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    want, got = ref(x), ours(x2)
    _compare(got, want, tol)
    g = torch.randn_like(want)
    want.backward(g)
    got.backward(g)
    _compare(x2.grad, x.grad, 10 * tol)
    for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
        _compare(q.grad, p.grad, 10 * tol * max(1.0, p.grad.abs().max().item()))
    for a, b in zip(ref.buffers(), ours.buffers()):
        _compare(b, a, tol)


MODES = {"default": {}, "reduce-overhead": {"mode": "reduce-overhead"}, "dynamic": {"dynamic": True}}


@gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MODELS)
def test_module_compiles_fullgraph(name, mode):
    ref_cls, ours_cls, init, shape, tol = MODELS[name]
    torch._dynamo.reset()
    ref, ours = model_pair(ref_cls, ours_cls, init, "cuda")
    eager = copy.deepcopy(ours)
    explain = torch._dynamo.explain(copy.deepcopy(ours))(torch.randn(*shape, device="cuda"))
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    compiled = torch.compile(ours, fullgraph=True, **MODES[mode])
    for rows in (shape[0], shape[0] + 8):  # a second shape: recompiles, or dynamic
        x = torch.randn(rows, *shape[1:], device="cuda")
        for _ in range(3):  # reduce-overhead records, then replays
            got = compiled(x)
            want = eager(x)
        _compare(got, want, tol)
        _compare(got, ref(x), tol)
    for a, b in zip(eager.buffers(), ours.buffers()):  # running statistics updated alike
        _compare(b, a, tol)


@gpu
@pytest.mark.parametrize("name", MODELS)
def test_module_compiles_fullgraph_after_eager_warm_up(name):
    """A module called eagerly first (its cached plans, of the weights and of x's
    signature, filled) compiles with fullgraph=True as a fresh one does, then keeps
    matching the reference through an optimizer step (no stale plan) and back in eager."""
    ref_cls, ours_cls, init, shape, tol = MODELS[name]
    torch._dynamo.reset()
    ref, ours = model_pair(ref_cls, ours_cls, init, "cuda")
    x = torch.randn(*shape, device="cuda")
    for _ in range(2):
        _compare(ours(x), ref(x), tol)  # eager: plans made, then taken
    compiled = torch.compile(ours, fullgraph=True)
    _compare(compiled(x), ref(x), tol)
    with torch.no_grad():  # the same in-place update of both: no plan may keep the old weights
        for m in (ref, ours):
            for p in m.parameters():
                p.mul_(0.5).add_(0.25)
    _compare(compiled(x), ref(x), tol)
    _compare(ours(x), ref(x), tol)
    for a, b in zip(ref.buffers(), ours.buffers()):  # running statistics updated alike
        _compare(b, a, tol)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_around_torch_func_transforms(device):
    """torch.compile of torch.func transforms (vmap, grad, jacrev) of the modules and
    functions: the reference's results (Dynamo raised an internal error tracing the ops'
    autograd.Function under a transform; there they run as their PyTorch-ops reference)."""
    from torch.func import grad, jacrev, vmap
    g = torch.Generator().manual_seed(0)
    x, xs = torch.randn(6, 8, generator=g).to(device), torch.randn(3, 6, 8, generator=g).to(device)
    lin = torch.nn.Linear(8, 5).to(device)
    w, b = lin.weight.detach(), lin.bias.detach()
    ours_lin = cupykern.torch.Linear(8, 5).to(device)
    ours_lin.load_state_dict(lin.state_dict())
    cases = {
        "vmap L2Norm": (lambda: vmap(L2Norm())(xs), lambda: vmap(L2NormReference())(xs)),
        "grad Linear": (lambda: grad(lambda t: ours_lin(t).sin().sum())(x),
                        lambda: grad(lambda t: lin(t).sin().sum())(x)),
        "jacrev l1_normalize": (lambda: jacrev(lambda t: cupykern.l1_normalize(t))(x[:2]),
                                lambda: jacrev(lambda t: normalize_torch(t, 1, 1))(x[:2])),
        "grad gemm_scale_batchnorm": (
            lambda: grad(lambda t: cupykern.gemm_scale_batchnorm(t, w, b, b.cos(), b.sin(), b,
                                                                 training=True).sin().sum())(x),
            lambda: grad(lambda t: F.batch_norm(F.linear(t, w, b) * b.cos(), None, None, b.sin(),
                                                b, True).sin().sum())(x)),
        "grad matmul_sum": (
            lambda: grad(lambda t: cupykern.matmul_sum_max_mean_logsumexp(t, w, b).sum())(x),
            lambda: grad(lambda t: m4_torch(t, w, b).sum())(x)),
    }
    for name, (ours, ref) in cases.items():
        torch._dynamo.reset()
        got = torch.compile(ours, backend="eager")()
        torch.testing.assert_close(got, ref(), atol=1e-5, rtol=1e-5, msg=name)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="eps"):  # (the op's own checks do not run there)
        torch.compile(lambda: grad(lambda t: cupykern.gemm_scale_batchnorm(
            t, w, b, b, b, b, eps=-1.0).sum())(x), backend="eager")()


@gpu
def test_array_functions_compile_fullgraph():
    torch._dynamo.reset()
    x = torch.randn(32, 64, device="cuda")
    w, b = torch.randn(48, 64, device="cuda") / 8, torch.randn(48, device="cuda")
    s, g, be = (torch.randn(48, device="cuda") for _ in range(3))

    def f(x):
        y = cupykern.l2_normalize(cupykern.linear(x, w, b)) + cupykern.l1_normalize(x).sum()
        z = cupykern.gemm_scale_batchnorm(x, w, b, s, g, be)
        return y + z + cupykern.matmul_sum_max_mean_logsumexp(x, w, b)

    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    _compare(torch.compile(f, fullgraph=True)(x), f(x), 1e-4)


@gpu
@pytest.mark.parametrize("name", MODELS)
def test_module_cuda_graph_replays_new_inputs(name):
    ref_cls, ours_cls, init, shape, tol = MODELS[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, "cuda")
    ref.eval(), ours.eval()
    static_x = torch.randn(*shape, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            ours(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_y = ours(static_x)
    for seed in range(3):
        torch.manual_seed(seed)
        static_x.copy_(torch.randn(*shape, device="cuda"))
        graph.replay()
        with torch.no_grad():
            _compare(static_y, ref(static_x), tol)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("device", DEVICES)
def test_module_exports_for_inference(name, device):
    ref_cls, ours_cls, init, shape, tol = MODELS[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, device)
    ref.eval(), ours.eval()
    x = torch.randn(*shape, device=device)
    program = torch.export.export(ours, (x,))
    if device == "cuda" or name.startswith("L"):  # CUDA, or CPU modules that run our ops
        assert any("cupykern" in str(n.target) for n in program.graph.nodes)
    with torch.no_grad():
        _compare(program.module()(x), ref(x), tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [None, 3.0, "x", [[1.0]]], ids=["None", "float", "str", "list"])
@pytest.mark.parametrize("name", MODELS)
def test_module_rejects_non_tensors(name, bad, device):
    _, ours_cls, init, _, _ = MODELS[name]
    with pytest.raises(TypeError, match="^x: expected a torch.Tensor"):
        ours_cls(*init).to(device)(bad)


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_sum_op_checks_its_plan(device):
    x, w = torch.ones(2, 3, device=device), torch.ones(4, 3, device=device)
    good = plan_op(w, None)
    for bad in (good.float(), good[:-1], torch.zeros(12, dtype=torch.float64, device=device)[1:7]):
        with pytest.raises(ValueError, match="^plan: "):
            matmul_sum_op(x, w, None, bad)
    with pytest.raises(TypeError, match="^plan: "):
        matmul_sum_op(x, w, None, [0.0] * 6)


def test_ops_are_visible_to_jit_trace_meta_tensors_and_torch_function_modes():
    """Anything that watches or traces a call sees the op, never its implementation."""
    from torch.overrides import TorchFunctionMode

    x = torch.randn(4, 6)
    traced = torch.jit.trace(L1Norm(), (x,))
    assert "cupykern::normalize" in str(traced.graph)
    assert L1Norm()(x.to("meta")).device.type == "meta"
    assert tuple(GemmScaleBatchNorm(6, 5, (5,)).to("meta")(x.to("meta")).shape) == (4, 5)

    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Watch():
        L2Norm()(x)
    assert any("cupykern.normalize" in f for f in seen), seen


def test_gsbn_backward_computes_only_the_gradients_asked_for():
    """Frozen weights: no weight gradient (and no GEMM for it), through either path."""
    torch.manual_seed(0)
    m = GemmScaleBatchNorm(6, 5, (5,))
    m.gemm.weight.requires_grad_(False)
    x = torch.randn(8, 6, requires_grad=True)
    y = cupykern.gemm_scale_batchnorm(x, m.gemm.weight, m.gemm.bias, m.scale, m.bn.weight, m.bn.bias,
                                      m.bn.running_mean, m.bn.running_var, m.bn.num_batches_tracked)
    y.square().sum().backward()
    assert m.gemm.weight.grad is None and x.grad is not None and m.scale.grad is not None


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def _prune(m):
    torch.nn.utils.prune.l1_unstructured(m, "weight", amount=0.5)  # a forward pre-hook


def _parametrize(m):
    torch.nn.utils.parametrize.register_parametrization(m, "weight", _Doubled())


def _forward_hook(m):
    m.register_forward_hook(lambda mod, args, out: out.abs())


@pytest.mark.parametrize("change", [_prune, _parametrize, _forward_hook],
                         ids=["prune", "parametrize", "forward_hook"])
@pytest.mark.parametrize("name", ["GemmScaleBatchNorm", "MatmulSumMaxMeanLogSumExp"])
@pytest.mark.parametrize("device", DEVICES)
def test_submodule_hooks_and_parametrizations_are_honoured(name, change, device):
    """The fused forward never calls its submodules: hooks on them must not be skipped,
    and a parametrized weight must be read through its parametrization."""
    ref_cls, ours_cls, init, shape, tol = MODELS[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, device)
    for m in (ref, ours):
        change(m.gemm if name == "GemmScaleBatchNorm" else m.linear)
    x = torch.randn(*shape, device=device)
    want = ref(x)
    _compare(ours(x), want, tol)
    plain = model_pair(ref_cls, ours_cls, init, device)[1]
    assert not torch.allclose(plain(x), want, atol=tol, rtol=tol)  # the change matters


CUDA_AUTOCAST = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("device, dtype", [("cpu", torch.bfloat16)] + [
    pytest.param("cuda", d, marks=gpu) for d in CUDA_AUTOCAST])
def test_linear_follows_autocast(device, dtype):
    """In an autocast region ``linear`` computes in the region's dtype, as F.linear does
    (float64 untouched), and keeps autograd; compiled too on the CPU (compiled on CUDA:
    the test below)."""
    x = torch.randn(33, 40, device=device, requires_grad=True)
    w = torch.randn(24, 40, device=device, requires_grad=True)
    b = torch.randn(24, device=device)
    fns = [cupykern.linear]
    if device == "cpu":
        torch._dynamo.reset()
        fns.append(torch.compile(lambda *a: cupykern.linear(*a), fullgraph=True))
    with torch.autocast(device, dtype=dtype):
        want = torch.nn.functional.linear(x, w, b)
        for fn in fns:
            got = fn(x, w, b)
            assert got.dtype == want.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert cupykern.linear(x.double(), w.double(), b.double()).dtype == torch.float64
    got.float().sum().backward()
    assert x.grad is not None and w.grad is not None and w.grad.dtype == torch.float32


FUSED_PAIRS = {
    "GemmScaleBatchNorm": (GemmScaleBatchNormReference, GemmScaleBatchNorm, (40, 24, (24,))),
    "MatmulSumMaxMeanLogSumExp": (MatmulSumMaxMeanLogSumExpReference, MatmulSumMaxMeanLogSumExp,
                                  (40, 24))}


@pytest.mark.parametrize("device, region", [("cpu", torch.bfloat16)] + [
    pytest.param("cuda", d, marks=gpu) for d in CUDA_AUTOCAST])
@pytest.mark.parametrize("params", ["float32", "the region's"])
@pytest.mark.parametrize("name", FUSED_PAIRS)
def test_fused_modules_take_x_in_any_dtype_under_autocast(name, params, device, region):
    """In an autocast region the reference model's Linear takes x into the region's dtype,
    so x of another 16/32-bit dtype than the weights (an autocast Linear's output, say)
    works there: the module and the function return the reference's dtype, with values
    within 16-bit rounding of it (CUDA: ours from float32 data, TF32 GEMMs). Outside
    autocast a mismatch stays a TypeError naming weight."""
    ref_cls, ours_cls, init = FUSED_PAIRS[name]
    params = torch.float32 if params == "float32" else region  # (BatchNorm refuses a float32
    # input with 16-bit parameters: bfloat16 weights in a float16 region fail in the reference)
    ref, ours = (m.to(device, params) for m in model_pair(ref_cls, ours_cls, init, device))
    lin = ours.gemm if name == "GemmScaleBatchNorm" else ours.linear
    for xdt in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(64, 40, device=device).to(xdt)
        with torch.autocast(device, dtype=region):
            want = ref(x)
            if name == "GemmScaleBatchNorm":
                fn = cupykern.gemm_scale_batchnorm(x, lin.weight, lin.bias, ours.scale,
                                                   ours.bn.weight, ours.bn.bias, training=True)
            else:
                fn = cupykern.matmul_sum_max_mean_logsumexp(x, lin.weight, lin.bias)
            got = ours(x)
        for out in (got, fn):
            assert out.dtype == want.dtype, (xdt, out.dtype, want.dtype)
            scale = float(want.detach().float().abs().max())
            torch.testing.assert_close(out.float(), want.float(), rtol=5e-2, atol=5e-2 * scale)
        if xdt != params:
            with pytest.raises(TypeError, match="weight"):
                ours(x)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_linear_follows_each_autocast_dtype(device):
    """Compiled calls in one autocast dtype after another, compiled afresh or not, return
    each region's dtype. (Inductor's compiled-graph cache keys on the traced graph only:
    the casts must be in it, or a fresh compile in float16 reused the bfloat16 graph.)"""
    cupykern.linear(torch.randn(2, 3, device=device), torch.randn(2, 3, device=device))
    x, w = torch.randn(8, 16, device=device), torch.randn(4, 16, device=device)
    with (torch._inductor.config.patch(fx_graph_cache=True),  # where the defect was
          torch._functorch.config.patch(enable_autograd_cache=True)):
        for fresh in (False, True):
            torch._dynamo.reset()
            fn = torch.compile(lambda a, b: cupykern.linear(a, b), fullgraph=True)
            for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
                if fresh:
                    torch._dynamo.reset()
                with torch.autocast(device, dtype=dtype):
                    got = fn(x, w)
                    assert got.dtype == dtype
                    torch.testing.assert_close(got, torch.nn.functional.linear(x, w),
                                               atol=5e-2, rtol=5e-2)


@gpu
@pytest.mark.parametrize("dtype", CUDA_AUTOCAST)
@pytest.mark.parametrize("name", MODELS)
def test_modules_follow_autocast(name, dtype):
    """Under CUDA autocast each module returns the reference's dtype and values within
    16-bit matmul tolerance (our GEMMs run at TF32 there, at least as accurate), and trains."""
    ref_cls, ours_cls, init, shape, _ = MODELS[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, "cuda")
    x = torch.randn(*shape, device="cuda", requires_grad=True)
    for call in range(2):  # the first call plans; the second may take the planned path
        with torch.autocast("cuda", dtype=dtype):
            want, got = ref(x), ours(x)
        assert got.dtype == want.dtype
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * scale, rtol=2e-2)
        x.grad = None
        got.float().sum().backward()
        assert x.grad is not None and all(p.grad is not None for p in ours.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["L1Norm", "L2Norm"])
def test_norms_follow_autocast_on_16bit_inputs(name, device):
    """CUDA autocast computes torch.norm in float32, so the reference L2 model returns
    float32 for bfloat16 x there; L1 (and CPU autocast) stay in x's dtype."""
    ref_cls, ours_cls, init, shape, _ = MODELS[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, device)
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        want, got = ref(x), ours(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)


def test_mm_op_names_b_for_a_dtype_mismatch():
    with pytest.raises(TypeError, match=r"^b: dtype float64 does not match a's dtype float32"):
        mm_op(torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float64), "highest")


@pytest.mark.parametrize("p", [1, 2])
def test_normalize_backward_op_is_contiguous_as_its_fake(p):
    """The backward op's CPU result is contiguous for transposed x and dy, as its fake
    tensor (what torch.compile plans with) says."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(6, 5, generator=g).t(), torch.randn(6, 5, generator=g).t()
    got = normalize_backward_op(x, dy, p, 1)
    with FakeTensorMode() as mode:
        fake = normalize_backward_op(mode.from_tensor(x), mode.from_tensor(dy), p, 1)
    assert got.is_contiguous() and got.stride() == fake.stride() and got.shape == fake.shape
