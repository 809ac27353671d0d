// Long rows, or fewer rows than SMs: each row split into chunks, one CTA per (row, chunk)
// item. Forward and fused backward (formula: Grad) in every kernel here.
// - Two passes (normalize_chunk_sums, then normalize_chunk_apply): pass 1 writes each item's
//   partial sums; pass 2 adds its row's partials in a fixed order and writes its chunk of y
//   (or, BWD, of dx). x (and dy) are read twice: the second read hits L2 where the data
//   fits it.
// - One pass (normalize_chunk_lagged): the same two steps in one launch, the write of an
//   item `lag` tickets behind its sums, so that its second read finds the chunk still in
//   L2 even when x is larger than L2 (see the kernel).
#include "normalize.cuh"

// The vectors of item `item`'s chunk: [v0, v1) of its row's 16-byte vectors (RowSplit's
// grid); chunk 0 also takes the row's head and tail scalars. Chunks are VC vectors.
struct Chunk {
  long long row, k, v0, v1;
  __device__ __forceinline__ Chunk(long long item, long long nchunks, long long vc, long long nvec) {
    row = item / nchunks, k = item % nchunks;
    v0 = k * vc;
    v1 = min(v0 + vc, nvec);
  }
  // Loads the UNROLL vectors of x (and, BWD, dy) at v, v + THREADS, ... that lie in the chunk.
  template <int THREADS, int UNROLL, bool BWD, typename T>
  __device__ __forceinline__ void load(Vec16<T> (&b)[UNROLL], Vec16<T> (&g)[BWD ? UNROLL : 1],
                                       const T* xr, const T* gr, int head, long long v) const {
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
      const long long w = v + (long long)i * THREADS;
      if (w < v1) {
        b[i].u = ld_global_nc_v4(xr + head + w * Vec16<T>::N);
        if constexpr (BWD) g[i].u = ld_global_nc_v4(gr + head + w * Vec16<T>::N);
      }
    }
  }
  // Adds the norm terms (s) and, BWD, dy . x (t) of the vectors load() gave for v.
  template <int P, int THREADS, int UNROLL, bool BWD, typename T, typename A>
  __device__ __forceinline__ void add(const Vec16<T> (&b)[UNROLL], const Vec16<T> (&g)[BWD ? UNROLL : 1],
                                      long long v, A& s, A& t) const {
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
      if (v + (long long)i * THREADS < v1) {
#pragma unroll
        for (int j = 0; j < Vec16<T>::N; ++j) {
          const A xv = to_acc(b[i].e[j]);
          s += norm_term<P, BWD>(xv);
          if constexpr (BWD) t += to_acc(g[BWD ? i : 0].e[j]) * xv;
        }
      }
    }
  }
  // Chunk 0's head and tail scalars (fewer than two vectors' worth: thread i takes scalar i).
  template <int P, bool BWD, typename T, typename A>
  __device__ __forceinline__ void add_scalars(const RowSplit& rs, const T* xr, const T* gr, A& s, A& t) const {
    if (k == 0 && (int)threadIdx.x < rs.nscalar) {
      const long long c = rs.scalar_pos(threadIdx.x);
      const A xv = to_acc(xr[c]);
      s += norm_term<P, BWD>(xv);
      if constexpr (BWD) t += to_acc(gr[c]) * xv;
    }
  }
  // Writes the chunk of y (BWD: dx) from its row's sums s (norm terms) and t (dy . x).
  template <int P, int THREADS, int UNROLL, bool BWD, typename T, typename A>
  __device__ __forceinline__ void write(const RowSplit& rs, const T* xr, const T* gr, T* yr, A s, A t,
                                        long long ncols) const {
    auto each = [&](auto f) {  // f(x value, dy value) -> output value
      for (long long v = v0 + threadIdx.x; v < v1; v += THREADS * UNROLL) {
        Vec16<T> b[UNROLL], g[BWD ? UNROLL : 1];
        load<THREADS, UNROLL, BWD>(b, g, xr, gr, rs.head, v);
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
          const long long w = v + (long long)i * THREADS;
          if (w < v1) {
            const Vec16<T> o = vec_from_acc<T>([&](int j) {
              return f(to_acc(b[i].e[j]), BWD ? to_acc(g[BWD ? i : 0].e[j]) : (A)0);
            });
            st_global_cs_v4(yr + rs.head + w * Vec16<T>::N, o.u);
          }
        }
      }
      if (k == 0 && (int)threadIdx.x < rs.nscalar) {
        const long long c = rs.scalar_pos(threadIdx.x);
        yr[c] = from_acc<T>(f(to_acc(xr[c]), BWD ? to_acc(gr[c]) : (A)0));
      }
    };
    if constexpr (BWD) {
      const Grad<P, T, A> grad(s, t, ncols);
      each([&](A xv, A gv) { return grad(xv, gv); });
    } else {
      const Scaler<A> scale(row_divisor<P, T>(s, ncols));
      each([&](A xv, A) { return scale(xv); });
    }
  }
};

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
  constexpr int K = BWD ? 2 : 1;
  __shared__ A scratch[THREADS / 32];
  for (long long item = blockIdx.x; item < nrows * nchunks; item += gridDim.x) {
    const T* xr = x + (item / nchunks) * xs;
    const T* gr = dy + (item / nchunks) * dys;
    const RowSplit rs(xr, ncols);
    const Chunk ch(item, nchunks, vc, rs.nvec);
    A s = 0, t = 0;
    for (long long v = ch.v0 + threadIdx.x; v < ch.v1; v += THREADS * UNROLL) {
      Vec16<T> b[UNROLL], g[BWD ? UNROLL : 1];
      ch.load<THREADS, UNROLL, BWD>(b, g, xr, gr, rs.head, v);
      ch.add<P, THREADS, UNROLL, BWD>(b, g, v, s, t);
    }
    ch.add_scalars<P, BWD>(rs, xr, gr, s, t);
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
  constexpr int K = BWD ? 2 : 1;
  __shared__ A scratch[THREADS / 32];
  // Items in reverse: the last items pass 1 read are the likeliest still in L2.
  for (long long it = blockIdx.x; it < nrows * nchunks; it += gridDim.x) {
    const long long item = nrows * nchunks - 1 - it;
    const long long row = item / nchunks;
    const T* xr = x + row * xs;
    const RowSplit rs(xr, ncols);
    const Chunk ch(item, nchunks, vc, rs.nvec);
    A s = 0, t = 0;
    for (long long k = threadIdx.x; k < nchunks; k += THREADS) {
      s += partial[(row * nchunks + k) * K];
      if constexpr (BWD) t += partial[(row * nchunks + k) * K + 1];
    }
    s = block_sum(s, scratch);
    if constexpr (BWD) t = block_sum(t, scratch);
    ch.write<P, THREADS, UNROLL, BWD>(rs, xr, dy + row * dys, y + row * ys, s, t, ncols);
  }
}

// A published partial sum, stored as its bits inverted in one single-copy-atomic store:
// the launch zeroes the buffer first, and no stored value is 0 (a nan is stored as the
// canonical nan, never the all-ones pattern whose inverse is 0). So a reader that sees a
// nonzero word has the whole value, with no flag or fence beside it.
__device__ __forceinline__ void publish(float* p, float v) {
  const unsigned u = ~__float_as_uint(v == v ? v : quiet_nan<float>());
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(u) : "memory");
}
__device__ __forceinline__ void publish(double* p, double v) {
  const unsigned long long u = ~(unsigned long long)__double_as_longlong(v == v ? v : quiet_nan<double>());
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"(p), "l"(u) : "memory");
}
// Reads a published partial into v; false while it is not published yet.
__device__ __forceinline__ bool peek(const float* p, float& v) {
  unsigned u;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(u) : "l"(p) : "memory");
  v = __uint_as_float(~u);
  return u != 0;
}
__device__ __forceinline__ bool peek(const double* p, double& v) {
  unsigned long long u;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(u) : "l"(p) : "memory");
  v = __longlong_as_double((long long)~u);
  return u != 0;
}

// One pass over chunks of VC = THREADS * UNROLL vectors (one load per thread and unroll
// step). Work comes as tickets 0, 1, ... from an atomic counter (*ticket, zeroed by the
// launch with the partials): ticket t loads chunk t (t < items), then writes item t - lag
// (t >= lag) from its row's published partials, then publishes chunk t's partials.
// Deadlock-free whatever the residency: lag >= nchunks, so item t - lag's row ends before
// item t, and an item waits only for items of smaller tickets. Tickets go in counter order
// to running CTAs, each of which publishes every ticket it takes after waiting only on
// smaller ones; so the smallest unpublished ticket is always being worked on (a CTA's
// next ticket is taken during its current item, behind it, which keeps that order).
// The write re-reads chunk t - lag, read `lag` tickets ago: an L2 hit when lag chunks fit
// L2 (the caller picks lag = nchunks + grid). Sums: a chunk's terms in the order pass 1
// adds them, a row's partials in pass 2's order: the bits of the two-pass kernels with
// chunks of VC vectors, every run. `partial` (items * K, zeroed) as in pass 1.
// MINB: the CTAs per SM the launch gives (its grid is MINB per SM), which the register
// budget must allow.
template <int P, typename T, int THREADS, int UNROLL, bool BWD, int MINB>
__global__ void __launch_bounds__(THREADS, MINB)
normalize_chunk_lagged(const T* __restrict__ x, const T* __restrict__ dy,
                       typename acc_of<T>::type* partial, unsigned long long* ticket,
                       T* __restrict__ y, long long nrows, long long ncols, long long xs,
                       long long dys, long long ys, long long nchunks, long long lag) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_chunk_lagged: THREADS must be whole warps, at most 1024");
  static_assert(UNROLL >= 1, "normalize_chunk_lagged: UNROLL >= 1");
  static_assert(MINB >= 1 && MINB * THREADS <= 2048, "normalize_chunk_lagged: MINB CTAs of THREADS must fit an SM");
  typedef typename acc_of<T>::type A;
  constexpr int K = BWD ? 2 : 1;
  constexpr long long VC = (long long)THREADS * UNROLL;
  __shared__ A scratch[THREADS / 32];
  __shared__ long long next[2];  // this item's ticket and the one taken during it
  const long long items = nrows * nchunks, end = items + lag;
  if (threadIdx.x == 0) next[0] = (long long)atomicAdd(ticket, 1ull);
  __syncthreads();
  for (int cur = 0;; cur ^= 1) {
    const long long tk = next[cur];
    if (tk >= end) break;
    if (threadIdx.x == 0) next[cur ^ 1] = (long long)atomicAdd(ticket, 1ull);
    // 1. chunk tk into registers: its loads are in flight during step 2
    Vec16<T> b[UNROLL], g[BWD ? UNROLL : 1];
    const long long row = (tk < items ? tk : 0) / nchunks;
    const T* xr = x + row * xs;
    const T* gr = dy + row * dys;
    const RowSplit rs(xr, ncols);
    const Chunk ch(tk < items ? tk : 0, nchunks, VC, rs.nvec);
    if (tk < items) ch.load<THREADS, UNROLL, BWD>(b, g, xr, gr, rs.head, ch.v0 + threadIdx.x);
    // 2. item tk - lag: wait until its row's partials are all published, add them in
    // pass 2's order, write its chunk
    if (tk >= lag) {
      const long long item = tk - lag, wrow = item / nchunks;
      const A* pr = partial + wrow * nchunks * K;
      A s, t;
      for (;;) {
        bool missing = false;
        s = 0, t = 0;
        for (long long k = threadIdx.x; k < nchunks; k += THREADS) {
          A v;
          missing |= !peek(pr + k * K, v);
          s += v;
          if constexpr (BWD) {
            missing |= !peek(pr + k * K + 1, v);
            t += v;
          }
        }
        if (!__syncthreads_or(missing)) break;
        __nanosleep(200);
      }
      s = block_sum(s, scratch);
      if constexpr (BWD) t = block_sum(t, scratch);
      const T* wx = x + wrow * xs;
      const RowSplit ws(wx, ncols);
      const Chunk wc(item, nchunks, VC, ws.nvec);
      wc.write<P, THREADS, UNROLL, BWD>(ws, wx, dy + wrow * dys, y + wrow * ys, s, t, ncols);
    }
    // 3. chunk tk's partials, published
    if (tk < items) {
      A s = 0, t = 0;
      ch.add<P, THREADS, UNROLL, BWD>(b, g, ch.v0 + threadIdx.x, s, t);
      ch.add_scalars<P, BWD>(rs, xr, gr, s, t);
      s = block_sum(s, scratch);
      if constexpr (BWD) t = block_sum(t, scratch);
      if (threadIdx.x == 0) {
        publish(partial + tk * K, s);
        if constexpr (BWD) publish(partial + tk * K + 1, t);
      }
    }
    __syncthreads();  // next[cur ^ 1] written; every thread has read next[cur]
  }
}
