"""What synchronized batch statistics share across processes (torch.distributed, any
backend: NCCL between GPUs, gloo between CPUs or on one GPU): a small float64 vector
per rank, gathered in rank order and merged in that order, so that every rank gets the
same bits, run after run (an all_reduce's summation order is the backend's)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def world_size(group) -> int:
    """Processes of ``group`` (None: the default group); 1 while torch.distributed is not
    initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def gather(t: torch.Tensor, group) -> list:
    """``t`` (same shape on every rank) of every rank of ``group``, in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def moments(y: torch.Tensor):
    """This rank's per-column [count, mean (N), M2 (N)] of y (B, N), float64 (zeros for
    an empty batch), as :func:`cupykern._stats.merge_moments` takes them, and its
    [min (N), max (N)] (+inf, -inf for an empty batch)."""
    b, n = y.shape
    out = y.new_zeros((2 * n + 1,), dtype=torch.float64)
    # (new_full, not torch.tensor: a host-to-device copy would wait for the GPU)
    extremes = torch.cat([y.new_full((n,), float("inf"), dtype=torch.float64),
                          y.new_full((n,), float("-inf"), dtype=torch.float64)])
    if b:
        var, mean = torch.var_mean(y, 0, correction=0)
        out[0] = b
        out[1:n + 1] = mean
        out[n + 1:] = var.double() * b
        extremes = torch.cat(torch.aminmax(y, dim=0)).double()
    return out, extremes


def sum_in_order(parts: list) -> torch.Tensor:
    """The sum of the ranks' tensors, added in rank order."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total
