// Shared device helpers for every cupykern kernel. Inlined by the loader.
//
// NVRTC here has no CUDA toolkit headers (no cuda_fp16.h on a CPU-only CI box),
// so the 16-bit float types are our own 2-byte structs converted with PTX.
#pragma once

typedef unsigned short u16;
struct half_t { u16 bits; };
struct bf16_t { u16 bits; };

// Accumulation type: float for 16/32-bit inputs, double for double.
template <typename T> struct acc_of { typedef float type; };
template <> struct acc_of<double> { typedef double type; };

// +inf and a quiet nan of A (NVRTC has no math.h macros); float's convert exactly to double.
template <typename A> __device__ __forceinline__ A infinity() { return (A)__int_as_float(0x7f800000); }
template <typename A> __device__ __forceinline__ A quiet_nan() { return (A)__int_as_float(0x7fc00000); }

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float to_acc(bf16_t v) { return __uint_as_float(((unsigned)v.bits) << 16); }

// Round an accumulator value to T (round to nearest even, like torch).
template <typename T> __device__ __forceinline__ T from_acc(float v);
template <typename T> __device__ __forceinline__ T from_acc(double v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ float from_acc<float>(double v) { return (float)v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(float v) { return v; }
template <> __device__ __forceinline__ half_t from_acc<half_t>(float v) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
  return h;
}
template <> __device__ __forceinline__ half_t from_acc<half_t>(double v) {
  half_t h;
  asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h.bits) : "d"(v));
  return h;
}
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(float v) {
  bf16_t h;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800  // no bf16 cvt: round to nearest even by hand
  const unsigned u = __float_as_uint(v);
  h.bits = (u & 0x7fffffffu) > 0x7f800000u ? (u16)((u >> 16) | 0x40u)  // nan stays a (quiet) nan
                                           : (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#else
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
#endif
  return h;
}
template <> __device__ __forceinline__ bf16_t from_acc<bf16_t>(double v) {
  return from_acc<bf16_t>((float)v);  // double->float->bf16 can double-round; only used for scalars
}

// p[n] in the accumulation type, or dflt where the optional array p is null.
template <typename T, typename A>
__device__ __forceinline__ A opt(const T* p, int n, A dflt) { return p ? to_acc(p[n]) : dflt; }

// Tiles of ``rows`` rows over M rows. A row pass's grid holds at most 65535 blocks on y
// (MAX_GRID_Y, _geometry.py), fewer than the tiles of a few million rows: the blocks of
// grid row y take tiles y, y + gridDim.y, ...
// (32-bit unsigned: M + rows - 1 < 2**32; a 64-bit division costs ~100 instructions a thread)
__device__ __forceinline__ int row_tiles(int M, int rows) {
  return (int)(((unsigned)M + (unsigned)rows - 1u) / (unsigned)rows);
}

// Where a block's threads lie in a row pass (gemm_scale_batchnorm.cu's bn_apply,
// bn_train_apply, bn_column_stats; the backward's bn_grad_partials, bn_grad_dz_rows):
// ``lanes`` rows side by side (a power of 2 dividing THREADS), each across THREADS / lanes
// threads of VEC columns, so that a narrow z (a row of fewer than THREADS vectors) still
// keeps every thread busy and a warp's loads contiguous. A tile is ROWS * lanes rows, each
// thread ROWS of them, one in every ``lanes``; grid row y takes tiles y, y + gridDim.y, ...
// (row_tiles). Grid (cdiv(cdiv(N, VEC), THREADS / lanes), min(tiles, MAX_GRID_Y)), block
// THREADS.
template <int THREADS, int ROWS, int VEC>
struct RowSpot {
  int col, lane, lanes, M, tiles;
  __device__ __forceinline__ RowSpot(int lanes_, int M_) : lanes(lanes_), M(M_) {
    const int across = THREADS / lanes;
    col = (blockIdx.x * across + threadIdx.x % across) * VEC;
    lane = threadIdx.x / across;
    tiles = row_tiles(M, ROWS * lanes);
  }
  // This thread's rows of tile t: r0(t), r0(t) + lanes, ... below r1(t). Unsigned: a
  // row index plus a step of rows stays below 2**32 where M is near 2**31.
  __device__ __forceinline__ unsigned r0(int t) const {
    return (unsigned)min((long long)M, (long long)t * ROWS * lanes + lane);
  }
  __device__ __forceinline__ unsigned r1(int t) const {
    return (unsigned)min((long long)M, (long long)(t + 1) * ROWS * lanes);
  }
};

// 16 bytes of T: the unit of every vectorised load and store.
template <typename T> struct Vec16 {
  static constexpr int N = 16 / sizeof(T);
  union { uint4 u; T e[N]; };
};

// Round two accumulator values into one 32-bit word of T (lo in the low half).
// Packed cvt halves the conversion count for 16-bit types (conversions are a
// quarter-rate pipe and would otherwise cap fp16 output bandwidth).
// (Packed cvt needs sm_80; older archs round each half on its own.)
__device__ __forceinline__ unsigned pack2(float lo, float hi, half_t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  return (unsigned)from_acc<half_t>(lo).bits | ((unsigned)from_acc<half_t>(hi).bits << 16);
#else
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}
__device__ __forceinline__ unsigned pack2(float lo, float hi, bf16_t) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  return (unsigned)from_acc<bf16_t>(lo).bits | ((unsigned)from_acc<bf16_t>(hi).bits << 16);
#else
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// Vec16 of T from N accumulator values: f(j) gives element j.
template <typename T, typename F> __device__ __forceinline__ Vec16<T> vec_from_acc(F f) {
  Vec16<T> o;
  if constexpr (sizeof(T) == 2) {
    unsigned w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = pack2(f(2 * k), f(2 * k + 1), T{});
    o.u = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
#pragma unroll
    for (int j = 0; j < Vec16<T>::N; ++j) o.e[j] = from_acc<T>(f(j));
  }
  return o;
}

__device__ __forceinline__ uint4 ld_global_nc_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// Streaming store: evict-first, the output is not re-read by this kernel.
__device__ __forceinline__ void st_global_cs_v4(void* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// Deterministic block-wide sum (fixed shuffle tree, then warps in order).
// Every thread gets the result. `scratch` holds >= blockDim.x/32 values.
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename A> __device__ __forceinline__ A block_sum(A v, A* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) scratch[warp] = v;
  __syncthreads();
  A t = 0;
  for (int w = 0; w < nwarps; ++w) t += scratch[w];
  __syncthreads();  // scratch may be reused right after
  return t;
}

// ---- Thread-block clusters (sm_90+). On older archs a "cluster" is one CTA.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CK_HAS_CLUSTERS 1
#define CK_CLUSTER_DIMS(C) __cluster_dims__(C, 1, 1)
#else
#define CK_HAS_CLUSTERS 0
#define CK_CLUSTER_DIMS(C)
#endif

__device__ __forceinline__ unsigned cluster_ctarank() {
#if CK_HAS_CLUSTERS
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
#else
  return 0;
#endif
}


// Split form: arrive (publishing this CTA's DSMEM stores), do independent work, wait.
__device__ __forceinline__ void cluster_arrive() {
#if CK_HAS_CLUSTERS
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if CK_HAS_CLUSTERS
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The cluster's sum of K values per CTA, once per step (a row), without a cluster
// barrier: thread 0 of each CTA stores its values into its slot of every CTA's `part`
// by st.async, whose bytes complete on the receiving CTA's mbarrier, and each CTA waits
// on its own barrier. Two buffers and barriers by step parity suffice: a CTA sends step
// s + 2 only after it has every CTA's step s + 1 values, which each CTA sends after it
// has read step s's. Every CTA adds the slots in rank order: the same sum everywhere.
// Declare `__shared__ ClusterSum<A, C, K> cs;`, call start() in every thread (thread 0
// initialises the mbarriers, then a cluster barrier: no CTA's slots are written before
// every CTA of the cluster runs), then sum() once per step in every thread.
template <typename A, int C, int K> struct ClusterSum {
  static_assert(K * sizeof(A) == 4 || K * sizeof(A) == 8 || K * sizeof(A) == 16,
                "ClusterSum: st.async stores 4, 8 or 16 bytes");
  alignas(16) A part[2][C][K];
  unsigned long long bar[2];

  __device__ __forceinline__ void start() {
#if CK_HAS_CLUSTERS
    if constexpr (C > 1) {
      if (threadIdx.x == 0) {
        for (int p = 0; p < 2; ++p)
          asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(&bar[p])) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      }
      cluster_arrive();
      cluster_wait();
    }
#endif
  }
  // v: this CTA's K values in, the cluster's sums out (every thread; thread 0's are sent).
  __device__ __forceinline__ void sum(A (&v)[K], int step, unsigned rank) {
#if CK_HAS_CLUSTERS
    const int p = step & 1;
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                   :: "r"(smem_u32(&bar[p])), "n"(C * K * (int)sizeof(A)) : "memory");
      for (unsigned r = 0; r < C; ++r) send(remote(&part[p][rank][0], r), remote(&bar[p], r), v);
    }
    const unsigned b = smem_u32(&bar[p]), parity = (step >> 1) & 1;
    asm volatile("{\n.reg .pred P;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
                 "@!P bra W_%=;\n}\n" :: "r"(b), "r"(parity) : "memory");
#pragma unroll
    for (int k = 0; k < K; ++k) {
      v[k] = 0;
      for (int r = 0; r < C; ++r) v[k] += part[p][r][k];
    }
#endif
  }

 private:
  __device__ __forceinline__ static unsigned smem_u32(const void* q) {
    return (unsigned)__cvta_generic_to_shared(q);
  }
  __device__ __forceinline__ static unsigned remote(const void* q, unsigned rank) {
    unsigned r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(q)), "r"(rank));
    return r;
  }
  __device__ __forceinline__ static void send(unsigned dst, unsigned bar, const A (&v)[K]) {
    if constexpr (sizeof(A) == 4 && K == 1) {
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                   :: "r"(dst), "r"(__float_as_uint(v[0])), "r"(bar) : "memory");
    } else if constexpr (sizeof(A) == 4) {
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];"
                   :: "r"(dst), "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[1])), "r"(bar) : "memory");
    } else if constexpr (K == 1) {
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];"
                   :: "r"(dst), "l"(__double_as_longlong(v[0])), "r"(bar) : "memory");
    } else {
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b64 [%0], {%1, %2}, [%3];"
                   :: "r"(dst), "l"(__double_as_longlong(v[0])), "l"(__double_as_longlong(v[1])), "r"(bar)
                   : "memory");
    }
  }
};
