"""Property-based fuzzing of every op against float64 PyTorch references.

Hypothesis draws sizes (0, 1, primes, 2**k +- 1), ndim 1-4, every axis, all four
dtypes, layouts (C / Fortran / transposed, stepped, padded, misaligned, expanded and
broadcast stride-0 views), array kinds, ``out=`` (none, in place, any non-overlapping
layout) and special values (zero rows, nan, +-inf, huge, denormal). Every input and
output view sits in a sentinel (nan) buffer: inputs must stay bit-identical and
nothing outside an output view may change. Results follow tests/support.py's rule:
within the tolerance table, or no farther from float64 than 2x PyTorch's own error,
with nan/inf exactly where PyTorch has them.

Two profiles: the CPU one (NumPy / torch CPU reference paths) runs in CI in seconds;
the GPU one (CuPy, torch CUDA; ``@pytest.mark.gpu``) draws 200 examples per op, or
``CUPYKERN_FUZZ_EXAMPLES`` for a deeper run. Both are derandomized and database-free,
so every run draws the same examples.
"""
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cupykern
from cupykern.torch import GemmScaleBatchNorm, L1Norm, L2Norm, MatmulSumMaxMeanLogSumExp
from support import (ACC_MAX, ATOL, CPU_KINDS, DTYPES, GPU_KINDS, SPECIALS, TOL, Fill, Layout,
                     as_strided, assert_close_or_within_2x_torch, bn_factor, device_of,
                     flush_denormals, flushes, gsbn_bounds, gsbn_torch, guarded, is_kind,
                     linear_torch, m4_torch, matmul_floor, matmul_precision, matmul_scale,
                     near_overflow, normalize_torch, supports, to_kind, to_torch, tolerance)

# nan/inf/overflow arithmetic is the point here: the NumPy paths and references warn.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

_COMMON = dict(deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_GPU_EXAMPLES = int(os.environ.get("CUPYKERN_FUZZ_EXAMPLES", 200))
CPU = settings(max_examples=40, **_COMMON)
GPU = settings(max_examples=_GPU_EXAMPLES, **_COMMON)
GPU_FOCUSED = settings(max_examples=max(_GPU_EXAMPLES // 4, 1), **_COMMON)

SIZES = (1, 2, 3, 0, 5, 7, 9, 13, 17, 31, 33, 37, 63, 65, 127, 129, 251, 255, 257, 509,
         511, 513, 1021, 1023, 1025, 2039, 2047, 2049, 4093, 4095, 4097, 8191, 8193, 16381,
         16383, 16385)
MAX_ELEMS = 20000  # per array, so the GPU profile runs in a couple of minutes
MAX_BUFFER = 8 * MAX_ELEMS
NORMALIZE = {"l1": cupykern.l1_normalize, "l2": cupykern.l2_normalize}
PRECISIONS = (None, "highest", "high", "medium")


# ---------------------------------------------------------------- strategies

def sizes(cap, low=0):
    return st.sampled_from([n for n in SIZES if low <= n <= cap])


@st.composite
def shapes(draw, ndim, cap=MAX_ELEMS):
    """``ndim`` sizes whose nonzero product is at most ``cap``, in any order."""
    shape = []
    for _ in range(ndim):
        shape.append(draw(sizes(cap)))
        cap //= max(shape[-1], 1)
    return tuple(draw(st.permutations(shape)))


@st.composite
def layouts(draw, shape, overlap=True, stride0=False):
    """A Layout for ``shape``: any memory order, steps, padding and misalignment; with
    ``overlap``, also stride-0 dims (expanded: any; broadcast: leading); ``stride0``
    forces one of those."""
    d = len(shape)
    order = draw(st.sampled_from(["C", "F", "transposed"]))
    perm = {"C": None, "F": tuple(reversed(range(d)))}.get(order)
    if order == "transposed":
        perm = tuple(draw(st.permutations(range(d))))
    steps = tuple(draw(st.sampled_from([1, 2, 3])) for _ in range(d)) if draw(st.booleans()) else None
    pads = tuple(draw(st.sampled_from([0, 1, 5])) for _ in range(d)) if draw(st.booleans()) else None
    zero = ()
    if overlap and d:
        modes = ["expanded", "broadcast"] if stride0 else ["none", "expanded", "broadcast"]
        mode = draw(st.sampled_from(modes))
        if mode == "expanded":
            zero = tuple(i for i in range(d) if draw(st.booleans())) or (d - 1,)
        elif mode == "broadcast":
            zero = tuple(range(draw(st.integers(1, d))))
    misalign = draw(st.sampled_from([0, 1]))
    layout = Layout.make(shape, perm, steps, pads, zero, misalign)
    if layout.size > MAX_BUFFER:  # keep buffers small: drop the gaps
        layout = Layout.make(shape, perm, None, None, zero, misalign)
    return layout


def contiguous(shape):
    """C-contiguous, 16-byte aligned or one element past."""
    return st.sampled_from([0, 1]).map(lambda m: Layout.make(shape, misalign=m))


def dtypes(kind):
    return st.sampled_from([d for d in DTYPES if supports(kind, d)])


def fills(specials=SPECIALS, uniform=None):
    chosen = st.just(())
    if specials:
        chosen = st.lists(st.sampled_from(specials), max_size=3, unique=True).map(tuple)
    return st.builds(Fill, seed=st.integers(0, 2**31 - 1),
                     uniform=st.booleans() if uniform is None else st.just(uniform),
                     exponent=st.sampled_from([0, -6, 6]), specials=chosen)


PLAIN = fills(specials=())  # parameters: ordinary values


@st.composite
def matmul_dims(draw, min_m=0, min_n=0):
    """(M, K, N) with M*K, N*K and M*N at most MAX_ELEMS."""
    k = draw(sizes(4097))
    m = draw(sizes(MAX_ELEMS // max(k, 1), low=min_m))
    n = draw(sizes(MAX_ELEMS // max(k, m, 1), low=min_n))
    return m, k, n


def vector(data, values, kind, label, overlap=True):
    """A guarded 1-D view of ``values`` in a drawn layout."""
    return guarded(values, data.draw(layouts(values.shape, overlap), label=label), kind)


def optional_vector(data, n, dtype, kind, label):
    if not data.draw(st.booleans(), label=f"has {label}"):
        return None
    return vector(data, data.draw(PLAIN, label=f"{label} fill").values((n,), dtype), kind, label)


def on(device, *tensors):
    """Copies of CPU tensors (or None) on ``device``."""
    return [None if t is None else t.to(device, copy=True) for t in tensors]


def vals(*guards):
    """The values each guard's view holds (CPU tensors; None passes through)."""
    return [None if g is None else g.values for g in guards]


def f64(*guards):
    return [None if v is None else v.double() for v in vals(*guards)]


def view(g):
    return None if g is None else g.view


def check_inputs_unchanged(**guards):
    for name, g in guards.items():
        if g is not None:
            g.check_unchanged(name)


# ---------------------------------------------------------------- normalize

def check_normalize(data, kinds, stride0=False):
    kind = data.draw(st.sampled_from(kinds), label="kind")
    dtype = data.draw(dtypes(kind), label="dtype")
    ndim = data.draw(st.integers(1, 4), label="ndim")
    shape = data.draw(shapes(ndim), label="shape")
    axis = data.draw(st.integers(-ndim, ndim - 1), label="axis")
    p = data.draw(st.sampled_from(sorted(NORMALIZE)), label="p")
    fill = data.draw(fills(), label="x fill")
    x = guarded(fill.values(shape, dtype, axis), data.draw(
        layouts(shape, stride0=stride0), label="x layout"), kind)
    modes = ["none", "out"] + ([] if x.layout.overlaps_itself() else ["in place"])
    mode = data.draw(st.sampled_from(modes), label="out mode")
    out = None
    if mode == "out":  # a fresh, offset or strided out; its elements start as nan too
        out = guarded(torch.full(shape, math.nan, dtype=dtype),
                      data.draw(layouts(shape, overlap=False), label="out layout"), kind)
    module = (mode == "none" and kind in ("torch", "torch_cpu") and ndim >= 2 and axis % ndim == 1
              and data.draw(st.booleans(), label="module"))

    if module:
        got = {"l1": L1Norm, "l2": L2Norm}[p]()(x.view)
    else:
        target = {"none": None, "out": view(out), "in place": x.view}[mode]
        got = NORMALIZE[p](x.view, axis, out=target)
        if target is not None:
            assert got is target
    assert is_kind(got, kind) and to_torch(got).dtype == dtype and tuple(got.shape) == shape
    if mode == "in place":
        x.check_outside_unchanged("x (out=x)")
    else:
        x.check_unchanged("x")
    if out is not None:
        out.check_outside_unchanged("out")

    # GPU float32/bfloat16 read denormal inputs as zeros (-ftz): so do the references.
    xv = flush_denormals(x.values) if flushes(kind, dtype) else x.values
    ref = normalize_torch(xv.double(), p, axis)
    theirs = normalize_torch(xv.to(device_of(kind)), p, axis)
    assert_close_or_within_2x_torch(got, theirs, ref, TOL[dtype], ATOL[dtype], what=f"{p}_normalize")


@CPU
@given(st.data())
def test_normalize_cpu(data):
    check_normalize(data, CPU_KINDS)


@pytest.mark.long
@pytest.mark.gpu
@GPU
@given(st.data())
def test_normalize_gpu(data):
    check_normalize(data, GPU_KINDS)


@pytest.mark.long
@pytest.mark.gpu
@GPU_FOCUSED
@given(st.data())
def test_normalize_stride0_gpu(data):
    """Expanded / broadcast (stride-0) inputs: leading stride-0 dims once read out of bounds."""
    check_normalize(data, GPU_KINDS, stride0=True)


def check_overlapping_out_raises(data, kinds):
    """out whose elements share memory (expanded) is a ValueError naming out; on the GPU
    so is an out that partly overlaps x (the CPU path computes before it writes). x is
    left untouched."""
    kind = data.draw(st.sampled_from(kinds), label="kind")
    dtype = data.draw(dtypes(kind), label="dtype")
    shape = data.draw(shapes(data.draw(st.integers(1, 3))).filter(lambda s: math.prod(s) > 1),
                      label="shape")
    p = data.draw(st.sampled_from(sorted(NORMALIZE)), label="p")
    x = guarded(data.draw(PLAIN).values(shape, dtype), Layout.make(shape), kind)
    wide = data.draw(st.sampled_from([i for i, n in enumerate(shape) if n > 1]), label="expanded dim")
    outs = [guarded(torch.zeros(shape, dtype=dtype), Layout.make(shape, zero=(wide,)), kind).view]
    if kind in GPU_KINDS:  # the same buffer as x, one element on
        outs.append(as_strided(x.buffer, kind, shape, x.layout.strides, x.layout.offset + 1))
    for out in outs:
        with pytest.raises(ValueError, match="out"):
            NORMALIZE[p](x.view, -1, out=out)
    x.check_unchanged("x")


@CPU
@given(st.data())
def test_normalize_overlapping_out_raises_cpu(data):
    check_overlapping_out_raises(data, CPU_KINDS)


@pytest.mark.long
@pytest.mark.gpu
@GPU_FOCUSED
@given(st.data())
def test_normalize_overlapping_out_raises_gpu(data):
    check_overlapping_out_raises(data, GPU_KINDS)


# ---------------------------------------------------------------- linear

def precisions(dtype):
    """float32 takes every precision; other dtypes ignore it."""
    return st.sampled_from(PRECISIONS if dtype == torch.float32 else (None, "high"))


def check_linear(data, kinds):
    kind = data.draw(st.sampled_from(kinds), label="kind")
    dtype = data.draw(dtypes(kind), label="dtype")
    precision = data.draw(precisions(dtype), label="precision")
    k = data.draw(sizes(4097), label="K")
    lead = data.draw(shapes(data.draw(st.integers(0, 2)), MAX_ELEMS // max(k, 1)), label="leading dims")
    n = data.draw(sizes(MAX_ELEMS // max(k, math.prod(lead), 1)), label="N")
    x = guarded(data.draw(fills(), label="x fill").values(lead + (k,), dtype),
                data.draw(layouts(lead + (k,)), label="x layout"), kind)
    w = guarded(data.draw(fills(), label="weight fill").values((n, k), dtype),
                data.draw(layouts((n, k)), label="weight layout"), kind)
    bias = optional_vector(data, n, dtype, kind, "bias")
    out = None
    if data.draw(st.booleans(), label="out"):
        out = guarded(torch.full(lead + (n,), math.nan, dtype=dtype),
                      data.draw(layouts(lead + (n,), overlap=False), label="out layout"), kind)

    got = cupykern.linear(x.view, w.view, view(bias), precision=precision, out=view(out))
    assert is_kind(got, kind) and tuple(got.shape) == lead + (n,) and to_torch(got).dtype == dtype
    check_inputs_unchanged(x=x, weight=w, bias=bias)
    if out is not None:
        assert got is out.view
        out.check_outside_unchanged("out")

    prec = precision or "highest"  # None: torch's global setting (untouched) or CuPy's default
    x64, w64, b64 = f64(x, w, bias)
    ref = linear_torch(x64, w64, b64)
    with matmul_precision(prec):
        theirs = linear_torch(*on(device_of(kind), *vals(x, w, bias)))
    rtol = tolerance(dtype, prec)
    scale, floor = matmul_scale(x64, w64, b64), matmul_floor(x64, w64, dtype)
    # Partial sums past the accumulator's range, or a result at the edge of the dtype's,
    # overflow or not depending on summation order: not compared.
    skip = (scale >= ACC_MAX[dtype] / 4) | near_overflow(ref, floor + rtol * scale, dtype)
    if dtype == torch.float32 and prec == "highest" and kind in GPU_KINDS:
        # Documented limitation (README): 3xTF32 multiplies an inf operand by the other's
        # small half, and 0 * inf gives nan where SGEMM gives inf.
        skip = skip | ref.isinf()
    assert_close_or_within_2x_torch(got, theirs, ref, rtol, floor, scale=scale, skip=skip,
                                    what=f"linear ({prec})")


@CPU
@given(st.data())
def test_linear_cpu(data):
    check_linear(data, CPU_KINDS)


@pytest.mark.long
@pytest.mark.gpu
@GPU
@given(st.data())
def test_linear_gpu(data):
    check_linear(data, GPU_KINDS)


# ---------------------------------------------------------------- GemmScaleBatchNorm

def check_gsbn(data, kinds):
    kind = data.draw(st.sampled_from(kinds), label="kind")
    dtype = data.draw(dtypes(kind), label="dtype")
    precision = data.draw(precisions(dtype), label="precision")
    training = data.draw(st.booleans(), label="training")
    stats = not training or data.draw(st.booleans(), label="running stats")
    momentum = data.draw(st.sampled_from([0.1, None, 0.5]), label="momentum")
    eps = data.draw(st.sampled_from([1e-5, 1e-3]), label="eps")
    # A training batch of one row is a ValueError, as in PyTorch (tests/test_gemm_scale_batchnorm.py);
    # zero features make F.batch_norm (the reference, and ours on torch CPU) fail.
    m, k, n = data.draw(matmul_dims(min_m=2 if training else 0, min_n=1), label="M, K, N")
    module = (stats and k > 0 and kind in ("torch", "torch_cpu")
              and data.draw(st.booleans(), label="module"))
    x = guarded(data.draw(fills(), label="x fill").values((m, k), dtype),
                data.draw(layouts((m, k)), label="x layout"), kind)
    w = guarded(data.draw(fills(), label="weight fill").values((n, k), dtype),
                data.draw(layouts((n, k)), label="weight layout"), kind)
    scale = vector(data, data.draw(PLAIN, label="scale fill").values((n,), dtype), kind, "scale")
    if module:  # nn.Linear and nn.BatchNorm1d always have these
        bias, gamma, beta = (vector(data, data.draw(PLAIN).values((n,), dtype), kind, name)
                             for name in ("bias", "bn_weight", "bn_bias"))
    else:
        bias, gamma, beta = (optional_vector(data, n, dtype, kind, name)
                             for name in ("bias", "bn_weight", "bn_bias"))
    rm = rv = nbt = nbt0 = None
    if stats:  # updated in place, so the API wants them contiguous (misaligned is fine)
        rm = guarded(data.draw(PLAIN).values((n,), dtype), data.draw(contiguous((n,))), kind)
        var = data.draw(fills(specials=(), uniform=True)).values((n,), dtype) + 0.5
        rv = guarded(var, data.draw(contiguous((n,))), kind)
        # momentum None (a cumulative average) needs the counter to update the statistics
        if module or (training and momentum is None) or data.draw(st.booleans(), label="counter"):
            nbt0 = data.draw(st.integers(0, 5), label="num_batches_tracked")
            nbt = to_kind(torch.tensor(nbt0), kind)

    if module:
        mod = GemmScaleBatchNorm(k, n, (n,), eps=eps, momentum=momentum).to(device_of(kind), dtype)
        with torch.no_grad():
            for param, g in ((mod.gemm.weight, w), (mod.gemm.bias, bias), (mod.scale, scale),
                             (mod.bn.weight, gamma), (mod.bn.bias, beta),
                             (mod.bn.running_mean, rm), (mod.bn.running_var, rv)):
                param.copy_(g.values)
            mod.bn.num_batches_tracked.fill_(nbt0)
        mod.train(training)
        with matmul_precision(precision):
            got = mod(x.view)
        new_rm, new_rv, nbt = mod.bn.running_mean, mod.bn.running_var, mod.bn.num_batches_tracked
    else:
        got = cupykern.gemm_scale_batchnorm(
            x.view, w.view, view(bias), scale.view, view(gamma), view(beta), view(rm), view(rv),
            nbt, training=training, momentum=momentum, eps=eps, precision=precision)
        check_inputs_unchanged(weight=w, bias=bias, scale=scale, bn_weight=gamma, bn_bias=beta)
        if stats:
            for g, name in ((rm, "running_mean"), (rv, "running_var")):
                g.check_outside_unchanged(name) if training else g.check_unchanged(name)
            new_rm, new_rv = rm.read(), rv.read()
    x.check_unchanged("x")
    assert is_kind(got, kind) and tuple(got.shape) == (m, n) and to_torch(got).dtype == dtype
    if nbt is not None:
        assert int(to_torch(nbt)) == nbt0 + training

    prec = precision or "highest"
    factor = 0.0
    if training and stats:
        factor = bn_factor(momentum, None if nbt0 is None else nbt0 + 1)
    args64 = f64(x, w, bias, scale, gamma, beta)
    rm64, rv64 = f64(rm, rv)
    ref_stats = [None if t is None else t.clone() for t in (rm64, rv64)]
    ref = gsbn_torch(*args64, *ref_stats, training, factor, eps)
    dev = device_of(kind)
    their_stats = on(dev, *vals(rm, rv))
    with matmul_precision(prec):
        theirs = gsbn_torch(*on(dev, *vals(x, w, bias, scale, gamma, beta)), *their_stats,
                            training, factor, eps)
    rtol = tolerance(dtype, prec)
    d_out, d_rm, d_rv, skip = gsbn_bounds(*args64, rm64, rv64, ref, training, factor, eps, rtol, dtype)
    skip_out = skip | near_overflow(ref, d_out + rtol * ref.abs(), dtype)
    assert_close_or_within_2x_torch(got, theirs, ref, rtol, d_out, skip=skip_out,
                                    what=f"output ({'training' if training else 'eval'}, {prec})")
    if stats:
        # Where a training batch column holds +-inf, PyTorch's own Welford statistics are
        # nan or +-inf depending on how it splits the rows over threads: not compared.
        # That includes y overflowing the input dtype while float64's stays finite.
        if training:
            skip = skip | torch.isinf(torch.nn.functional.linear(*args64[:3]) * args64[3]).any(0)
            with matmul_precision(prec):
                xd, wd, bd, sd = on(dev, *vals(x, w, bias, scale))
                y = torch.nn.functional.linear(xd, wd, bd) * sd
            skip = skip | torch.isinf(y).any(0).cpu()
        for i, (name, new, bound) in enumerate((("running_mean", new_rm, d_rm),
                                                ("running_var", new_rv, d_rv))):
            assert_close_or_within_2x_torch(new, their_stats[i], ref_stats[i], rtol, bound,
                                            skip=skip, what=name)


@CPU
@given(st.data())
def test_gemm_scale_batchnorm_cpu(data):
    check_gsbn(data, CPU_KINDS)


@pytest.mark.long
@pytest.mark.gpu
@GPU
@given(st.data())
def test_gemm_scale_batchnorm_gpu(data):
    check_gsbn(data, GPU_KINDS)


# ---------------------------------------------------------------- MatmulSumMaxMeanLogSumExp

def check_m4(data, kinds):
    kind = data.draw(st.sampled_from(kinds), label="kind")
    dtype = data.draw(dtypes(kind), label="dtype")
    b, k, n = data.draw(matmul_dims(), label="B, K, N")
    x = guarded(data.draw(fills(), label="x fill").values((b, k), dtype),
                data.draw(layouts((b, k)), label="x layout"), kind)
    w = guarded(data.draw(fills(), label="weight fill").values((n, k), dtype),
                data.draw(layouts((n, k)), label="weight layout"), kind)
    bias = optional_vector(data, n, dtype, kind, "bias")
    how = ["function", "plan"] + (["module"] if kind in ("torch", "torch_cpu") and k and n else [])
    how = data.draw(st.sampled_from(how), label="call")

    if how == "module":
        mod = MatmulSumMaxMeanLogSumExp(k, n).to(device_of(kind), dtype)
        with torch.no_grad():
            mod.linear.weight.copy_(w.values)
            if bias is None:
                mod.linear.bias = None
            else:
                mod.linear.bias.copy_(bias.values)
        got = mod(x.view)
    else:
        plan = cupykern.prepare_matmul_sum(w.view, view(bias)) if how == "plan" else None
        got = cupykern.matmul_sum_max_mean_logsumexp(x.view, w.view, view(bias), plan=plan)
    check_inputs_unchanged(x=x, weight=w, bias=bias)
    assert is_kind(got, kind) and tuple(got.shape) == (b, 1) and to_torch(got).dtype == dtype

    x64, w64, b64 = f64(x, w, bias)
    ref = m4_torch(x64, w64, b64)
    theirs = m4_torch(*on(device_of(kind), *vals(x, w, bias)))
    # The sum of N Linear outputs: its error scales with sum_j sum_k |x_k w_jk| + |b_j|.
    rtol = TOL[dtype]
    per_out = matmul_scale(x64, w64, b64)
    floor = matmul_floor(x64, w64, dtype)
    scale = per_out.sum(1, keepdim=True)
    atol = floor.sum(1, keepdim=True) + ATOL[dtype]
    # Overflow that depends on summation order (torch's partial sums, the rounding of
    # one output or of the total at the dtype's edge) is not compared.
    z = linear_torch(x64, w64, b64)
    z_edge = near_overflow(z, floor + rtol * per_out, dtype).any(1, keepdim=True)
    skip = (scale >= ACC_MAX[dtype] / 4) | z_edge | near_overflow(ref, atol + rtol * scale, dtype)
    assert_close_or_within_2x_torch(got, theirs, ref, rtol, atol, scale=scale, skip=skip,
                                    what=f"matmul_sum ({how})")


@CPU
@given(st.data())
def test_matmul_sum_cpu(data):
    check_m4(data, CPU_KINDS)


@pytest.mark.long
@pytest.mark.gpu
@GPU
@given(st.data())
def test_matmul_sum_gpu(data):
    check_m4(data, GPU_KINDS)
