// Chan et al. parallel (count, mean, M2) merge, shared by the GEMM epilogue and
// the BatchNorm coefficient kernel.
#pragma once

// Chan et al.: merge partial b into the running (n, mean, m2).
// Equal means (infinite ones included: an all-inf column keeps its inf mean) add no
// spread; an empty running part takes b as it is.
template <typename A>
__device__ __forceinline__ void chan_merge(A& n, A& mean, A& m2, A nb, A meanb, A m2b) {
  if (nb == (A)0) return;
  if (n == (A)0) {
    n = nb, mean = meanb, m2 = m2b;
    return;
  }
  const A nn = n + nb, d = meanb == mean ? (A)0 : meanb - mean, f = nb / nn;
  mean += d * f;
  m2 += m2b + d * d * n * f;
  n = nn;
}
