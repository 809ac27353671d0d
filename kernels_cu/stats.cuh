// Chan et al. parallel (count, mean, M2) merge, shared by the GEMM epilogue and
// the BatchNorm coefficient kernel.
#pragma once

// Rows per M tile of the GEMM's partial statistics of each column: mean, M2, min, max
// (part[(PART_ROWS*mt + r)*N + n]); the BatchNorm coefficient kernel reads them.
constexpr int PART_ROWS = 4;

// Chan et al.: merge partial b into the running (n, mean, m2).
template <typename A>
__device__ __forceinline__ void chan_merge(A& n, A& mean, A& m2, A nb, A meanb, A m2b) {
  if (nb == (A)0) return;
  const A nn = n + nb, d = meanb - mean, f = nb / nn;
  mean += d * f;
  m2 += m2b + d * d * n * f;
  n = nn;
}
