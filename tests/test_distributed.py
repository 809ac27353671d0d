"""Synchronized batch statistics: GemmScaleBatchNorm trained over torch.distributed.

Each test starts its processes with torch.multiprocessing and checks, on every rank,
our synchronized model against the reference model run on the whole batch in one
process, in float64: outputs, the rank's input gradient, the parameter gradients summed
over ranks (each rank's are its own, as nn.SyncBatchNorm's: DDP averages them) and the
running statistics, which must also be bitwise equal on every rank.

* CPU, gloo, two ranks: the merge logic, in CI.
* One GPU, gloo, two ranks both on it (gloo moves CUDA tensors): our GPU kernels.
* Several GPUs, NCCL, a rank per GPU (up to 4): skipped where fewer than two are present.
"""
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conftest import gpu_count
from cupykern.torch import GemmScaleBatchNorm
from cupykern.torch.gemm_scale_batchnorm import GemmScaleBatchNormReference

K, N = 24, 8
# (rows per rank, momentum, how bn learns it synchronizes): uneven ranks, a rank with one
# row and an empty rank; "sync" converts bn to nn.SyncBatchNorm, "group" passes the
# module a process group.
CASES = [((3, 5), 0.1, "sync"), ((1, 4), None, "group"), ((0, 6), 0.1, "sync"),
         ((7, 2), None, "sync")]
STEPS = 2
RTOL = 1e-4  # float32 against the float64 reference: the tolerance table's float32 figure


def _spawn(world: int, backend: str, device: str) -> None:
    with tempfile.TemporaryDirectory() as d:  # (the file store deletes its file when done)
        mp.spawn(_worker, args=(world, f"{d}/rendezvous", backend, device), nprocs=world)


def _worker(rank, world, path, backend, device):
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        if device == "cuda:rank":
            device = f"cuda:{rank}"
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        for sizes, momentum, how in CASES:
            _check_case(rank, world, device, (sizes * world)[:world], momentum, how)
    finally:
        dist.destroy_process_group()


def _close(ours, ref, what, scale=None):
    atol = RTOL * (ref.abs().max().item() if scale is None else scale)
    torch.testing.assert_close(ours.detach().double().cpu(), ref.detach().double(), rtol=RTOL,
                               atol=atol, msg=lambda m: f"{what}: {m}")


def _check_case(rank, world, device, sizes, momentum, how):
    torch.manual_seed(0)
    ours = GemmScaleBatchNorm(K, N, (N,), momentum=momentum,
                              process_group=dist.group.WORLD if how == "group" else None)
    if how == "sync":
        ours = nn.SyncBatchNorm.convert_sync_batchnorm(ours)
    ours = ours.to(device)
    torch.manual_seed(0)
    ref = GemmScaleBatchNormReference(K, N, (N,), momentum=momentum).double()
    gen = torch.Generator().manual_seed(1)
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    for step in range(STEPS):
        x_all = torch.randn(sum(sizes), K, generator=gen, dtype=torch.float64)
        g_all = torch.randn(sum(sizes), N, generator=gen, dtype=torch.float64)
        x_ref = x_all.requires_grad_()
        out_ref = ref(x_ref)
        out_ref.backward(g_all)
        x = x_all[rows].detach().float().to(device).requires_grad_()
        out = ours(x)
        out.backward(g_all[rows].float().to(device))
        what = f"rank {rank}, sizes {sizes}, momentum {momentum}, {how}, step {step}"
        _close(out, out_ref[rows], f"{what}: output", out_ref.abs().max().item())
        _close(x.grad, x_ref.grad[rows], f"{what}: x.grad", x_ref.grad.abs().max().item())
        # (gemm.bias's gradient cancels to rounding noise: tolerances scale with the largest)
        largest = max(q.grad.abs().max().item() for q in ref.parameters())
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            total = p.grad.clone()
            dist.all_reduce(total)
            _close(total, q.grad, f"{what}: {name}.grad", largest)
            p.grad = q.grad = None
        for (name, b), c in zip(ours.named_buffers(), ref.buffers()):
            _close(b, c, f"{what}: {name}")
            copies = [torch.empty_like(b) for _ in range(world)]
            dist.all_gather(copies, b)
            assert all(torch.equal(c, b) for c in copies), f"{what}: {name} differs across ranks"


def test_synchronized_statistics_cpu_gloo():
    _spawn(2, "gloo", "cpu")


@pytest.mark.gpu
def test_synchronized_statistics_one_gpu_gloo():
    _spawn(2, "gloo", "cuda:0")


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 or more GPUs for NCCL ranks (found fewer)")
def test_synchronized_statistics_nccl():
    _spawn(min(gpu_count(), 4), "nccl", "cuda:rank")


def test_no_synchronization_without_several_processes():
    """One process (torch.distributed not initialized): a SyncBatchNorm or a process group
    leaves the statistics this process's own, as nn.SyncBatchNorm does."""
    torch.manual_seed(0)
    ref = GemmScaleBatchNormReference(K, N, (N,))
    torch.manual_seed(0)
    ours = nn.SyncBatchNorm.convert_sync_batchnorm(GemmScaleBatchNorm(K, N, (N,)))
    x = torch.randn(6, K)
    torch.testing.assert_close(ours(x), ref(x))
    torch.testing.assert_close(ours.bn.running_var, ref.bn.running_var)
