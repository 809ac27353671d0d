// Row normalisation y = x / d(row) over the last (contiguous) axis.
//   P == 1: d = mean(|x|)      (L1Norm)
//   P == 2: d = sqrt(sum(x^2))  (L2Norm)
// Rows may have any stride; elements within a row are contiguous.
#include "normalize.cuh"

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

// The next row's 16-byte vectors of NARR arrays, staged in dynamic shared memory by
// cp.async while this row is reduced and stored, without registers: each thread owns
// its VPT slots per array ([array][i][thread], so a warp's accesses are contiguous) and
// waits for its own copies only. The launch gives NARR * VPT * THREADS * 16 bytes.
template <int NARR, int THREADS, int VPT> struct Ahead {
  uint4* slots;
  __device__ __forceinline__ Ahead() {
    extern __shared__ uint4 ahead_smem[];
    slots = ahead_smem;
  }
  __device__ __forceinline__ static bool sized() {  // the launch gave enough shared memory
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    return bytes >= NARR * VPT * THREADS * 16u;
  }
  __device__ __forceinline__ uint4* slot(int arr, int i) const {
    return slots + (arr * VPT + i) * THREADS + threadIdx.x;
  }
  __device__ __forceinline__ void copy(int arr, int i, const void* src) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"((unsigned)__cvta_generic_to_shared(slot(arr, i))), "l"(src) : "memory");
#else
    *slot(arr, i) = ld_global_nc_v4(src);
#endif
  }
  __device__ __forceinline__ static void commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
  }
  __device__ __forceinline__ static void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
  }
};

// Rows are walked by clusters: row0 = blockIdx.x / C, then + nclusters. Each step takes
// the row's vectors into registers, reduces them, adds the CTAs' partial sums
// (ClusterSum: st.async onto mbarriers, no cluster barrier per row) and writes the
// row. With PREFETCH the next row's fetch goes to shared memory (Ahead) right after
// this row's reduction has consumed its registers (so no cp.async can overwrite a slot
// before it was read), and stays in flight through the sums and the stores; without,
// each step loads its row at the top. Registers hold one row either way.
// Capacity: C * THREADS * VPT 16-byte vectors per row (the caller checks it).

// One cluster of C CTAs per row; the row stays on chip between the reduction and the
// scaling, so x is read from DRAM exactly once. Register cap: three 512 x 4 / 256 x 8
// CTAs per SM (the most whose buffers fit without spilling).
template <int P, typename T, int C, int THREADS, int VPT, bool PREFETCH = true,
          int MIN_CTAS = (VPT <= 4 ? 1024 : 512) * 3 / 2 / THREADS>
__global__ void __launch_bounds__(THREADS, MIN_CTAS > 0 ? MIN_CTAS : 1)
CK_CLUSTER_DIMS(C)
normalize_rows(const T* __restrict__ x, T* __restrict__ y, long long nrows, long long ncols,
               long long xs, long long ys) {
  check_cluster_rows<C, THREADS, VPT>();
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N;
  __shared__ A scratch[THREADS / 32];
  __shared__ ClusterSum<A, C, 1> cs;  // (C > 1) the cluster's row sum
  const Ahead<1, THREADS, VPT> ahead;
  if (PREFETCH && !ahead.sized()) __trap();

  const unsigned rank = C > 1 ? cluster_ctarank() : 0;
  const long long nclusters = gridDim.x / C;
  const long long vec0 = (long long)rank * VPT * THREADS + threadIdx.x;  // + i * THREADS

  V b[VPT];
  A sc = 0, nsc = 0;  // this thread's head/tail scalar (rank 0 only): this row's, the next's
  auto fetch = [&](long long row) {
    const T* xr = x + row * xs;
    const RowSplit rs(xr, ncols);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = vec0 + (long long)i * THREADS;
      if (v < rs.nvec) {
        if constexpr (PREFETCH) ahead.copy(0, i, xr + rs.head + v * N);
        else b[i].u = ld_global_nc_v4(xr + rs.head + v * N);
      }
    }
    if constexpr (PREFETCH) ahead.commit();
    if (rank == 0 && (int)threadIdx.x < rs.nscalar) nsc = to_acc(xr[rs.scalar_pos(threadIdx.x)]);
  };

  long long row = blockIdx.x / C;
  if (PREFETCH && row < nrows) fetch(row);
  cs.start();
  for (int step = 0; row < nrows; row += nclusters, ++step) {
    const RowSplit rs(x + row * xs, ncols);
    if constexpr (PREFETCH) {
      ahead.wait();
#pragma unroll
      for (int i = 0; i < VPT; ++i)
        if (vec0 + (long long)i * THREADS < rs.nvec) b[i].u = *ahead.slot(0, i);
    } else {
      fetch(row);
    }
    sc = nsc;
    A s = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (vec0 + (long long)i * THREADS < rs.nvec) {
#pragma unroll
        for (int j = 0; j < N; ++j) s += norm_term<P>(to_acc(b[i].e[j]));
      }
    }
    const bool has_scalar = rank == 0 && (int)threadIdx.x < rs.nscalar;
    if (has_scalar) s += norm_term<P>(sc);
    if (PREFETCH && row + nclusters < nrows) fetch(row + nclusters);

    A total[1] = {block_sum(s, scratch)};
    if constexpr (C > 1) cs.sum(total, step, rank);

    const Scaler<A> scale(row_divisor<P, T>(total[0], ncols));
    T* yr = y + row * ys + rs.head;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = vec0 + (long long)i * THREADS;
      if (v < rs.nvec) {
        const V o = vec_from_acc<T>([&](int j) { return scale(to_acc(b[i].e[j])); });
        st_global_cs_v4(yr + v * N, o.u);
      }
    }
    if (has_scalar) y[row * ys + rs.scalar_pos(threadIdx.x)] = from_acc<T>(scale(sc));
  }
}

// Backward of y = x / d (the formula: Grad in normalize.cuh), d recomputed from x (rounded to T as the forward rounds it), so the forward saves only
// x. One cluster of C CTAs per row holds the row of x and of dy on chip: x and dy are
// read once and dx written once. Rows of x, dy and dx start at the same offset modulo 16
// bytes (the caller checks it). Rows are walked, and PREFETCH stages the next row's x
// and dy, as in normalize_rows. Register cap: two 512 x 4 CTAs per SM.
template <int P, typename T, int C, int THREADS, int VPT, bool PREFETCH = true,
          int MIN_CTAS = (VPT <= 4 ? 1024 : 512) / THREADS>
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
  __shared__ ClusterSum<A, C, 2> cs;  // (C > 1) the cluster's row sums: norm term, dy.x
  const Ahead<2, THREADS, VPT> ahead;
  if (PREFETCH && !ahead.sized()) __trap();

  const unsigned rank = C > 1 ? cluster_ctarank() : 0;
  const long long nclusters = gridDim.x / C;
  const long long vec0 = (long long)rank * VPT * THREADS + threadIdx.x;  // + i * THREADS

  V bx[VPT], bg[VPT];  // this thread's share of the row of x and of dy
  A xsc = 0, gsc = 0, nxsc = 0, ngsc = 0;  // head/tail scalars (rank 0): this row's, the next's
  auto fetch = [&](long long row) {
    const T* xr = x + row * xs;
    const T* gr = dy + row * dys;
    const RowSplit rs(xr, ncols);
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = vec0 + (long long)i * THREADS;
      if (v < rs.nvec) {
        if constexpr (PREFETCH) {
          ahead.copy(0, i, xr + rs.head + v * N);
          ahead.copy(1, i, gr + rs.head + v * N);
        } else {
          bx[i].u = ld_global_nc_v4(xr + rs.head + v * N);
          bg[i].u = ld_global_nc_v4(gr + rs.head + v * N);
        }
      }
    }
    if constexpr (PREFETCH) ahead.commit();
    if (rank == 0 && (int)threadIdx.x < rs.nscalar) {
      nxsc = to_acc(xr[rs.scalar_pos(threadIdx.x)]);
      ngsc = to_acc(gr[rs.scalar_pos(threadIdx.x)]);
    }
  };

  long long row = blockIdx.x / C;
  if (PREFETCH && row < nrows) fetch(row);
  cs.start();
  for (int step = 0; row < nrows; row += nclusters, ++step) {
    const RowSplit rs(x + row * xs, ncols);
    if constexpr (PREFETCH) {
      ahead.wait();
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        if (vec0 + (long long)i * THREADS < rs.nvec) {
          bx[i].u = *ahead.slot(0, i);
          bg[i].u = *ahead.slot(1, i);
        }
      }
    } else {
      fetch(row);
    }
    xsc = nxsc;
    gsc = ngsc;
    A sn = 0, sg = 0;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (vec0 + (long long)i * THREADS < rs.nvec) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const A xv = to_acc(bx[i].e[j]);
          sn += norm_term<P, true>(xv);
          sg += to_acc(bg[i].e[j]) * xv;
        }
      }
    }
    const bool has_scalar = rank == 0 && (int)threadIdx.x < rs.nscalar;
    if (has_scalar) {  // after the vectors, as the forward adds it: the same d
      sn += norm_term<P, true>(xsc);
      sg += gsc * xsc;
    }
    if (PREFETCH && row + nclusters < nrows) fetch(row + nclusters);

    A t[2] = {block_sum(sn, scratch), block_sum(sg, scratch)};
    if constexpr (C > 1) cs.sum(t, step, rank);
    const Grad<P, T, A> grad(t[0], t[1], ncols);
    T* dr = dx + row * dxs + rs.head;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const long long v = vec0 + (long long)i * THREADS;
      if (v < rs.nvec) {
        const V o = vec_from_acc<T>([&](int j) { return grad(to_acc(bx[i].e[j]), to_acc(bg[i].e[j])); });
        st_global_cs_v4(dr + v * N, o.u);
      }
    }
    if (has_scalar) dx[row * dxs + rs.scalar_pos(threadIdx.x)] = from_acc<T>(grad(xsc, gsc));
  }
}
