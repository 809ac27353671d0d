// Row normalisation y = x / d(row) over the last (contiguous) axis.
//   P == 1: d = mean(|x|)      (L1Norm)
//   P == 2: d = sqrt(sum(x^2))  (L2Norm)
// Rows may have any stride; elements within a row are contiguous.
#include "common.cuh"

template <int P, typename A> __device__ __forceinline__ A norm_term(A v) {
  return P == 1 ? fabs(v) : v * v;
}

// The divisor from the row's reduction, rounded to T first as torch does
// (torch computes mean/norm in the accumulation type, then stores it as T).
template <int P, typename T, typename A> __device__ __forceinline__ A row_divisor(A s, long long n) {
  A d = P == 1 ? s / (A)n : sqrt(s);
  return to_acc(from_acc<T>(d));
}

// y = x / d. For ordinary d a reciprocal multiply is within an ulp of the
// division; 0, inf, nan, denormal and huge d (whose reciprocal would flush to
// zero under -ftz) use the true division so special rows match torch exactly.
template <typename A> struct Scaler {
  A d, r;
  bool exact;
  __device__ __forceinline__ explicit Scaler(A d_) : d(d_), r((A)1 / d_) {
    const A lo = sizeof(A) == 4 ? (A)1.2e-38 : (A)2.3e-308;
    const A hi = sizeof(A) == 4 ? (A)8.5e37 : (A)4.4e307;
    exact = !(d >= lo && d <= hi);
  }
  __device__ __forceinline__ A operator()(A x) const { return exact ? x / d : x * r; }
};

// Scalar (head/tail) positions of a row whose first 16-byte boundary is `head`
// elements in: elements [0, head) and [tail0, n). Index k < nscalar maps to one.
__device__ __forceinline__ long long scalar_pos(int k, int head, long long tail0) {
  return k < head ? (long long)k : tail0 + (k - head);
}

// One cluster of C CTAs per row; the row stays in registers between the
// reduction and the scaling, so x is read from DRAM exactly once.
// Capacity: C * THREADS * VPT 16-byte vectors (the caller checks it).
template <int P, typename T, int C, int THREADS, int VPT>
__global__ void __launch_bounds__(THREADS) CK_CLUSTER_DIMS(C)
normalize_rows(const T* __restrict__ x, T* __restrict__ y, long long nrows, long long ncols,
               long long xs, long long ys) {
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N;
  __shared__ A scratch[THREADS / 32];
  __shared__ A part[2][C];  // per-CTA partial sums of the cluster, double-buffered

  const unsigned rank = C > 1 ? cluster_ctarank() : 0;
  const long long nclusters = gridDim.x / C;
  int parity = 0;
  for (long long row = blockIdx.x / C; row < nrows; row += nclusters, parity ^= 1) {
    const T* xr = x + row * xs;
    T* yr = y + row * ys;
    int head = (int)(((16u - ((unsigned)(size_t)xr & 15u)) & 15u) / sizeof(T));
    if (head > ncols) head = (int)ncols;
    const long long nvec = (ncols - head) / N;
    const long long tail0 = head + nvec * N;
    const int nscalar = head + (int)(ncols - tail0);

    V buf[VPT];
    A s = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = ((long long)rank * VPT + i) * THREADS + threadIdx.x;
      if (v < nvec) buf[i].u = ld_global_nc_v4(xr + head + v * N);
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = ((long long)rank * VPT + i) * THREADS + threadIdx.x;
      if (v < nvec) {
#pragma unroll
        for (int j = 0; j < N; ++j) s += norm_term<P>(to_acc(buf[i].e[j]));
      }
    }
    // The < 2*N unaligned head/tail elements go to the threads of rank 0.
    A xs_val = 0;
    const bool has_scalar = rank == 0 && (int)threadIdx.x < nscalar;
    if (has_scalar) {
      xs_val = to_acc(xr[scalar_pos(threadIdx.x, head, tail0)]);
      s += norm_term<P>(xs_val);
    }

    const A cta_sum = block_sum(s, scratch);
    A total = cta_sum;
    if constexpr (C > 1) {
      if (threadIdx.x == 0) {
        for (unsigned r = 0; r < C; ++r) st_dsmem(&part[parity][rank], r, cta_sum);
      }
      cluster_sync();
      total = 0;
      for (int r = 0; r < C; ++r) total += part[parity][r];  // same order in every CTA
    }

    const Scaler<A> scale(row_divisor<P, T>(total, ncols));
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = ((long long)rank * VPT + i) * THREADS + threadIdx.x;
      if (v < nvec) {
        V o;
#pragma unroll
        for (int j = 0; j < N; ++j) o.e[j] = from_acc<T>(scale(to_acc(buf[i].e[j])));
        st_global_cs_v4(yr + head + v * N, o.u);
      }
    }
    if (has_scalar) yr[scalar_pos(threadIdx.x, head, tail0)] = from_acc<T>(scale(xs_val));
  }
}

// Rows too long for a cluster's registers: two passes over fixed chunks.
// Pass 1 writes one partial per (row, chunk); pass 2 sums a row's partials in
// chunk order (deterministic) and scales its chunk. Reads x twice.
template <int P, typename T>
__global__ void __launch_bounds__(256)
normalize_partials(const T* __restrict__ x, typename acc_of<T>::type* __restrict__ partial,
                   long long nrows, long long ncols, long long xs, long long chunk,
                   long long nchunks) {
  typedef typename acc_of<T>::type A;
  __shared__ A scratch[8];
  for (long long item = blockIdx.x; item < nrows * nchunks; item += gridDim.x) {
    const long long row = item / nchunks, c0 = (item % nchunks) * chunk;
    const long long c1 = min(c0 + chunk, ncols);
    const T* xr = x + row * xs;
    A s = 0;
    for (long long c = c0 + threadIdx.x; c < c1; c += blockDim.x) s += norm_term<P>(to_acc(xr[c]));
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) partial[item] = s;
  }
}

template <int P, typename T>
__global__ void __launch_bounds__(256)
normalize_apply(const T* __restrict__ x, T* __restrict__ y,
                const typename acc_of<T>::type* __restrict__ partial, long long nrows,
                long long ncols, long long xs, long long ys, long long chunk, long long nchunks) {
  typedef typename acc_of<T>::type A;
  for (long long item = blockIdx.x; item < nrows * nchunks; item += gridDim.x) {
    const long long row = item / nchunks, c0 = (item % nchunks) * chunk;
    const long long c1 = min(c0 + chunk, ncols);
    A total = 0;
    for (long long k = 0; k < nchunks; ++k) total += partial[row * nchunks + k];
    const Scaler<A> scale(row_divisor<P, T>(total, ncols));
    const T* xr = x + row * xs;
    T* yr = y + row * ys;
    for (long long c = c0 + threadIdx.x; c < c1; c += blockDim.x)
      yr[c] = from_acc<T>(scale(to_acc(xr[c])));
  }
}
