"""GemmScaleBatchNorm training over several GPUs: ``python -m cupykern.benchmarks.scale_out``.

Each world size W runs W processes (NCCL, a GPU each) that train ours and the
reference model, both with ``bn`` converted to nn.SyncBatchNorm and wrapped in
DistributedDataParallel, at B x K -> N per GPU (weak scaling; default the benchmark
shape 16384x4096->4096, float32). A step is forward + backward + SGD step, timed with CUDA
events on rank 0 (mean of ``--steps`` after warm-up). FLOP model: 3 GEMMs of 2*B*K*N
per GPU and step. Prints per W: ms per step for ours and the reference, the speedup,
and ours' weak-scaling efficiency t(1) / t(W). With one process SyncBatchNorm does not
synchronize, so W = 1 is the single-GPU fused path against plain BatchNorm.
``--share`` runs all ranks on GPU 0 over gloo: a functional check of the synchronized
path on one GPU, whose times say nothing of scaling.
"""
from __future__ import annotations

import argparse
import tempfile

from cupykern.benchmark import require_gpu, tflops, torch


def _step_ms(model, x, steps):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.randn(x.shape[0], model.module.gemm.out_features, device=x.device)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).backward(g)
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def _worker(rank, world, path, args, share, results):
    from torch import distributed as dist
    from torch import nn

    from cupykern.torch import GemmScaleBatchNorm
    from cupykern.torch.gemm_scale_batchnorm import GemmScaleBatchNormReference

    dev = 0 if share else rank
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo" if share else "nccl", init_method=f"file://{path}",
                            rank=rank, world_size=world)
    torch.set_float32_matmul_precision(args.precision)
    b, k, n = args.shape
    times = []
    for cls in (GemmScaleBatchNorm, GemmScaleBatchNormReference):
        torch.manual_seed(0)
        m = nn.SyncBatchNorm.convert_sync_batchnorm(cls(k, n, (n,))).cuda()
        model = nn.parallel.DistributedDataParallel(m, device_ids=[dev])
        x = torch.randn(b, k, device="cuda")
        times.append(_step_ms(model, x, args.steps))
        del model, m, x
    dist.barrier()
    if rank == 0:
        results[world] = times
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m cupykern.benchmarks.scale_out", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=(16384, 4096, 4096),
                    metavar=("B", "K", "N"), help="rows per GPU, in_features, out_features")
    ap.add_argument("--worlds", type=int, nargs="+", default=None,
                    help="process counts (default 1, 2, 4 up to the GPUs present)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--precision", default="highest", choices=("highest", "high"))
    ap.add_argument("--share", action="store_true", help="all ranks on GPU 0 over gloo")
    args = ap.parse_args(argv)
    require_gpu()
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count()
    worlds = args.worlds or [w for w in (1, 2, 4) if w <= gpus]
    if not args.share and max(worlds) > gpus:
        raise SystemExit(f"--worlds {max(worlds)} needs that many GPUs ({gpus} present); "
                         "--share runs them all on one")
    b, k, n = args.shape
    print(f"GPU: {torch.cuda.get_device_name()} x {gpus}, torch {torch.__version__}; "
          f"{b}x{k}->{n} per GPU, float32 '{args.precision}', "
          f"{'gloo on GPU 0' if args.share else 'NCCL'}")
    print(f"{'GPUs':>4} {'ours ms':>9} {'TFLOP/s':>8} {'reference ms':>13} {'speedup':>8} "
          f"{'weak scaling':>13}")
    results = mp.Manager().dict()
    for w in worlds:
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(w, f"{d}/rendezvous", args, args.share, results), nprocs=w)
        ours, ref = results[w]
        scaling = f"{results[worlds[0]][0] / ours:.2f}" if worlds[0] == 1 else "-"
        print(f"{w:>4} {ours:>9.2f} {tflops(3 * 2 * b * k * n, ours):>8.1f} {ref:>13.2f} "
              f"{ref / ours:>7.2f}x {scaling:>13}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
