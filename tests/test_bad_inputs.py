"""Bad-input battery: every public function and module rejects bad arguments with a
TypeError / ValueError that names the argument, leaves every input bit-exact unchanged
(module state included), and leaves the CUDA context usable.

Each case builds its call from a :class:`Kind` (how to make arrays of one input kind),
so one table runs on NumPy and torch CPU (CI) and on torch CUDA and CuPy (``@gpu``).
"""
from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import cupykern  # noqa: E402
from cupykern.torch import (GemmScaleBatchNorm, L1Norm, L2Norm,  # noqa: E402
                            MatmulSumMaxMeanLogSumExp)

CPU_KINDS = ("numpy", "torch_cpu")
GPU_KINDS = ("torch_cuda", "cupy")
ALL = CPU_KINDS + GPU_KINDS
TORCH = ("torch_cpu", "torch_cuda")
NON_TORCH = ("numpy", "cupy")
NUMPY = ("numpy",)
GPU = GPU_KINDS
CUDA_TORCH = ("torch_cuda",)
# The kind a "foreign" argument has: the other library, same place.
_FOREIGN = {"numpy": "torch_cpu", "torch_cpu": "numpy", "torch_cuda": "cupy", "cupy": "torch_cuda"}
# The host twin of a GPU kind (same library, CPU).
_HOST = {"torch_cuda": "torch_cpu", "cupy": "numpy"}


class Kind:
    """Makes arrays of one input kind; remembers every array and module it made, so the
    test can snapshot them all."""

    def __init__(self, name, tracked=None):
        self.name = name
        self.device = "cuda" if name in GPU_KINDS else "cpu"
        self.tracked = [] if tracked is None else tracked

    def of(self, a: np.ndarray):
        """``a`` converted to this kind (tracked)."""
        if self.name == "numpy":
            obj = a
        elif self.name == "cupy":
            import cupy
            obj = cupy.asarray(a)
        else:
            obj = torch.from_numpy(a).to(self.device)
        self.tracked.append(obj)
        return obj

    def arr(self, shape=(4, 6), dtype="float32", seed=0):
        return self.of(np.random.default_rng(seed).standard_normal(shape).astype(dtype))

    @property
    def foreign(self):
        return Kind(_FOREIGN[self.name], self.tracked)

    @property
    def host(self):
        return Kind(_HOST[self.name], self.tracked)

    def other_device(self, shape, dtype="float32"):
        """An array of this kind on cuda:1 (skips without a second GPU)."""
        if torch.cuda.device_count() < 2:
            pytest.skip("needs a second GPU")
        if self.name == "cupy":
            import cupy
            with cupy.cuda.Device(1):
                obj = cupy.asarray(np.ones(shape, dtype))
        else:
            obj = torch.ones(shape, dtype=getattr(torch, dtype), device="cuda:1")
        self.tracked.append(obj)
        return obj

    def sparse(self, shape):
        """A sparse COO torch tensor (torch kinds only)."""
        obj = self.arr(shape).to_sparse()
        self.tracked.append(obj)
        return obj

    def expanded(self, shape):
        """A writable view of ``shape`` whose rows all share one row's memory."""
        base = self.arr((1,) + tuple(shape[1:]), seed=5)
        if self.name in TORCH:
            return base.expand(shape)
        strides = (0,) + base.strides[1:]
        if self.name == "numpy":
            return np.lib.stride_tricks.as_strided(base, shape, strides, writeable=True)
        import cupy
        return cupy.lib.stride_tricks.as_strided(base, shape, strides)

    def read_only(self, shape=(4, 6), dtype="float32"):
        """A NumPy array flagged writeable=False (numpy kind only)."""
        a = self.arr(shape, dtype, seed=6)
        a.flags.writeable = False
        return a

    def overlapping(self, **shapes):
        """Views of one (rows, cols + 1) buffer, the second shifted by a column, so
        they partially overlap: ``overlapping(x=(4, 6), out=(4, 6))``."""
        (n1, (m, c1)), (n2, (_, c2)) = shapes.items()
        buf = self.arr((m, max(c1, c2) + 1), seed=7)
        return {n1: buf[:, :c1], n2: buf[:, 1:1 + c2]}

    def module(self, m: nn.Module):
        m = m.to(self.device)
        self.tracked.append(m)
        return m


def _raw(obj):
    """(dtype, shape, bytes) of an array or tensor, or a module's state, for bit-exact
    (nan-safe) comparison."""
    if isinstance(obj, nn.Module):
        return [(k, _raw(v)) for k, v in obj.state_dict().items()]
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        t = (t.to_dense() if t.layout != torch.strided else t).cpu().contiguous().reshape(-1)
        return str(obj.dtype), tuple(obj.shape), t.view(torch.uint8).numpy().tobytes()
    if isinstance(obj, np.ndarray):
        return obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes()
    import cupy
    return obj.dtype.str, obj.shape, cupy.asnumpy(obj).tobytes()


def _to_numpy(y):
    if isinstance(y, torch.Tensor):
        return y.cpu().numpy()
    return y if isinstance(y, np.ndarray) else y.get()


def _check_healthy(k: Kind):
    """A small valid op of this kind still runs and gives the right answer."""
    x = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    y = cupykern.l2_normalize(Kind(k.name).of(x))
    if k.device == "cuda":
        torch.cuda.synchronize()
        if k.name == "cupy":
            import cupy
            cupy.cuda.Device().synchronize()
    expect = x / np.sqrt((x * x).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(_to_numpy(y), expect, rtol=1e-6)


@dataclass
class Case:
    id: str
    build: object  # Kind -> zero-argument callable that must raise
    exc: type
    match: str
    kinds: tuple = ALL


def _prefixed(prefix, cases):
    return [Case(f"{prefix}-{c.id}", c.build, c.exc, c.match, c.kinds) for c in cases]


def _not_array(name, got):
    return rf"^{name}: expected a cupy\.ndarray, torch\.Tensor or numpy\.ndarray, got {got}"


def _call(fn, defaults):
    """``make(k, **overrides)``: ``fn`` bound to default arguments of kind ``k`` (built
    only where not overridden)."""
    def make(k, **over):
        args = {n: over.pop(n) if n in over else d(k) for n, d in defaults.items()}
        return partial(fn, **args, **over)
    return make


# ---- l1_normalize / l2_normalize: x (4, 6), axis 1 ----

def _norm_cases(fn):
    call = _call(fn, {"x": lambda k: k.arr()})
    return _prefixed(fn.__name__, [
        Case("x-list", lambda k: call(k, x=[[1.0, 2.0]]), TypeError, _not_array("x", "list")),
        Case("x-None", lambda k: call(k, x=None), TypeError, _not_array("x", "NoneType")),
        Case("x-str", lambda k: call(k, x="abc"), TypeError, _not_array("x", "str")),
        Case("x-float", lambda k: call(k, x=3.0), TypeError, _not_array("x", "float")),
        Case("x-int32", lambda k: call(k, x=k.arr(dtype="int32")), TypeError, "^x: .*dtype int32"),
        Case("x-bool", lambda k: call(k, x=k.arr(dtype="bool")), TypeError, "^x: .*dtype bool"),
        Case("x-complex", lambda k: call(k, x=k.arr(dtype="complex64")), TypeError, "^x: .*dtype complex64"),
        Case("x-0d", lambda k: call(k, x=k.arr(())), ValueError, "^x: "),
        Case("x-sparse", lambda k: call(k, x=k.sparse((4, 6))),
             TypeError, "^x: .*layout torch.sparse_coo", TORCH),
        Case("x-matrix", lambda k: call(k, x=np.asmatrix(k.arr())), TypeError, r"^x: numpy.*matrix", NUMPY),
        Case("x-masked", lambda k: call(k, x=np.ma.masked_array(k.arr(), mask=k.arr() > 0)),
             TypeError, "^x: numpy.ma.*MaskedArray", NUMPY),
        Case("config-str", lambda k: call(k, config="fast"), TypeError, "^config: expected a tuple.*'fast'"),
        Case("config-float-entry", lambda k: call(k, config=(1.5, 128, 4)), TypeError,
             r"^config: expected a tuple of integers, got \(1.5, 128, 4\)"),
        Case("config-nested", lambda k: call(k, config=[[1]]), TypeError, "^config: .*integers"),
        Case("axis-2", lambda k: call(k, axis=2), ValueError, "^axis: 2 is out of range"),
        Case("axis-neg3", lambda k: call(k, axis=-3), ValueError, "^axis: -3 is out of range"),
        Case("axis-float", lambda k: call(k, axis=1.0), TypeError, "^axis: "),
        Case("axis-str", lambda k: call(k, axis="1"), TypeError, "^axis: "),
        Case("axis-None", lambda k: call(k, axis=None), TypeError, "^axis: "),
        Case("axis-bool", lambda k: call(k, axis=True), TypeError, "^axis: "),
        Case("out-list", lambda k: call(k, out=[[0.0] * 6] * 4), TypeError, _not_array("out", "list")),
        Case("out-shape", lambda k: call(k, out=k.arr((4, 5))), ValueError, r"^out: .*shape"),
        Case("out-transposed-shape", lambda k: call(k, out=k.arr((6, 4))), ValueError, r"^out: .*shape"),
        Case("out-dtype", lambda k: call(k, out=k.arr(dtype="float64")), TypeError, "^out: .*dtype"),
        Case("out-foreign", lambda k: call(k, out=k.foreign.arr()), TypeError, "^out: "),
        Case("out-host", lambda k: call(k, out=k.host.arr()), TypeError, "^out: ", GPU),
        Case("out-device1", lambda k: call(k, out=k.other_device((4, 6))), ValueError, "^out: .*cuda:1", GPU),
        Case("out-sparse", lambda k: call(k, out=k.sparse((4, 6))), TypeError, "^out: .*layout", TORCH),
        Case("out-expanded", lambda k: call(k, out=k.expanded((4, 6))), ValueError, "^out: "),
        Case("out-overlaps-x", lambda k: call(k, **k.overlapping(x=(4, 6), out=(4, 6))),
             ValueError, "^out: .*overlap", GPU),
        Case("out-read-only", lambda k: call(k, out=k.read_only()), ValueError, "^out: .*read-only", NUMPY),
    ])


# ---- linear: x (4, 6), weight (5, 6), bias (5,) ----

_linear = _call(cupykern.linear, {"x": lambda k: k.arr(), "weight": lambda k: k.arr((5, 6), seed=1),
                                  "bias": lambda k: k.arr((5,), seed=2)})

LINEAR = [
    Case("x-list", lambda k: _linear(k, x=[[1.0] * 6] * 4), TypeError, _not_array("x", "list")),
    Case("x-None", lambda k: _linear(k, x=None), TypeError, _not_array("x", "NoneType")),
    Case("x-str", lambda k: _linear(k, x="x"), TypeError, _not_array("x", "str")),
    Case("weight-None", lambda k: _linear(k, weight=None), TypeError, _not_array("weight", "NoneType")),
    Case("weight-list", lambda k: _linear(k, weight=[[1.0] * 6] * 5),
         TypeError, _not_array("weight", "list")),
    Case("bias-list", lambda k: _linear(k, bias=[0.0] * 5), TypeError, _not_array("bias", "list")),
    Case("bias-float", lambda k: _linear(k, bias=0.5), TypeError, _not_array("bias", "float")),
    Case("x-int64", lambda k: _linear(k, x=k.arr(dtype="int64")), TypeError, "^x: .*dtype int64"),
    Case("x-bool", lambda k: _linear(k, x=k.arr(dtype="bool")), TypeError, "^x: .*dtype bool"),
    Case("x-complex", lambda k: _linear(k, x=k.arr(dtype="complex64")), TypeError, "^x: .*dtype complex64"),
    Case("weight-int32", lambda k: _linear(k, weight=k.arr((5, 6), "int32")),
         TypeError, "^weight: .*dtype int32"),
    Case("weight-float64", lambda k: _linear(k, weight=k.arr((5, 6), "float64")),
         TypeError, "^weight: .*dtype"),
    Case("bias-float64", lambda k: _linear(k, bias=k.arr((5,), "float64")), TypeError, "^bias: .*dtype"),
    Case("bias-float16", lambda k: _linear(k, bias=k.arr((5,), "float16")), TypeError, "^bias: .*dtype"),
    Case("x-0d", lambda k: _linear(k, x=k.arr(())), ValueError, "^x: "),
    Case("weight-1d", lambda k: _linear(k, weight=k.arr((6,))), ValueError, "^weight: .*2-D"),
    Case("weight-3d", lambda k: _linear(k, weight=k.arr((5, 6, 1))), ValueError, "^weight: .*2-D"),
    Case("K-mismatch", lambda k: _linear(k, x=k.arr((4, 7))), ValueError, "^x: .*in_features"),
    Case("bias-length", lambda k: _linear(k, bias=k.arr((6,))), ValueError, r"^bias: .*\(5,\)"),
    Case("bias-2d", lambda k: _linear(k, bias=k.arr((1, 5))), ValueError, r"^bias: .*\(5,\)"),
    Case("precision-low", lambda k: _linear(k, precision="low"), ValueError, "^precision: "),
    Case("precision-empty", lambda k: _linear(k, precision=""), ValueError, "^precision: "),
    # (an array: its truth value and `in` are elementwise; a plan key must not read them)
    Case("precision-array", lambda k: _linear(k, precision=k.arr((2,))), ValueError, "^precision: "),
    Case("weight-foreign", lambda k: _linear(k, weight=k.foreign.arr((5, 6))), TypeError, "^weight: "),
    Case("bias-foreign", lambda k: _linear(k, bias=k.foreign.arr((5,))), TypeError, "^bias: "),
    Case("weight-host", lambda k: _linear(k, weight=k.host.arr((5, 6))), TypeError, "^weight: ", GPU),
    Case("weight-device1", lambda k: _linear(k, weight=k.other_device((5, 6))),
         ValueError, "^weight: .*cuda:1", GPU),
    Case("x-sparse", lambda k: _linear(k, x=k.sparse((4, 6))), TypeError, "^x: .*layout", TORCH),
    Case("weight-sparse", lambda k: _linear(k, weight=k.sparse((5, 6))),
         TypeError, "^weight: .*layout", TORCH),
    Case("bias-sparse", lambda k: _linear(k, bias=k.sparse((5,))), TypeError, "^bias: .*layout", TORCH),
    Case("out-list", lambda k: _linear(k, out=[[0.0] * 5] * 4), TypeError, _not_array("out", "list")),
    Case("out-shape", lambda k: _linear(k, out=k.arr((4, 6))), ValueError, r"^out: .*shape"),
    Case("out-dtype", lambda k: _linear(k, out=k.arr((4, 5), "float64")), TypeError, "^out: .*dtype"),
    Case("out-foreign", lambda k: _linear(k, out=k.foreign.arr((4, 5))), TypeError, "^out: "),
    Case("out-sparse", lambda k: _linear(k, out=k.sparse((4, 5))), TypeError, "^out: .*layout", TORCH),
    Case("out-expanded", lambda k: _linear(k, out=k.expanded((4, 5))), ValueError, "^out: "),
    Case("out-overlaps-x", lambda k: _linear(k, weight=k.arr((6, 6)), bias=None,
                                             **k.overlapping(x=(4, 6), out=(4, 6))),
         ValueError, "^out: .*overlap", GPU),
    Case("out-overlaps-weight", lambda k: _linear(k, bias=None, x=k.arr((4, 6)),
                                                  **k.overlapping(weight=(4, 6), out=(4, 4))),
         ValueError, "^out: .*overlap", GPU),
    Case("out-read-only", lambda k: _linear(k, out=k.read_only((4, 5))),
         ValueError, "^out: .*read-only", NUMPY),
]


# ---- gemm_scale_batchnorm: x (4, 6), weight (5, 6), vectors (5,), running stats and
# num_batches_tracked given (so every case also checks that nothing was updated) ----

def _nbt(k, value=3, shape=(), dtype="int64"):
    return k.of(np.full(shape, value, dtype))


_gsbn = _call(cupykern.gemm_scale_batchnorm, {
    "x": lambda k: k.arr(), "weight": lambda k: k.arr((5, 6), seed=1),
    "bias": lambda k: k.arr((5,), seed=2), "scale": lambda k: k.arr((5,), seed=3),
    "bn_weight": lambda k: k.arr((5,), seed=4), "bn_bias": lambda k: k.arr((5,), seed=5),
    "running_mean": lambda k: k.arr((5,), seed=6),
    "running_var": lambda k: k.of(np.linspace(0.5, 2.0, 5, dtype=np.float32)),
    "num_batches_tracked": _nbt})
_NO_STATS = dict(running_mean=None, running_var=None, num_batches_tracked=None)

GSBN = [
    Case("x-list", lambda k: _gsbn(k, x=[[1.0] * 6] * 4), TypeError, _not_array("x", "list")),
    Case("x-None", lambda k: _gsbn(k, x=None), TypeError, _not_array("x", "NoneType")),
    Case("weight-None", lambda k: _gsbn(k, weight=None), TypeError, _not_array("weight", "NoneType")),
    Case("scale-list", lambda k: _gsbn(k, scale=[1.0] * 5), TypeError, _not_array("scale", "list")),
    Case("running_mean-list", lambda k: _gsbn(k, running_mean=[0.0] * 5),
         TypeError, _not_array("running_mean", "list")),
    Case("x-int32", lambda k: _gsbn(k, x=k.arr(dtype="int32")), TypeError, "^x: .*dtype int32"),
    Case("weight-float64", lambda k: _gsbn(k, weight=k.arr((5, 6), "float64")),
         TypeError, "^weight: .*dtype"),
    Case("scale-int32", lambda k: _gsbn(k, scale=k.arr((5,), "int32")), TypeError, "^scale: .*dtype"),
    Case("bn_bias-float16", lambda k: _gsbn(k, bn_bias=k.arr((5,), "float16")),
         TypeError, "^bn_bias: .*dtype"),
    Case("running_var-float64", lambda k: _gsbn(k, running_var=k.arr((5,), "float64")),
         TypeError, "^running_var: .*dtype"),
    Case("x-0d", lambda k: _gsbn(k, x=k.arr(())), ValueError, "^x: "),
    Case("x-1d", lambda k: _gsbn(k, x=k.arr((6,))), ValueError, "^x: .*2-D"),
    Case("x-3d", lambda k: _gsbn(k, x=k.arr((2, 4, 6))), ValueError, "^x: .*2-D"),
    Case("weight-1d", lambda k: _gsbn(k, weight=k.arr((6,))), ValueError, "^weight: .*2-D"),
    Case("K-mismatch", lambda k: _gsbn(k, x=k.arr((4, 7))), ValueError, "^x: .*in_features"),
    Case("bias-length", lambda k: _gsbn(k, bias=k.arr((4,))), ValueError, r"^bias: .*\(5,\)"),
    Case("scale-length", lambda k: _gsbn(k, scale=k.arr((2,))), ValueError, r"^scale: .*\(5,\)"),
    Case("bn_weight-2d", lambda k: _gsbn(k, bn_weight=k.arr((5, 1))), ValueError, r"^bn_weight: .*\(5,\)"),
    Case("running_var-length", lambda k: _gsbn(k, running_var=k.arr((6,))),
         ValueError, r"^running_var: .*\(5,\)"),
    Case("scale-None", lambda k: _gsbn(k, scale=None), ValueError,
         r"^scale: required, shape \(5,\) or \(1,\)"),
    Case("running_mean-without-var", lambda k: _gsbn(k, running_var=None), ValueError, "running_var"),
    Case("running_var-without-mean", lambda k: _gsbn(k, running_mean=None), ValueError, "running_mean"),
    Case("eval-without-stats", lambda k: _gsbn(k, training=False, **_NO_STATS), ValueError, "running_mean"),
    Case("batch-of-1", lambda k: _gsbn(k, x=k.arr((1, 6))), ValueError,
         "^Expected more than 1 value per channel when training"),
    Case("eps-None", lambda k: _gsbn(k, eps=None), TypeError, "^eps: "),
    Case("eps-str", lambda k: _gsbn(k, eps="1e-5"), TypeError, "^eps: "),
    Case("eps-negative", lambda k: _gsbn(k, eps=-1e-5), ValueError, "^eps: "),
    Case("eps-nan", lambda k: _gsbn(k, eps=float("nan")), ValueError, "^eps: "),
    Case("eps-negative-eval", lambda k: _gsbn(k, eps=-1.0, training=False), ValueError, "^eps: "),
    Case("eps-zero-training", lambda k: _gsbn(k, eps=0.0), ValueError, "^eps: .*positive"),
    Case("training-array", lambda k: _gsbn(k, training=k.of(np.array([True, False]))),
         TypeError, "^training: "),
    Case("momentum-str", lambda k: _gsbn(k, momentum="a"), TypeError, "^momentum: "),
    Case("momentum-str-no-stats", lambda k: _gsbn(k, momentum="a", **_NO_STATS), TypeError, "^momentum: "),
    Case("momentum-list", lambda k: _gsbn(k, momentum=[0.1]), TypeError, "^momentum: "),
    Case("momentum-None-without-nbt", lambda k: _gsbn(k, momentum=None, num_batches_tracked=None),
         ValueError, "num_batches_tracked"),
    Case("nbt-shape-3", lambda k: _gsbn(k, num_batches_tracked=_nbt(k, shape=(3,))),
         ValueError, "^num_batches_tracked: "),
    Case("nbt-float32", lambda k: _gsbn(k, num_batches_tracked=_nbt(k, dtype="float32")),
         TypeError, "^num_batches_tracked: "),
    Case("nbt-int32", lambda k: _gsbn(k, num_batches_tracked=_nbt(k, dtype="int32")),
         TypeError, "^num_batches_tracked: "),
    Case("nbt-int", lambda k: _gsbn(k, num_batches_tracked=3), TypeError, "^num_batches_tracked: "),
    Case("nbt-foreign", lambda k: _gsbn(k, num_batches_tracked=_nbt(k.foreign)),
         TypeError, "^num_batches_tracked: "),
    Case("training-str", lambda k: _gsbn(k, training="yes"), TypeError, "^training: "),
    Case("precision-low", lambda k: _gsbn(k, precision="low"), ValueError, "^precision: "),
    Case("precision-array", lambda k: _gsbn(k, precision=k.arr((2,))), ValueError, "^precision: "),
    Case("bn_weight-foreign", lambda k: _gsbn(k, bn_weight=k.foreign.arr((5,))), TypeError, "^bn_weight: "),
    Case("running_mean-foreign", lambda k: _gsbn(k, running_mean=k.foreign.arr((5,))),
         TypeError, "^running_mean: "),
    Case("running_var-host", lambda k: _gsbn(k, running_var=k.host.arr((5,))),
         TypeError, "^running_var: ", GPU),
    Case("running_mean-device1", lambda k: _gsbn(k, running_mean=k.other_device((5,))), ValueError,
         "^running_mean: .*cuda:1", GPU),
    Case("x-sparse", lambda k: _gsbn(k, x=k.sparse((4, 6))), TypeError, "^x: .*layout", TORCH),
    Case("running_mean-sparse", lambda k: _gsbn(k, running_mean=k.sparse((5,))),
         TypeError, "^running_mean: .*layout", TORCH),
    Case("nbt-sparse", lambda k: _gsbn(k, num_batches_tracked=_nbt(k, shape=(1,)).to_sparse()), TypeError,
         "^num_batches_tracked: .*layout", TORCH),
    # Buffers updated in place must be writable, with distinct elements.
    Case("running_mean-expanded", lambda k: _gsbn(k, running_mean=k.expanded((5,))),
         ValueError, "^running_mean: "),
    Case("running_mean-read-only", lambda k: _gsbn(k, running_mean=k.read_only((5,))), ValueError,
         "^running_mean: .*read-only", NUMPY),
    Case("nbt-read-only", lambda k: _gsbn(k, num_batches_tracked=k.read_only((), "int64")), ValueError,
         "^num_batches_tracked: .*read-only", NUMPY),
]


# ---- matmul_sum_max_mean_logsumexp: x (4, 6), weight (5, 6), bias (5,); and plans ----

_msml = _call(cupykern.matmul_sum_max_mean_logsumexp, {
    "x": lambda k: k.arr(), "weight": lambda k: k.arr((5, 6), seed=1), "bias": lambda k: k.arr((5,), seed=2)})
_prepare = _call(cupykern.prepare_matmul_sum, {
    "weight": lambda k: k.arr((5, 6), seed=1), "bias": lambda k: k.arr((5,), seed=2)})


def _plan_call(k, x):
    """Calling a valid plan (of kind ``k``) on ``x``."""
    return partial(_prepare(k)(), x)


def _plan_for_other_bias(k):
    w = k.arr((5, 6), seed=1)
    plan = cupykern.prepare_matmul_sum(w, k.arr((5,), seed=2))
    return _msml(k, weight=w, bias=k.arr((5,), seed=2), plan=plan)


MSML = [
    Case("x-list", lambda k: _msml(k, x=[[1.0] * 6] * 4), TypeError, _not_array("x", "list")),
    Case("x-None", lambda k: _msml(k, x=None), TypeError, _not_array("x", "NoneType")),
    Case("weight-None", lambda k: _msml(k, weight=None), TypeError, _not_array("weight", "NoneType")),
    Case("bias-list", lambda k: _msml(k, bias=[0.0] * 5), TypeError, _not_array("bias", "list")),
    Case("x-int64", lambda k: _msml(k, x=k.arr(dtype="int64")), TypeError, "^x: .*dtype int64"),
    Case("x-bool", lambda k: _msml(k, x=k.arr(dtype="bool")), TypeError, "^x: .*dtype bool"),
    Case("x-complex", lambda k: _msml(k, x=k.arr(dtype="complex128")), TypeError, "^x: .*dtype complex128"),
    Case("weight-float64", lambda k: _msml(k, weight=k.arr((5, 6), "float64"), bias=None),
         TypeError, "^weight: .*dtype"),
    Case("bias-float16", lambda k: _msml(k, bias=k.arr((5,), "float16")), TypeError, "^bias: .*dtype"),
    Case("x-0d", lambda k: _msml(k, x=k.arr(())), ValueError, "^x: "),
    Case("x-1d", lambda k: _msml(k, x=k.arr((6,))), ValueError, "^x: .*2-D"),
    Case("weight-1d", lambda k: _msml(k, weight=k.arr((6,))), ValueError, "^weight: .*2-D"),
    Case("weight-3d", lambda k: _msml(k, weight=k.arr((5, 6, 1))), ValueError, "^weight: .*2-D"),
    Case("K-mismatch", lambda k: _msml(k, x=k.arr((4, 7))), ValueError, "^x: .*in_features"),
    Case("bias-length", lambda k: _msml(k, bias=k.arr((6,))), ValueError, r"^bias: .*\(5,\)"),
    Case("bias-2d", lambda k: _msml(k, bias=k.arr((5, 1))), ValueError, r"^bias: .*\(5,\)"),
    Case("weight-foreign", lambda k: _msml(k, weight=k.foreign.arr((5, 6)), bias=None),
         TypeError, "^weight: "),
    Case("bias-foreign", lambda k: _msml(k, bias=k.foreign.arr((5,))), TypeError, "^bias: "),
    Case("weight-host", lambda k: _msml(k, weight=k.host.arr((5, 6)), bias=None),
         TypeError, "^weight: ", GPU),
    Case("bias-device1", lambda k: _msml(k, bias=k.other_device((5,))), ValueError, "^bias: .*cuda:1", GPU),
    Case("x-sparse", lambda k: _msml(k, x=k.sparse((4, 6))), TypeError, "^x: .*layout", TORCH),
    Case("weight-sparse", lambda k: _msml(k, weight=k.sparse((5, 6))), TypeError, "^weight: .*layout", TORCH),
    Case("bias-sparse", lambda k: _msml(k, bias=k.sparse((5,))), TypeError, "^bias: .*layout", TORCH),
    Case("plan-other-weight", lambda k: _msml(k, plan=_prepare(k)()), ValueError, "^plan: "),
    Case("plan-other-bias", _plan_for_other_bias, ValueError, "^plan: "),
    Case("plan-str", lambda k: _msml(k, plan="plan"), TypeError, "^plan: "),
    # prepare_matmul_sum and MatmulSumPlan.__call__
    Case("prepare-weight-list", lambda k: _prepare(k, weight=[[1.0] * 6] * 5),
         TypeError, _not_array("weight", "list")),
    Case("prepare-weight-int32", lambda k: _prepare(k, weight=k.arr((5, 6), "int32")),
         TypeError, "^weight: .*dtype"),
    Case("prepare-weight-1d", lambda k: _prepare(k, weight=k.arr((6,))), ValueError, "^weight: .*2-D"),
    Case("prepare-bias-length", lambda k: _prepare(k, bias=k.arr((4,))), ValueError, r"^bias: .*\(5,\)"),
    Case("prepare-bias-float64", lambda k: _prepare(k, bias=k.arr((5,), "float64")),
         TypeError, "^bias: .*dtype"),
    Case("prepare-bias-foreign", lambda k: _prepare(k, bias=k.foreign.arr((5,))), TypeError, "^bias: "),
    Case("prepare-weight-sparse", lambda k: _prepare(k, weight=k.sparse((5, 6))),
         TypeError, "^weight: .*layout", TORCH),
    Case("plan-call-x-list", lambda k: _plan_call(k, [[1.0] * 6]), TypeError, _not_array("x", "list")),
    Case("plan-call-K-mismatch", lambda k: _plan_call(k, k.arr((4, 7))), ValueError, "^x: .*in_features"),
    Case("plan-call-x-float64", lambda k: _plan_call(k, k.arr(dtype="float64")),
         TypeError, "^(x|weight): .*dtype"),
    Case("plan-call-x-foreign", lambda k: _plan_call(k, k.foreign.arr()), TypeError, "^(x|weight): "),
]


# ---- modules: x (4, 6); GemmScaleBatchNorm(6, 5), MatmulSumMaxMeanLogSumExp(6, 5) ----

def _gsbn_module(**bn_attrs):
    m = GemmScaleBatchNorm(6, 5, (5,))
    for name, value in bn_attrs.items():
        setattr(m.bn, name, value)
    return m


def _replaced(m, **submodules):
    for name, value in submodules.items():
        setattr(m, name, value)
    return m


MODULES = {"L1Norm": L1Norm, "L2Norm": L2Norm, "GSBN": _gsbn_module,
           "MSML": lambda: MatmulSumMaxMeanLogSumExp(6, 5)}


_DEFAULT = object()


def _fwd(k, make, x=_DEFAULT):
    """Calling a fresh module (on k's device) on ``x`` (default a (4, 6) array of kind k)."""
    return partial(k.module(make()), k.arr() if x is _DEFAULT else x)


def _module_cases():
    cases = []
    for name, make in MODULES.items():
        cases += _prefixed(name, [
            Case("x-array", lambda k, m=make: _fwd(k, m),
                 TypeError, r"^x: expected a torch\.Tensor", NON_TORCH),
            Case("x-list", lambda k, m=make: _fwd(k, m, [[1.0] * 6] * 4),
                 TypeError, r"^x: expected a torch\.Tensor", TORCH),
            Case("x-None", lambda k, m=make: _fwd(k, m, None),
                 TypeError, r"^x: expected a torch\.Tensor", TORCH),
            Case("x-sparse", lambda k, m=make: _fwd(k, m, k.sparse((4, 6))),
                 TypeError, "^x: .*layout", TORCH),
        ])
    for name in ("L1Norm", "L2Norm"):
        cases += _prefixed(name, [Case("x-1d", lambda k, m=MODULES[name]: _fwd(k, m, k.arr((5,))),
                                       ValueError, f"^x: {name} normalizes over dim 1, so x needs at "
                                       "least 2 dimensions, got shape \\(5,\\)", TORCH)])
    for name in ("GSBN", "MSML"):
        make = MODULES[name]
        # (MatmulSumMaxMeanLogSumExp takes N-D x, as its nn reference does)
        nd = [] if name == "MSML" else [
            Case("x-3d", lambda k, m=make: _fwd(k, m, k.arr((2, 4, 6))), ValueError, "^x: .*2-D", TORCH)]
        cases += _prefixed(name, nd + [
            Case("x-int64", lambda k, m=make: _fwd(k, m, k.arr(dtype="int64")),
                 TypeError, "^x: .*dtype int64", TORCH),
            Case("x-float64", lambda k, m=make: _fwd(k, m, k.arr(dtype="float64")),
                 TypeError, "^(x|weight): .*dtype", TORCH),
            Case("in_features", lambda k, m=make: _fwd(k, m, k.arr((4, 7))),
                 ValueError, "^x: .*in_features", TORCH),
            Case("x-host", lambda k, m=make: _fwd(k, m, k.host.arr()),
                 TypeError, "^(x|weight): ", CUDA_TORCH),
        ])
    # On CUDA the fused kernel must be able to honour gemm, bn and bn's settings (on the
    # CPU the module runs the reference model itself, which honours anything).
    cases += [
        Case("GSBN-batch-of-1", lambda k: _fwd(k, _gsbn_module, k.arr((1, 6))), ValueError,
             "^Expected more than 1 value per channel when training", TORCH),
        Case("GSBN-bn-LayerNorm", lambda k: _fwd(k, lambda: _replaced(_gsbn_module(), bn=nn.LayerNorm(5))),
             TypeError, "^bn: ", CUDA_TORCH),
        Case("GSBN-bn-Identity", lambda k: _fwd(k, lambda: _replaced(_gsbn_module(), bn=nn.Identity())),
             TypeError, "^bn: ", CUDA_TORCH),
        Case("GSBN-gemm-Identity", lambda k: _fwd(k, lambda: _replaced(_gsbn_module(), gemm=nn.Identity())),
             TypeError, "^gemm: ", CUDA_TORCH),
        Case("GSBN-gemm-Conv1d",
             lambda k: _fwd(k, lambda: _replaced(_gsbn_module(), gemm=nn.Conv1d(6, 5, 1))),
             TypeError, "^gemm: ", CUDA_TORCH),
        Case("GSBN-bn-momentum-str", lambda k: _fwd(k, lambda: _gsbn_module(momentum="a")),
             TypeError, "^momentum: ", CUDA_TORCH),
        Case("GSBN-bn-eps-negative", lambda k: _fwd(k, lambda: _gsbn_module(eps=-1.0)),
             ValueError, "^eps: ", CUDA_TORCH),
        Case("GSBN-bn-eps-None", lambda k: _fwd(k, lambda: _gsbn_module(eps=None)),
             TypeError, "^eps: ", CUDA_TORCH),
    ]
    return cases


CASES = (_norm_cases(cupykern.l1_normalize) + _norm_cases(cupykern.l2_normalize)
         + _prefixed("linear", LINEAR) + _prefixed("gsbn", GSBN) + _prefixed("msml", MSML)
         + _prefixed("module", _module_cases()))
assert len({c.id for c in CASES}) == len(CASES), "duplicate case ids"


def _params(kinds):
    return [pytest.param(c, kind, id=f"{c.id}-{kind}") for c in CASES for kind in kinds
            if kind in c.kinds]


def _check(case: Case, kind: str):
    k = Kind(kind)
    call = case.build(k)
    before = [_raw(o) for o in k.tracked]
    with pytest.raises(case.exc, match=case.match):
        call()
    for i, (obj, old) in enumerate(zip(k.tracked, before)):
        assert _raw(obj) == old, f"argument #{i} ({type(obj).__name__}) was modified"
    _check_healthy(k)


@pytest.mark.parametrize("case, kind", _params(CPU_KINDS))
def test_bad_input_cpu(case, kind):
    _check(case, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("case, kind", _params(GPU_KINDS))
def test_bad_input_gpu(case, kind):
    _check(case, kind)


# Under autocast a call goes through torch's dispatcher, whose parse of the op's schema
# comes before the checks: the same errors all the same. (A float16 bias beside float32 x
# is no error there: autocast casts both, as it does for F.linear.)
_AUTOCAST_CASTS = {"linear-bias-float16"}


def _autocast_params():
    return [p for p in _params(("torch_cpu",)) + [
        pytest.param(*p.values, id=p.id, marks=pytest.mark.gpu) for p in _params(("torch_cuda",))]
        if p.values[0].id not in _AUTOCAST_CASTS]


@pytest.mark.parametrize("case, kind", _autocast_params())
def test_bad_input_under_autocast(case, kind):
    with torch.autocast(Kind(kind).device, dtype=torch.bfloat16):
        _check(case, kind)


# ---- what is accepted at the edges (not errors): results as the reference gives them

@pytest.mark.parametrize("kind", CPU_KINDS)
def test_gsbn_scale_of_one_broadcasts_like_the_module(kind):
    """A (1,) scale (the module's scale_shape allows it) equals the same value per column."""
    k = Kind(kind)
    x, w, b = k.arr((8, 6)), k.arr((5, 6), seed=1), k.arr((5,), seed=2)
    one = np.array([1.7], np.float32)
    got = cupykern.gemm_scale_batchnorm(x, w, b, k.of(one), None, None)
    want = cupykern.gemm_scale_batchnorm(x, w, b, k.of(np.full(5, 1.7, np.float32)), None, None)
    assert got.shape == (8, 5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def _gsbn_edge(kind):
    """(Kind, call(x, **options)) of gemm_scale_batchnorm with (5, 6) weights, running
    statistics and a num_batches_tracked of 3."""
    k = Kind(kind)
    w, vecs = k.arr((5, 6), seed=1), [k.arr((5,), seed=s) for s in range(2, 6)]
    stats = (k.arr((5,), seed=6), k.of(np.linspace(0.5, 2.0, 5, dtype=np.float32)), _nbt(k))
    return k, stats, lambda x, **o: cupykern.gemm_scale_batchnorm(x, w, *vecs, *stats, **o)


def _gsbn_edge_kinds():
    return [pytest.param(kind, marks=pytest.mark.gpu) if kind in GPU_KINDS else kind
            for kind in ALL]


@pytest.mark.parametrize("kind", _gsbn_edge_kinds())
def test_gsbn_empty_training_batch_is_counted_as_batchnorm_counts_it(kind):
    """nn.BatchNorm1d on an empty training batch: an empty result, the running statistics
    untouched, num_batches_tracked counted."""
    k, stats, call = _gsbn_edge(kind)
    before = [_to_numpy(s).copy() for s in stats[:2]]
    out = call(k.arr((0, 6)))
    assert tuple(out.shape) == (0, 5)
    assert int(_to_numpy(stats[2])) == 4
    for s, b in zip(stats[:2], before):
        np.testing.assert_array_equal(_to_numpy(s), b)
    bn = nn.BatchNorm1d(5)
    bn.num_batches_tracked.fill_(3)
    assert bn(torch.zeros(0, 5)).shape == (0, 5) and bn.num_batches_tracked.item() == 4


@pytest.mark.parametrize("kind", _gsbn_edge_kinds())
def test_gsbn_counts_batches_without_running_statistics(kind):
    """A num_batches_tracked without running statistics is counted in training mode by
    every kind (NumPy's reference as the kernels and the torch op)."""
    k = Kind(kind)
    nbt = _nbt(k)
    cupykern.gemm_scale_batchnorm(k.arr((4, 6)), k.arr((5, 6), seed=1), None,
                                  k.arr((5,), seed=3), None, None, None, None, nbt)
    assert int(_to_numpy(nbt)) == 4


@pytest.mark.parametrize("kind", _gsbn_edge_kinds())
def test_gsbn_eval_reads_read_only_and_strided_running_statistics(kind):
    """Eval mode only reads the running statistics and num_batches_tracked: read-only
    (NumPy) or strided ones are taken, as F.batch_norm takes them; and NumPy's bool for
    training is a bool."""
    k, stats, call = _gsbn_edge(kind)
    x = k.arr((4, 6))
    want = _to_numpy(call(x, training=False))
    strided = [k.of(np.repeat(_to_numpy(s), 2)) for s in stats[:2]]
    views = [s[::2] for s in strided]
    if kind == "numpy":
        for s in (*views, stats[2]):
            s.flags.writeable = False
    w, vecs = k.arr((5, 6), seed=1), [k.arr((5,), seed=s) for s in range(2, 6)]
    got = cupykern.gemm_scale_batchnorm(x, w, *vecs, *views, stats[2], training=np.False_)
    np.testing.assert_allclose(_to_numpy(got), want, rtol=1e-6, atol=1e-6)
    assert int(_to_numpy(stats[2])) == 3


@pytest.mark.parametrize("fn", [cupykern.l1_normalize, cupykern.l2_normalize])
def test_empty_rows_give_an_empty_result_without_warnings(fn):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy's "Mean of empty slice" must not leak out
        y = fn(np.zeros((5, 0), np.float32))
    assert y.shape == (5, 0) and y.dtype == np.float32


class _Precision(str, __import__("enum").Enum):
    HIGH = "high"


class _AnyEqual(str):
    def __eq__(self, other):
        return True

    __hash__ = str.__hash__


def test_check_precision_reads_a_str_subclass_as_its_characters():
    from cupykern.gemm_checks import check_precision

    for precision in (np.str_("high"), _Precision.HIGH):
        got = check_precision(precision)
        assert got == "high" and type(got) is str
    with pytest.raises(ValueError, match="^precision: "):  # (compared as a plain str)
        check_precision(_AnyEqual("low"))


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.gpu) if k in GPU_KINDS else k
                                  for k in ALL])
@pytest.mark.parametrize("precision", [np.str_("high"), _Precision.HIGH], ids=["numpy-str", "str-enum"])
def test_str_subclass_precision_is_its_string(kind, precision):
    """A str subclass (numpy.str_, a str Enum) is the precision its characters name, as
    PyTorch's own settings take it: the same results as the plain string's (on the GPU,
    where "high" (TF32) and "highest" differ, those of "high")."""
    k = Kind(kind)
    for fn in (_linear, _gsbn):
        got, want = fn(k, precision=precision)(), fn(k, precision="high")()
        np.testing.assert_array_equal(_to_numpy(got), _to_numpy(want))
    a, b = k.arr((4, 6)), k.arr((6, 5), seed=1)
    got, want = (_to_numpy(cupykern.matmul(a, b, precision=p)) for p in (precision, "high"))
    np.testing.assert_array_equal(got, want)
    if kind in GPU_KINDS:
        assert not np.array_equal(got, _to_numpy(cupykern.matmul(a, b, precision="highest")))
