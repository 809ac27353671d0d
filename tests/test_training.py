"""Training loops: each documented model, ours against the reference from the same seed,
20 steps of SGD, AdamW and fused AdamW. Catches stale caches and gradient drift.

Tolerances follow each quantity's sensitivity rather than trial:
* outputs: ours against a float64 run of *our own* weights (the two models' weights
  drift apart at rounding level, and M4 sums all N rows of W, so comparing the two
  models' outputs would measure that drift N-fold, not our forward's error);
* weights: against the reference's, within the drift that gradients matching to
  GRAD_RTOL (of the largest gradient of any parameter, the tolerance table's float32
  figure) allow:
  SGD moves each weight by lr * dg per step; AdamW by at most
  lr * 3 * dg / (sqrt(v_hat) + eps) (perturbing both moments), capped at 2 * lr;
* BatchNorm running statistics: after every step, against the float64 run's update of
  our own buffers (against the reference's, they would again measure the weights' drift).
"""
import pytest
import torch

from support import assert_grad_close, model_pair
from test_torch_ops import DEVICES, MODELS

STEPS = 20
GRAD_RTOL = 1e-4  # float32 "highest": gradients within 1e-4 of max|grad|
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    "adamw_fused": (torch.optim.AdamW, {"lr": 1e-3, "fused": True}),
}


def _float64_twin(ref_cls, init, ours, device):
    """The reference model in float64 holding our current weights and buffers."""
    twin = ref_cls(*init).to(device, torch.float64)
    twin.load_state_dict({k: v.double() if v.is_floating_point() else v
                          for k, v in ours.state_dict().items()})
    return twin.train(ours.training)


def _drift(opt, kw, p, grad_tol):
    """How far one step may move p's copies apart when their gradients differ by up to
    grad_tol (see the module docstring); p belongs to the reference optimizer ``opt``."""
    if isinstance(opt, torch.optim.SGD):
        return kw["lr"] * grad_tol
    state = opt.state[p]
    beta2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
    v_hat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
    return torch.clamp(3 * kw["lr"] * grad_tol / (v_hat.sqrt() + eps), max=2 * kw["lr"])


def _check_grads(params, params_ours) -> float:
    """Our parameters' gradients against the reference's, within GRAD_RTOL of the largest
    gradient of any parameter (a gradient that cancels to ~0, like gemm.bias's under
    training-mode BatchNorm, is rounding noise of that size); returns that tolerance."""
    grad_tol = GRAD_RTOL * max((p.grad.abs().max().item() for p in params), default=0.0)
    for p, q in zip(params, params_ours):
        torch.testing.assert_close(q.grad, p.grad, atol=grad_tol, rtol=0)
    return grad_tol


# The norms have no parameters: their loop checks outputs only, without an optimizer.
CASES = [(name, opt) for name, spec in MODELS.items() for opt in (OPTIMIZERS if spec[2] else [None])]


@pytest.mark.parametrize("name, opt_name", CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_training_loop_matches_reference(name, opt_name, device):
    ref_cls, ours_cls, init, shape, tol = MODELS[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, device)
    params, params_ours = list(ref.parameters()), list(ours.parameters())
    if opt_name:
        make, kw = OPTIMIZERS[opt_name]
        opt_ref, opt_ours = make(params, **kw), make(params_ours, **kw)
    bound = [torch.zeros_like(p) for p in params]
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(*shape, generator=g).to(device) + 0.1 * step
        twin = _float64_twin(ref_cls, init, ours, device)  # before ours updates its buffers
        out = ours(x)
        with torch.no_grad():
            want = twin(x.double())
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol,
                                   msg=lambda m: f"step {step}: {m}")
        for (n, a), b in zip(twin.named_buffers(), ours.buffers()):
            torch.testing.assert_close(b.to(a.dtype), a, atol=tol, rtol=tol,
                                       msg=lambda m: f"step {step}, {n}: {m}")
        if not params:
            continue
        c = torch.randn(out.shape, generator=g).to(device)  # loss = <c, out>
        (ref(x) * c).sum().backward()
        (out * c).sum().backward()
        grad_tol = _check_grads(params, params_ours)
        opt_ref.step()
        opt_ours.step()
        for i, (p, q) in enumerate(zip(params, params_ours)):
            bound[i] = bound[i] + _drift(opt_ref, kw, p, grad_tol)
            assert ((q - p).abs() <= 2 * bound[i] + 1e-7 * p.abs()).all(), (step, i)
        opt_ref.zero_grad()
        opt_ours.zero_grad()


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_training_steps_match_reference(name, device):
    """Forward + backward + SGD step of ``torch.compile(ours, fullgraph=True)`` (no graph
    break allowed) against the eager reference, three steps."""
    ref_cls, ours_cls, init, shape, tol = MODELS[name]
    ref, ours = model_pair(ref_cls, ours_cls, init, device)
    compiled = torch.compile(ours, fullgraph=True)
    params, params_ours = list(ref.parameters()), list(ours.parameters())
    opts = [torch.optim.SGD(p, lr=0.05) for p in (params, params_ours)] if params else []
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        x = torch.randn(*shape, generator=g).to(device)
        xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        want, got = ref(xr), compiled(xo)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"step {step}: {m}")
        c = torch.randn(want.shape, generator=g).to(device)
        (want * c).sum().backward()
        (got * c).sum().backward()
        assert_grad_close(xo.grad, xr.grad, GRAD_RTOL, what=f"x, step {step}")
        _check_grads(params, params_ours)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (n, a), b in zip(ref.named_buffers(), ours.buffers()):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol, msg=lambda m: f"{n}: {m}")
