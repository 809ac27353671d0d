"""Second order and torch.func: every function and module's backward is itself
differentiable (gradgradcheck in float64, a WGAN-GP gradient penalty against the
reference model), and grad, vjp, jacrev, jvp, jacfwd, vmap and vmap of grad (per-sample
gradients) give the reference model's results, or raise the kind of error it raises.

On the CPU the functions run the ops' CPU implementations (the same autograd.Functions
and rules as on CUDA); the modules GemmScaleBatchNorm and MatmulSumMaxMeanLogSumExp run
the reference model itself there, so their cases count on the GPU."""
import copy

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import cupykern
from cupykern.torch import GemmScaleBatchNorm, L1Norm, L2Norm, MatmulSumMaxMeanLogSumExp, convert
from cupykern.torch.gemm_scale_batchnorm import GemmScaleBatchNormReference
from cupykern.torch.matmul_sum_max_mean_logsumexp import MatmulSumMaxMeanLogSumExpReference
from cupykern.torch.normalize import L1NormReference, L2NormReference
from support import m4_torch as m4_reference, model_pair, normalize_torch

gpu = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]
F64 = torch.float64
TOL = dict(atol=1e-9, rtol=1e-9)

# name -> (reference class, our class, init args, one sample's input shape, mode)
MODULES = {
    "L1Norm": (L1NormReference, L1Norm, (), (5, 7), None),
    "L2Norm": (L2NormReference, L2Norm, (), (5, 7), None),
    "GemmScaleBatchNorm train": (GemmScaleBatchNormReference, GemmScaleBatchNorm,
                                 (7, 4, (4,)), (5, 7), True),
    "GemmScaleBatchNorm batch statistics": (GemmScaleBatchNormReference, GemmScaleBatchNorm,
                                            (7, 4, (4,)), (5, 7), "batch statistics"),
    "GemmScaleBatchNorm eval": (GemmScaleBatchNormReference, GemmScaleBatchNorm,
                                (7, 4, (4,)), (5, 7), False),
    "MatmulSumMaxMeanLogSumExp": (MatmulSumMaxMeanLogSumExpReference, MatmulSumMaxMeanLogSumExp,
                                  (7, 4), (5, 7), None),
}


def _pair(name, device):
    ref_cls, ours_cls, init, shape, training = MODULES[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, device)
    ref, ours = ref.double(), ours.double()
    if training == "batch statistics":  # torch.func's recipe for BatchNorm in training
        for m in (ref, ours):
            torch.func.replace_all_batch_norm_modules_(m)
    elif training is not None:
        ref.train(training), ours.train(training)
        if not training:  # running statistics that are not the initial ones
            for m in (ref, ours):
                m.bn.running_mean.copy_(torch.linspace(-1, 1, 4))
                m.bn.running_var.copy_(torch.linspace(0.5, 2, 4))
    return ref, ours, shape


def _rand(*shape, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(device)


# ------------------------------------------------------------------ double backward

def _functions(device):
    """name -> (function of tensors, its float64 inputs that require grad)."""
    r = lambda *s, seed: _rand(*s, device=device, seed=seed).requires_grad_()  # noqa: E731
    x, w, b, s, ga, be = (r(6, 5, seed=1), r(4, 5, seed=2), r(4, seed=3), r(4, seed=4),
                          r(4, seed=5), r(4, seed=6))
    rm, rv = _rand(4, device=device, seed=7), _rand(4, device=device, seed=8).abs() + 0.5
    return {
        "l1_normalize": (lambda x: cupykern.l1_normalize(x), (x,)),
        "l2_normalize axis 0": (lambda x: cupykern.l2_normalize(x, axis=0), (x,)),
        "linear": (cupykern.linear, (x, w, b)),
        "matmul batched": (cupykern.matmul, (r(2, 6, 5, seed=9), r(5, 3, seed=10))),
        "gemm_scale_batchnorm train": (
            lambda *a: cupykern.gemm_scale_batchnorm(*a, rm.clone(), rv.clone()), (x, w, b, s, ga, be)),
        "gemm_scale_batchnorm batch statistics": (cupykern.gemm_scale_batchnorm, (x, w, b, s, ga, be)),
        "gemm_scale_batchnorm eval": (
            lambda *a: cupykern.gemm_scale_batchnorm(*a, rm, rv, training=False), (x, w, b, s, ga, be)),
        "matmul_sum_max_mean_logsumexp": (cupykern.matmul_sum_max_mean_logsumexp, (x, w, b)),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_gradgradcheck_every_function(device):
    for name, (fn, args) in _functions(device).items():
        assert torch.autograd.gradgradcheck(fn, args), name


def _as_function(m, x):
    """``(f, inputs)``: m's output as a function of x and its parameters."""
    names = [n for n, _ in m.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in m.named_parameters()]

    def f(x, *ps):
        return functional_call(m, dict(zip(names, ps)), (x,))
    return f, (x.detach().clone().requires_grad_(), *params)


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("device", DEVICES)
def test_gradgradcheck_every_module(name, device):
    _, ours, shape = _pair(name, device)
    f, inputs = _as_function(ours, _rand(*shape, device=device))
    assert torch.autograd.gradgradcheck(f, inputs)


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("device", DEVICES)
def test_gradient_penalty_matches_reference(name, device):
    """WGAN-GP: a penalty on the input gradient, then backward to the parameters."""
    grads = []
    for m in _pair(name, device)[:2]:
        x = _rand(*MODULES[name][3], device=device).requires_grad_()
        y = m(x)
        gx, = torch.autograd.grad(y.sum(), x, create_graph=True)
        (y.pow(2).mean() + gx.pow(2).sum()).backward()
        grads.append([x.grad] + [p.grad for p in m.parameters()])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, **TOL)


def test_matmul_sum_double_backward_reaches_the_weight():
    """The issue's case: dx = g W.sum(0) must carry its dependence on W."""
    x, w = _rand(3, 4, device="cpu").requires_grad_(), _rand(2, 4, device="cpu", seed=1)
    grads = []
    for fn in (cupykern.matmul_sum_max_mean_logsumexp, m4_reference):
        wi = w.clone().requires_grad_()
        gx, = torch.autograd.grad(fn(x, wi).sum(), x, create_graph=True)
        gx.pow(2).sum().backward()
        grads.append(wi.grad)
    torch.testing.assert_close(grads[0], grads[1], **TOL)
    assert grads[0].abs().max() > 0


# ------------------------------------------------------------------ torch.func

def _run(fn):
    """``(result, None)`` or ``(None, the exception)``."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - compared with the reference's
        return None, e


def _same(ours, ref):
    (got, got_err), (want, want_err) = _run(ours), _run(ref)
    if want_err is not None or got_err is not None:
        assert (got_err is not None and want_err is not None
                and isinstance(got_err, type(want_err))), (repr(got_err), repr(want_err))
        return False
    torch.utils._pytree.tree_map(lambda a, b: torch.testing.assert_close(a, b, **TOL), got, want)
    return True


def _transforms(f, args, batch):
    """name -> a call of ``f(*args)`` under that transform (argument 0 is x; ``batch``:
    x with one more leading dimension)."""
    every = tuple(range(len(args)))
    tangents = tuple(torch.ones_like(a) / (i + 1) for i, a in enumerate(args))
    cot = torch.linspace(-1, 1, f(*args).numel(), dtype=F64, device=args[0].device)
    cot = cot.reshape(f(*args).shape)
    rest = (None,) * (len(args) - 1)

    def per_sample(x, *ps):  # one sample's gradients (a sample: one input of the batch)
        return grad(lambda ps, x: f(x, *ps).sum())(ps, x)
    return {
        "grad": lambda: grad(lambda *a: f(*a).sum(), argnums=every)(*args),
        "vjp": lambda: vjp(f, *args)[1](cot),
        "jacrev": lambda: jacrev(f, argnums=every)(*args),
        "jvp": lambda: jvp(f, args, tangents),
        "jacfwd": lambda: jacfwd(f, argnums=every)(*args),
        "vmap": lambda: vmap(f, in_dims=(0, *rest))(batch, *args[1:]),
        "vmap of grad": lambda: vmap(per_sample, in_dims=(0, *rest))(batch, *args[1:]),
        "grad of grad": lambda: grad(lambda x: grad(lambda x: f(x, *args[1:]).pow(2).sum())(x)
                                     .pow(2).sum())(args[0]),
    }


TRANSFORMS = ("grad", "vjp", "jacrev", "jvp", "jacfwd", "vmap", "vmap of grad", "grad of grad")


@pytest.mark.parametrize("name", MODULES)
@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_on_modules_matches_reference(name, device):
    ref, ours, shape = _pair(name, device)
    x, batch = _rand(*shape, device=device), _rand(3, *shape, device=device, seed=9)
    params = [p.detach().clone() for p in ours.parameters()]
    cases = [_transforms(_as_function(m, x)[0], (x, *params), batch) for m in (ours, ref)]
    results = {t: _same(cases[0][t], cases[1][t]) for t in TRANSFORMS}
    for a, b in zip(ours.buffers(), ref.buffers()):  # (running statistics)
        torch.testing.assert_close(a, b, **TOL)
    # What PyTorch refuses: BatchNorm's running statistics in training mode, captured
    # from outside a grad/jvp transform, or unbatched under vmap.
    refused = set(TRANSFORMS) if name == "GemmScaleBatchNorm train" else set()
    assert {t for t, ok in results.items() if not ok} == refused


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_updates_running_statistics_passed_in(device):
    """BatchNorm's running statistics as inputs of the transformed function: grad works
    and updates them once, as the reference does."""
    ref, ours, shape = _pair("GemmScaleBatchNorm train", device)
    x = _rand(*shape, device=device)
    got = []
    for m in (ours, ref):
        params, buffers = dict(m.named_parameters()), dict(m.named_buffers())
        got.append(grad(lambda p, b, x: functional_call(m, (p, b), (x,)).pow(2).sum())(
            params, buffers, x))
        assert m.bn.num_batches_tracked.item() == 1
    torch.utils._pytree.tree_map(lambda a, b: torch.testing.assert_close(a, b, **TOL), *got)
    for a, b in zip(ours.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_transforms_with_running_statistics_copied_inside(device):
    """jvp, jacfwd and hessian in training mode, the running statistics copied inside the
    transformed function (where they may be updated): the reference's results, and the
    module's own buffers untouched (the op's jvp updates copies made inside its nested
    transform, not the tensors it captured)."""
    ref = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4)).double()
    ours = convert(copy.deepcopy(ref)).to(device)  # (the op on the CPU too)
    ref, x = ref.to(device), _rand(6, 5, device=device)
    before = [b.clone() for b in ours.buffers()]

    def model(m):
        def f(x):
            buffers = {k: v.clone() for k, v in m.named_buffers()}
            return functional_call(m, (dict(m.named_parameters()), buffers), (x,))
        return f
    for name, transform in (("jvp", lambda f: jvp(f, (x,), (torch.ones_like(x),))),
                            ("jacfwd", lambda f: jacfwd(f)(x)),
                            ("hessian", lambda f: hessian(lambda x: f(x).pow(2).sum())(x))):
        got, want = transform(model(ours)), transform(model(ref))
        torch.utils._pytree.tree_map(
            lambda a, b: torch.testing.assert_close(a, b, **TOL, msg=name), got, want)
    for a, b in zip(ours.buffers(), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _function_pairs(device):
    """name -> (ours, reference) as functions of (x, *parameters)."""
    from cupykern.torch.gemm import linear
    from cupykern.torch.gemm_scale_batchnorm import _reference as gsbn_reference
    rm, rv = _rand(4, device=device, seed=7), _rand(4, device=device, seed=8).abs() + 0.5

    def gsbn(training):
        def ours(x, *p):
            return cupykern.gemm_scale_batchnorm(x, *p, rm, rv, training=training)

        def ref(x, *p):
            return gsbn_reference(x, *p, rm, rv, None, training, 0.1, 1e-5, "highest", False)[0]
        return ours, ref
    return {
        "l1_normalize": (lambda x: cupykern.l1_normalize(x), lambda x: normalize_torch(x, 1, 1)),
        "l2_normalize axis 0": (lambda x: cupykern.l2_normalize(x, axis=0),
                                lambda x: normalize_torch(x, 2, 0)),
        "linear": (linear, torch.nn.functional.linear),
        "matmul batched": (cupykern.matmul, torch.matmul),
        "gemm_scale_batchnorm batch statistics": (cupykern.gemm_scale_batchnorm,
                                                  lambda x, *p: gsbn_reference(
                                                      x, *p, None, None, None, True, None, 1e-5,
                                                      "highest", False)[0]),
        "gemm_scale_batchnorm train": gsbn(True),
        "gemm_scale_batchnorm eval": gsbn(False),
        "matmul_sum_max_mean_logsumexp": (cupykern.matmul_sum_max_mean_logsumexp, m4_reference),
    }


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_on_functions_matches_reference(device):
    funcs = _functions(device)
    for name, (ours, ref) in _function_pairs(device).items():
        args = tuple(a.detach() for a in funcs[name][1])
        batch = _rand(3, *args[0].shape, device=device, seed=9)
        cases = [_transforms(f, args, batch) for f in (ours, ref)]
        results = {t: _same(cases[0][t], cases[1][t]) for t in TRANSFORMS}
        refused = {"vmap", "vmap of grad"} if name == "gemm_scale_batchnorm train" else set()
        assert {t for t, ok in results.items() if not ok} == refused, name


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_of_an_ensemble_of_weights(device):
    """Batched weights (model ensembles): the reference's rule under vmap."""
    x, ws = _rand(5, 7, device=device), _rand(3, 4, 7, device=device, seed=1)
    for ours, ref in ((cupykern.matmul_sum_max_mean_logsumexp, m4_reference),
                      (cupykern.linear, torch.nn.functional.linear)):
        torch.testing.assert_close(vmap(ours, in_dims=(None, 0))(x, ws),
                                   vmap(ref, in_dims=(None, 0))(x, ws), **TOL)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mode_ad_with_dual_tensors(device):
    """torch.autograd.forward_ad in eager mode: tangents are never dropped."""
    import torch.autograd.forward_ad as fwad

    funcs = _functions(device)
    for name, (ours, ref) in _function_pairs(device).items():
        args = tuple(a.detach() for a in funcs[name][1])
        tangents = [torch.ones_like(a) / (i + 1) for i, a in enumerate(args)]
        got = []
        for f in (ours, ref):
            with fwad.dual_level():
                y = f(*(fwad.make_dual(a, t) for a, t in zip(args, tangents)))
                got.append(fwad.unpack_dual(y))
        assert got[0].tangent is not None, name
        torch.testing.assert_close(got[0].primal, got[1].primal, **TOL)
        torch.testing.assert_close(got[0].tangent, got[1].tangent, **TOL)


def _batchnorm_written_out(x, w, b, s, gamma, beta, eps=1e-5):
    """Training-mode model 3 with BatchNorm's statistics written out in PyTorch ops."""
    y = torch.nn.functional.linear(x, w, b) * s
    mean, var = y.mean(0), y.var(0, unbiased=False)
    return (y - mean) * torch.rsqrt(var + eps) * gamma + beta


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_scale_batchnorm_hessian_over_parameters(device):
    """hessian and grad of jacrev (a vmap between the two differentiations) of the
    training-mode op over (weight, bn_weight), against the model written out in PyTorch
    ops, and grad of jacrev against central differences of the inner gradient. (PyTorch's
    own F.batch_norm gives a different (d bn_weight, d weight) block here, one that
    finite differences of its own gradient disagree with, on torch 2.13 CPU; the written-out
    model and finite differences agree with ours.)"""
    g = torch.Generator().manual_seed(0)
    x, w, b, s, gamma, beta = (torch.randn(*shape, generator=g, dtype=F64).to(device)
                               for shape in ((4, 5), (3, 5), (3,), (3,), (3,), (3,)))

    def ours(w, gamma):
        return cupykern.gemm_scale_batchnorm(x, w, b, s, gamma, beta, training=True).sin().sum()

    def written(w, gamma):
        return _batchnorm_written_out(x, w, b, s, gamma, beta).sin().sum()

    got, want = (torch.func.hessian(f, argnums=(0, 1))(w, gamma) for f in (ours, written))
    for i in range(2):
        for j in range(2):
            torch.testing.assert_close(got[i][j], want[i][j], **TOL, msg=f"block {i}{j}")
    c = torch.arange(3.0, dtype=F64, device=device)

    def inner(f, w):  # the bn_weight gradient's weighted sum, by jacrev (a vmap of vjp)
        return (jacrev(f, 1)(w, gamma) * c).sum()

    mixed = grad(lambda w: inner(ours, w))(w)
    e, fd = 1e-6, torch.zeros_like(w)
    for idx in [(0, 0), (1, 2), (2, 4)]:
        step = torch.zeros_like(w)
        step[idx] = e
        fd[idx] = (inner(ours, w + step) - inner(ours, w - step)) / (2 * e)
        torch.testing.assert_close(mixed[idx], fd[idx], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(mixed, grad(lambda w: inner(written, w))(w), **TOL)
