// Few long rows in one read of x (and, BWD, of dy). A cooperative launch, every CTA
// resident at once (one per SM), each owning one chunk of one row (Chunk: `cpr` CTAs a
// row). A CTA reads its chunk once, summing it, and keeps the chunk's front on chip: REGS
// vectors a thread in registers, then `held` vectors in shared memory (BWD: as many of dy
// beside them). It publishes its partial sums, waits until the row's other CTAs have
// published theirs, adds them in a fixed order (one divisor a row, the same in each of its
// CTAs) and writes its chunk of y (BWD: of dx, formula Grad): first the rest, re-read back
// to front (what it read last is what L2 still holds), then the front from chip. A chunk
// that fits on chip is read once; a larger one re-reads only what neither the chip nor L2
// kept (normalize_long.cu's two passes re-read all of x and dy). Each CTA reads and writes
// only its own chunk (chunk 0 also the row's head and tail scalars), so y may be x (or dy).
#include "normalize_chip.cuh"

template <int P, typename T, int THREADS, int REGS, int UNROLL, int LINE, bool BWD>
__global__ void __launch_bounds__(THREADS, 1)
normalize_resident(const T* __restrict__ x, const T* __restrict__ dy,
                   typename acc_of<T>::type* __restrict__ partial, unsigned* __restrict__ arrived,
                   T* __restrict__ y, long long ncols, long long xs, long long gs, long long ys,
                   long long cpr, long long held) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_resident: THREADS must be whole warps, at most 1024");
  static_assert(REGS >= 1 && UNROLL >= 1, "normalize_resident: REGS >= 1, UNROLL >= 1");
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N, K = BWD ? 2 : 1;  // (K: partial sums a chunk)
  constexpr long long STEP = (long long)THREADS * UNROLL;
  extern __shared__ uint4 kept[];  // `held` vectors of x (a multiple of THREADS), BWD then dy's
  __shared__ A scratch[THREADS / 32];
  const long long row = blockIdx.x / cpr;
  const T* xr = x + row * xs;
  const T* gr = dy + row * gs;  // (rows of dy start like x's modulo 16 bytes)
  T* yr = y + row * ys;
  const RowSplit rs(xr, ncols);
  const Chunk ch = line_chunk<LINE>(xr, rs, blockIdx.x % cpr, cpr);
  const int tid = threadIdx.x;
  const long long smem0 = ch.v0 + (long long)REGS * THREADS, rest0 = smem0 + held;
  A s = 0, t = 0;  // the norm terms, and (BWD) dy . x
  auto add = [&](const V& b, const V& g) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const A xv = to_acc(b.e[j]);
      s += norm_term<P, BWD>(xv);
      if constexpr (BWD) t += to_acc(g.e[j]) * xv;
    }
  };
  const T* xv0 = xr + rs.head;
  const T* gv0 = gr + rs.head;

  // Read: the shared-memory part's copies issued first (all in flight at once), the
  // registers' loads, the rest streamed (UNROLL vectors in flight), then the shared-memory
  // part summed (each thread its own copies).
  const L2Policy policy;
  for (long long k = tid; k < held && smem0 + k < ch.v1; k += THREADS) {
    copy_to_shared(kept + k, xv0 + (smem0 + k) * N, policy.first);
    if constexpr (BWD) copy_to_shared(kept + held + k, gv0 + (smem0 + k) * N, policy.first);
  }
  V reg[REGS], greg[BWD ? REGS : 1];
#pragma unroll
  for (int r = 0; r < REGS; ++r) {
    const long long v = ch.v0 + (long long)r * THREADS + tid;
    if (v < ch.v1) {
      reg[r].u = load_v4(xv0 + v * N, policy.first);
      if constexpr (BWD) greg[r].u = load_v4(gv0 + v * N, policy.first);
    }
  }
#pragma unroll
  for (int r = 0; r < REGS; ++r)
    if (ch.v0 + (long long)r * THREADS + tid < ch.v1) add(reg[r], greg[BWD ? r : 0]);
  // UNROLL vectors of the rest at v, v + THREADS, ... (those in the chunk), of x and (BWD) dy
  auto load_rest = [&](V (&b)[UNROLL], V (&g)[BWD ? UNROLL : 1], long long v,
                       unsigned long long priority) {
#pragma unroll
    for (int i = 0; i < UNROLL; ++i) {
      const long long w = v + (long long)i * THREADS;
      if (w < ch.v1) {
        b[i].u = load_v4(xv0 + w * N, priority);
        if constexpr (BWD) g[i].u = load_v4(gv0 + w * N, priority);
      }
    }
  };
  for (long long v = rest0 + tid; v < ch.v1; v += STEP) {
    V b[UNROLL], g[BWD ? UNROLL : 1];
    load_rest(b, g, v, policy.last);
#pragma unroll
    for (int i = 0; i < UNROLL; ++i)
      if (v + (long long)i * THREADS < ch.v1) add(b[i], g[BWD ? i : 0]);
  }
  copies_to_shared_done();
  V g_kept;  // (dy's shared-memory vector, BWD)
  for (long long k = tid; k < held && smem0 + k < ch.v1; k += THREADS) {
    V b;
    b.u = kept[k];
    if constexpr (BWD) g_kept.u = kept[held + k];
    add(b, g_kept);
  }
  if (ch.k == 0 && tid < rs.nscalar) {
    const long long c = rs.scalar_pos(tid);
    const A xs_ = to_acc(xr[c]);
    s += norm_term<P, BWD>(xs_);
    if constexpr (BWD) t += to_acc(gr[c]) * xs_;
  }
  s = block_sum(s, scratch);
  if constexpr (BWD) t = block_sum(t, scratch);

  // The row's sums: publish this chunk's, wait for the row's others (all CTAs are
  // resident: the cooperative launch guarantees it), add them in chunk order.
  if (tid == 0) {
    partial[blockIdx.x * K] = s;
    if constexpr (BWD) partial[blockIdx.x * K + 1] = t;
    __threadfence();
    atomicAdd(arrived + row, 1u);
    while (*(volatile unsigned*)(arrived + row) < (unsigned)cpr) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
  s = t = 0;
  for (long long k = tid; k < cpr; k += THREADS) {
    s += __ldcg(partial + (row * cpr + k) * K);
    if constexpr (BWD) t += __ldcg(partial + (row * cpr + k) * K + 1);
  }
  s = block_sum(s, scratch);
  if constexpr (BWD) t = block_sum(t, scratch);
  auto write = [&](auto f) {  // f(x value, dy value) -> output value
    auto out = [&](const V& b, const V& g) {
      return vec_from_acc<T>([&](int j) { return f(to_acc(b.e[j]), BWD ? to_acc(g.e[j]) : (A)0); }).u;
    };
    // The rest back to front, then shared memory, then registers.
    if (rest0 < ch.v1) {
      for (long long step = (ch.v1 - rest0 + STEP - 1) / STEP - 1; step >= 0; --step) {
        const long long v = rest0 + step * STEP + tid;
        V b[UNROLL], g[BWD ? UNROLL : 1];
        load_rest(b, g, v, policy.first);
#pragma unroll
        for (int i = 0; i < UNROLL; ++i) {
          const long long w = v + (long long)i * THREADS;
          if (w < ch.v1) st_global_cs_v4(yr + rs.head + w * N, out(b[i], g[BWD ? i : 0]));
        }
      }
    }
    for (long long k = tid; k < held && smem0 + k < ch.v1; k += THREADS) {
      V b;
      b.u = kept[k];
      if constexpr (BWD) g_kept.u = kept[held + k];
      st_global_cs_v4(yr + rs.head + (smem0 + k) * N, out(b, g_kept));
    }
#pragma unroll
    for (int r = 0; r < REGS; ++r) {
      const long long v = ch.v0 + (long long)r * THREADS + tid;
      if (v < ch.v1) st_global_cs_v4(yr + rs.head + v * N, out(reg[r], greg[BWD ? r : 0]));
    }
    if (ch.k == 0 && tid < rs.nscalar) {
      const long long c = rs.scalar_pos(tid);
      yr[c] = from_acc<T>(f(to_acc(xr[c]), BWD ? to_acc(gr[c]) : (A)0));
    }
  };
  with_row_output<P, T, BWD>(s, t, ncols, write);
}
