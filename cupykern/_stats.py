"""Per-column batch statistics of row blocks, merged: what synchronized BatchNorm (over
processes) and the Dask path (over chunks) share. A block's statistics are one float64
vector [count, mean (N), M2 (N)] (M2: the sum of squared deviations from the mean);
any array library with arithmetic operators (NumPy, CuPy, torch) works."""
from __future__ import annotations


def merge_moments(parts):
    """``(count, mean, M2)`` of all rows from the blocks' vectors, merged in their order
    with Chan et al.'s pairwise formula (exact for empty blocks), so that the result is
    the same bits whoever merges them."""
    n = (parts[0].shape[0] - 1) // 2
    count, mean, m2 = parts[0][0], parts[0][1:n + 1], parts[0][n + 1:]
    for p in parts[1:]:
        cb, mb, m2b = p[0], p[1:n + 1], p[n + 1:]
        total = count + cb
        w = cb / (total + (total == 0))  # the new block's share (0 when both are empty)
        delta = mb - mean
        mean = mean + delta * w
        m2 = m2 + m2b + delta * delta * count * w
        count = total
    return count, mean, m2
