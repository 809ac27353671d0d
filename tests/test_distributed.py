"""Synchronized batch statistics: GemmScaleBatchNorm trained over torch.distributed.

Each test starts its processes with torch.multiprocessing. The synchronized-statistics
tests check, on every rank, our synchronized model against the reference model run on the whole batch in one
process, in float64: outputs, the rank's input gradient, the parameter gradients summed
over ranks (each rank's are its own, as nn.SyncBatchNorm's: DDP averages them) and the
running statistics, which must also be bitwise equal on every rank.

The DDP tests train every documented model under DistributedDataParallel, ours against
the reference under the same wrapper.

* CPU, gloo, two ranks: the merge logic and the wrappers' plumbing, in CI (on the CPU
  the wrapped modules run the reference model's code: PyTorch's SyncBatchNorm refuses
  CPU tensors, so there GemmScaleBatchNorm keeps plain BatchNorm in both).
* One GPU, gloo, two ranks both on it (gloo moves CUDA tensors): our GPU kernels.
* Several GPUs, NCCL, a rank per GPU (up to 4): skipped where fewer than two are present.
"""
import functools
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conftest import gpu_count
from cupykern.torch import GemmScaleBatchNorm
from cupykern.torch.gemm_scale_batchnorm import GemmScaleBatchNormReference
from test_torch_ops import MODELS
from test_training import GRAD_RTOL

K, N = 24, 8
# (rows per rank, momentum, how bn learns it synchronizes): uneven ranks, a rank with one
# row and an empty rank; "sync" converts bn to nn.SyncBatchNorm, "group" passes the
# module a process group.
CASES = [((3, 5), 0.1, "sync"), ((1, 4), None, "group"), ((0, 6), 0.1, "sync"),
         ((7, 2), None, "sync")]
STEPS = 2
RTOL = 1e-4  # float32 against the float64 reference: the tolerance table's float32 figure


def _spawn(check, world: int, backend: str, device: str) -> None:
    """``check(rank, world, device)`` on ``world`` ranks of a new process group."""
    with tempfile.TemporaryDirectory() as d:  # (the file store deletes its file when done)
        mp.spawn(_worker, args=(check, world, f"{d}/rendezvous", backend, device), nprocs=world)


def _worker(rank, check, world, path, backend, device):
    dist.init_process_group(backend, init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        if device == "cuda:rank":
            device = f"cuda:{rank}"
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        check(rank, world, device)
        dist.barrier()  # (no rank tears its group down while another still uses it)
    finally:
        dist.destroy_process_group()
    # The check passed: leave without interpreter finalization, where gloo's worker
    # threads may still hold tensors of groups that FSDP's device mesh keeps alive and
    # destroying them aborts the process (seen once in CI, cpu-gloo-fsdp: "terminate called
    # without an active exception"; pytorch/pytorch#179291). spawn reads exit code 0.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _check_synchronized(rank, world, device):
    for sizes, momentum, how in CASES:
        _check_case(rank, world, device, (sizes * world)[:world], momentum, how)
    _check_overflow(rank, world, device)
    model = GemmScaleBatchNorm(K, N, (N,), process_group=dist.group.WORLD).to(device)
    x = torch.randn(1 if rank == 0 else 0, K, device=device)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):  # 1 row in all
        model(x)
    model.bn = nn.SyncBatchNorm(N, process_group=dist.new_group(list(range(world))))
    with pytest.raises(ValueError, match="process_group: GemmScaleBatchNorm was given one"):
        model(torch.randn(4, K, device=device))


def _check_overflow(rank, world, device):
    """float16 columns whose y = (z + b) * scale overflows in some row: non-finite outputs
    and running statistics where the reference on the whole batch has them (whether a
    mean is inf or nan there is the backend's: PyTorch's CPU sums, its CUDA kernels
    run Welford updates)."""
    models = []
    for cls in (GemmScaleBatchNorm, GemmScaleBatchNormReference):
        torch.manual_seed(0)
        m = cls(K, N, (N,)).half()
        with torch.no_grad():
            m.scale[:3] = torch.tensor([65000.0, -40000.0, 3e4])
        models.append(m.to(device))
    models[0].process_group = dist.group.WORLD
    x_all = (torch.randn(4 * world, K, generator=torch.Generator().manual_seed(3)) * 4).half()
    ours, ref = models[0](x_all[4 * rank:4 * rank + 4].to(device)), models[1](x_all.to(device))
    ref = ref[4 * rank:4 * rank + 4]
    assert ref[:, :3].isnan().any(), "the case must overflow"
    for got, want, what in ((ours, ref, "output"), *((a, b, n) for (n, a), b in zip(
            models[0].bn.named_buffers(), models[1].bn.buffers()) if n != "num_batches_tracked")):
        got, want = got.detach().float().cpu(), want.detach().float().cpu()
        fin = want.isfinite()
        assert torch.equal(got.isfinite(), fin), what
        torch.testing.assert_close(got[fin], want[fin], rtol=2e-3, atol=2e-3 * want[fin].abs().max().item(),
                                   msg=lambda m: f"{what}: {m}")


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


# (backend, device of each rank): CPU ranks; two ranks sharing one GPU (gloo moves
# CUDA tensors); a rank per GPU over NCCL.
# All are long (process groups, compiled DDP/FSDP: minutes); CI runs the CPU ranks.
RUNS = [pytest.param("gloo", "cpu", id="cpu-gloo", marks=pytest.mark.long),
        pytest.param("gloo", "cuda:0", id="one-gpu-gloo",
                     marks=[pytest.mark.gpu, pytest.mark.long]),
        pytest.param("nccl", "cuda:rank", id="nccl", marks=[
            pytest.mark.gpu, pytest.mark.long, pytest.mark.skipif(
                gpu_count() < 2, reason="needs 2 or more GPUs for NCCL ranks (found fewer)")])]


def _world(backend):
    return min(gpu_count(), 4) if backend == "nccl" else 2


@pytest.mark.parametrize("backend, device", RUNS)
def test_synchronized_statistics(backend, device):
    _spawn(_check_synchronized, _world(backend), backend, device)


TRAIN_STEPS = 20


def _ddp_pairs(device):
    """(name, reference, ours) built from one seed, for every documented model; the norms
    behind an nn.Linear (DDP needs parameters). On CUDA GemmScaleBatchNorm's bn is
    converted to nn.SyncBatchNorm in both (on the CPU the reference's cannot run)."""
    for name, (ref_cls, ours_cls, init, shape, _) in MODELS.items():
        pair = []
        for cls in (ref_cls, ours_cls):
            torch.manual_seed(0)
            m = cls(*init)
            if not init:
                m = nn.Sequential(nn.Linear(shape[1], shape[1]), m)
            if device != "cpu" and isinstance(m, GemmScaleBatchNormReference):
                m = nn.SyncBatchNorm.convert_sync_batchnorm(m)
            pair.append(m.to(device))
        yield name, shape, *pair


def _ddp(m, device):
    ids = [torch.device(device).index] if device != "cpu" else None
    return nn.parallel.DistributedDataParallel(m, device_ids=ids)


def _fsdp(m, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    return fully_shard(m, mesh=mesh)


def _ddp_compiled(m, device):
    return torch.compile(_ddp(m, device))


def _fsdp_compiled(m, device):
    return torch.compile(_fsdp(m, device))


WRAPPERS = {"ddp": _ddp, "fsdp": _fsdp, "ddp_compiled": _ddp_compiled,
            "fsdp_compiled": _fsdp_compiled}


def _local(t):
    """This rank's part of a tensor (an FSDP-sharded DTensor's shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _check_training(wrapper, rank, world, device):
    """20 SGD steps of wrapper(ours) against wrapper(reference), each rank on its own
    batches. Every step starts both from the same weights (ours are set to the
    reference's: the two drift apart at rounding level otherwise, which says nothing of
    the wrapper) and must give the same loss, gradients (within GRAD_RTOL of the largest,
    as the training tests), weight update and buffers."""
    lr = 0.05
    for name, shape, ref, ours in _ddp_pairs(device):
        models = [WRAPPERS[wrapper](m, device) for m in (ref, ours)]
        opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in models]
        pairs = list(zip(ref.parameters(), ours.parameters()))
        gen = torch.Generator().manual_seed(100 + rank)
        for step in range(TRAIN_STEPS):
            what = f"{name}, {wrapper}, rank {rank}, step {step}"
            x = torch.randn(*shape, generator=gen).to(device)
            losses, c = [], None
            for m, opt in zip(models, opts):
                opt.zero_grad()
                out = m(x)
                if c is None:  # loss = <c, out>
                    c = torch.randn(out.shape, generator=gen).to(device)
                loss = (out * c).sum()
                loss.backward()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-7,
                                       msg=lambda m: f"{what}: loss {m}")
            grad_tol = GRAD_RTOL * max(_local(p.grad).abs().max().item() for p, _ in pairs)
            for p, q in pairs:
                torch.testing.assert_close(_local(q.grad), _local(p.grad), rtol=0, atol=grad_tol,
                                           msg=lambda m: f"{what}: gradient {m}")
            for opt in opts:
                opt.step()
            with torch.no_grad():
                for p, q in pairs:  # an SGD step moves them apart by lr * grad_tol at most
                    torch.testing.assert_close(_local(q), _local(p), rtol=1e-6, atol=lr * grad_tol,
                                               msg=lambda m: f"{what}: updated weight {m}")
                    q.copy_(p)
            for (key, a), b in zip(ref.named_buffers(), ours.buffers()):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{what}: {key} {m}")


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("backend, device", RUNS)
def test_training_matches_reference(wrapper, backend, device):
    _spawn(functools.partial(_check_training, wrapper), _world(backend), backend, device)


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
