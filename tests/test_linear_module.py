"""cupykern.torch.Linear, convert / unconvert (with fused Linear -> BatchNorm1d pairs),
the attention helper, and the models benchmark's builders.

CPU tests check module structure, state_dict, parameter sharing and the fused pairs'
arguments (on the CPU the fused op runs its PyTorch reference, so it must match the two
modules to rounding); GPU tests (marked) check the same equivalences on our kernels,
in float32 ("highest") and bf16 autocast, and torch.compile(fullgraph=True)."""
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cupykern
from cupykern.torch import FusedSequential, Linear, convert, unconvert
from cupykern.torch import linear as linear_mod
from cupykern.torch.attention import scaled_dot_product, scaled_dot_product_attention


def _seeded(fn, seed=0):
    torch.manual_seed(seed)
    return fn()


def _same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture
def fused_calls(monkeypatch):
    """How many Linear -> BatchNorm1d pairs ran as one fused call."""
    calls = []
    real = linear_mod.gemm_scale_batchnorm

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_mod, "gemm_scale_batchnorm", spy)
    return calls


# ---- Linear

def test_linear_is_nn_linear_with_its_init_state_and_repr():
    ref = _seeded(lambda: nn.Linear(7, 5))
    ours = _seeded(lambda: Linear(7, 5))
    assert isinstance(ours, nn.Linear)
    _same_state(ref, ours)
    assert list(dict(ours.named_parameters())) == ["weight", "bias"]
    assert ours.extra_repr() == ref.extra_repr() == "in_features=7, out_features=5, bias=True"
    assert repr(ours) == repr(ref)
    nb = Linear(3, 2, bias=False, dtype=torch.float64, device="cpu")
    assert nb.bias is None and nb.weight.dtype == torch.float64
    assert list(nb.state_dict()) == ["weight"]
    torch.manual_seed(1)
    ours.reset_parameters()
    torch.manual_seed(1)
    ref.reset_parameters()
    _same_state(ref, ours)


@pytest.mark.parametrize("shape", [(6, 7), (2, 3, 7), (7,), (0, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_outputs_and_grads_match_nn_linear(shape, bias):
    ref = _seeded(lambda: nn.Linear(7, 5, bias=bias))
    ours = _seeded(lambda: Linear(7, 5, bias=bias))
    x = torch.randn(shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = ref(x), ours(x2)
    torch.testing.assert_close(y2, y)
    g = torch.randn_like(y)
    y.backward(g)
    y2.backward(g)
    torch.testing.assert_close(x2.grad, x.grad)
    for p, q in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_linear_runs_cupykern_linear(monkeypatch):
    seen = []
    real = linear_mod.linear_unplanned
    monkeypatch.setattr(linear_mod, "linear_unplanned", lambda *a: seen.append(a) or real(*a))
    m = Linear(4, 3)
    m(torch.randn(2, 4))
    assert len(seen) == 1 and seen[0][1] is m.weight and seen[0][2] is m.bias and seen[0][3] is None
    assert type(seen[0][4]) is tuple  # (the key its plan lookup built)


def test_linear_leaves_other_inputs_to_pytorch():
    m = Linear(4, 3)
    with pytest.raises(RuntimeError):  # PyTorch's own error for mixed dtypes
        m(torch.randn(2, 4, dtype=torch.float64))
    c = Linear(4, 3, dtype=torch.complex64)
    x = torch.randn(2, 4, dtype=torch.complex64)
    torch.testing.assert_close(c(x), F.linear(x, c.weight, c.bias))


def test_linear_runs_a_plan_and_leaves_what_it_refuses_to_pytorch(monkeypatch):
    """The shape-keyed plan (stored here under the CPU call's key, as eager CUDA calls
    store theirs), which the module tries before its own checks: a planned signature runs
    it; one whose op refuses the arguments (a float64 weight under float32 x's key) still
    gets nn.Linear's own RuntimeError, not cupykern's TypeError."""
    from cupykern.torch import gemm as tgemm

    m = Linear(6, 5)
    x = torch.randn(3, 6)
    ran = []
    monkeypatch.setitem(tgemm._LINEAR_PLANS, tgemm._linear_shape_key(x, m.weight, m.bias, None),
                        lambda *a: ran.append(1) or F.linear(*a))
    torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=0, atol=0)
    assert ran == [1]
    m.double()
    with pytest.raises(RuntimeError):
        m(x)
    with pytest.raises(TypeError, match="^weight"):
        cupykern.linear(x, m.weight, m.bias)


def test_a_call_past_its_plan_builds_the_shape_key_once(monkeypatch):
    """A call whose signature has no plan (here on the CPU: ours never stores one there)
    builds its shape key once, the functional call's and the module's, and the full path
    is handed that very key to store a plan under."""
    from cupykern.torch import gemm as tgemm

    built, handed = [], []
    real_key, real_remember = tgemm._linear_shape_key, tgemm._remember
    monkeypatch.setattr(tgemm, "_linear_shape_key", lambda *a: built.append(real_key(*a)) or built[-1])
    monkeypatch.setattr(tgemm, "_remember", lambda op, key, *a: handed.append(key) or real_remember(op, key, *a))
    m = Linear(6, 5)
    x = torch.randn(3, 6)
    for call in (lambda: cupykern.linear(x, m.weight, m.bias), lambda: m(x)):
        built.clear(), handed.clear()
        torch.testing.assert_close(call(), F.linear(x, m.weight, m.bias))
        assert len(built) == 1 and len(handed) == 1 and handed[0] is built[0]
        assert built[0] == real_key(x, m.weight, m.bias, None)


def test_from_linear_shares_parameters_hooks_and_mode():
    lin = nn.Linear(4, 3).eval()
    seen = []
    handle = lin.register_forward_hook(lambda m, i, o: seen.append(o))
    ours = Linear.from_linear(lin)
    assert type(ours) is Linear and ours.weight is lin.weight and ours.bias is lin.bias
    assert not ours.training
    x = torch.randn(2, 4)
    torch.testing.assert_close(ours(x), lin(x))
    assert len(seen) == 2
    handle.remove()
    ours(x)
    assert len(seen) == 2
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)  # an optimizer of the original
    ours(x).sum().backward()
    before = lin.weight.detach().clone()
    opt.step()
    assert not torch.equal(lin.weight, before)
    ours.register_parameter("extra", nn.Parameter(torch.ones(1)))  # own dictionaries
    assert "extra" not in dict(lin.named_parameters())


def test_from_linear_refuses_subclasses_and_parametrized_linears():
    class Mine(nn.Linear):
        pass

    with pytest.raises(TypeError, match="nn.Linear"):
        Linear.from_linear(Mine(2, 2))
    p = nn.Linear(2, 2)
    torch.nn.utils.parametrize.register_parametrization(p, "weight", nn.Identity())
    with pytest.raises(TypeError):
        Linear.from_linear(p)
    assert type(convert(nn.Sequential(p))[0]) is not Linear  # left alone


# ---- convert / unconvert

class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
                                     nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.Tanh())])
        self.heads = nn.ModuleDict({"x": nn.Linear(8, 2)})
        self.shared = self.a  # one module reached twice

    def forward(self, x):
        x = self.a(x)
        for b in self.blocks:
            x = b(x)
        return self.heads["x"](self.shared(x))


def test_convert_nested_models_shares_parameters_and_keeps_outputs():
    ref = _seeded(Custom)
    model = _seeded(Custom)
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    x = torch.randn(5, 8)
    out = convert(model)
    assert out is model  # (the root is no nn.Linear / nn.Sequential)
    assert [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == keys
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is Linear for m in linears)
    assert model.shared is model.a
    assert type(model.blocks[1][0]) is nn.Sequential  # no pair: not retyped
    torch.testing.assert_close(model(x), ref(x))
    back = unconvert(model)
    assert back is model and all(type(m) is nn.Linear for m in model.modules()
                                 if isinstance(m, nn.Linear))
    assert [id(p) for p in model.parameters()] == params and model.shared is model.a


def test_convert_a_linear_root_and_leaves_subclasses():
    lin = nn.Linear(3, 3)
    assert type(convert(lin)) is Linear and convert(lin).weight is lin.weight

    class Mine(nn.Linear):
        pass

    m = nn.Sequential(Mine(3, 3), nn.modules.linear.NonDynamicallyQuantizableLinear(3, 3))
    convert(m)
    assert type(m[0]) is Mine and type(m[1]) is nn.modules.linear.NonDynamicallyQuantizableLinear


def test_convert_leaves_cupykerns_fused_modules_alone():
    """GemmScaleBatchNorm and MatmulSumMaxMeanLogSumExp run their own kernels on a plain
    nn.Linear they require: convert leaves them (and it) as they are."""
    from cupykern.torch import GemmScaleBatchNorm, MatmulSumMaxMeanLogSumExp

    model = nn.Sequential(GemmScaleBatchNorm(4, 4, (4,)), MatmulSumMaxMeanLogSumExp(4, 3))
    out = convert(model)
    assert out is model and type(model[0].gemm) is nn.Linear
    assert type(model[1].linear) is nn.Linear


def _mlp(bn=lambda n: nn.BatchNorm1d(n)):
    return nn.Sequential(nn.Linear(6, 8), bn(8), nn.ReLU(),
                         nn.Sequential(nn.Linear(8, 8), bn(8)), nn.Linear(8, 3))


BN_KINDS = {
    "default": lambda n: nn.BatchNorm1d(n),
    "momentum_none": lambda n: nn.BatchNorm1d(n, momentum=None),
    "no_affine": lambda n: nn.BatchNorm1d(n, affine=False),
    "no_running_stats": lambda n: nn.BatchNorm1d(n, track_running_stats=False),
    "eps_momentum": lambda n: nn.BatchNorm1d(n, eps=1e-3, momentum=0.3),
}


@pytest.mark.parametrize("kind", list(BN_KINDS))
def test_fused_pairs_match_linear_batchnorm_in_both_modes(kind, fused_calls):
    ref = _seeded(lambda: _mlp(BN_KINDS[kind]))
    ours = convert(_seeded(lambda: _mlp(BN_KINDS[kind])))
    assert type(ours) is FusedSequential and type(ours[3]) is FusedSequential
    assert type(ours[0]) is Linear and type(ours[1]) is nn.BatchNorm1d
    for training in (True, True, False, True, False):
        ref.train(training)
        ours.train(training)
        x = torch.randn(16, 6)
        x2 = x.clone().requires_grad_()
        x = x.requires_grad_()
        y, y2 = ref(x), ours(x2)
        torch.testing.assert_close(y2, y, atol=1e-5, rtol=1e-5)
        g = torch.randn_like(y)
        y.backward(g)
        y2.backward(g)
        torch.testing.assert_close(x2.grad, x.grad, atol=1e-5, rtol=1e-5)
        for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-5, msg=n)
        ref.zero_grad()
        ours.zero_grad()
        sr, so = ref.state_dict(), ours.state_dict()
        assert list(sr) == list(so)
        for k in sr:  # running statistics and num_batches_tracked after each call
            torch.testing.assert_close(so[k], sr[k], atol=1e-6, rtol=1e-6, msg=k)
    assert len(fused_calls) == 2 * 5


def test_fused_pairs_state_dict_round_trips_both_ways():
    ref = _seeded(_mlp)
    ref.train()
    for _ in range(3):
        ref(torch.randn(10, 6))
    ours = convert(_seeded(_mlp, seed=5))
    ours.load_state_dict(ref.state_dict())  # strict: the same keys
    _same_state(ref, ours)
    ours.train()
    ours(torch.randn(10, 6))
    plain = _seeded(_mlp, seed=7)
    plain.load_state_dict(ours.state_dict())
    _same_state(ours, plain)
    assert list(dict(ours.named_parameters())) == list(dict(plain.named_parameters()))
    assert list(dict(ours.named_buffers())) == list(dict(plain.named_buffers()))


def test_convert_then_unconvert_restores_plain_modules_sharing_state():
    model = _seeded(_mlp)
    params = [id(t) for t in list(model.parameters()) + list(model.buffers())]
    ours = convert(model)
    assert ours is not model  # a fused root is a new module holding the same children
    assert ours[0] is model[0] and ours[1] is model[1]  # (children replaced in place)
    assert type(ours[0]) is Linear
    back = unconvert(ours)
    assert type(back) is nn.Sequential and type(back[3]) is nn.Sequential
    assert [type(m) for m in back.modules()] == [type(m) for m in _mlp().modules()]
    assert [id(t) for t in list(back.parameters()) + list(back.buffers())] == params
    assert not any(isinstance(m, (Linear, FusedSequential)) for m in back.modules())


def test_convert_without_fusing_keeps_sequential(fused_calls):
    model = convert(_seeded(_mlp), fuse_batchnorm=False)
    assert type(model) is nn.Sequential and type(model[0]) is Linear
    model(torch.randn(4, 6))
    assert not fused_calls


def test_fused_sequential_keeps_nn_sequential_behaviour():
    ours = convert(_seeded(_mlp))
    assert isinstance(ours, nn.Sequential) and len(ours) == 5
    head = ours[:2]
    assert type(head) is FusedSequential and head[0] is ours[0]
    ours.append(nn.Identity())
    ours.eval()
    x = torch.randn(3, 6)
    torch.testing.assert_close(ours(x), unconvert(copy.deepcopy(ours))(x))


def test_unfused_cases_run_the_modules(fused_calls):
    """3-D input (BatchNorm1d's (N, C, L) form), hooks, one training row, autocast and
    mixed dtypes: PyTorch's Linear -> BatchNorm1d itself, not the fused call."""
    ref = _seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    ours = convert(copy.deepcopy(ref))
    x3 = torch.randn(3, 4, 4)
    torch.testing.assert_close(ours(x3), ref(x3))
    handle = ours[1].register_forward_hook(lambda *a: None)
    ours(torch.randn(5, 4))
    handle.remove()
    # a forward set on the instance (accelerate's hooks, CPU offload): it runs
    ours[0].forward = lambda t: nn.Linear.forward(ours[0], t) * 2
    ref[0].forward = lambda t: nn.Linear.forward(ref[0], t) * 2
    x = torch.randn(5, 4)
    torch.testing.assert_close(ours(x), ref(x))
    del ours[0].forward, ref[0].forward
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        ours(torch.randn(1, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = ours(torch.randn(5, 4)), ref(torch.randn(5, 4))
    assert y.dtype == yr.dtype
    mixed = convert(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4).double()))
    with pytest.raises(RuntimeError):  # as PyTorch: float input, float64 BatchNorm
        mixed(torch.randn(5, 4))
    assert not fused_calls
    ours(torch.randn(5, 4))
    assert len(fused_calls) == 1


def test_optimizer_made_before_convert_trains_the_converted_model():
    ref = _seeded(_mlp)
    model = _seeded(_mlp)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model = convert(model)
    for _ in range(3):
        x = torch.randn(12, 6)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (k, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=k)


def test_converted_model_traces_fullgraph_on_cpu():
    """Dynamo traces the converted model (fused pairs, Linear, attention) in one graph."""
    torch._dynamo.reset()
    model = convert(_seeded(_mlp))
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(8, 6)
    torch.testing.assert_close(compiled(x), ref(x), atol=1e-5, rtol=1e-5)
    _same_state(ref, model)  # running statistics updated alike
    f = torch.compile(lambda q, k, v: scaled_dot_product(q, k, v), fullgraph=True,
                      backend="aot_eager")
    q, k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 6, 5), torch.randn(2, 3, 6, 5)
    torch.testing.assert_close(f(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_global_backward_pre_hooks_unfuse_the_pair():
    """A global full-backward pre-hook must see BatchNorm1d's backward: the pair runs the
    modules."""
    seen = []
    handle = torch.nn.modules.module.register_module_full_backward_pre_hook(
        lambda m, g: seen.append(type(m)))
    try:
        model = convert(_seeded(lambda: nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3))))
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
        model(x).sum().backward()
    finally:
        handle.remove()
    assert nn.BatchNorm1d in seen


def test_convert_leaves_a_batchnorm_subclass_unfused():
    """A BatchNorm1d subclass with its own forward is not a pair: the Sequential stays one,
    with the subclass's outputs."""
    class Doubled(nn.BatchNorm1d):
        def forward(self, x):
            return 2 * super().forward(x)

    ref = _seeded(lambda: nn.Sequential(nn.Linear(5, 3), Doubled(3)))
    ours = convert(copy.deepcopy(ref))
    assert type(ours) is nn.Sequential
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ours(x), ref(x))


# ---- attention

def _formula(q, k, v, mask=None, scale=None):
    s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("case", ["plain", "float_mask", "bool_mask", "scale", "causal",
                                  "broadcast"])
def test_attention_matches_the_pytorch_formula_with_grads(case):
    torch.manual_seed(0)
    dt = torch.float64
    q = torch.randn(2, 3, 5, 4, dtype=dt)
    k = torch.randn(2, 3 if case != "broadcast" else 1, 7, 4, dtype=dt)
    v = torch.randn(2, 3 if case != "broadcast" else 1, 7, 6, dtype=dt)
    mask, scale, causal = None, None, False
    if case == "float_mask":
        mask = torch.randn(5, 7, dtype=dt)
    elif case == "bool_mask":
        mask = torch.rand(2, 1, 5, 7) > 0.3
        mask[..., 0] = True
    elif case == "scale":
        scale = 0.3
    elif case == "causal":
        causal = True
        mask_c = torch.ones(5, 7, dtype=torch.bool).tril()
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = scaled_dot_product(*ins, mask, scale, is_causal=causal)
    want = _formula(*refs, mask_c if causal else mask, scale)
    torch.testing.assert_close(out, want)
    g = torch.randn_like(want)
    out.backward(g)
    want.backward(g)
    for a, b in zip(ins, refs):
        torch.testing.assert_close(a.grad, b.grad)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, mask, 0.0, causal, scale), sdpa)


def test_attention_runs_cupykern_matmul_and_checks_arguments(monkeypatch):
    from cupykern.torch import attention

    seen = []
    real = attention.matmul
    monkeypatch.setattr(attention, "matmul", lambda a, b, **kw: seen.append(kw) or real(a, b, **kw))
    q = torch.randn(2, 4, 8)
    scaled_dot_product(q, q, q, precision="highest")
    assert seen == [{"precision": "highest"}] * 2
    with pytest.raises(ValueError, match="mask"):
        scaled_dot_product(q, q, q, torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    kv = torch.randn(2, 1, 4, 8)
    q4 = torch.randn(2, 4, 4, 8)
    torch.testing.assert_close(scaled_dot_product_attention(q4, kv, kv, enable_gqa=True),
                               F.scaled_dot_product_attention(q4, kv, kv, enable_gqa=True))
    q6 = torch.randn(1, 6, 4, 8)  # key and value heads repeated each by its own count
    for hk, hv in ((2, 3), (6, 2), (3, 6)):
        k, v = torch.randn(1, hk, 4, 8), torch.randn(1, hv, 4, 8)
        torch.testing.assert_close(scaled_dot_product_attention(q6, k, v, enable_gqa=True),
                                   F.scaled_dot_product_attention(q6, k, v, enable_gqa=True))
    with pytest.raises(TypeError, match="^attn_mask: expected a boolean or floating"):
        scaled_dot_product_attention(q, q, q, torch.ones(4, 4, dtype=torch.long))
    h = q.half()  # a float32 mask added in the scores' dtype: a float16 result, as F.sdpa's
    mask = torch.randn(4, 4)
    out = scaled_dot_product_attention(h, h, h, mask)
    assert out.dtype == F.scaled_dot_product_attention(h, h, h, mask).dtype == torch.float16
    for name, args in (("k", (q, q.double(), q)), ("v", (q, q, q.half()))):
        with pytest.raises(TypeError, match=f"^{name}: dtype"):  # (F.sdpa raises too)
            scaled_dot_product(*args)
        with pytest.raises(RuntimeError):
            F.scaled_dot_product_attention(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (float16 cast, float64 not: F.sdpa's)
        assert scaled_dot_product(q, q.half(), q).dtype == torch.bfloat16
        with pytest.raises(TypeError, match="^k: dtype"):
            scaled_dot_product(q, q.double(), q)


def test_attention_gqa_repeats_heads_in_place():
    """enable_gqa repeats each key / value head for its group of query heads (head i of
    the query reads head i // group), as F.scaled_dot_product_attention; a value width
    other than the key's."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64)
               for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 3)))
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


# ---- the models benchmark (its builders on the CPU, so the script does not rot)

TINY = {"layers": 1, "hidden": 16, "heads": 2, "ffn": 32, "batch": 2, "seq": 6, "width": 16,
        "depth": 2, "classes": 5, "mlp_batch": 12}


def test_models_benchmark_builders_and_errors_on_cpu():
    from cupykern.benchmarks import models

    enc = _seeded(lambda: models.build_transformer(1, 16, 2, 32))
    assert sum(isinstance(m, nn.Linear) for m in enc.modules()) == 4
    conv = models.convert_model(copy.deepcopy(enc))
    assert all(type(m) is Linear for m in conv.modules() if isinstance(m, nn.Linear))
    assert conv.layers[0].attend is scaled_dot_product
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(conv(x), enc(x), atol=1e-5, rtol=1e-5)
    mlp = convert(models.build_mlp(16, 2, 5))
    assert type(mlp) is FusedSequential
    for name in models.MODELS:
        rows = models.run_model(name, TINY, 1, 1, device="cpu", timed=False)
        assert [r["form"] for r in rows] == list(models.FORMS)
        for r in rows:  # float32 on the CPU against float64: rounding only
            assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-4, r
    models.print_rows(rows)


def test_models_benchmark_has_help_and_needs_a_gpu():
    name = "cupykern.benchmarks.models"
    r = subprocess.run([sys.executable, "-m", name, "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: python -m {name}"), r.stderr
    r = subprocess.run([sys.executable, "-m", name, "--models", "nope"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--models" in r.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "-m", name], capture_output=True, text=True)
        assert r.returncode == 1 and "No CUDA GPU found" in r.stderr


# ---- GPU

def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 1024), (4, 256, 1024), (3, 1024)])
def test_gpu_linear_matches_float64(shape):
    torch.manual_seed(0)
    ours = Linear(1024, 768, device="cuda")
    x = torch.randn(shape, device="cuda", requires_grad=True)
    y = ours(x)
    w64, b64 = ours.weight.double(), ours.bias.double()
    x64 = x.detach().double().requires_grad_()
    y64 = F.linear(x64, w64, b64)
    torch.testing.assert_close(y.double(), y64, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(y)
    y.backward(g)
    y64.backward(g.double())
    err = (x.grad.double() - x64.grad).abs().max() / x64.grad.abs().max()
    assert err < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(BN_KINDS))
@pytest.mark.parametrize("training", [True, False])
def test_gpu_fused_pairs_match_pytorch(kind, training, fused_calls):
    """Fused pairs on our kernels against PyTorch's float32 modules ("highest": SGEMM):
    outputs and statistics within 1e-4; gradients, which BatchNorm's backward makes
    sensitive to rounding, judged against a float64 run (:func:`_assert_grads_as_accurate`)."""
    ref = _seeded(lambda: _mlp(BN_KINDS[kind])).cuda().train(training)
    ours = convert(copy.deepcopy(ref))
    big_ref = _seeded(lambda: nn.Sequential(nn.Linear(512, 1024), BN_KINDS[kind](1024), nn.ReLU(),
                                            nn.Linear(1024, 256))).cuda().train(training)
    big = convert(copy.deepcopy(big_ref))
    for r, o, x in ((ref, ours, torch.randn(64, 6, device="cuda")),
                    (big_ref, big, torch.randn(1024, 512, device="cuda"))):
        r64 = copy.deepcopy(r).double()
        for _ in range(3):
            xr = x.clone().requires_grad_()
            xo = x.clone().requires_grad_()
            x64 = x.double().requires_grad_()
            y, y2, y64 = r(xr), o(xo), r64(x64)
            torch.testing.assert_close(y2, y, atol=1e-4, rtol=1e-4)
            g = torch.randn_like(y)
            y.backward(g)
            y2.backward(g)
            y64.backward(g.double())
            _assert_grads_as_accurate(o, r, r64, (xo, xr, x64))
            for m in (r, o, r64):
                m.zero_grad()
            for (k, a), b in zip(r.state_dict().items(), o.state_dict().values()):
                torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=k)
    assert fused_calls


def _assert_grads_as_accurate(ours, ref, ref64, inputs=None):
    """Each gradient of ``ours`` (and of the input, ``inputs``: ours', ref's and ref64's)
    is within twice PyTorch's own float32 error against the float64 run ``ref64``, plus
    1e-5 of the largest gradient (float32's rounding of it)."""
    pairs = [(n, q.grad, p.grad, p64.grad) for (n, p), q, p64 in
             zip(ref.named_parameters(), ours.parameters(), ref64.parameters())]
    if inputs is not None:
        pairs.append(("x", *(t.grad for t in inputs)))
    for name, got, theirs, want in pairs:
        scale = want.abs().max().item()
        ours_err = (got.double() - want).abs().max().item()
        theirs_err = (theirs.double() - want).abs().max().item()
        assert ours_err <= 2 * theirs_err + 1e-5 * scale, (name, ours_err, theirs_err, scale)


@pytest.mark.gpu
def test_gpu_bf16_autocast_keeps_pytorch_dtypes():
    ref = _seeded(lambda: nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.ReLU(),
                                        nn.Linear(512, 64))).cuda()
    ours = convert(copy.deepcopy(ref))
    x = torch.randn(128, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, y2 = ref(x), ours(x)
    assert y2.dtype == y.dtype
    torch.testing.assert_close(y2.float(), y.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(ours[1].running_mean, ref[1].running_mean, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("training", [True, False])
def test_gpu_compile_fullgraph_of_a_converted_model(training):
    torch._dynamo.reset()
    ref = _seeded(lambda: nn.Sequential(nn.Linear(512, 1024), nn.BatchNorm1d(1024), nn.ReLU(),
                                        nn.Linear(1024, 256))).cuda().train(training)
    ours = convert(copy.deepcopy(ref))
    compiled = torch.compile(ours, fullgraph=True)
    ref64 = copy.deepcopy(ref).double()
    x = torch.randn(1024, 512, device="cuda")
    for _ in range(2):
        y, y2, y64 = ref(x), compiled(x), ref64(x.double())
        torch.testing.assert_close(y2, y, atol=1e-4, rtol=1e-4)
        y.square().mean().backward()
        y2.square().mean().backward()
        y64.square().mean().backward()
    _assert_grads_as_accurate(ours, ref, ref64)
    for (k, a), b in zip(ref.state_dict().items(), ours.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=k)


@pytest.mark.gpu
def test_gpu_attention_and_compiled_encoder_layer():
    from cupykern.benchmarks import models

    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    out = scaled_dot_product(q, k, v)
    want = _formula(*(t.detach().double() for t in (q, k, v)))
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    out.sum().backward()
    with torch.device("cuda"):
        enc = _seeded(lambda: models.build_transformer(2, 256, 4, 1024))
    conv = models.convert_model(copy.deepcopy(enc))
    x = torch.randn(2, 128, 256, device="cuda")
    compiled = torch.compile(conv, fullgraph=True)
    torch.testing.assert_close(compiled(x), enc(x), atol=1e-4, rtol=1e-4)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert conv(x).dtype == enc(x).dtype


@pytest.mark.gpu
def test_gpu_models_benchmark_quick(tmp_path):
    import json

    from cupykern.benchmarks import models

    out = tmp_path / "models.json"
    assert models.main(["--quick", "--steps", "2", "--warmup", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["form"] for r in rows} == set(models.FORMS) and all(r["ms"] > 0 for r in rows)
    for r in rows:
        if r["precision"] == "highest":  # float32-accurate forms
            assert r["grad_err"] < 1e-3, r


def test_sparse_input_goes_to_pytorch_as_nn_linear_takes_it():
    """Sparse x (COO, CSR), which cupykern.linear does not take: F.linear's result, in a
    Linear and in a fused Linear -> BatchNorm1d pair alike."""
    ref = _seeded(lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    ours = convert(copy.deepcopy(ref))
    assert isinstance(ours, FusedSequential)
    x = _seeded(lambda: torch.randn(5, 4), 1)
    for sparse in (x.to_sparse(), x.to_sparse_csr()):
        torch.testing.assert_close(ours[0](sparse), ref[0](x))
    torch.testing.assert_close(ours(x.to_sparse()), ref(x.to_sparse()))
    _same_state(ours, ref)


@pytest.mark.parametrize("fn", [convert, unconvert])
@pytest.mark.parametrize("module", [None, 3, torch.ones(2), [nn.Linear(2, 2)]],
                         ids=["None", "int", "tensor", "list"])
def test_convert_names_a_module_that_is_not_one(fn, module):
    with pytest.raises(TypeError, match="^module: expected a torch.nn.Module, got"):
        fn(module)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_eps_of_zero_is_what_the_installed_pytorch_makes_of_it(device, training):
    """An eps of 0 (torch from 2.10 refuses it in training): a fused pair and a
    GemmScaleBatchNorm compute, or raise, exactly as PyTorch's own modules do."""
    from cupykern.torch import GemmScaleBatchNorm
    from cupykern.torch.gemm_scale_batchnorm import GemmScaleBatchNormReference

    pair = _seeded(lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, eps=0.0)))
    gsbn = _seeded(lambda: GemmScaleBatchNormReference(4, 3, (3,), eps=0.0))
    x = _seeded(lambda: torch.randn(5, 4), 1).to(device)
    for ref, ours in ((pair, convert(copy.deepcopy(pair))),
                      (gsbn, _seeded(lambda: GemmScaleBatchNorm(4, 3, (3,), eps=0.0)))):
        ref, ours = ref.to(device).train(training), ours.to(device).train(training)
        results = []
        for m in (ours, ref):
            try:
                results.append(m(x))
            except Exception as error:  # noqa: BLE001 - compared with PyTorch's
                results.append(error)
        if isinstance(results[1], Exception):
            assert type(results[0]) is type(results[1]) and str(results[0]) == str(results[1])
        else:
            torch.testing.assert_close(results[0], results[1], rtol=1e-4, atol=1e-4)
        _same_state(ours, ref)


def test_attention_scales_q_and_k_before_the_product():
    """float16 q . k past float16's maximum (8.2e4 here) with finite scaled scores: finite
    results within float16 rounding of float64, as F.scaled_dot_product_attention (it
    scales q and k by sqrt(scale) first; scaling the product gave inf and nan)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 64, generator=g) for _ in range(3))
    q[..., :] = q[..., :1].abs() * 40 + 1
    k[..., :] = k[..., :1].abs() * 40 + 1
    got = scaled_dot_product_attention(*(t.half() for t in (q, k, v)))
    assert (q.half().float() @ k.half().float().transpose(-2, -1)).max() > 65504
    want = F.scaled_dot_product_attention(*(t.half().double() for t in (q, k, v)))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_linear_takes_nested_tensors_as_nn_linear():
    """A nested tensor (strided layout) runs through F.linear, as nn.Linear; the array
    functions refuse one with a TypeError naming the argument."""
    ref = _seeded(lambda: nn.Linear(4, 3))
    ours = Linear.from_linear(ref)
    x = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    for a, b in zip(ours(x).unbind(), ref(x).unbind()):
        torch.testing.assert_close(a, b)
    for call, name in ((lambda: cupykern.linear(x, ref.weight), "x"),
                       (lambda: cupykern.matmul(x, ref.weight.t()), "a"),
                       (lambda: cupykern.l2_normalize(x), "x")):
        with pytest.raises(TypeError, match=f"^{name}: expected a strided .* nested tensor"):
            call()
