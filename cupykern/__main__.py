"""The main job: verify and benchmark every documented model.

    python -m cupykern [--quick] [--json PATH] [--models L1Norm,L2Norm,...] [--iters N]

For each model and benchmark shape it checks ModelNew against the PyTorch
reference (same seed, several random inputs, allclose at the case's tolerance)
and times it against PyTorch eager and torch.compile in the same run, with the
same-run device-copy bandwidth as the ceiling for memory-bound shapes. Then the
same for a training step (forward + backward, x and the parameters requiring
grad): gradients against the reference's, and the step's time.
Without a GPU it says so, checks the NumPy reference path of the wanted models' array
functions (and of ``linear`` and ``matmul``, the GEMMs behind models 3 and 4) and exits 0;
options that only shape the timing (``--quick``, ``--iters``) are then named as not
applying, in one line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from cupykern.models import CLASSES, NAMES, resolve


def _gpu() -> tuple[str | None, str]:
    """(GPU name or None, why there is none)."""
    try:
        import torch
    except ImportError:
        return None, ("PyTorch is not installed (the main job compares against it: install "
                      "the torch build for your CUDA driver, see the README's recipes)")
    if not torch.cuda.is_available():
        return None, "No CUDA GPU found (torch.cuda.is_available() is False)"
    return torch.cuda.get_device_name(), ""


# The array functions each model's check exercises on the CPU (both GEMM models use the
# GEMM functions, linear and matmul).
_CPU_FUNCTIONS = {"l1norm": ("l1_normalize",), "l2norm": ("l2_normalize",),
                  "matmul_sum_max_mean_logsumexp": ("linear", "matmul",
                                                    "matmul_sum_max_mean_logsumexp"),
                  "gemm_scale_batchnorm": ("linear", "matmul", "gemm_scale_batchnorm")}


def _cpu_check(wanted=NAMES) -> dict:
    """Exercise the wanted models' array functions' NumPy path on small shapes against
    float64 math; {function: {"correct": bool, "max_abs_err": float}}."""
    import cupykern

    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = rng.standard_normal((24, 64)).astype(np.float32) / 8
    b = rng.standard_normal(24).astype(np.float32)
    s, g, beta = (rng.standard_normal(24).astype(np.float32) for _ in range(3))
    x64, w64, b64 = x.astype(np.float64), w.astype(np.float64), b.astype(np.float64)
    z = x64 @ w64.T
    ys = s * (z + b64)
    # matmul with NumPy semantics: 2-D @ 2-D, a batch broadcast against a matrix, 1-D @ 2-D
    xb = x.reshape(2, 8, 64)
    wt, w64t = np.ascontiguousarray(w.T), w64.T
    got_mm = [cupykern.matmul(x, wt), cupykern.matmul(xb, wt), cupykern.matmul(x[0], wt)]
    want_mm = [z, xb.astype(np.float64) @ w64t, x64[0] @ w64t]
    want_bn = g * (ys - ys.mean(0)) / np.sqrt(ys.var(0) + 1e-5) + beta
    checks = {
        "l1_normalize": (cupykern.l1_normalize(x), x64 / np.abs(x64).mean(1, keepdims=True)),
        "l2_normalize": (cupykern.l2_normalize(x), x64 / np.sqrt((x64 * x64).sum(1, keepdims=True))),
        "linear": (cupykern.linear(x, w, b), z + b64),
        "matmul": (got_mm, want_mm),
        "matmul_sum_max_mean_logsumexp": (cupykern.matmul_sum_max_mean_logsumexp(x, w, b),
                                          (z + b64).sum(1, keepdims=True)),
        "gemm_scale_batchnorm": (cupykern.gemm_scale_batchnorm(x, w, b, s, g, beta), want_bn),
    }
    picked = {f for m in wanted for f in _CPU_FUNCTIONS[m]}
    results = {}
    for name, (got, want) in checks.items():
        if name not in picked:
            continue
        pairs = list(zip(got, want)) if isinstance(got, list) else [(got, want)]
        ok = all(g.shape == v.shape and np.allclose(g, v, atol=1e-4, rtol=1e-4) for g, v in pairs)
        err = max(float(np.abs(g - v).max()) if g.shape == v.shape else float("inf")
                  for g, v in pairs)
        results[name] = {"correct": ok, "max_abs_err": err}
        print(f"  {name:<32} {'ok' if ok else 'MISMATCH'}", flush=True)
    return results


def _check(case, ref, new, seeds=3):
    """Compare with the reference on fresh inputs: ("yes" | "yes*" | "NO", max |err|).

    "yes*": outside allclose of PyTorch's float32 result, yet within it of a float64
    run of the reference and closer to that than PyTorch is (PyTorch's own rounding
    is the difference, e.g. a long float32 sum whose result lands near zero).
    """
    import torch

    verdict, worst = "yes", 0.0
    for s in range(seeds):
        torch.manual_seed(1000 + s)
        inputs = case.make_inputs("cuda")
        with torch.no_grad():
            want, got = ref(*inputs), new(*inputs)
        err = (got.float() - want.float()).abs().max().item()
        worst = max(worst, err)
        if not torch.allclose(got, want, atol=case.atol, rtol=case.atol):
            if not _closer_to_float64(case, ref, inputs, got, want):
                return "NO", err
            verdict = "yes*"
        del inputs, want, got
    return verdict, worst


def _closer_to_float64(case, ref, inputs, got, want) -> bool:
    import copy

    import torch

    if sum(t.numel() for t in inputs) > 2**28:  # keep the float64 copy small
        return False
    with torch.no_grad():
        exact = copy.deepcopy(ref).double()(*(t.double() for t in inputs))
    ours, theirs = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
    return bool(torch.allclose(got.double(), exact, atol=case.atol, rtol=case.atol) and ours <= theirs)


def _run_case(module, case, iters):
    import torch

    from cupykern.benchmark import SWEEP_SECONDS, copy_ms, gbps, tflops, time_ms

    torch.manual_seed(0)
    ref = module.Model(*case.init_inputs).cuda()
    torch.manual_seed(0)
    new = module.ModelNew(*case.init_inputs).cuda()
    same_params = all(torch.equal(a, b) for a, b in
                      zip(ref.state_dict().values(), new.state_dict().values()))
    t0 = time.perf_counter()
    torch.manual_seed(0)
    inputs = case.make_inputs("cuda")
    with torch.no_grad():
        new(*inputs)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    verdict, err = _check(case, ref, new)
    if not same_params:
        verdict = "NO"
    row = {"model": module.__name__.rsplit(".", 1)[1], "case": case.label, "verdict": verdict,
           "correct": verdict != "NO", "max_abs_err": err, "first_call_ms": first_ms}
    # Each timed on its own, calls back to back (in rounds interleaved with eager's and
    # compiled's, the 15 us MatmulSumMaxMeanLogSumExp call read 34-71 us after their
    # 2.7 ms GEMMs, H200), for at least ``iters`` calls, a short one up to 20 times as
    # many (time_each's ``seconds``): a median of hundreds of calls, which a host hiccup
    # does not move (the quickstart's 5 calls read L1Norm 16x16384's forward at 0.62x
    # eager: 25 us against 16).
    with torch.no_grad():
        row["ms"] = time_ms(lambda: new(*inputs), iters=iters, seconds=SWEEP_SECONDS)
        row["eager_ms"] = time_ms(lambda: ref(*inputs), iters=iters, seconds=SWEEP_SECONDS)
        compiled = torch.compile(ref)
        row["compile_ms"] = time_ms(lambda: compiled(*inputs), iters=iters, seconds=SWEEP_SECONDS)
    row["speedup_eager"] = row["eager_ms"] / row["ms"]
    row["speedup_compile"] = row["compile_ms"] / row["ms"]
    if case.nbytes:
        row["copy_ms"] = copy_ms(inputs[0], iters=iters)
        copy_bw = gbps(2 * inputs[0].nbytes, row["copy_ms"])
        row["pct_copy_bw"] = 100 * gbps(case.nbytes, row["ms"]) / copy_bw
    if case.flops:
        row["tflops"] = tflops(case.flops, row["ms"])
    row.update(_train_case(ref, new, compiled, inputs, case.atol, iters))
    del inputs, ref, new, compiled
    torch.cuda.empty_cache()
    return row


def _train_case(ref, new, compiled, inputs, atol, iters) -> dict:
    """A training step, ``model(x).backward(g)`` with x and every parameter requiring grad:
    our gradients against the reference's (max |difference| relative to max |grad|
    within ``atol``), and its time against eager and torch.compile."""
    import torch

    from cupykern.benchmark import SWEEP_SECONDS, time_each

    x = inputs[0].detach().requires_grad_()
    rest = inputs[1:]
    with torch.no_grad():
        g = torch.randn_like(ref(x, *rest))
    leaves = {m: [x] + list(m.parameters()) for m in (ref, new)}

    def clear():
        for t in leaves[ref] + leaves[new]:
            t.grad = None

    grads = {}
    for m in (ref, new):
        clear()
        m(x, *rest).backward(g)
        grads[m] = [t.grad.float() for t in leaves[m]]
    # x's gradient relative to its own largest, the parameters' to the largest of any
    # parameter's (one that cancels to ~0, like gemm.bias's under training-mode
    # BatchNorm, holds rounding noise of that size), as the training tests judge them.
    big = [b.abs().max().item() for b in grads[ref]]
    scale = big[:1] + [max(big[1:], default=0.0)] * (len(big) - 1)
    rel = torch.tensor([(a - b).abs().max().item() / max(m, 1e-30)  # (max() would drop a nan)
                        for a, b, m in zip(grads[new], grads[ref], scale)]).max().item()
    del grads
    row = {"grad_rel_err": rel, "grad_correct": rel <= atol}
    # The three steps in interleaved rounds (time_each): a small step is the host's time,
    # which drifts between seconds on these hosts (H200, timed one after the other, L2Norm's
    # 128x4096 step read 1.08x eager and L1Norm's 1.80x, the same code path; interleaved
    # 1.22x and 1.25x). A large step reads differently too, by what it follows: ours /
    # timed alone, GemmScaleBatchNorm 16384x4096->4096 14.5 / 15.9 ms, and
    # MatmulSumMaxMeanLogSumExp 1024x8192->8192, after torch.compile's 8.5 ms step, 1.087 /
    # 0.681 ms (docs/performance.md#method).
    steps = [lambda m=m: m(x, *rest).backward(g) for m in (new, ref, compiled)]
    row["train_ms"], row["train_eager_ms"], row["train_compile_ms"] = time_each(
        steps, iters=iters, setup=clear, seconds=SWEEP_SECONDS)
    clear()
    row["train_speedup_eager"] = row["train_eager_ms"] / row["train_ms"]
    row["train_speedup_compile"] = row["train_compile_ms"] / row["train_ms"]
    return row


def _print_table(rows):
    head = (f"{'model':<30} {'case':<28} {'ok':<4} {'ms':>8} {'eager':>8} {'compile':>8} "
            f"{'x eager':>8} {'x comp':>7} {'%copyBW':>8} {'TFLOP/s':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        pct = f"{r['pct_copy_bw']:.1f}" if "pct_copy_bw" in r else "-"
        tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
        print(f"{r['model']:<30} {r['case']:<28} {r['verdict']:<4} "
              f"{r['ms']:>8.3f} {r['eager_ms']:>8.3f} {r['compile_ms']:>8.3f} "
              f"{r['speedup_eager']:>8.2f} {r['speedup_compile']:>7.2f} {pct:>8} {tf:>8}")
    head = (f"{'training step (forward + backward)':<59} {'grads':<6} {'ms':>8} {'eager':>8} "
            f"{'compile':>8} {'x eager':>8} {'x comp':>7} {'max|dgrad|/max|grad|':>21}")
    print()
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:<30} {r['case']:<28} {'ok' if r['grad_correct'] else 'NO':<6} "
              f"{r['train_ms']:>8.3f} {r['train_eager_ms']:>8.3f} {r['train_compile_ms']:>8.3f} "
              f"{r['train_speedup_eager']:>8.2f} {r['train_speedup_compile']:>7.2f} "
              f"{r['grad_rel_err']:>21.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupykern", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes only")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ap.add_argument("--models", help="comma-separated subset of: " + ", ".join(CLASSES)
                    + " (or their lower-case module names)")
    ap.add_argument("--iters", type=_positive, default=None,
                    help="timed calls per measurement, at least (>= 1; a short call gets up to "
                         "20 times as many)")
    args = ap.parse_args(argv)
    timing_only = [o for o, given in (("--quick", args.quick), ("--iters", args.iters is not None))
                   if given]
    args.iters = 20 if args.iters is None else args.iters
    try:
        wanted = resolve(args.models) if args.models is not None else NAMES
    except ValueError as e:
        ap.error(f"--models: {e}")

    gpu, why = _gpu()
    if gpu is None:
        print(f"{why}: nothing to benchmark.")
        if timing_only:
            print(f"{' and '.join(timing_only)} {'do' if len(timing_only) > 1 else 'does'} not "
                  "apply without a GPU (nothing is timed; the check's shapes are small): ignored.")
        print("Checking the NumPy reference path on small shapes instead:")
        checks = _cpu_check(wanted)
        if args.json:
            _write_json(args.json, {"gpu": None, "reason": why, "cpu_check": checks})
        return 0 if all(c["correct"] for c in checks.values()) else 1

    from cupykern import models

    print(f"GPU: {gpu}")
    rows = []
    for module in models.available():
        name = module.__name__.rsplit(".", 1)[1]
        if name not in wanted:
            continue
        for case in module.CASES:
            if args.quick and not case.quick:
                continue
            print(f"[{name}] {case.label}: compiling, verifying, timing ...", flush=True)
            row = _run_case(module, case, args.iters)
            print(f"    {'ok' if row['correct'] else 'MISMATCH'} ({row['verdict']}, max |err| vs PyTorch"
                  f" {row['max_abs_err']:.2e}),"
                  f" first call {row['first_call_ms']:.0f} ms, {row['ms']:.3f} ms; training step"
                  f" {row['train_ms']:.3f} ms, gradients {'ok' if row['grad_correct'] else 'MISMATCH'}",
                  flush=True)
            rows.append(row)
    print()
    _print_table(rows)
    if any(r["verdict"] == "yes*" for r in rows):
        print("yes*: outside allclose of PyTorch's float32 output, but within it of a float64 run of"
              " the reference and closer to it than PyTorch.")
    if args.json:
        from cupykern.benchmark import run_meta

        command = " ".join(["python -m cupykern", *(sys.argv[1:] if argv is None else argv)])
        _write_json(args.json, {"gpu": gpu, "meta": run_meta(command), "rows": rows})
    return 0 if all(r["correct"] and r["grad_correct"] for r in rows) else 1


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def _write_json(path, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"Wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
