"""Arrays of any library: DLPack producers (DLPack 1.x with max_version, legacy ones,
the stream argument, the read-only flag), the CUDA array interface (Numba), JAX arrays
in and out, JAX tracers refused. CPU tests use producer objects wrapping NumPy arrays;
the GPU tests use JAX, Numba and cuda.core where installed (skipped with the reason
elsewhere)."""
import numpy as np
import pytest

import cupykern
from cupykern._array import DLPACK_VERSION, import_array, is_producer

gpu = pytest.mark.gpu


class Producer:
    """Another library's array: only ``__dlpack__`` / ``__dlpack_device__`` (DLPack 1.x);
    records the keyword arguments of each export."""

    def __init__(self, array):
        self.array, self.calls = array, []

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version})
        kw = {} if max_version is None else {"max_version": max_version}
        if stream is not None:
            kw["stream"] = stream
        return self.array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class LegacyProducer(Producer):
    """A producer from before DLPack 1.0: ``__dlpack__(stream=None)`` only."""

    def __dlpack__(self, stream=None):
        self.calls.append({"stream": stream})
        return self.array.__dlpack__() if stream is None else self.array.__dlpack__(stream=stream)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x, w, b = rng.standard_normal((6, 5)), rng.standard_normal((4, 5)), rng.standard_normal(4)
    v = [rng.standard_normal(4) for _ in range(3)]
    rm, rv = rng.standard_normal(4), rng.random(4) + 0.5
    return x, w, b, v, rm, rv


def _calls(wrap):
    """(function name, call on wrapped arrays, the same call on NumPy arrays)."""
    x, w, b, v, rm, rv = _inputs()
    yield "l1_normalize", lambda: cupykern.l1_normalize(wrap(x)), lambda: cupykern.l1_normalize(x)
    yield ("l2_normalize", lambda: cupykern.l2_normalize(wrap(x), axis=0),
           lambda: cupykern.l2_normalize(x, axis=0))
    yield "linear", lambda: cupykern.linear(wrap(x), wrap(w), wrap(b)), lambda: cupykern.linear(x, w, b)
    yield ("gemm_scale_batchnorm eval",
           lambda: cupykern.gemm_scale_batchnorm(wrap(x), wrap(w), wrap(b), *map(wrap, v), wrap(rm),
                                                 wrap(rv), training=False),
           lambda: cupykern.gemm_scale_batchnorm(x, w, b, *v, rm, rv, training=False))
    yield ("matmul_sum_max_mean_logsumexp",
           lambda: cupykern.matmul_sum_max_mean_logsumexp(wrap(x), wrap(w), wrap(b)),
           lambda: cupykern.matmul_sum_max_mean_logsumexp(x, w, b))


@pytest.mark.parametrize("kind", [Producer, LegacyProducer])
def test_cpu_producers_in_numpy_out(kind):
    made = []

    def wrap(a):
        made.append(kind(a))
        return made[-1]
    for name, ours, want in _calls(wrap):
        got = ours()
        assert type(got) is np.ndarray, name
        np.testing.assert_allclose(got, want(), rtol=1e-12, err_msg=name)
    for p in made:  # each exported once, DLPack 1.x asked for (legacy: the fallback call)
        first = p.calls[0]
        if kind is Producer:
            assert p.calls == [{"stream": None, "max_version": DLPACK_VERSION}]
        else:
            assert first == {"stream": None} and len(p.calls) == 1


def test_producer_running_statistics_are_updated_in_place():
    x, w, b, v, rm, rv = _inputs()
    want_m, want_v = rm.copy(), rv.copy()
    cupykern.gemm_scale_batchnorm(x, w, b, *v, want_m, want_v)
    out = cupykern.gemm_scale_batchnorm(Producer(x), w, b, *v, Producer(rm), Producer(rv))
    np.testing.assert_allclose(rm, want_m, rtol=1e-12)
    np.testing.assert_allclose(rv, want_v, rtol=1e-12)
    assert type(out) is np.ndarray


def test_out_is_written_and_returned_as_given():
    x = _inputs()[0]
    o = np.empty_like(x)
    out = Producer(o)
    assert cupykern.l2_normalize(Producer(x), out=out) is out
    np.testing.assert_allclose(o, cupykern.l2_normalize(x), rtol=1e-12)


def test_read_only_producers_are_never_written():
    x, w, b, v, rm, rv = _inputs()
    ro = x.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out: is read-only"):
        cupykern.l1_normalize(x, out=Producer(ro))
    rm.flags.writeable = False
    with pytest.raises(ValueError, match="running_mean: is read-only"):
        cupykern.gemm_scale_batchnorm(x, w, b, *v, Producer(rm), rv)
    assert import_array(Producer(ro), "x")[1] is True  # the DLPack 1.x READ_ONLY flag
    assert import_array(Producer(x), "x")[1] is False


def test_prepared_plan_of_a_producer():
    x, w, b = _inputs()[:3]
    pw, pb = Producer(w), Producer(b)
    plan = cupykern.prepare_matmul_sum(pw, pb)
    np.testing.assert_allclose(cupykern.matmul_sum_max_mean_logsumexp(Producer(x), pw, pb, plan=plan),
                               cupykern.matmul_sum_max_mean_logsumexp(x, w, b), rtol=1e-12)
    np.testing.assert_allclose(plan(Producer(x)), plan(x), rtol=1e-12)


def test_jax_tracers_and_non_arrays_get_clear_type_errors():
    # A tracer is told by its class's ancestry (jax need not be installed here).
    tracer = type("Tracer", (), {"__module__": "jax._src.core", "__dlpack__": lambda self: None})
    traced = type("DynamicJaxprTracer", (tracer,), {"__module__": "jax._src.interpreters"})()
    with pytest.raises(TypeError, match="concrete arrays"):
        cupykern.l2_normalize(traced)
    with pytest.raises(TypeError, match="concrete arrays"):
        cupykern.linear(_inputs()[0], traced)
    with pytest.raises(TypeError, match=r"x: expected a cupy.ndarray.*got list.*__dlpack__"):
        cupykern.l2_normalize([[1.0, 2.0]])
    assert is_producer(Producer(np.ones(2))) and not is_producer(np.ones(2))


def test_producers_on_an_unsupported_device_are_refused():
    class Elsewhere(Producer):
        def __dlpack_device__(self):
            return (4, 0)  # kDLOpenCL
    with pytest.raises(TypeError, match="device type 4"):
        cupykern.l2_normalize(Elsewhere(np.ones((2, 2))))


# ------------------------------------------------------------------ GPU producers

def _gpu_inputs(cp):
    return [cp.asarray(a) for a in _inputs()[:3]]


@gpu
def test_gpu_producer_gets_the_consumer_stream_and_returns_cupy():
    import cupy as cp

    x, w, b = _gpu_inputs(cp)
    for stream in (cp.cuda.Stream(non_blocking=True), cp.cuda.Stream.null):
        with stream:
            px = Producer(x)
            got = cupykern.linear(px, Producer(w), Producer(b))
            assert type(got) is cp.ndarray
            want = stream.ptr or 1  # 1: the legacy default stream, as DLPack numbers it
            assert px.calls == [{"stream": want, "max_version": DLPACK_VERSION}]
            cp.testing.assert_allclose(got, x @ w.T + b, rtol=1e-12)
        stream.synchronize()
    lp = LegacyProducer(x)
    cp.testing.assert_allclose(cupykern.l2_normalize(lp), cupykern.l2_normalize(x), rtol=1e-12)
    assert lp.calls == [{"stream": cp.cuda.get_current_stream().ptr or 1}]


@gpu
def test_jax_arrays_in_jax_arrays_out():
    jax = pytest.importorskip("jax", reason="JAX is not installed")
    import jax.numpy as jnp

    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    jax.config.update("jax_enable_x64", True)  # (float64, as the other producers' tests)
    arrays = _inputs()
    x, w, b = (jnp.asarray(a) for a in arrays[:3])
    v = [jnp.asarray(a) for a in arrays[3]]
    rm, rv = jnp.asarray(arrays[4]), jnp.asarray(arrays[5])
    cases = {
        "l1_normalize": (cupykern.l1_normalize(x), x / jnp.abs(x).mean(1, keepdims=True)),
        "l2_normalize": (cupykern.l2_normalize(x), x / jnp.linalg.norm(x, axis=1, keepdims=True)),
        "linear": (cupykern.linear(x, w, b), x @ w.T + b),
        "matmul_sum_max_mean_logsumexp": (cupykern.matmul_sum_max_mean_logsumexp(x, w, b),
                                          (x @ w.T + b).sum(1, keepdims=True)),
        "gemm_scale_batchnorm eval": (
            cupykern.gemm_scale_batchnorm(x, w, b, *v, rm, rv, training=False),
            ((x @ w.T + b) * v[0] - rm) / jnp.sqrt(rv + 1e-5) * v[1] + v[2]),
    }
    for name, (got, want) in cases.items():
        assert isinstance(got, jax.Array), name
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-9, err_msg=name)
    with pytest.raises(ValueError, match="out: is read-only"):  # JAX arrays are immutable
        cupykern.l2_normalize(x, out=jnp.zeros_like(x))
    with pytest.raises(TypeError, match="concrete arrays"):
        jax.jit(cupykern.l2_normalize)(x)


@gpu
def test_numba_device_arrays_through_the_cuda_array_interface():
    numba_cuda = pytest.importorskip("numba.cuda", reason="Numba is not installed")
    import cupy as cp

    x, w, b = _inputs()[:3]
    dx, dw = numba_cuda.to_device(x), numba_cuda.to_device(w)
    got = cupykern.linear(dx, dw)
    assert type(got) is cp.ndarray
    np.testing.assert_allclose(cp.asnumpy(got), x @ w.T, rtol=1e-12)
    out = numba_cuda.device_array_like(x)
    assert cupykern.l2_normalize(dx, out=out) is out
    np.testing.assert_allclose(out.copy_to_host(), x / np.linalg.norm(x, axis=1, keepdims=True),
                               rtol=1e-12)


@gpu
def test_cuda_core_buffer_is_imported_zero_copy():
    core = pytest.importorskip("cuda.core", reason="cuda.core is not installed")
    if not hasattr(core, "Device"):  # (before cuda.core 0.4: cuda.core.experimental)
        core = pytest.importorskip("cuda.core.experimental", reason="cuda.core has no Device")
    dev = core.Device()
    dev.set_current()
    try:
        buf = dev.allocate(256, stream=dev.default_stream)
    except TypeError:  # (older cuda.core: no stream argument)
        buf = dev.allocate(256)
    if not hasattr(buf, "__dlpack__"):
        pytest.skip("this cuda.core's Buffer exports no DLPack")
    arr, read_only = import_array(buf, "x")
    assert arr.data.ptr == int(buf.handle) and arr.nbytes == 256 and not read_only
    with pytest.raises(TypeError, match="unsupported dtype"):  # raw bytes, not floats
        cupykern.l2_normalize(buf)
