"""L1 / L2 row normalisation: ``x / mean(|x|)`` and ``x / sqrt(sum(x*x))`` along an axis.

GPU design: three kernel families, one dispatcher (``_route``, its table below).
Short rows (kernels_cu/normalize_short.cu): a group of lanes per row, many rows per warp.
Medium rows (kernels_cu/normalize.cu): one thread-block cluster per row keeps the row in
registers between the reduction and the scaling, so x is read from DRAM once and y
written once (copy-bandwidth bound); the next row loads into shared memory meanwhile.
Long rows, and few rows (kernels_cu/normalize_long.cu): chunks of every row spread over
all SMs, two passes (x read twice; the second read hits L2 where x fits it). Every
family has a fused backward, and adds in a fixed order (deterministic). Few rows
(kernels_cu/normalize_resident.cu): one cooperative launch, a chunk a CTA, each chunk's
front kept on chip while the row's CTAs exchange their sums, so x (and, backward, dy) is
read once where the chip holds it; many such rows (kernels_cu/normalize_pipelined.cu): the
same on every SM in row groups, each walking its rows in turn, two rows on chip, one read
while the other is written.
"""
from __future__ import annotations

import operator

import numpy as np

from . import _dask, _loader
from ._array import (CTYPE, ITEMSIZE, Place, cached, cached_checked, check_out, contiguous,
                     copy_into, data_ptr, empty, is_torch, launch, launch_all, moveaxis,
                     native, normalize_axis, operand, same_place, signature, torch_layer)
from ._geometry import acc_dtype, cdiv, co_aligned, row_stride

_FILE, _SHORT_FILE, _LONG_FILE = "normalize.cu", "normalize_short.cu", "normalize_long.cu"
_RESIDENT_FILE, _PIPELINED_FILE = "normalize_resident.cu", "normalize_pipelined.cu"
_RESIDENT, _PIPELINED = "normalize_resident", "normalize_pipelined"  # (their kernels)
P = {"l1": 1, "l2": 2}

# ---- The dispatcher: which kernel family a geometry gets (_route), in this order.
# 1. Short rows (normalize_short.cu): rows of at most SHORT_MAX_VECTORS 16-byte vectors
#    (4 KB) go to a group of G lanes per row, many rows per warp. H200, same run, float32
#    L2, host included (the envelope grid): with one CTA per row 262144x7 took 342 us against
#    eager's 20, 1048576x32 1286 us against 335. GPU time (graph replay), H200: 8192x768
#    float32 13.9 us with (32, 8, 1) against 15.0 for a 128-thread CTA per row; 16384x1024
#    36.5 us against 37.0 (the boundary: past 4 KB the CTA kernel holds the row).
# 2. Medium rows: a thread-block cluster per row (CONFIGS below), the row in registers.
#    Also for few such rows: 2x65535 float32 4.5 us GPU time either way and 6.9 us host
#    included against 8.7 chunked; 16x65535 4.9 us against 6.0-8.6 chunked.
# 3. Rows longer than the largest cluster holds: chunks of every row over all SMs
#    (normalize_long.cu, two passes). H200 (the envelope grid): 1 x 1048576 float32 took 90 us on
#    a 16-CTA two-pass launch against eager's 22; chunked, 5.7 us GPU time with chunks of
#    1024 vectors (6.4 us at 512, 8.7 at 256). x is read twice: 1x4194304 float32 12.8 us
#    (torch.compile 10.8 us, copy 5.9); 8x4194304 float32 (x > L2) 111.2 us, 1.72x copy
#    time, with pass 2 walking each chunk from its end (115.3 us walking from the front,
#    same run). A one-pass kernel (each chunk written a fixed number of chunks after its
#    read, 9fcba98) was slower at every shape (8x4194304 float32 113.8-127.6 us against
#    114.4; 3x2000001 24.0-26.4 against 20.4): see docs/performance.md.
# 4. Of those, forward, up to RESIDENT_MAX_ROWS rows of at least RESIDENT_MIN_BYTES (one
#    row: RESIDENT_ONE_ROW_MIN_BYTES): one cooperative launch (normalize_resident.cu), each
#    chunk's front kept on chip (352 KB an SM: 46 MB on an H200), the rest re-read from L2
#    where it still holds it. H200, GPU time (graph replay), two-pass against this, us
#    (clone's): 8x1048576 float32 25.2 against 21.5 (17.4); 4x4194304 float32 54.1 / 42.8
#    (33.6); 8x4194304 bfloat16 54.8 / 44.5 (33.6); 11x2312175 float32 87.8 / 78.5 (75.8);
#    7x3381554 79.4 / 75.6 (71.6); 8x4194304 float32 107.0 / 99.3 (64.7); 2x16777216
#    float32 107.6 / 98.6 (64.1; torch.compile 98.8); 4x8388608 107.8 / 98.1; 3x8388608
#    82.0 / 70.4 (49.4; compile 80.1); one row: 1x16777216 float32 50.6 / 42.7 (32.6),
#    1x33554432 104.1 / 99.1 (64.0). Not taken: one row under 64 MB (1x8388608 float32
#    25.4 / 25.6; 1x16777216 bfloat16 25.5 / 27.2), and less than 32 MB, where its
#    counters' memset, the CTAs' exchange and one CTA an SM cost more than a second read
#    (1x4194304 float32 11.2 against 12.1; 4x2097152 bfloat16 11.8 against 13.4; host
#    included, one launch fewer: 21.3 against 17.0, 21.9 against 17.8). At most 16 rows:
#    a row takes sms // nrows CTAs, so more rows leave more SMs idle (timed: 4 to 16 rows,
#    0 to 6 of 132 SMs idle). 32 MB is close either way: 2x4194304 float32 25.6 / 25.8.
# 5. The backward, up to RESIDENT_MAX_ROWS rows (one row too) of x from RESIDENT_MIN_BYTES
#    to RESIDENT_BACKWARD_MAX_BYTES: the same launch holding x and dy (half the chip each).
#    H200, GPU time, two-pass against this, us, L2 (x's clone; the ceiling, x and dy read
#    and dx written, is 1.5x it): 32 MB of x, 2x4194304 float32 41.9 / 37.0 (17.6),
#    8x1048576 41.9 / 36.5, 1x8388608 44.1 / 36.6, rows of odd lengths too: 7x1198373 42.2 /
#    38.3, 3x2796203 41.9 / 38.0; 64 MB, 4x4194304 83.5 / 79.4 (32.2), 16x1048576 83.3 /
#    79.1, 1x16777216 83.3 / 79.2, 8x4194304 bfloat16 83.7 / 79.6 (L1 alike). Past 64 MB
#    less of x and dy stays on chip and the one launch loses to two: 67 MB, 5x3355443 83.7 /
#    86.7, 9x1864135 83.7 / 87.6, 12x1398101 84.0 / 84.8; 134 MB, 12x2796203 166.8 / 179.8;
#    8x4194304 164.0 / 162.5.
# 6. Tried before 4 (forward only): at least PIPELINED_MIN_ROWS rows, x of at least
#    PIPELINED_MIN_BYTES; more rows than 4 takes, from PIPELINED_MANY_MIN_BYTES: the
#    pipelined few-rows kernel (normalize_pipelined.cu), a CTA an SM, in row groups
#    (_row_groups) that each walk their rows one after another, two rows' chunks on
#    chip (176 KB a CTA each, float64 128 KB: rows to 22.7 MB, 16.5 MB, read once on
#    the whole chip), each row's exchange waiting behind the next row's reads. H200, GPU
#    time (graph replay), the few-rows kernel (rows side by side) or, past 16 rows, the
#    two-pass one against this, us (clone's), float32 unless named. One group (rows from
#    about 11 MiB, float64 8 MiB), two runs: 8x4194304 96.2 / 92.7 (64.4); 4x8388608 96.1 / 87.6;
#    8x2097152 float64 100.2 / 87.9; 8x8388608 bfloat16 98.8 / 89.9; 16x4194304 198.2 /
#    176.9 (127.4); 6x8388608 147.8 / 130.8; 16x8388608 bfloat16 201.5 / 171.4; 9x4194303
#    120.9 / 104.8; 4x16777216 198.8 / 193.8; two-pass: 24x4194304 321.6 / 267.9 (189.6),
#    32x4194304 414.5 / 352.3. Row groups, two runs (a range where both timed a shape;
#    64x262144 float64, 200x163840 and 100x300001 from the first, which split the rows
#    into 11, 33 and 18 groups where `_row_groups` now makes 7, 29 and 17):
#    128x262144 110.8-111.1 / 93.8 (64.2-65.7); 64x524288 113.0-113.2 / 93.7-94.7;
#    32x1048576 107.4-107.6 / 96.4; 256x262144 212.7 / 184.6 (127.5); 64x1048576 228.3 /
#    176.6; 512x262144 432.5 / 353.5; 128x524288 bfloat16 111.0 / 96.7; 64x262144 float64
#    108.2 / 99.4; 24x1048576 float64 160.9-161.0 / 129.4-130.1; 200x163840 (640 KB rows)
#    107.6 / 97.7; odd lengths 100x300001 101.1 / 89.8, 37x1000003 125.9 / 107.8; the
#    few-rows kernel: 12x2796203 103.9-104.7 / 95.1-96.0, 16x2097152 96.1 / 94.1-94.5.
#    More rows than 4 takes, 40 to 128 MB: 40x262144 35.3 / 31.3, 20x524288 34.6 / 30.4,
#    64x262144 53.6 / 47.2-47.6, 17x1048576 59.7 / 54.7, 40x131072 float64 35.6 / 33.8.
#    Not taken: under 40 MB (32x262144 25.9 / 28.0, 96x196608 bfloat16 30.9 / 31.2, where
#    the two-pass kernels' second read hits L2), 3-16 rows under 128 MB (16x1048576 42.0 /
#    49.0, 12x2097152 68.1 / 72.1, 6x4194304 68.1 / 72.4; 3x8388608, 96 MB, won by 4% in
#    four runs, 68.7 / 66.0, where 6x4194304 lost by 4-6%), two rows (2x16777216 95.7 /
#    99.0) and one; on GPUs without clusters, rows that a cluster holds on sm_90 (timed
#    on the H200 alone, so at rows no cluster holds).
PIPELINED_MIN_ROWS = 3
PIPELINED_MIN_BYTES = 2**27
PIPELINED_MANY_MIN_BYTES = 40 * 2**20
RESIDENT_MIN_BYTES = 2**25
RESIDENT_ONE_ROW_MIN_BYTES = 2**26
RESIDENT_BACKWARD_MAX_BYTES = 2**26
RESIDENT_MAX_ROWS = 16
_COOPERATIVE_LAUNCH_TOO_LARGE = 720  # (CUresult: a grid larger than can be resident)
SHORT_MAX_VECTORS = 256
# The backward holds x and dy: up to 128 vectors a row. H200 GPU time, float32: 65536x512
# (128 vectors) 103 us with (32, 4, 1) against 128 for a CTA per row; 16384x1024 (256) 74
# us with (32, 8, 1) against 56.
SHORT_MAX_VECTORS_BACKWARD = 128

# Short-row kernel configurations (G lanes per row, UNITS per lane, ROWS rows per lane per
# step), smallest capacity G * UNITS first: the first that holds a row is taken. Rows of
# at least two vectors' worth use 16-byte vector units (head and tail scalars apart),
# shorter rows single elements (per item size). H200 GPU time (graph replay):
# - vector units: one per lane (G = the row's vectors) and a few rows in flight per
#   lane win: 524288x16 bfloat16 (2 vectors) 9.5 us with (2, 1, 2), 12.5 with (2, 1, 8),
#   19.3 with (4, 1, 4) (copy 5.9); 524288x16 float32 18.5 us with (4, 1, 4), 23.0 with
#   (4, 1, 8), 25.5 with (8, 1, 4) (copy 17.5); 1048576x32 float32 70.1 us with (8, 1, 4),
#   80.8 with (8, 1, 8), 103 with (16, 1, 2) (copy 64.8); 131072x100 float32 32.7 us with
#   (32, 1, 2), 35.5 with (32, 2, 2) (copy 26.5).
# - single elements: 262144x7 float32 6.2 us with (4, 2, 4), 7.4 with (8, 1, 4), 9.9 with
#   (2, 4, 4), 16.7 with one lane per row (1, 8, 2); 2000000x5 bfloat16 24.5 us with
#   (2, 4, 4), 31.6 with (4, 2, 4), 49.0 with (8, 1, 4) (copy 13.7).
SHORT_VECTOR = ((2, 1, 2), (4, 1, 4), (8, 1, 4), (16, 1, 2), (32, 1, 2), (32, 2, 2), (32, 4, 1),
                (32, 8, 1))
# The backward's (x and dy in flight, twice the registers): at most 2 rows in flight per lane.
# H200 GPU time (graph replay), 1048576x32 backward, same run, ratio to 1.5x copy: bfloat16
# L1 (4, 1, 2) 59.4 us 1.18x, (2, 2, 2) 62.7, (4, 1, 4) 76.4 1.52x, (1, 4, 2) 75.1, (4, 1,
# 8) 116.5; L2 (4, 1, 2) 55.1 1.10x against (4, 1, 4) 70.4; float32 L1 (8, 1, 2) 105.9 us
# 1.09x, (4, 2, 2) 109.7, (8, 1, 4) 116.4 1.20x, (8, 1, 8) 176.3; L2 (8, 1, 2) 105.2 against
# (8, 1, 4) 118.0 (copy 33.6 / 64.9 us).
SHORT_VECTOR_BACKWARD = ((2, 1, 2), (4, 1, 2), (8, 1, 2), (16, 1, 2), (32, 1, 2), (32, 2, 2),
                         (32, 4, 1))
SHORT_SCALAR = {2: ((2, 4, 4), (8, 2, 4)), 4: ((4, 2, 4),), 8: ((4, 2, 4),)}
# Alternatives the benchmark's tuning section times: (G, UNITS, ROWS, vector units).
SHORT_TUNING = ((8, 1, 4, False), (2, 1, 8, True))
_SHORT_THREADS = 256
_SHORT_CTAS_PER_SM = 8  # a full SM of 256-thread CTAs; more CTAs walk more steps

# Kernel configurations (cluster CTAs, threads per CTA, 16-byte vectors per thread[, prefetch
# [, rows per cluster]]), smallest first. A row of ncols elements needs C*T*V >= ncols //
# (16 // itemsize) vectors. Prefetch stages the next row in shared memory (cp.async)
# while registers hold this one. Per item size, measured at 32768x65535, same runs:
# float32 4-CTA clusters of 512 x 8 with prefetch, one CTA per SM (H200 1.135x copy
# time, H100 1.067x; 8 x 256 x 8 with 16 rows per cluster 1.164x / 1.103x); 2-byte types
# 512 x 4 without prefetch, three CTAs per SM (float16 H200 1.05-1.09x, H100 1.05x).
# The cluster's row sums travel by st.async onto mbarriers (ClusterSum): with a cluster
# barrier per row instead, 1.20-1.22x (float16 1.14-1.16x).
# Rows stay on chip: bulk tensor-copy (TMA) loads into a ring of 2-6 shared-memory row
# buffers per CTA timed >= 1.26x copy time forward (backward >= 1.55x its ceiling) on
# H200, and no SM-issued copy, TMA or not, came under 1.08x the driver's memcpy.
_SINGLE = ((1, 128, 4), (1, 256, 4), (1, 512, 4), (1, 1024, 4))
CONFIGS = {2: _SINGLE + ((2, 512, 4, False), (4, 512, 4, False), (8, 512, 4, False)),
           4: _SINGLE + ((2, 256, 8), (4, 256, 8), (4, 512, 8), (8, 512, 8)),
           8: _SINGLE + ((2, 256, 8), (4, 256, 8), (8, 256, 8), (8, 512, 8))}
# Alternatives the benchmark sweeps (benchmarks/normalize.py); a 4th entry False
# drops the next-row prefetch (no shared-memory staging).
TUNING_CONFIGS = {2: ((4, 512, 4), (4, 256, 8, False)),
                  4: ((8, 512, 4), (4, 1024, 4), (8, 256, 8, True, 16), (8, 256, 8, False), (8, 512, 4, False)),
                  8: ()}
# The fused backward holds x and dy: its own configurations, in the same form, picked
# the same way; clusters prefetch x and dy (2 x 32 KB of shared memory per 512 x 4 CTA,
# two CTAs per SM). At 32768x65535 float32 on H200: 512 x 4 1.09-1.10x its ceiling,
# 1.13-1.15x without prefetch (1.20-1.22x with a cluster barrier per row, no prefetch).
_NO_PREFETCH = tuple(c + (False,) for c in _SINGLE)
BACKWARD_CONFIGS = {
    2: _NO_PREFETCH + ((2, 512, 4), (4, 512, 4), (8, 512, 4)),
    4: _NO_PREFETCH + ((2, 512, 4), (4, 512, 4), (8, 512, 4), (8, 512, 8)),
    8: _NO_PREFETCH + ((2, 256, 8), (4, 256, 8), (8, 256, 8), (8, 512, 8))}
_ROWS_PER_CLUSTER = 4  # each cluster walks ~4 rows: its next row loads while it scales one
# Chunked two-pass kernels: THREADS per CTA, UNROLL vectors in flight per thread; about
# ITEMS_PER_SM (row, chunk) items per SM, each at least MIN_CHUNK vectors (see 3. above).
_CHUNK = {"THREADS": 256, "UNROLL": 4, "ITEMS_PER_SM": 8, "MIN_CHUNK": 1024}
# Few rows, forward (4. above), per item size: (THREADS, REGS 16-byte vectors a thread
# kept in registers, UNROLL vectors in flight a thread), one CTA an SM. sm_90 ptxas: 115-126
# registers a thread, no spills (float64 from 8 vectors on spills: its division's
# registers). H200, GPU us, (512, 16, 4) / (512, 16, 8) / (1024, 8, 4) (the last without
# the kernel's L2 priorities): 4x4194304 float32 42.8 / 43.8 / 46.5; 8x4194304 bfloat16
# 44.5 / 45.2 / 50.0. (512, 24, 4) spills (50.9 us at 4x4194304 float32, no priorities).
RESIDENT = {2: (512, 16, 4), 4: (512, 16, 4), 8: (512, 4, 4)}
RESIDENT_TUNING = ((512, 16, 8), (1024, 8, 4))  # (what the benchmark times)
# The backward's (x and dy a thread: half the vectors of each in registers).
RESIDENT_BACKWARD = {2: (512, 8, 4), 4: (512, 8, 4), 8: (512, 2, 4)}
# The pipelined forward's (normalize_pipelined.cu): two rows' chunks a thread, as the
# backward's x and dy (half the vectors of each in registers).
PIPELINED = RESIDENT_BACKWARD
# Rows a pipelined CTA holds at once, a bank each (one read while the one before is
# written): the kernel's BANKS, which its walk fixes at two.
PIPELINED_BANKS = 2
# A few-rows chunk is a whole number of 128-byte lines (8 vectors), its boundaries on
# lines of x (normalize_resident.cu), so that no line is split between two CTAs. H200,
# GPU time, chunks of any vector count against whole lines (rows starting on a line):
# 2x16777216 float32 112.1 against 98.6 us, 4x8388608 111.3 / 98.1, 3x8388608 78.2 / 70.4
# (rows whose chunks were already whole lines, such as 8x4194304, unchanged: 99.0 / 99.4).
RESIDENT_CHUNK_VECTORS = 8


def _kernel_of(cfg) -> tuple:
    """(cluster CTAs, threads, vectors, prefetch) of a configuration: prefetch defaults to
    on, and a 5th entry (rows per cluster) changes the launch, not the kernel."""
    return tuple(cfg[:3]) + (bool(cfg[3]) if len(cfg) > 3 else True,)


def _staging(cfg, arrays: int) -> int:
    """Dynamic shared memory of a configuration's kernel: with prefetch, the next row's
    16-byte vectors of ``arrays`` arrays (x; the backward x and dy) for each thread."""
    c, t, v, prefetch = _kernel_of(cfg)
    return arrays * t * v * 16 if prefetch else 0


def _tf(b) -> str:
    return "true" if b else "false"


def _cluster_expr(p, dtype, cfg):
    c, t, v, prefetch = _kernel_of(cfg)
    return f"normalize_rows<{p}, {CTYPE[dtype]}, {c}, {t}, {v}, {_tf(prefetch)}>"


def _backward_expr(p, dtype, cfg):
    c, t, v, prefetch = _kernel_of(cfg)
    return f"normalize_backward_rows<{p}, {CTYPE[dtype]}, {c}, {t}, {v}, {_tf(prefetch)}>"


def _short_expr(p, dtype, short, bwd):
    g, units, rows, vec = short
    return (f"normalize_short_rows<{p}, {CTYPE[dtype]}, {g}, {units}, {_tf(vec)}, {rows}, "
            f"{_SHORT_THREADS}, {_tf(bwd)}>")


def _chunk_exprs(p, dtype, bwd):
    tail = f"{p}, {CTYPE[dtype]}, {_CHUNK['THREADS']}, {_CHUNK['UNROLL']}, {_tf(bwd)}>"
    return f"normalize_chunk_sums<{tail}", f"normalize_chunk_apply<{tail}"


def _few_rows_expr(kernel, p, dtype, cfg, last):
    """A few-rows kernel's instantiation, ``last`` its last template argument: _RESIDENT's
    ``bwd`` (a bool) or _PIPELINED's BANKS (:data:`PIPELINED_BANKS`)."""
    threads, regs, unroll = cfg
    last = _tf(last) if isinstance(last, bool) else last
    return (f"{kernel}<{p}, {CTYPE[dtype]}, {threads}, {regs}, {unroll}, "
            f"{RESIDENT_CHUNK_VECTORS}, {last}>")


def _short_table(itemsize: int):
    """Every short-row configuration of an item size as (G, UNITS, ROWS, vector units):
    the forward's and the backward's (each direction compiles and accepts all of them)."""
    return (tuple(c + (True,) for c in dict.fromkeys(SHORT_VECTOR + SHORT_VECTOR_BACKWARD))
            + tuple(c + (False,) for c in SHORT_SCALAR[itemsize]) + SHORT_TUNING)


for _p in P.values():
    for _dt in CTYPE:
        _isz = ITEMSIZE[_dt]
        for _cfg in CONFIGS[_isz] + TUNING_CONFIGS[_isz]:
            _loader.register(_FILE, [_cluster_expr(_p, _dt, _cfg)], min_cc=90 if _cfg[0] > 1 else 0)
        for _cfg in BACKWARD_CONFIGS[_isz] + CONFIGS[_isz] + TUNING_CONFIGS[_isz]:
            _loader.register(_FILE, [_backward_expr(_p, _dt, _cfg)], min_cc=90 if _cfg[0] > 1 else 0)
        for _bwd in (False, True):
            _loader.register(_SHORT_FILE, [_short_expr(_p, _dt, c, _bwd) for c in _short_table(_isz)])
            _loader.register(_LONG_FILE, _chunk_exprs(_p, _dt, _bwd))
        _loader.register(_RESIDENT_FILE, [_few_rows_expr(_RESIDENT, _p, _dt, c, False)
                                          for c in (RESIDENT[_isz],) + RESIDENT_TUNING]
                         + [_few_rows_expr(_RESIDENT, _p, _dt, RESIDENT_BACKWARD[_isz], True)])
        _loader.register(_PIPELINED_FILE, [_few_rows_expr(_PIPELINED, _p, _dt, PIPELINED[_isz],
                                                          PIPELINED_BANKS)])


def l1_normalize(x, axis: int = 1, *, out=None, config=None):
    """``x / mean(abs(x), axis, keepdims=True)``, computed in one fused pass.

    Args:
        x: CuPy array, torch tensor (CUDA or CPU) or NumPy array of float16,
            bfloat16, float32 or float64, any ndim >= 1.
        axis: the axis to reduce (negative counts from the end).
        out: optional array of x's kind, device, shape and dtype to write into
            (may be ``x`` itself).
        config: for tuning and tests on the GPU: force one kernel and configuration,
            a tuple: (cluster CTAs, threads, 16-byte vectors per thread[, prefetch[,
            rows per cluster]]) from :data:`CONFIGS` or :data:`TUNING_CONFIGS` whose
            capacity C*T*V holds a row; (0, G, UNITS, ROWS, vector units) for the
            short-row kernel (:data:`SHORT_VECTOR`, :data:`SHORT_SCALAR` of x's item
            size, :data:`SHORT_TUNING`; G * UNITS must hold a row); (-1, VC) for the chunked
            two-pass kernel with chunks of VC 16-byte vectors; (-2,) or (-2, THREADS, REGS,
            UNROLL) (:data:`RESIDENT` of x's item size, :data:`RESIDENT_TUNING`) for the
            few-rows kernel (at most one row an SM), (-3,) or (-3, THREADS, REGS, UNROLL)
            (:data:`PIPELINED` of x's item size) for its pipelined form, forward (any
            number of rows, walked in row groups of CTAs, a CTA an SM).
            ``None`` (default):
            the dispatcher's choice (see ``_route``).

    Returns an array of x's kind (torch in -> torch out, on x's device and
    torch's current stream). torch tensors go through the custom op
    ``torch.ops.cupykern.normalize`` (autograd, torch.compile, CUDA graphs). A Dask
    array (CuPy or NumPy chunks) gives a Dask array normalized block by block, ``axis``
    rechunked into one chunk where it is split (``out`` not supported).
    Sums accumulate in float32 (float64 for float64) and the mean is rounded to
    x's dtype before dividing, as PyTorch does. A row of zeros gives nan (0/0);
    inf and nan propagate as in PyTorch.

    Copies: none when ``axis`` is the last axis, elements along it are
    contiguous and the rows are evenly strided (any C-contiguous array, or a
    slice such as ``x[:, :n]``); otherwise x is first copied to a contiguous
    array with ``axis`` last, and the result is returned as a view in x's axis
    order. x is also copied when ``out`` does not share its 16-byte alignment.
    """
    return _dispatch(x, 1, axis, out, config)


def l2_normalize(x, axis: int = 1, *, out=None, config=None):
    """``x / sqrt(sum(x * x, axis, keepdims=True))`` (no eps: a zero row gives nan).

    Arguments, return value, accumulation and copies as in :func:`l1_normalize`.
    """
    return _dispatch(x, 2, axis, out, config)


def _dispatch(x, p, axis, out, config):
    """torch tensors to the custom op, Dask arrays block by block, the rest here."""
    if is_torch(x):
        return torch_layer("normalize").normalize(x, p, axis, out, config)
    if _dask.is_dask(x):
        _dask.no_out(out)
        ax = check(_dask.sample(x, (0,) * x.ndim), p, axis, None, config)[1]
        x = _dask.whole(x, ax)
        return _dask.map_blocks(normalize, x, p, ax, None, config, name=f"l{p}_normalize")
    return normalize(x, p, axis, out, config)


def reference(x: np.ndarray, axis: int, p: int) -> np.ndarray:
    """NumPy reference with PyTorch's rounding: reduce in float32/float64, round the
    divisor to x's dtype, divide."""
    acc = np.float64 if x.dtype == np.float64 else np.float32
    xa = x.astype(acc)
    with np.errstate(all="ignore"):
        if p == 1:
            # (sum / n, not np.mean: a length-0 row gives nan as torch.mean does, without
            # NumPy's "Mean of empty slice" warning)
            d = np.sum(np.abs(xa), axis=axis, keepdims=True) / acc(xa.shape[axis])
        else:
            d = np.sqrt(np.sum(xa * xa, axis=axis, keepdims=True))
        return (xa / d.astype(x.dtype).astype(acc)).astype(native(x.dtype))


def check(x, p: int, axis, out=None, config=None):
    """Validate the arguments once: (x's Operand, axis in range, p, out's Operand or None,
    config). torch.norm of one element is |x| (sqrt(x*x) would overflow), so p=2 over a
    length-1 axis becomes p=1."""
    if type(p) is not int or p not in (1, 2):  # (the public functions pass 1 or 2; the op any int)
        raise ValueError(f"p: expected 1 (mean |x|) or 2 (the Euclidean norm), got {p!r}")
    a = operand(x, "x")
    if a.ndim == 0:
        raise ValueError("x: expected an array with at least 1 dimension, got a 0-d array")
    ax = normalize_axis(axis, a.ndim)
    if p == 2 and a.shape[ax] == 1:
        p = 1
    o = check_out(out, a, a.shape, inputs=(a,), in_place=True) if out is not None else None
    if config is not None:
        config = config_tuple(config)
        _require_config(config, a.dtype)
    return a, ax, p, o, config


def config_tuple(config) -> tuple:
    """``config`` as a tuple of ints; TypeError for a string or another non-sequence, or
    an entry that is not an integer (e.g. 1.5, which int() would truncate)."""
    if isinstance(config, (str, bytes)) or not hasattr(config, "__iter__"):
        raise TypeError(f"config: expected a tuple (cluster CTAs, threads, vectors[, prefetch[, "
                        f"rows per cluster]]), got {config!r}")
    try:
        return tuple(operator.index(v) for v in tuple(config))  # (a bool: the prefetch flag)
    except TypeError:
        raise TypeError(f"config: expected a tuple of integers, got {config!r}") from None


def _require_config(config, dtype, backward=False):
    """ValueError unless ``config`` names a known kernel configuration of ``dtype`` (see
    :func:`l1_normalize`'s ``config``)."""
    if len(config) == 2 and config[0] == -1:
        if config[1] < 1:
            raise ValueError(f"config: chunk vectors (2nd entry) must be >= 1, got {config}")
        return
    if config[:1] == (-3,) and backward:
        raise ValueError(f"config: {config}: the pipelined few-rows kernel (-3) is the "
                         "forward's only; the backward's few-rows kernel is (-2,)")
    if config[:1] in ((-2,), (-3,)):
        isz = ITEMSIZE[dtype]
        known = ((RESIDENT_BACKWARD[isz],) if backward else (PIPELINED[isz],) if config[0] == -3
                 else (RESIDENT[isz],) + RESIDENT_TUNING)
        if config[1:] and config[1:] not in known:
            raise ValueError(f"config: {config} is not ({config[0]},) or one of the few-rows "
                             f"configurations ({config[0]}, THREADS, REGS, UNROLL) of {dtype}: "
                             f"{known}")
        return
    if len(config) == 5 and config[0] == 0:
        table = _short_table(ITEMSIZE[dtype])
        if (config[1], config[2], config[3], bool(config[4])) not in table:
            raise ValueError(f"config: {config} is not a short-row configuration (0, G, UNITS, "
                             f"ROWS, vector units) of {dtype}: {table}")
        return
    if not 3 <= len(config) <= 5 or config[0] < 1:
        raise ValueError(f"config: expected (cluster CTAs, threads, vectors[, prefetch[, rows "
                         f"per cluster]]), (0, G, UNITS, ROWS, vector units), (-1, chunk "
                         f"vectors), (-2[, THREADS, REGS, UNROLL]) or (-3[, THREADS, REGS, "
                         f"UNROLL]), got {config}")
    if len(config) == 5 and config[4] < 1:
        raise ValueError(f"config: rows per cluster (5th entry) must be >= 1, got {config[4]}")
    isz = ITEMSIZE[dtype]
    known = (BACKWARD_CONFIGS[isz] if backward else ()) + CONFIGS[isz] + TUNING_CONFIGS[isz]
    if _kernel_of(config) not in {_kernel_of(c) for c in known}:
        raise ValueError(f"config: {config} is not one of the {dtype} configurations "
                         f"{known} (optionally with a rows-per-cluster 5th entry)")


_plans: dict = {}  # (signature(x), p, axis) -> run(x) for a fresh output, or None


def normalize(x, p: int, axis, out=None, config=None):
    """``x / d`` with d the row's L1 mean (p=1) or L2 norm (p=2) along ``axis``, for
    CuPy arrays, NumPy arrays and (from the torch layer) torch tensors: the array
    functions' core, after :func:`l1_normalize` / :func:`l2_normalize` have sent torch
    tensors to their custom op."""
    checked = None
    if out is None and config is None and type(axis) is int:  # the common call: cached
        run, checked = cached_checked(_plans, (signature(x), p, axis), check, _fresh, (x, p, axis))
        if run is not None:
            return run(x)
    a, ax, p, o, config = checked or check(x, p, axis, out, config)
    if a.kind == "cpu":
        res = reference(x, ax, p)
        return res if o is None else _fill(out, res)
    if a.size == 0:  # laid out as any result: contiguous with the axis last, viewed back
        if o is not None:
            return out
        shape = list(a.shape)
        shape.append(shape.pop(ax))
        return moveaxis(empty(a, tuple(shape)), -1, ax)

    isz = ITEMSIZE[a.dtype]
    xs = _rows(a, ax)
    os_ = _rows(o, ax) if o is not None else None
    if xs is not None and os_ is not None and co_aligned(a.ptr, xs, o.ptr, os_, isz):
        _plan(a, xs, os_, p, config)(a, a.ptr, o.ptr)
        return out  # straight into out, no copies

    src = a if xs is not None else operand(contiguous(operand(moveaxis(x, ax, -1), "x")), "x")
    dst = operand(empty(src, src.shape), "out")
    ss, ds = _rows(src, src.ndim - 1), src.shape[-1]
    if not co_aligned(src.ptr, ss, dst.ptr, ds, isz):  # e.g. x = big[:, 1:] vs a fresh buffer
        src = operand(contiguous(src, copy=True), "x")
        ss = ds
    _plan(src, ss, ds, p, config)(src, src.ptr, dst.ptr)
    res = dst.obj if xs is not None else moveaxis(dst.obj, -1, ax)
    return res if o is None else _fill(out, res)


def _fill(out, res):
    copy_into(out, res)
    return out


def _fresh(checked, x, p, axis):
    """``run(x) -> y`` for calls like this one without ``out`` (``checked``: their
    validation): one allocation and the kernel(s), no copies; None where the call needs
    the general path (CPU, empty, or x not read in place as aligned rows)."""
    a, ax, p, _, _ = checked
    if a.kind == "cpu" or a.size == 0:
        return None
    xs = _rows(a, ax)
    if xs is None or not co_aligned(a.ptr, xs, 0, a.shape[-1], ITEMSIZE[a.dtype]):
        return None  # (a fresh output is 16-byte aligned)
    plan, place, shape = _plan(a, xs, a.shape[-1], p), Place(a), a.shape

    def run(x):
        y = empty(place, shape)
        plan(place, place.ptr(x), place.ptr(y))
        return y

    return run


def _rows(a, ax):
    """Row stride of ``a`` as rows along axis ``ax``, or None unless ``ax`` is the last
    axis and ``a`` is a row view (see :func:`cupykern._geometry.row_stride`)."""
    return row_stride(a.shape, a.strides) if ax == a.ndim - 1 else None


def _row_vectors(ncols: int, dtype: str) -> int:
    """16-byte vectors a row of ``ncols`` holds (the rest are head/tail scalars)."""
    return ncols // (16 // ITEMSIZE[dtype])


def _pick_config(ncols: int, dtype: str, cc: int, table=CONFIGS):
    nvec = _row_vectors(ncols, dtype)
    for cfg in table[ITEMSIZE[dtype]]:
        if (cfg[0] == 1 or cc >= 90) and cfg[0] * cfg[1] * cfg[2] >= nvec:
            return cfg
    return None


def _pick_short(ncols: int, dtype: str, backward=False):
    """The short-row configuration (G, UNITS, ROWS, vector units) for rows of ``ncols``:
    vector units from two vectors' worth of elements on, the first that holds a row."""
    isz = ITEMSIZE[dtype]
    vec = ncols >= 2 * (16 // isz)
    need = _row_vectors(ncols, dtype) if vec else ncols
    if vec and need > (SHORT_MAX_VECTORS_BACKWARD if backward else SHORT_MAX_VECTORS):
        return None
    table = (SHORT_VECTOR_BACKWARD if backward else SHORT_VECTOR) if vec else SHORT_SCALAR[isz]
    return next((c + (vec,) for c in table if c[0] * c[1] >= need), None)


def _route(nrows: int, ncols: int, dtype: str, cc: int, sms: int, backward=False):
    """The dispatcher: ``(0, G, UNITS, ROWS, vector units)`` (short rows), a cluster
    configuration, ``(-3,)`` (many long rows, forward), ``(-2,)`` (few rows) or ``(-1, VC)``
    (chunked), per the table at the top of this module."""
    short = _pick_short(ncols, dtype, backward)
    if short is not None:
        return (0,) + short
    cfg = _pick_config(ncols, dtype, cc, BACKWARD_CONFIGS if backward else CONFIGS)
    if cfg is not None:
        return cfg
    if not backward and _pipelined_pays(nrows, ncols, dtype):
        return (-3,)
    if nrows <= min(RESIDENT_MAX_ROWS, sms) and _few_rows_pay(nrows, ncols, dtype, backward):
        return (-2,)
    return (-1, _chunk_vectors(nrows, ncols, dtype, sms))


def _few_rows_pay(nrows: int, ncols: int, dtype: str, backward: bool) -> bool:
    """Whether x's bytes fall in the few-rows kernel's window (the table's rows 4 and 5):
    forward from RESIDENT_MIN_BYTES (one row: RESIDENT_ONE_ROW_MIN_BYTES) up; backward up
    to RESIDENT_BACKWARD_MAX_BYTES, past which x and dy spill off the chip."""
    nbytes = nrows * ncols * ITEMSIZE[dtype]
    if backward:
        return RESIDENT_MIN_BYTES <= nbytes <= RESIDENT_BACKWARD_MAX_BYTES
    return nbytes >= (RESIDENT_MIN_BYTES if nrows > 1 else RESIDENT_ONE_ROW_MIN_BYTES)


def _pipelined_pays(nrows: int, ncols: int, dtype: str) -> bool:
    """Whether the forward's rows take the pipelined few-rows kernel (the table's row 6):
    PIPELINED_MIN_ROWS rows or more, x of at least PIPELINED_MIN_BYTES; more rows than the
    few-rows kernel takes, from PIPELINED_MANY_MIN_BYTES. Rows that a cluster holds on
    sm_90 stay on the two-pass kernels where there are no clusters: the kernel was timed
    on the H200 only, at rows no cluster holds."""
    nbytes = nrows * ncols * ITEMSIZE[dtype]
    return nrows >= PIPELINED_MIN_ROWS and _pick_config(ncols, dtype, 90) is None and (
        nbytes >= PIPELINED_MIN_BYTES
        or nrows > RESIDENT_MAX_ROWS and nbytes >= PIPELINED_MANY_MIN_BYTES)


def _chunk_vectors(nrows: int, ncols: int, dtype: str, sms: int) -> int:
    """Vectors per chunk: about _CHUNK["ITEMS_PER_SM"] items per SM over all rows, each
    at least MIN_CHUNK vectors."""
    nvec = max(1, _row_vectors(ncols, dtype))
    per_row = max(1, cdiv(_CHUNK["ITEMS_PER_SM"] * sms, nrows))
    return max(_CHUNK["MIN_CHUNK"], cdiv(nvec, per_row))


def _clusters(cfg, nrows: int, device: int) -> int:
    """Clusters to launch for ``nrows`` rows: each walks about ``cfg``'s 5th entry (default
    _ROWS_PER_CLUSTER) rows, so that its next row loads while it scales one; at least 4
    per SM while there are rows (small row counts: one row per cluster)."""
    per = cfg[4] if len(cfg) > 4 else _ROWS_PER_CLUSTER
    return min(nrows, max(cdiv(nrows, per), 4 * _loader.sm_count(device)), (2**31 - 1) // cfg[0])


def _check_capacity(cfg, ncols: int, dtype: str) -> None:
    """ValueError unless a configuration holds a whole row (only a given config can be
    short: the dispatcher picks one that holds it)."""
    if cfg[0] in (-1, -2, -3):
        return
    if cfg[0] == 0:
        need = _row_vectors(ncols, dtype) if cfg[4] else ncols
        if cfg[1] * cfg[2] < need:
            raise ValueError(f"config: {cfg} holds {cfg[1] * cfg[2]} {'16-byte vectors' if cfg[4] else 'elements'}"
                             f" per row, fewer than a row of {ncols} {dtype} needs")
        return
    held = cfg[0] * cfg[1] * cfg[2]
    if held < _row_vectors(ncols, dtype):
        raise ValueError(f"config: {cfg} holds {held} 16-byte vectors per row, fewer than "
                         f"a row of {ncols} {dtype} needs")


def _launcher(src, p, nrows, ncols, strides, cfg, backward):
    """``go(place, x, dy, out)`` launching the kernel(s) of ``cfg`` for this geometry
    (``strides``: the row strides of x, dy and out; dy and its stride unused forward)."""
    dt, dev = src.dtype, src.device
    _check_capacity(cfg, ncols, dt)
    xs, gs, ys = strides
    if cfg[0] == 0:  # short rows
        fn = _loader.function(_SHORT_FILE, _short_expr(p, dt, cfg[1:], backward), dev)
        g, _, rows = cfg[1:4]
        per_cta = _SHORT_THREADS // g * rows
        grid = (min(cdiv(nrows, per_cta), _SHORT_CTAS_PER_SM * _loader.sm_count(dev)),)
        tail = (nrows, ncols, xs, gs, ys)
        return lambda a, x, dy, y: launch(a, fn, grid, (_SHORT_THREADS,), (x, dy, y) + tail)
    if cfg[0] == -1:  # chunked, two passes
        vc = cfg[1]
        nchunks = cdiv(max(1, _row_vectors(ncols, dt)), vc)
        items, k = nrows * nchunks, 2 if backward else 1
        k1, k2 = (_loader.function(_LONG_FILE, e, dev) for e in _chunk_exprs(p, dt, backward))
        grid = (min(items, _CHUNK["ITEMS_PER_SM"] * _loader.sm_count(dev), 2**31 - 1),)
        block = (_CHUNK["THREADS"],)

        def chunked(a, x, dy, y):
            partial = empty(a, (items * k,), acc_dtype(dt))
            pp = data_ptr(partial)
            launch_all(a, ((k1, grid, block, (x, dy, pp, nrows, ncols, xs, gs, vc, nchunks), 0),
                           (k2, grid, block, (x, dy, pp, y, nrows, ncols, xs, gs, ys, vc, nchunks), 0)))

        return chunked
    if cfg[0] == -2:
        table = RESIDENT_BACKWARD if backward else RESIDENT
        return _resident(src, p, nrows, ncols, strides, cfg[1:] or table[ITEMSIZE[dt]], backward)
    if cfg[0] == -3:
        return _pipelined(src, p, nrows, ncols, strides, cfg[1:] or PIPELINED[ITEMSIZE[dt]])
    smem = _staging(cfg, 2 if backward else 1)
    expr = (_backward_expr if backward else _cluster_expr)(p, dt, cfg)
    fn = _loader.function(_FILE, expr, dev, smem)
    grid, block = (_clusters(cfg, nrows, dev) * cfg[0],), (cfg[1],)
    if backward:
        return lambda a, x, dy, y: launch(a, fn, grid, block, (x, dy, y, nrows, ncols, xs, gs, ys), smem)
    return lambda a, x, dy, y: launch(a, fn, grid, block, (x, y, nrows, ncols, xs, ys), smem)


def _resident(src, p, nrows, ncols, strides, cfg, backward):
    """``go(place, x, dy, out)`` for the few-rows kernel (dy unused forward): a cooperative
    launch of ``sms // nrows`` CTAs a row, each one chunk, its front kept on chip (REGS
    vectors a thread of x and, backward, of dy, then as much shared memory as the chunk
    needs and a CTA may have, split between them)."""
    threads, regs, unroll = cfg
    xs, gs, ys = strides
    k = 2 if backward else 1  # (arrays held, and partial sums a chunk)
    dt, dev = src.dtype, src.device
    sms = _loader.sm_count(dev)
    if nrows > sms:
        raise ValueError(f"config: the few-rows kernel takes at most {sms} rows (one a CTA, "
                         f"a CTA an SM), got {nrows}")
    smem_max = _few_rows_smem(dev)
    expr = _few_rows_expr(_RESIDENT, p, dt, cfg, backward)
    fn = _loader.function(_RESIDENT_FILE, expr, dev, smem_max)
    cpr = sms // nrows
    held = _held(ncols, dt, cpr, regs, threads, smem_max // k)
    grid = nrows * cpr
    return _cooperative(src, p, nrows, ncols, strides, backward, (
        fn, (grid,), (threads,), lambda x, dy, sums, counters, y: (
            x, dy, sums, counters, y, ncols, xs, gs, ys, cpr, held), held * 16 * k), grid * k)


def _pipelined(src, p, nrows, ncols, strides, cfg):
    """``go(place, x, dy, out)`` (dy unused) for the pipelined few-rows kernel, forward:
    a cooperative launch of a CTA an SM in row groups (_row_groups), each CTA owning one
    chunk of its group's rows, two rows' chunks on chip (two banks: REGS vectors a thread
    in registers, then up to half the shared memory a CTA may have), one row read while
    the row before it is written."""
    threads, regs, unroll = cfg
    xs, _, ys = strides
    dt, dev = src.dtype, src.device
    smem_max = _few_rows_smem(dev)
    expr = _few_rows_expr(_PIPELINED, p, dt, cfg, PIPELINED_BANKS)
    fn = _loader.function(_PIPELINED_FILE, expr, dev, smem_max)
    smem_bank = smem_max // PIPELINED_BANKS
    bank = regs * threads + _shared_vectors(smem_bank, threads)
    groups, cpr = _row_groups(nrows, ncols, dt, _loader.sm_count(dev), bank)
    held = _held(ncols, dt, cpr, regs, threads, smem_bank)
    grid = groups * cpr
    return _cooperative(src, p, nrows, ncols, strides, False, (
        fn, (grid,), (threads,), lambda x, dy, sums, counters, y: (
            x, sums, counters, y, nrows, ncols, xs, ys, cpr, held),
        held * 16 * PIPELINED_BANKS), nrows * cpr)


def _row_groups(nrows: int, ncols: int, dtype: str, sms: int, bank: int) -> tuple:
    """(groups, CTAs a row) of the pipelined kernel. A row needs the fewest CTAs whose
    banks of ``bank`` vectors hold it (all SMs where it needs more), which bounds the
    groups: as many as the SMs make, at most a row each, for the fewest rounds (rows a
    group walks, each row's exchange waiting on the one before); then as few as take
    the rows in those rounds, so that the groups walk as many rows each (within one) and
    a row gets more CTAs. H200, GPU us, float32: 128x262144, 22 groups
    of 6 CTAs 93.8, 11 of 12 107.0, 5 of 26 145.6; 64x1048576, 5 groups of 26 176.6, 2
    of 66 229.1; 16x1048576, 5 groups of 26 (4 rounds, one group walking 4 rows) 53.1,
    then in another run 4 groups of 33 (4 rows each) 49.0."""
    line = RESIDENT_CHUNK_VECTORS  # (the kernels' LINE: a chunk is whole lines)
    need = cdiv(_row_vectors(ncols, dtype) + line - 1, bank // line * line)
    most = max(1, min(nrows, sms // max(1, need)))
    groups = cdiv(nrows, cdiv(nrows, most))
    return groups, sms // groups


def _few_rows_smem(device: int) -> int:
    """The dynamic shared memory a few-rows CTA takes: all a CTA may have but its static
    scratch (under 1 KB)."""
    return _loader.max_shared_per_block(device) - 1024


def _held(ncols, dtype, chunks, regs, threads, smem) -> int:
    """Shared-memory vectors a few-rows CTA holds of its chunk of a row cut in ``chunks``
    (past its ``regs`` vectors a thread in registers): what the longest chunk needs, at
    most ``smem`` bytes, a multiple of ``threads``."""
    line = RESIDENT_CHUNK_VECTORS  # (the kernels' LINE)
    # (the longest chunk a row can have: its boundaries up to line - 1 vectors earlier)
    vc = line * cdiv(_row_vectors(ncols, dtype) + line - 1, chunks * line)
    return min(_shared_vectors(smem, threads), cdiv(max(0, vc - regs * threads), threads) * threads)


def _shared_vectors(smem: int, threads: int) -> int:
    """The 16-byte vectors that ``smem`` bytes hold, a multiple of ``threads`` (each thread
    copies, holds and writes its own)."""
    return smem // 16 // threads * threads


def _cooperative(src, p, nrows, ncols, strides, backward, kernel, nsums):
    """``go(place, x, dy, out)`` launching a few-rows kernel, ``kernel`` = (function, grid,
    block, ``args(x, dy, sums, counters, y)``, dynamic shared memory), as a cooperative
    launch, with a work buffer of ``nsums`` partial sums and a zeroed counter a row; or,
    where the driver refuses that grid, the two-pass kernels."""
    fn, grid, block, args, smem = kernel
    acc = acc_dtype(src.dtype)
    place = Place(src)  # (what the two-pass fallback is planned from: no array kept)
    two_pass = []  # the chunked launcher, once the driver has refused this grid

    def go(a, x, dy, y):
        if two_pass:
            return two_pass[0](a, x, dy, y)
        work = empty(a, (nsums + nrows,), acc)  # the chunks' sums, then a counter a row
        sums = data_ptr(work)
        counters = sums + nsums * ITEMSIZE[acc]
        try:
            launch_all(a, ((fn, grid, block, args(x, dy, sums, counters, y), smem),),
                       zero=((counters, 4 * nrows),), cooperative=True)
        except _loader.cupy().cuda.driver.CUDADriverError as exc:
            # Fewer SMs than the device counts are this process's (an MPS client's share,
            # a green context): the grid cannot be resident at once. The two-pass kernels
            # compute the same, for this plan's later calls too.
            if exc.status != _COOPERATIVE_LAUNCH_TOO_LARGE:
                raise
            sms = _loader.sm_count(place.device)
            cfg = (-1, _chunk_vectors(nrows, ncols, place.dtype, sms))
            two_pass.append(_launcher(place, p, nrows, ncols, strides, cfg, backward))
            two_pass[0](a, x, dy, y)

    return go


def _plan(src, xs, ys, p, config=None):
    """A callable ``plan(src, x_ptr, y_ptr)`` launching the kernel(s) for this geometry."""
    ncols = src.shape[-1]
    nrows = src.size // ncols
    dev = src.device
    cfg = config or _route(nrows, ncols, src.dtype, _loader.device_cc(dev), _loader.sm_count(dev))
    go = _launcher(src, p, nrows, ncols, (xs, 0, ys), cfg, False)
    return lambda a, x, y: go(a, x, 0, y)


def normalize_backward(x, dy, p: int, axis, config=None):
    """dx for ``y = normalize(x, p, axis)`` and the gradient ``dy`` of y, GPU arrays of one
    kind, shape and dtype: one read of x and dy and one write of dx (the divisor is
    recomputed from x, so a forward need keep only x; rows too long for a cluster read x
    and dy twice). A dy that is not a row view aligned like x is copied first. Returns
    None where the kernels do not apply (CPU or empty arrays, ``axis`` not the last, x
    not a row view aligned like a fresh array); the caller then computes dx another way.
    ``config``: for tuning, a configuration as the forward's (see :func:`l1_normalize`),
    the cluster ones also from :data:`BACKWARD_CONFIGS`, the few-rows one (-2,) or (-2,
    *:data:`RESIDENT_BACKWARD` of x's item size)."""
    run = cached(_plans, ("backward", signature(x), signature(dy), p, axis, config),
                 lambda: _backward_fresh(x, dy, p, axis, config))
    return None if run is None else run(x, dy)


def _backward_fresh(x, dy, p, axis, config):
    """``run(x, dy) -> dx`` for calls like this one, or None (see normalize_backward)."""
    a, ax, p, _, _ = check(x, p, axis)
    if config is not None:
        config = config_tuple(config)
        _require_config(config, a.dtype, backward=True)
    g = operand(dy, "dy")
    same_place(a, g)
    if (g.dtype, tuple(g.shape)) != (a.dtype, tuple(a.shape)):
        raise ValueError(f"dy: expected {a.dtype} {tuple(a.shape)} like x, got {g.dtype} "
                         f"{tuple(g.shape)}")
    if a.kind == "cpu" or a.size == 0:
        return None
    ncols, isz = a.shape[-1], ITEMSIZE[a.dtype]
    xs, gs = _rows(a, ax), _rows(g, ax)
    if xs is None or not co_aligned(a.ptr, xs, 0, ncols, isz):  # (dx: fresh, aligned)
        return None
    # A dy that is no row view aligned like x (the stride-0 gradient of y.sum(), a
    # transposed or misaligned one) is copied, then the kernel runs: the PyTorch ops of
    # the fallback cost more host time (H200, L1Norm / L2Norm training steps with
    # y.sum(): 0.60-0.70x eager that way, against 1.33-1.40x with a contiguous dy).
    copy = gs is None or not co_aligned(a.ptr, xs, g.ptr, gs, isz)
    gs = ncols if copy else gs
    nrows = a.size // ncols
    cfg = config or _route(nrows, ncols, a.dtype, _loader.device_cc(a.device),
                           _loader.sm_count(a.device), backward=True)
    go = _launcher(a, p, nrows, ncols, (xs, gs, ncols), cfg, True)
    place, shape = Place(a), a.shape

    def run(x, dy):
        if copy:  # (a new array: an offset contiguous view is one too)
            dy = contiguous(operand(dy, "dy"), copy=True)
        dx = empty(place, shape)
        go(place, place.ptr(x), place.ptr(dy), place.ptr(dx))
        return dx

    return run
