// Few long rows in one read of x (forward only). A cooperative launch, every CTA resident
// at once (one per SM), each owning one chunk of one row (Chunk: `cpr` CTAs a row). A CTA
// reads its chunk once, summing it, and keeps the chunk's front on chip: REGS vectors a
// thread in registers, then `held` vectors in shared memory. It publishes its partial sum,
// waits until the row's other CTAs have published theirs, adds them in a fixed order (one
// divisor a row, the same in each of its CTAs) and writes its chunk: first the rest,
// re-read back to front (what it read last is what L2 still holds), then the front from
// chip. A chunk that fits on chip is read once; a larger one re-reads only what neither
// the chip nor L2 kept (normalize_long.cu's two passes re-read all of x). Each CTA reads
// and writes only its own chunk (chunk 0 also the row's head and tail scalars), so y may
// be x.
#include "normalize.cuh"

// Loads with an L2 eviction priority (sm_80+; plain loads before): what a CTA keeps on chip
// is read "evict first" (never re-read), the rest "evict last" (re-read from L2 after the
// row's sum), and re-read "evict first". H200, GPU time against the same loads without
// the priorities: 4x4194304 float32 42.8 against 45.9 us, 8x4194304 bfloat16 44.5 against
// 47.4, 11x2312175 float32 78.5 against 82.7.
struct L2Policy {
  unsigned long long first, last;
  __device__ __forceinline__ L2Policy() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(first));
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(last));
#else
    first = last = 0;
#endif
  }
};

__device__ __forceinline__ uint4 load_v4(const void* p, unsigned long long policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(policy));
  return r;
#else
  return ld_global_nc_v4(p);
#endif
}

// 16 bytes from global to shared memory without registers (cp.async, sm_80+; a load and a
// store before), and the wait for this thread's copies.
__device__ __forceinline__ void copy_to_shared(uint4* dst, const void* src, unsigned long long policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;"
               :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "l"(policy) : "memory");
#else
  *dst = ld_global_nc_v4(src);
#endif
}
__device__ __forceinline__ void copies_to_shared_done() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

template <int P, typename T, int THREADS, int REGS, int UNROLL, int LINE>
__global__ void __launch_bounds__(THREADS, 1)
normalize_resident(const T* __restrict__ x, typename acc_of<T>::type* __restrict__ partial,
                   unsigned* __restrict__ arrived, T* __restrict__ y, long long ncols,
                   long long xs, long long ys, long long cpr, long long held) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "normalize_resident: THREADS must be whole warps, at most 1024");
  static_assert(REGS >= 1 && UNROLL >= 1, "normalize_resident: REGS >= 1, UNROLL >= 1");
  static_assert(LINE >= 1 && (LINE & (LINE - 1)) == 0, "normalize_resident: LINE (16-byte vectors a chunk boundary falls on) must be a power of 2");
  typedef typename acc_of<T>::type A;
  typedef Vec16<T> V;
  constexpr int N = V::N;
  constexpr long long STEP = (long long)THREADS * UNROLL;
  extern __shared__ uint4 kept[];  // `held` vectors (a multiple of THREADS)
  __shared__ A scratch[THREADS / 32];
  const long long item = blockIdx.x;
  const T* xr = x + (item / cpr) * xs;
  T* yr = y + (item / cpr) * ys;
  const RowSplit rs(xr, ncols);
  // Chunks of whole lines of x (LINE vectors: 128 bytes), on lines of x wherever the row
  // starts: no line split between two CTAs. A row starting on a line (shift 0) has the
  // chunks of its vector count alone.
  const long long shift = ((size_t)(xr + rs.head) / 16) & (LINE - 1);
  const long long vc = LINE * ((rs.nvec + shift + cpr * LINE - 1) / (cpr * LINE));
  const Chunk ch(item, cpr, vc, rs.nvec, shift);
  const int tid = threadIdx.x;
  const long long smem0 = ch.v0 + (long long)REGS * THREADS, rest0 = smem0 + held;
  A s = 0;
  auto add = [&](const V& b) {
#pragma unroll
    for (int j = 0; j < N; ++j) s += norm_term<P>(to_acc(b.e[j]));
  };

  // Read: the shared-memory part's copies issued first (all in flight at once), the
  // registers' loads, the rest streamed (UNROLL vectors in flight), then the shared-memory
  // part summed (each thread its own copies).
  const L2Policy policy;
  for (long long k = tid; k < held && smem0 + k < ch.v1; k += THREADS)
    copy_to_shared(kept + k, xr + rs.head + (smem0 + k) * N, policy.first);
  V reg[REGS];
#pragma unroll
  for (int r = 0; r < REGS; ++r) {
    const long long v = ch.v0 + (long long)r * THREADS + tid;
    if (v < ch.v1) reg[r].u = load_v4(xr + rs.head + v * N, policy.first);
  }
#pragma unroll
  for (int r = 0; r < REGS; ++r)
    if (ch.v0 + (long long)r * THREADS + tid < ch.v1) add(reg[r]);
  // UNROLL vectors of the rest at v, v + THREADS, ... (those in the chunk)
  auto load_rest = [&](V (&b)[UNROLL], long long v, unsigned long long priority) {
#pragma unroll
    for (int i = 0; i < UNROLL; ++i)
      if (v + (long long)i * THREADS < ch.v1)
        b[i].u = load_v4(xr + rs.head + (v + (long long)i * THREADS) * N, priority);
  };
  for (long long v = rest0 + tid; v < ch.v1; v += STEP) {
    V b[UNROLL];
    load_rest(b, v, policy.last);
#pragma unroll
    for (int i = 0; i < UNROLL; ++i)
      if (v + (long long)i * THREADS < ch.v1) add(b[i]);
  }
  copies_to_shared_done();
  for (long long k = tid; k < held && smem0 + k < ch.v1; k += THREADS) {
    V b;
    b.u = kept[k];
    add(b);
  }
  if (ch.k == 0 && tid < rs.nscalar) s += norm_term<P>(to_acc(xr[rs.scalar_pos(tid)]));
  s = block_sum(s, scratch);

  // The row's sum: publish this chunk's, wait for the row's others (all CTAs are resident:
  // the cooperative launch guarantees it), add them in chunk order.
  if (tid == 0) {
    partial[item] = s;
    __threadfence();
    atomicAdd(arrived + ch.row, 1u);
    while (*(volatile unsigned*)(arrived + ch.row) < (unsigned)cpr) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
  A t = 0;
  for (long long k = tid; k < cpr; k += THREADS) t += __ldcg(partial + ch.row * cpr + k);
  t = block_sum(t, scratch);
  const Scaler<A> scale(row_divisor<P, T>(t, ncols));
  auto scaled = [&](const V& b) {
    return vec_from_acc<T>([&](int j) { return scale(to_acc(b.e[j])); }).u;
  };

  // Write: the rest back to front, then shared memory, then registers.
  if (rest0 < ch.v1) {
    for (long long step = (ch.v1 - rest0 + STEP - 1) / STEP - 1; step >= 0; --step) {
      const long long v = rest0 + step * STEP + tid;
      V b[UNROLL];
      load_rest(b, v, policy.first);
#pragma unroll
      for (int i = 0; i < UNROLL; ++i) {
        const long long w = v + (long long)i * THREADS;
        if (w < ch.v1) st_global_cs_v4(yr + rs.head + w * N, scaled(b[i]));
      }
    }
  }
  for (long long k = tid; k < held && smem0 + k < ch.v1; k += THREADS) {
    V b;
    b.u = kept[k];
    st_global_cs_v4(yr + rs.head + (smem0 + k) * N, scaled(b));
  }
#pragma unroll
  for (int r = 0; r < REGS; ++r) {
    const long long v = ch.v0 + (long long)r * THREADS + tid;
    if (v < ch.v1) st_global_cs_v4(yr + rs.head + v * N, scaled(reg[r]));
  }
  if (ch.k == 0 && tid < rs.nscalar) {
    const long long c = rs.scalar_pos(tid);
    yr[c] = from_acc<T>(scale(to_acc(xr[c])));
  }
}
