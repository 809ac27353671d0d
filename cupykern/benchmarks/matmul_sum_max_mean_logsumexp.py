"""Benchmark MatmulSumMaxMeanLogSumExp (documented model 4) on the GPU machine.

    python -m cupykern.benchmarks.matmul_sum_max_mean_logsumexp

Byte model, x (B, K), W (N, K), float32, fewest DRAM bytes per call:
  weights cached:           read x once           4*B*K        (wsum, 8*K bytes, stays in L2)
  weights changed in place: read W once, x once   4*(N*K + B*K) (+ bias, plan: < 0.1%)
The ceiling is the same-run device copy bandwidth (y.copy_(x) of a 1 GiB buffer, read +
write bytes / time); "%copy" = (model bytes / ms) / that bandwidth.

Timing (cupykern.benchmark.time_ms's method): CUDA events around the forward on the
current stream, L2 flushed before each call, median of many calls, x rotated over 4 fresh
tensors, inference (torch.no_grad()). The small shape is timed by wall clock over
back-to-back calls instead, so host overhead is included.
"""
from __future__ import annotations

import argparse
import time

import cupykern
from cupykern.benchmark import copy_ms, gbps, require_gpu, time_ms, torch
from cupykern.matmul_sum_max_mean_logsumexp import ROWS_PER_BLOCK


def _wall_us(fn, n=3000):
    """Mean wall-clock microseconds per call of back-to-back calls (host overhead included)."""
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def _rotating(xs):
    i = [0]

    def nxt():
        i[0] = (i[0] + 1) % len(xs)
        return xs[i[0]]
    return nxt


def _models(k, n):
    from cupykern.models.matmul_sum_max_mean_logsumexp import Model, ModelNew

    torch.manual_seed(0)
    ref = Model(k, n).cuda()
    torch.manual_seed(0)
    new = ModelNew(k, n).cuda()
    return ref, new, torch.compile(ref)


def main(argv=None):
    argparse.ArgumentParser(
        prog="python -m cupykern.benchmarks.matmul_sum_max_mean_logsumexp",
        description=__doc__.split("\n\n")[0]).parse_args(argv)
    require_gpu()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    big = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    ceiling = gbps(2 * big.nbytes, copy_ms(big))
    del big
    print(f"copy ceiling (1 GiB y.copy_(x)): {ceiling:.0f} GB/s\n", flush=True)

    B, K, N = 1024, 8192, 8192
    ref, new, comp = _models(K, N)
    xs = [torch.rand(B, K, device="cuda") for _ in range(4)]
    nxt = _rotating(xs)
    with torch.no_grad():
        err = (new(xs[0]) - ref(xs[0])).abs().max().item()
        print(f"[{B}x{K}->{N} float32] max |ours - eager| = {err:.2e}; "
              f"copy_(x) {copy_ms(xs[0]):.4f} ms", flush=True)
        comp(xs[0])  # compile outside the timing

        xbytes, wbytes = 4 * B * K, 4 * N * K
        eager = time_ms(lambda: ref(nxt()))
        compiled = time_ms(lambda: comp(nxt()))
        ours = time_ms(lambda: new(nxt()))
        print(f"  weights cached:  ours {ours:.4f} ms  eager {eager:.3f} ms  compile "
              f"{compiled:.3f} ms  -> {eager / ours:.0f}x eager, {compiled / ours:.0f}x compile, "
              f"{100 * gbps(xbytes, ours) / ceiling:.0f}% of copy BW (bytes: x)", flush=True)
        plan = cupykern.MatmulSumPlan(new.linear.weight.detach(), new.linear.bias.detach())
        for rows in ROWS_PER_BLOCK:
            t = time_ms(lambda: plan.apply(nxt(), rows=rows))
            print(f"    row kernel, {rows} rows/block: {t:.4f} ms "
                  f"({100 * gbps(xbytes, t) / ceiling:.0f}% of copy BW)", flush=True)

        w = new.linear.weight
        wr = ref.linear.weight

        def flip():  # an in-place change of the weights before every call
            w.mul_(-1.0)
            wr.mul_(-1.0)
        eager_w = time_ms(lambda: ref(nxt()), setup=flip)
        comp_w = time_ms(lambda: comp(nxt()), setup=flip)
        ours_w = time_ms(lambda: new(nxt()), setup=flip)
        build = time_ms(lambda: cupykern.MatmulSumPlan(w.detach(), new.linear.bias.detach()))
        err = (new(xs[0]) - ref(xs[0])).abs().max().item()
        print(f"  weights changed: ours {ours_w:.4f} ms  eager {eager_w:.3f} ms  compile "
              f"{comp_w:.3f} ms  -> {eager_w / ours_w:.0f}x eager, {comp_w / ours_w:.0f}x compile, "
              f"{100 * gbps(wbytes + xbytes, ours_w) / ceiling:.0f}% of copy BW (bytes: W + x); "
              f"plan build alone {build:.4f} ms "
              f"({100 * gbps(wbytes, build) / ceiling:.0f}% of copy BW); max err {err:.2e}", flush=True)
    del ref, new, comp, xs, plan
    torch.cuda.empty_cache()

    B, K, N = 128, 10, 5
    ref, new, comp = _models(K, N)
    x = torch.randn(B, K, device="cuda")
    for mode, ctx in (("no_grad", torch.no_grad), ("grad enabled", torch.enable_grad)):
        with ctx():
            comp(x)
            t_e, t_c, t_o = _wall_us(lambda: ref(x)), _wall_us(lambda: comp(x)), _wall_us(lambda: new(x))
        print(f"[{B}x{K}->{N} float32, {mode}, wall clock per call incl. host] ours {t_o:.1f} us  "
              f"eager {t_e:.1f} us  compile {t_c:.1f} us  -> {t_e / t_o:.2f}x eager, "
              f"{t_c / t_o:.2f}x compile", flush=True)


if __name__ == "__main__":
    main()
