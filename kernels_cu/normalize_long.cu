// Long rows, or fewer rows than SMs: each row split into chunks, one CTA per (row, chunk)
// item, in two passes. Pass 1 (normalize_chunk_sums) writes each item's partial sums;
// pass 2 (normalize_chunk_apply) adds its row's partials in a fixed order and writes its
// chunk of y (or, BWD, of dx). x (and dy) are read twice: the second read hits L2 where
// the data fits it (and, where x is larger, the part L2 still holds: pass 2 starts where
// pass 1 ended). Forward and fused backward (formula: Grad) in one pair of kernels.
#include "normalize.cuh"

// Pass 1: K = 1 (+1 for BWD) partial sums per item, at partial[item * K + j]: the
// norm terms, and (BWD) dy . x. Grid-stride over the items; UNROLL vectors in flight per
// thread. Rows of x and dy start alike modulo 16 bytes (the caller checks it).
template <int P, typename T, int THREADS, int UNROLL, bool BWD>
__global__ void __launch_bounds__(THREADS)
normalize_chunk_sums(const T* __restrict__ x, const T* __restrict__ dy,
                     typename acc_of<T>::type* __restrict__ partial, long long nrows,
                     long long ncols, long long xs, long long dys, long long vc, long long nchunks) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_chunk_sums: THREADS must be whole warps, at most 1024");
  static_assert(UNROLL >= 1, "normalize_chunk_sums: UNROLL >= 1");
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N, K = BWD ? 2 : 1;
  __shared__ A scratch[THREADS / 32];
  for (long long item = blockIdx.x; item < nrows * nchunks; item += gridDim.x) {
    const T* xr = x + (item / nchunks) * xs;
    const T* gr = dy + (item / nchunks) * dys;
    const RowSplit rs(xr, ncols);
    const Chunk ch(item, nchunks, vc, rs.nvec);
    A s = 0, t = 0;
    for (long long v = ch.v0 + threadIdx.x; v < ch.v1; v += THREADS * UNROLL) {
      V b[UNROLL], g[BWD ? UNROLL : 1];
      ch.load<THREADS, UNROLL, BWD>(b, g, xr, gr, rs.head, v);
#pragma unroll
      for (int i = 0; i < UNROLL; ++i) {
        if (v + (long long)i * THREADS < ch.v1) {
#pragma unroll
          for (int j = 0; j < N; ++j) {
            const A xv = to_acc(b[i].e[j]);
            s += norm_term<P, BWD>(xv);
            if constexpr (BWD) t += to_acc(g[BWD ? i : 0].e[j]) * xv;
          }
        }
      }
    }
    if (ch.k == 0 && (int)threadIdx.x < rs.nscalar) {
      const long long c = rs.scalar_pos(threadIdx.x);
      const A xv = to_acc(xr[c]);
      s += norm_term<P, BWD>(xv);
      if constexpr (BWD) t += to_acc(gr[c]) * xv;
    }
    s = block_sum(s, scratch);
    if constexpr (BWD) t = block_sum(t, scratch);
    if (threadIdx.x == 0) {
      partial[item * K] = s;
      if constexpr (BWD) partial[item * K + 1] = t;
    }
  }
}

// Pass 2: each item adds its row's partials (thread i takes chunks i, i + THREADS, ...,
// then block_sum: the same order in every item of the row, so one d per row) and writes
// its chunk. Rows of x, dy and y start alike modulo 16 bytes (the caller checks it).
template <int P, typename T, int THREADS, int UNROLL, bool BWD>
__global__ void __launch_bounds__(THREADS)
normalize_chunk_apply(const T* __restrict__ x, const T* __restrict__ dy,
                      const typename acc_of<T>::type* __restrict__ partial, T* __restrict__ y,
                      long long nrows, long long ncols, long long xs, long long dys, long long ys,
                      long long vc, long long nchunks) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_chunk_apply: THREADS must be whole warps, at most 1024");
  static_assert(UNROLL >= 1, "normalize_chunk_apply: UNROLL >= 1");
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N, K = BWD ? 2 : 1;
  __shared__ A scratch[THREADS / 32];
  // Items in reverse: the last items pass 1 read are the likeliest still in L2.
  for (long long it = blockIdx.x; it < nrows * nchunks; it += gridDim.x) {
    const long long item = nrows * nchunks - 1 - it;
    const long long row = item / nchunks;
    const T* xr = x + row * xs;
    const T* gr = dy + row * dys;
    T* yr = y + row * ys;
    const RowSplit rs(xr, ncols);
    const Chunk ch(item, nchunks, vc, rs.nvec);
    A s = 0, t = 0;
    for (long long k = threadIdx.x; k < nchunks; k += THREADS) {
      s += partial[(row * nchunks + k) * K];
      if constexpr (BWD) t += partial[(row * nchunks + k) * K + 1];
    }
    s = block_sum(s, scratch);
    if constexpr (BWD) t = block_sum(t, scratch);
    auto write = [&](auto f) {  // f(x value, dy value) -> output value
      // The chunk from its end: pass 1 streams every chunk at once, front to back, so the
      // backs of the chunks are what L2 still holds when x is larger than L2.
      const long long steps = (ch.v1 - ch.v0 + THREADS * UNROLL - 1) / (THREADS * UNROLL);
      for (long long step = steps - 1; step >= 0; --step) {
        const long long v = ch.v0 + step * (THREADS * UNROLL) + threadIdx.x;
        V b[UNROLL], g[BWD ? UNROLL : 1];
        ch.load<THREADS, UNROLL, BWD>(b, g, xr, gr, rs.head, v);
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
          const long long w = v + (long long)i * THREADS;
          if (w < ch.v1) {
            const V o = vec_from_acc<T>([&](int j) {
              return f(to_acc(b[i].e[j]), BWD ? to_acc(g[BWD ? i : 0].e[j]) : (A)0);
            });
            st_global_cs_v4(yr + rs.head + w * N, o.u);
          }
        }
      }
      if (ch.k == 0 && (int)threadIdx.x < rs.nscalar) {
        const long long c = rs.scalar_pos(threadIdx.x);
        yr[c] = from_acc<T>(f(to_acc(xr[c]), BWD ? to_acc(gr[c]) : (A)0));
      }
    };
    with_row_output<P, T, BWD>(s, t, ncols, write);
  }
}
