"""Shared test utilities: tolerances, float64 references, layouts, array kinds, guards.

* ``TOL`` / ``MATMUL_TOL`` / ``ATOL``: the one tolerance table (:func:`tolerance`).
* ``*_torch``: each op as PyTorch expressions. Run on float64 copies of the (already
  rounded) inputs they are the reference; run in the input dtype they are PyTorch's own
  result, which :func:`assert_close_or_within_2x_torch` uses as the second yardstick.
* :class:`Layout` and :func:`guarded`: a strided view of any kind inside a buffer filled
  with a nan sentinel, so that reads outside the view poison results and writes outside
  it (or into an input) are caught bit for bit.
* Kinds: ``"cupy"``, ``"torch"`` (CUDA), ``"numpy"``, ``"torch_cpu"``; cupy is imported
  only when a GPU kind is used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F


GPU_KINDS = ("cupy", "torch")
CPU_KINDS = ("numpy", "torch_cpu")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# ---------------------------------------------------------------- tolerances

# Relative tolerance per dtype, applied to each op's error scale (|reference| for
# normalize, sum_k |x_k w_k| + |b| for matmuls): a few roundings of the dtype. float32
# allows for sums of ~16k terms (NumPy adds strided reductions one by one: ~1e-5 at 1k).
TOL = {torch.float64: 1e-12, torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# float32 matmuls by precision: "highest" is 3xTF32 (about SGEMM's accuracy); "high" is TF32
# (10 mantissa bits, truncated: up to 2**-10 per operand); "medium" bf16 operands (or TF32).
MATMUL_TOL = {"highest": 1e-5, "high": 4e-3, "medium": 1.6e-2}
# Absolute floor. float32 and bfloat16 (computed in float32) may be flushed to zero below
# the smallest normal: CuPy's NVRTC compiles with -ftz=true (a documented limitation).
# float16 is computed in float32, where its subnormals are normal: only their spacing.
ATOL = {torch.float64: torch.finfo(torch.float64).smallest_normal,
        torch.float32: torch.finfo(torch.float32).smallest_normal,
        torch.bfloat16: torch.finfo(torch.bfloat16).smallest_normal,
        torch.float16: 2.0 ** -24}
# Largest finite value of the type PyTorch accumulates each dtype in.
ACC_MAX = {torch.float64: torch.finfo(torch.float64).max, torch.float32: torch.finfo(torch.float32).max,
           torch.float16: torch.finfo(torch.float32).max, torch.bfloat16: torch.finfo(torch.float32).max}


def tolerance(dtype, precision=None) -> float:
    """The relative tolerance for ``dtype`` (float32 matmuls: for ``precision``)."""
    if dtype == torch.float32 and precision is not None:
        return MATMUL_TOL[precision]
    return TOL[dtype]


def flushes(kind, dtype) -> bool:
    """Whether results may differ from PyTorch's by denormals flushed to zero (-ftz)."""
    return kind in GPU_KINDS and dtype in (torch.float32, torch.bfloat16)


def flush_denormals(t: torch.Tensor) -> torch.Tensor:
    """``t`` with subnormal values replaced by a zero of the same sign, as -ftz reads them."""
    sub = (t != 0) & (t.abs() < torch.finfo(t.dtype).smallest_normal)
    return torch.where(sub, t * 0, t)


def near_overflow(ref: torch.Tensor, bound, dtype) -> torch.Tensor:
    """Where ``ref`` +- ``bound`` straddles the value that rounds to inf in ``dtype``: there
    a correct result may be finite or inf, depending on rounding and summation order."""
    fi = torch.finfo(dtype)
    edge = fi.max + fi.eps * 2.0 ** (math.floor(math.log2(fi.max)) - 1)  # max + half an ulp
    return (ref.abs() - edge).abs() <= bound


def assert_close_or_within_2x_torch(got, theirs, ref, rtol, atol=0.0, scale=None, skip=None,
                                    what="result"):
    """The comparison rule of the fuzz tests.

    ``got``: our result; ``theirs``: PyTorch's in the input dtype (same precision setting);
    ``ref``: the float64 reference from the same rounded inputs.

    * Where PyTorch's result is nan or +-inf, ours must be the same (equal_nan).
    * Elsewhere our error |got - ref| must be within ``atol + rtol * scale`` (``scale``
      defaults to |ref|), or else no more than twice PyTorch's own error |theirs - ref|.
      Where ref itself is not finite (float64 overflow), PyTorch's result stands in for it.
    * ``skip``: positions not compared at all (legitimately order-dependent overflow).
    """
    got, theirs, ref = (to_torch(a).to(torch.float64) for a in (got, theirs, ref))
    assert got.shape == ref.shape == theirs.shape, (what, got.shape, ref.shape, theirs.shape)
    skip = torch.zeros(ref.shape, dtype=torch.bool) if skip is None else skip.expand(ref.shape)
    special = ~torch.isfinite(theirs) & ~skip
    same = (got == theirs) | (got.isnan() & theirs.isnan())
    bad = special & ~same
    assert not bad.any(), (f"{what}: nan/inf differ from PyTorch's at {_where(bad)}: "
                           f"ours {got[bad][:6].tolist()}, PyTorch {theirs[bad][:6].tolist()}")
    ref = torch.where(torch.isfinite(ref), ref, theirs)
    err = (got - ref).abs()
    bound = atol + rtol * (ref.abs() if scale is None else scale)
    ok = (err <= bound) | (err <= 2 * (theirs - ref).abs())
    bad = ~ok & ~special & ~skip
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} beyond tolerance and 2x PyTorch's error, "
        f"first at {_where(bad)}: ours {got[bad][:4].tolist()}, PyTorch {theirs[bad][:4].tolist()}, "
        f"float64 {ref[bad][:4].tolist()}, bound {torch.broadcast_to(bound, ref.shape)[bad][:4].tolist()}")


def _where(mask):
    return [tuple(i) for i in mask.nonzero()[:4].tolist()]


# ---------------------------------------------------------------- references (PyTorch ops)

# Written out from the documented models (../shared/spec/MODELS.md), not imported from
# the package: its own PyTorch-ops references are the CPU paths under test (on torch CPU
# tensors the fuzz's "PyTorch's own result" would otherwise be ours).

def normalize_torch(x, p, axis):
    """Documented models 1 and 2 (any axis; ``p`` "l1" or "l2", or 1 or 2)."""
    if p in ("l1", 1):
        return x / torch.mean(torch.abs(x), dim=axis, keepdim=True)
    return x / torch.norm(x, p=2, dim=axis, keepdim=True)


def m4_torch(x, w, b=None):
    """Documented model 4 (MatmulSumMaxMeanLogSumExp)."""
    s = torch.sum(F.linear(x, w, b), dim=1, keepdim=True)
    s = torch.max(s, dim=1, keepdim=True)[0]
    s = torch.mean(s, dim=1, keepdim=True)
    s = torch.logsumexp(s, dim=1, keepdim=True)
    return torch.logsumexp(s, dim=1, keepdim=True)


def linear_torch(x, w, b=None):
    return F.linear(x, w, b)


def gsbn_torch(x, w, b, s, gamma, beta, rmean, rvar, training, factor, eps):
    """Documented model 3 as F.batch_norm: the tests' one reference for it (None for b,
    gamma, beta, or for both running statistics in training mode, as F.batch_norm takes
    them); ``rmean`` / ``rvar`` are updated in place with ``factor`` (:func:`bn_factor`)."""
    return F.batch_norm(F.linear(x, w, b) * s, rmean, rvar, gamma, beta, training, factor, eps)


def bn_factor(momentum, nbt_after):
    """nn.BatchNorm1d's running-average factor: momentum, or 1 / num_batches_tracked (after
    the increment) when momentum is None."""
    return momentum if momentum is not None else 1.0 / nbt_after


@contextlib.contextmanager
def matmul_precision(precision):
    """PyTorch's float32 matmul precision set to ``precision`` (None: left as is)."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision or old)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def assert_grad_close(got, want, rtol, atol=0.0, what=""):
    """The training issue's gradient rule: ``got`` within ``rtol`` of max|want| (plus
    ``atol``) everywhere, ``want`` being the reference gradient (float64 where one is
    run); same shape."""
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    mag = want.abs().max().item() if want.numel() else 0.0
    assert err <= rtol * mag + atol, (what, err, mag)


def finite_abs(t: torch.Tensor) -> torch.Tensor:
    """|t| in float64 with nan/inf as 0 (error scales count the finite terms)."""
    a = t.to(torch.float64).abs()
    return torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype))


def matmul_scale(x, w, b=None):
    """Error scale of x @ w.T + b: sum_k |x_k w_k| + |b| over finite terms (float64).
    Rounding errors are ulps of this, not of the possibly cancelled result."""
    s = finite_abs(x) @ finite_abs(w).T
    return s if b is None else s + finite_abs(b)


def matmul_floor(x, w, dtype):
    """Absolute error allowed for x @ w.T from flushed denormal operands (tiny * L1 norms)."""
    return ATOL[dtype] * (1 + finite_abs(x).sum(-1, keepdim=True) + finite_abs(w).sum(-1))


def _band(t, lim):
    """Finite magnitudes within a factor 4 of ``lim``: whether they overflow there depends
    on rounding and evaluation order."""
    a = finite_abs(t)
    return (a >= lim / 4) & (a <= 4 * lim)


def gsbn_bounds(x, w, b, s, gamma, beta, rmean, rvar, out, training, factor, eps, rtol, dtype):
    """Absolute error allowances for gsbn_torch's output, new running_mean and new
    running_var (the caller's rtol * |reference| comes on top), and the columns whose
    overflow depends on evaluation order (not compared).

    First-order propagation (doubled, for slack) of the GEMM error rtol * matmul_scale +
    matmul_floor through y = z * s and the normalisation: with few rows or a small
    variance this is large, as it is for PyTorch. Arguments are float64, rmean / rvar
    before the update, ``out`` the reference output.
    """
    z = F.linear(x, w, b)
    y = z * s
    gain = torch.ones(w.shape[0], dtype=torch.float64) if gamma is None else finite_abs(gamma)
    ey = finite_abs(s) * (rtol * matmul_scale(x, w, b) + matmul_floor(x, w, dtype)) + rtol * finite_abs(y)
    acc, lim = ACC_MAX[dtype], torch.finfo(dtype).max
    skip = (matmul_scale(x, w, b) >= acc / 4).any(0) | _band(z, lim).any(0) | _band(y, lim).any(0)
    zero = torch.zeros(w.shape[0], dtype=torch.float64)
    if training:
        m = x.shape[0]
        mu, var = y.mean(0), y.var(0, unbiased=False)
        sig = torch.sqrt(var + eps)
        e = ey.amax(0)
        dvar = 2 * var.sqrt() * e + e ** 2 + rtol * var
        d_out = gain / sig * (2 * e + ((y - mu) / sig).abs() * dvar / (2 * sig))
        d_rm, d_rv = factor * e, factor * m / (m - 1) * dvar
        skip |= torch.isfinite(y).all(0) & (4 * m * finite_abs(y).amax(0) ** 2 >= acc)  # sum of squares
    else:
        sig = torch.sqrt(rvar + eps)
        centred = finite_abs(y) + finite_abs(rmean)
        d_out = gain / sig * (ey + rtol * centred)
        d_rm = d_rv = zero
        # ours folds scale, gamma and 1/sigma into one factor: other intermediates
        skip |= (centred * gain.clamp(min=1) / sig.clamp(max=1) >= acc / 4).any(0)
    tiny = ATOL[dtype]
    d_out = 2 * d_out + rtol * (finite_abs(out) + (zero if beta is None else finite_abs(beta))) + tiny
    return d_out, 2 * d_rm + tiny, 2 * d_rv + tiny, skip


# ---------------------------------------------------------------- kinds

def supports(kind, dtype) -> bool:
    """NumPy and CuPy have no bfloat16."""
    return dtype != torch.bfloat16 or kind in ("torch", "torch_cpu")


def device_of(kind) -> str:
    """Where PyTorch's own (input-dtype) result is computed for this kind."""
    return "cuda" if kind in GPU_KINDS else "cpu"


def to_kind(t: torch.Tensor, kind):
    """A copy of CPU tensor ``t`` as ``kind``."""
    if kind == "torch_cpu":
        return t.clone()
    if kind == "torch":
        return t.cuda()
    if kind == "numpy":
        return t.numpy().copy()
    import cupy
    return cupy.asarray(t.numpy())


def to_torch(a) -> torch.Tensor:
    """Any kind's array as a contiguous CPU tensor (a copy for GPU kinds)."""
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().contiguous()
    if isinstance(a, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a))
    import cupy
    return torch.from_numpy(np.ascontiguousarray(cupy.asnumpy(a)))


def is_kind(a, kind) -> bool:
    if kind in ("torch", "torch_cpu"):
        return isinstance(a, torch.Tensor) and a.is_cuda == (kind == "torch")
    if kind == "numpy":
        return isinstance(a, np.ndarray)
    import cupy
    return isinstance(a, cupy.ndarray)


def as_strided(buf, kind, shape, strides, offset):
    """The view of flat buffer ``buf`` with element ``strides`` starting at ``offset``."""
    if kind in ("torch", "torch_cpu"):
        return buf.as_strided(shape, strides, offset)
    if kind == "numpy":
        from numpy.lib.stride_tricks import as_strided as strided
    else:
        from cupy.lib.stride_tricks import as_strided as strided
    return strided(buf[offset:], shape, tuple(s * buf.itemsize for s in strides))


# ---------------------------------------------------------------- layouts and guards

GUARD = 64  # sentinel elements before and after every view (128+ bytes: past a 16-byte load)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A view of ``shape`` in a flat buffer of ``size`` elements: element ``i`` of the view
    is buffer[offset + sum(i * strides)]."""

    shape: tuple
    strides: tuple
    offset: int
    size: int

    @classmethod
    def make(cls, shape, order=None, steps=None, pads=None, zero=(), misalign=0):
        """Lay ``shape`` out in memory.

        order: dims from outermost to innermost in memory (None: C order; reversed:
            Fortran order; any permutation: a transposed view).
        steps: per dim, every step-th element of a larger array (a sliced view, x[::2]).
        pads: per dim, extra unused elements (rows of a wider array, x[:, :n]).
        zero: dims with stride 0 (expanded / broadcast: every index reads one element).
        misalign: elements the view starts past a 16-byte boundary (x = big[1:]).
        """
        d = len(shape)
        order = tuple(range(d)) if order is None else tuple(order)
        steps = steps or (1,) * d
        pads = pads or (0,) * d
        extent = [1 if i in zero else shape[i] * steps[i] + pads[i] for i in range(d)]
        mem = [0] * d
        run = 1
        for i in reversed(order):
            mem[i] = run
            run *= extent[i]
        strides = tuple(0 if i in zero else mem[i] * steps[i] for i in range(d))
        offset = GUARD + misalign
        return cls(tuple(shape), strides, offset, offset + run + GUARD)

    def positions(self) -> torch.Tensor:
        """Buffer index of every element of the view (shape ``self.shape``)."""
        return torch.arange(self.size).as_strided(self.shape, self.strides, self.offset)

    def overlaps_itself(self) -> bool:
        return any(s == 0 and n > 1 for n, s in zip(self.shape, self.strides))


class Guarded:
    """A view of kind ``kind`` holding ``values`` inside a sentinel-filled buffer; the
    buffer as it was is kept to check afterwards what was written (see :func:`guarded`)."""

    def __init__(self, values: torch.Tensor, layout: Layout, kind, sentinel=math.nan):
        self.layout, self.kind = layout, kind
        host = torch.full((layout.size,), sentinel, dtype=values.dtype)
        pos = layout.positions().reshape(-1)
        host[pos] = values.reshape(-1)  # with stride 0 one of the aliased values wins
        self.inside = torch.zeros(layout.size, dtype=torch.bool)
        self.inside[pos] = True
        self.before = host
        self.values = host.as_strided(layout.shape, layout.strides, layout.offset).clone()
        self.buffer = to_kind(host, kind)
        self.view = as_strided(self.buffer, kind, layout.shape, layout.strides, layout.offset)

    def read(self) -> torch.Tensor:
        """The view's current contents (CPU tensor)."""
        return to_torch(self.buffer).as_strided(self.layout.shape, self.layout.strides,
                                                self.layout.offset)

    def check_unchanged(self, what):
        """The whole buffer is bit-identical to before (an input)."""
        changed = _bits(to_torch(self.buffer)) != _bits(self.before)
        assert not changed.any(), f"{what}: input modified at buffer positions {_first(changed)}"

    def check_outside_unchanged(self, what):
        """Nothing outside the view's elements changed (an output)."""
        changed = (_bits(to_torch(self.buffer)) != _bits(self.before)) & ~self.inside
        assert not changed.any(), f"{what}: written outside its view at {_first(changed)}"


def guarded(values: torch.Tensor, layout: Layout, kind) -> Guarded:
    """``values`` (CPU tensor of ``layout.shape``, already in the dtype) as a guarded view
    of ``kind``: ``g.view`` goes to the op, ``g.values`` is what the view really holds
    (aliased elements of stride-0 layouts share one value), then ``g.check_unchanged()``
    for inputs or ``g.check_outside_unchanged()`` for outputs."""
    return Guarded(values, layout, kind)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _first(mask):
    return mask.nonzero().reshape(-1)[:8].tolist()


# ---------------------------------------------------------------- values

SPECIALS = ("zero_rows", "nan", "inf", "-inf", "huge", "denormal")


@dataclasses.dataclass(frozen=True)
class Fill:
    """How to fill an array: seeded normal or uniform values times 2**exponent, plus a few
    special values at random positions ("zero_rows": whole lines along ``axis``)."""

    seed: int = 0
    uniform: bool = False
    exponent: int = 0
    specials: tuple = ()

    def values(self, shape, dtype, axis=-1) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        draw = torch.rand if self.uniform else torch.randn
        v = draw(shape, generator=g, dtype=torch.float64) * 2.0 ** self.exponent
        flat = v.view(-1)
        fi = torch.finfo(dtype)
        for s in sorted(self.specials):
            if v.numel() == 0:
                break
            if s == "zero_rows":
                v = _zero_lines(v, axis, g)
                flat = v.view(-1)
                continue
            pos = torch.randint(v.numel(), (int(torch.randint(1, 4, (), generator=g)),), generator=g)
            u = torch.rand(pos.shape, generator=g, dtype=torch.float64)
            sign = torch.where(torch.rand(pos.shape, generator=g) < 0.5, -1.0, 1.0).double()
            flat[pos] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf,
                         "huge": sign * fi.max * (0.25 + 0.25 * u),
                         "denormal": sign * fi.smallest_normal * u}[s]
        return v.to(dtype)


def _zero_lines(v, axis, g):
    """``v`` with a random third of its lines along ``axis`` set to zero."""
    w = v.movedim(axis, -1).contiguous()
    rows = w.view(-1, w.shape[-1])
    rows[torch.rand(rows.shape[0], generator=g) < 0.34] = 0
    return w.movedim(-1, axis).contiguous()


# ---------------------------------------------------------------- models

def model_pair(ref_cls, ours_cls, init=(), device="cpu"):
    """A (reference, ours) pair of modules built from the same seed, so that they hold the
    same parameters and buffers (our modules keep the reference's RNG order)."""
    torch.manual_seed(0)
    ref = ref_cls(*init).to(device)
    torch.manual_seed(0)
    ours = ours_cls(*init).to(device)
    for a, b in zip(ref.state_dict().values(), ours.state_dict().values()):
        assert torch.equal(a, b)
    return ref, ours


# ---- GEMM tests (test_gemm.py, test_gemm_route.py)

def gemm_data(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / k ** 0.5
    b = torch.randn(n, generator=g, dtype=torch.float64)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def gemm_errors(out, x, w, b):
    """(max |out - ref64|, max of |x| @ |w|.T + |b|) on the float64 reference."""
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    mag = x.double().abs() @ w.double().abs().T + b.double().abs()
    return (out.double() - ref).abs().max().item(), mag.max().item()


def col_major(t):
    """The same values as ``t`` (2-D), stored column by column."""
    return t.t().contiguous().t()


def hopper():
    return torch.cuda.get_device_capability() == (9, 0)


def check_mm(a, b, precision, bound):
    from cupykern.torch.gemm import mm_op as mm
    ref = a.double() @ b.double()
    mag = (a.double().abs() @ b.double().abs()).max().item()
    for av in (a, col_major(a)):
        for bv in (b, col_major(b)):
            out = mm(av, bv, precision or "highest")
            assert out.shape == ref.shape and out.dtype == a.dtype and out.is_contiguous()
            err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
            assert err <= bound * mag, (av.stride(), bv.stride(), err, mag)
