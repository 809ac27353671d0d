"""Threads and streams: every op launches on the caller's current stream (torch's or CuPy's)
and its kernels are deterministic, so calls from several threads, each on its own stream,
give bit-identical results to serial calls, and work queued on a side stream is ordered
after what precedes it on that stream."""
import threading
import types

import numpy as np
import pytest
import torch

import cupykern
from cupykern.torch import GemmScaleBatchNorm, L1Norm, L2Norm, MatmulSumMaxMeanLogSumExp

# Only GPU tests here, and the module's kernel below needs CuPy at import.
cupy = pytest.importorskip(
    "cupy", reason="needs a CUDA GPU (cupy is not installed: the cuda12/cuda13 extra)")

pytestmark = pytest.mark.gpu

THREADS, ITERS = 4, 8
# Keeps a stream busy for ~0.1 s (2e8 SM clocks), so that work queued behind it on that
# stream has visibly not run yet while the host goes on.
_SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {}
}""", "spin")
SPIN_CYCLES = np.int64(200_000_000)


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def spin(stream_ptr):
    """Occupy the stream (a raw cudaStream_t, so CuPy's and torch's streams alike)."""
    _SPIN.kernel((1,), (1,), (SPIN_CYCLES,), stream=types.SimpleNamespace(ptr=stream_ptr))


# ---------------------------------------------------------------- threads

class Shared:
    """matmul_sum weights and their plan, shared by every thread (read only)."""

    def __init__(self):
        self.w, self.b = randn(30, 128, seed=100).cuda(), randn(30, seed=101).cuda()
        self.plan = cupykern.prepare_matmul_sum(self.w, self.b)


class State:
    """One thread's inputs, BatchNorm buffers and modules (seeded: equal seeds, equal states)."""

    def __init__(self, seed):
        def r(*shape, dtype=torch.float32):
            self._n += 1
            return randn(*shape, seed=1000 * seed + self._n).to(dtype).cuda()

        self._n = 0
        self.xn, self.xb, self.xh = r(64, 1000), r(33, 515, dtype=torch.bfloat16), r(17, 4099, dtype=torch.float16)
        self.lin = {dt: (r(96, 72, dtype=dt), r(80, 72, dtype=dt), r(80, dtype=dt))
                    for dt in (torch.float32, torch.float16, torch.float64)}
        self.gx = r(64, 48)
        self.gp = [r(40, 48) / 48 ** 0.5] + [r(40) for _ in range(4)]  # W, b, scale, gamma, beta
        self.rm, self.rv = r(40), r(40).abs() + 0.5
        self.mx = r(20, 128)
        torch.manual_seed(seed)
        self.l1, self.l2 = L1Norm(), L2Norm()
        self.gsbn = GemmScaleBatchNorm(48, 40, (40,)).cuda()
        self.msum = MatmulSumMaxMeanLogSumExp(128, 30).cuda()


def run_ops(st, sh):
    """Every public function and module once; [(name, result)]."""
    out = [("l1 float32", cupykern.l1_normalize(st.xn)), ("l2 float32", cupykern.l2_normalize(st.xn)),
           ("l2 bfloat16", cupykern.l2_normalize(st.xb)), ("l1 float16", cupykern.l1_normalize(st.xh))]
    x, w, b = st.lin[torch.float32]
    out += [(f"linear {p}", cupykern.linear(x, w, b, precision=p)) for p in ("highest", "high", "medium")]
    out += [(f"linear {dt}", cupykern.linear(*st.lin[dt])) for dt in (torch.float16, torch.float64)]
    out += [("gsbn train", cupykern.gemm_scale_batchnorm(st.gx, *st.gp, st.rm, st.rv, precision="high")),
            ("gsbn eval", cupykern.gemm_scale_batchnorm(st.gx, *st.gp, st.rm, st.rv, training=False)),
            ("matmul_sum shared plan", cupykern.matmul_sum_max_mean_logsumexp(st.mx, sh.w, sh.b, plan=sh.plan)),
            ("matmul_sum own plan", cupykern.matmul_sum_max_mean_logsumexp(st.mx, sh.w, sh.b)),
            ("L1Norm", st.l1(st.xn)), ("L2Norm", st.l2(st.xn)),
            ("GemmScaleBatchNorm", st.gsbn(st.gx)), ("MatmulSumMaxMeanLogSumExp", st.msum(st.mx))]
    return out


def job(st, sh):
    """ITERS rounds of every op, then the buffers the rounds updated."""
    with torch.no_grad():
        res = [(f"round {i} {name}", t) for i in range(ITERS) for name, t in run_ops(st, sh)]
    bn = st.gsbn.bn
    return res + [("running_mean", st.rm), ("running_var", st.rv), ("bn.running_mean", bn.running_mean),
                  ("bn.running_var", bn.running_var), ("bn.num_batches_tracked", bn.num_batches_tracked)]


def test_threads_on_own_streams_match_serial_results():
    sh = Shared()
    expected = [job(State(i), sh) for i in range(THREADS)]  # serially, on the default stream
    states = [State(i) for i in range(THREADS)]
    streams = [torch.cuda.Stream() for _ in range(THREADS)]
    torch.cuda.synchronize()
    results, errors = [None] * THREADS, []
    start = threading.Barrier(THREADS)

    def worker(i):
        try:
            start.wait()
            with torch.cuda.stream(streams[i]):
                results[i] = job(states[i], sh)
            streams[i].synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for i in range(THREADS):
        for (name, got), (_, want) in zip(results[i], expected[i]):
            assert torch.equal(got, want), f"thread {i}: {name} differs from the serial result"


# ---------------------------------------------------------------- side streams

def stream_cases(to_gpu):
    """[(name, fn)]: fn(x) runs ops that read x (48 x 64), the array the tests rewrite on a
    side stream just before calling fn there."""
    def r(*shape, seed):
        return to_gpu(randn(*shape, seed=seed))

    w, b = r(40, 64, seed=1), r(40, seed=2)
    s, g, be, rm = (r(40, seed=i) for i in range(3, 7))
    rv = to_gpu(randn(40, seed=7).abs() + 0.5)
    wm, bm, bq, xq = r(30, 64, seed=8), r(30, seed=9), r(48, seed=10), r(16, 64, seed=11)
    plan = cupykern.prepare_matmul_sum(wm, bm)
    return [
        ("l1_normalize", cupykern.l1_normalize),
        ("l2_normalize", cupykern.l2_normalize),
        ("linear", lambda x: cupykern.linear(x, w, b)),
        ("linear, its result consumed by l2_normalize", lambda x: cupykern.l2_normalize(cupykern.linear(x, w, b))),
        ("gemm_scale_batchnorm train", lambda x: cupykern.gemm_scale_batchnorm(x, w, b, s, g, be)),
        ("gemm_scale_batchnorm eval",
         lambda x: cupykern.gemm_scale_batchnorm(x, w, b, s, g, be, rm, rv, training=False)),
        ("matmul_sum with a plan", lambda x: cupykern.matmul_sum_max_mean_logsumexp(x, wm, bm, plan=plan)),
        ("prepare_matmul_sum of x as the weight", lambda x: cupykern.prepare_matmul_sum(x, bq)(xq)),
    ]


# Each case: the expected result on the default stream; one untimed call on the side stream
# (its allocator pool then has the blocks, so no cudaMalloc, which may synchronise, happens
# while the side stream is busy); then, on the busy side stream, x is rewritten and read by
# the op. The result reflects the new x only if the op's kernels were queued on that stream
# behind the rewrite: the side streams do not synchronise with the default stream.

def test_torch_side_stream():
    side = torch.cuda.Stream()  # torch's pool streams are non-blocking
    old, new = randn(48, 64, seed=20).cuda(), randn(48, 64, seed=21).cuda()
    for name, fn in stream_cases(lambda t: t.cuda()):
        want = fn(new)
        x = old.clone()
        with torch.cuda.stream(side):
            fn(x)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            spin(side.cuda_stream)
            x.copy_(new)
            got = fn(x)
            # Else the stream drained before the op was queued, and the check below is void.
            assert not side.query(), f"{name}: the call waited for the side stream"
        side.synchronize()
        assert torch.equal(got, want), f"{name}: did not run on torch's current stream"


def test_cupy_non_default_stream():
    side = cupy.cuda.Stream(non_blocking=True)
    old, new = cupy.asarray(randn(48, 64, seed=20).numpy()), cupy.asarray(randn(48, 64, seed=21).numpy())
    for name, fn in stream_cases(lambda t: cupy.asarray(t.numpy())):
        want = fn(new)
        x = cupy.empty_like(old)
        with side:
            x[...] = old  # also compiles the copy kernel used below
            fn(x)
        cupy.cuda.Device().synchronize()
        with side:
            spin(side.ptr)
            x[...] = new
            got = fn(x)
            assert not side.done, f"{name}: the call waited for the stream"
        side.synchronize()
        assert cupy.array_equal(got, want), f"{name}: did not run on CuPy's current stream"


def test_first_tensor_map_in_a_thread_without_a_context():
    """A thread that has made no CUDA runtime call has no current context: so is
    autograd's backward thread on device 0 when our product is a backward's first op.
    The first tensor map encoded there (TMA, Hopper) still encodes, as in the main thread."""
    from cupykern import _tma
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tensor maps feed Hopper's TMA kernels only")
    t = torch.empty(256, 96, device="cuda")
    maps = _tma.Rows2D(256, 96, 96, 64, 32)
    got = []
    thread = threading.Thread(target=lambda: got.append(maps._encode(t.data_ptr())))
    thread.start()
    thread.join()
    assert got == [maps._encode(t.data_ptr())] and len(got[0]) == 128
