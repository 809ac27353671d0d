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

// Where a row's 16-byte vectors are: `head` scalar elements before the first
// 16-byte boundary, `nvec` whole vectors, then scalars from `tail0` to the end.
struct RowSplit {
  int head, nscalar;
  long long nvec, tail0;
  template <typename T> __device__ __forceinline__ RowSplit(const T* xr, long long ncols) {
    head = (int)(((16u - ((unsigned)(size_t)xr & 15u)) & 15u) / sizeof(T));
    if (head > ncols) head = (int)ncols;
    nvec = (ncols - head) / (16 / sizeof(T));
    tail0 = head + nvec * (16 / sizeof(T));
    nscalar = head + (int)(ncols - tail0);
  }
  // Position of scalar k < nscalar: [0, head) then [tail0, ncols).
  __device__ __forceinline__ long long scalar_pos(int k) const {
    return k < head ? (long long)k : tail0 + (k - head);
  }
};

// The launch configuration both row kernels check: a portable cluster of C CTAs
// (clusters need sm_90), whole warps, at least one vector per thread.
template <int C, int THREADS, int VPT> __device__ __forceinline__ void check_cluster_rows() {
#ifdef __CUDA_ARCH__  // (NVRTC compiles device code only; an nvcc host pass has no arch)
  static_assert(C == 1 || CK_HAS_CLUSTERS, "normalize: C > 1 (thread-block clusters) needs sm_90");
#endif
  static_assert(C >= 1 && C <= 8, "normalize: C is the portable cluster size, 1..8");
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize: THREADS must be whole warps, at most 1024");
  static_assert(VPT >= 1, "normalize: VPT >= 1");
}

// One cluster of C CTAs per row; the row stays in registers between the
// reduction and the scaling, so x is read from DRAM exactly once. Each cluster
// walks rows row0, row0 + nclusters, ... With PREFETCH two register buffers take
// turns: a row's step first issues the loads of the cluster's next row into the
// other buffer, so they stay in flight through this row's reduction, cluster
// barrier and stores (the loop is unrolled by two, so the buffers never move).
// Without, one buffer is loaded at the top of each step and more CTAs fit per SM.
// Capacity: C * THREADS * VPT 16-byte vectors per row (the caller checks it).
// Register cap: two (PREFETCH) or three 512 x 4 / 256 x 8 CTAs per SM, the
// most that each variant's buffers fit without spilling.
template <int P, typename T, int C, int THREADS, int VPT, bool PREFETCH = true,
          int MIN_CTAS = (VPT <= 4 ? 1024 : 512) * (PREFETCH ? 2 : 3) / 2 / THREADS>
__global__ void __launch_bounds__(THREADS, MIN_CTAS > 0 ? MIN_CTAS : 1)
CK_CLUSTER_DIMS(C)
normalize_rows(const T* __restrict__ x, T* __restrict__ y, long long nrows, long long ncols,
               long long xs, long long ys) {
  check_cluster_rows<C, THREADS, VPT>();
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N;
  __shared__ A scratch[THREADS / 32];
  __shared__ A part[2][C];  // per-CTA partial sums of the cluster, double-buffered

  const unsigned rank = C > 1 ? cluster_ctarank() : 0;
  const long long nclusters = gridDim.x / C;
  const long long vec0 = (long long)rank * VPT * THREADS + threadIdx.x;  // + i * THREADS

  V b0[VPT], b1[VPT];
  A sc0 = 0, sc1 = 0;  // this thread's head/tail scalar (rank 0 only)
  auto load = [&](V (&b)[VPT], A& scal, long long row) {
    const T* xr = x + row * xs;
    const RowSplit rs(xr, ncols);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = vec0 + (long long)i * THREADS;
      if (v < rs.nvec) b[i].u = ld_global_nc_v4(xr + rs.head + v * N);
    }
    if (rank == 0 && (int)threadIdx.x < rs.nscalar) scal = to_acc(xr[rs.scalar_pos(threadIdx.x)]);
  };
  // Row `row` from `buf` (already loaded with PREFETCH); `parity` picks part's half.
  auto step = [&](V (&buf)[VPT], A& sc, V (&nxt)[VPT], A& nsc, long long row, int parity) {
    if constexpr (PREFETCH) {
      if (row + nclusters < nrows) load(nxt, nsc, row + nclusters);
    } else {
      load(buf, sc, row);
    }
    const RowSplit rs(x + row * xs, ncols);
    A s = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (vec0 + (long long)i * THREADS < rs.nvec) {
#pragma unroll
        for (int j = 0; j < N; ++j) s += norm_term<P>(to_acc(buf[i].e[j]));
      }
    }
    const bool has_scalar = rank == 0 && (int)threadIdx.x < rs.nscalar;
    if (has_scalar) s += norm_term<P>(sc);

    A total = block_sum(s, scratch);
    if constexpr (C > 1) {
      if (threadIdx.x == 0) {
        for (unsigned r = 0; r < C; ++r) st_dsmem(&part[parity][rank], r, total);
      }
      cluster_arrive();
      cluster_wait();
      total = 0;
      for (int r = 0; r < C; ++r) total += part[parity][r];  // same order in every CTA
    }

    const Scaler<A> scale(row_divisor<P, T>(total, ncols));
    T* yr = y + row * ys + rs.head;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = vec0 + (long long)i * THREADS;
      if (v < rs.nvec) {
        const V o = vec_from_acc<T>([&](int j) { return scale(to_acc(buf[i].e[j])); });
        st_global_cs_v4(yr + v * N, o.u);
      }
    }
    if (has_scalar) y[row * ys + rs.scalar_pos(threadIdx.x)] = from_acc<T>(scale(sc));
  };

  long long row = blockIdx.x / C;
  if (PREFETCH && row < nrows) load(b0, sc0, row);
  if constexpr (C > 1) {  // DSMEM may be written only once every CTA of the cluster runs
    cluster_arrive();
    cluster_wait();
  }
  if constexpr (PREFETCH) {
    while (row < nrows) {
      step(b0, sc0, b1, sc1, row, 0);
      row += nclusters;
      if (row >= nrows) break;
      step(b1, sc1, b0, sc0, row, 1);
      row += nclusters;
    }
  } else {
    for (int parity = 0; row < nrows; row += nclusters, parity ^= 1) step(b0, sc0, b0, sc0, row, parity);
  }
}

// Rows too long for a cluster's registers: two passes over fixed chunks.
// Pass 1 writes one partial per (row, chunk); pass 2 sums a row's partials in
// chunk order (deterministic) and scales its chunk. Reads x twice.
// Block THREADS (normalize_apply too); grid-stride over the (row, chunk) items.
template <int P, typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
normalize_partials(const T* __restrict__ x, typename acc_of<T>::type* __restrict__ partial,
                   long long nrows, long long ncols, long long xs, long long chunk,
                   long long nchunks) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_partials: THREADS must be whole warps, at most 1024");
  typedef typename acc_of<T>::type A;
  __shared__ A scratch[THREADS / 32];
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

template <int P, typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
normalize_apply(const T* __restrict__ x, T* __restrict__ y,
                const typename acc_of<T>::type* __restrict__ partial, long long nrows,
                long long ncols, long long xs, long long ys, long long chunk, long long nchunks) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_apply: THREADS must be whole warps, at most 1024");
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

// Backward of y = x / d: with s = sum(dy * x) over the row,
//   P == 1: dx = dy / d - sign(x) * s / (d * d * n)
//   P == 2: dx = dy / d - x * s / (d * d * d)
// d recomputed from x (rounded to T as the forward rounds it), so the forward saves only
// x. One cluster of C CTAs per row holds the row of x and of dy in registers: x and dy
// are read once and dx written once. Rows of x, dy and dx start at the same offset
// modulo 16 bytes (the caller checks it). Capacity as normalize_rows, and PREFETCH as
// there: the next row's x and dy load into the other pair of buffers during this row's
// step (four buffers: one CTA of 512 x 4 per SM).
template <int P, typename T, int C, int THREADS, int VPT, bool PREFETCH = true,
          int MIN_CTAS = (VPT <= 4 ? 1024 : 512) / THREADS / (PREFETCH ? 2 : 1)>
__global__ void __launch_bounds__(THREADS, MIN_CTAS > 0 ? MIN_CTAS : 1)
CK_CLUSTER_DIMS(C)
normalize_backward_rows(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                        long long nrows, long long ncols, long long xs, long long dys,
                        long long dxs) {
  check_cluster_rows<C, THREADS, VPT>();
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N;
  __shared__ A scratch[THREADS / 32];
  __shared__ A part[2][2][C];  // [parity][norm term, dy.x][CTA]: the cluster's partial sums

  const unsigned rank = C > 1 ? cluster_ctarank() : 0;
  const long long nclusters = gridDim.x / C;
  const long long vec0 = (long long)rank * VPT * THREADS + threadIdx.x;  // + i * THREADS

  struct Row { V x[VPT], g[VPT]; A xsc, gsc; };  // a row's share of x and dy (+ scalars)
  Row r0, r1;
  auto load = [&](Row& b, long long row) {
    const T* xr = x + row * xs;
    const T* gr = dy + row * dys;
    const RowSplit rs(xr, ncols);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = vec0 + (long long)i * THREADS;
      if (v < rs.nvec) {
        b.x[i].u = ld_global_nc_v4(xr + rs.head + v * N);
        b.g[i].u = ld_global_nc_v4(gr + rs.head + v * N);
      }
    }
    if (rank == 0 && (int)threadIdx.x < rs.nscalar) {
      b.xsc = to_acc(xr[rs.scalar_pos(threadIdx.x)]);
      b.gsc = to_acc(gr[rs.scalar_pos(threadIdx.x)]);
    }
  };
  auto step = [&](Row& b, Row& next, long long row, int parity) {
    if constexpr (PREFETCH) {
      if (row + nclusters < nrows) load(next, row + nclusters);
    } else {
      load(b, row);
    }
    const RowSplit rs(x + row * xs, ncols);
    A sn = 0, sg = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (vec0 + (long long)i * THREADS < rs.nvec) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const A xv = to_acc(b.x[i].e[j]);
          sn += norm_term<P>(xv);
          sg += to_acc(b.g[i].e[j]) * xv;
        }
      }
    }
    const bool has_scalar = rank == 0 && (int)threadIdx.x < rs.nscalar;
    if (has_scalar) {  // after the vectors, as the forward adds it: the same d
      sn += norm_term<P>(b.xsc);
      sg += b.gsc * b.xsc;
    }
    A tn = block_sum(sn, scratch), tg = block_sum(sg, scratch);
    if constexpr (C > 1) {
      if (threadIdx.x == 0) {
        for (unsigned r = 0; r < C; ++r) {
          st_dsmem(&part[parity][0][rank], r, tn);
          st_dsmem(&part[parity][1][rank], r, tg);
        }
      }
      cluster_arrive();
      cluster_wait();
      tn = tg = 0;
      for (int r = 0; r < C; ++r) {  // same order in every CTA
        tn += part[parity][0][r];
        tg += part[parity][1][r];
      }
    }
    const A d = row_divisor<P, T>(tn, ncols);
    const A c = P == 1 ? tg / (d * d * (A)ncols) : tg / (d * d * d);
    auto grad = [&](A xv, A gv) {
      const A t = P == 1 ? (A)((xv > 0) - (xv < 0)) : xv;  // sign(nan) = 0, as torch.sign
      return gv / d - t * c;
    };
    T* dr = dx + row * dxs + rs.head;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = vec0 + (long long)i * THREADS;
      if (v < rs.nvec) {
        const V o = vec_from_acc<T>([&](int j) { return grad(to_acc(b.x[i].e[j]), to_acc(b.g[i].e[j])); });
        st_global_cs_v4(dr + v * N, o.u);
      }
    }
    if (has_scalar) dx[row * dxs + rs.scalar_pos(threadIdx.x)] = from_acc<T>(grad(b.xsc, b.gsc));
  };

  long long row = blockIdx.x / C;
  if (PREFETCH && row < nrows) load(r0, row);
  if constexpr (C > 1) {  // DSMEM may be written only once every CTA of the cluster runs
    cluster_arrive();
    cluster_wait();
  }
  if constexpr (PREFETCH) {
    while (row < nrows) {
      step(r0, r1, row, 0);
      row += nclusters;
      if (row >= nrows) break;
      step(r1, r0, row, 1);
      row += nclusters;
    }
  } else {
    for (int parity = 0; row < nrows; row += nclusters, parity ^= 1) step(r0, r0, row, parity);
  }
}
