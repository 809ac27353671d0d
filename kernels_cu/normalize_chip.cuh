// What the few-rows kernels (normalize_resident.cu, normalize_pipelined.cu) share: loads
// with an L2 eviction priority, copies to shared memory, and a row's chunks on lines of x.
#pragma once
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

// The chunk `k` of `nchunks` of the row at `xr` (RowSplit `rs`): whole lines of x (LINE
// vectors: 128 bytes), on lines of x wherever the row starts, so that no line is split
// between two CTAs. A row starting on a line (shift 0) has the chunks of its vector
// count alone.
template <int LINE, typename T>
__device__ __forceinline__ Chunk line_chunk(const T* xr, const RowSplit& rs, long long k,
                                            long long nchunks) {
  static_assert(LINE >= 1 && (LINE & (LINE - 1)) == 0, "line_chunk: LINE (16-byte vectors a chunk boundary falls on) must be a power of 2");
  const long long shift = ((size_t)(xr + rs.head) / 16) & (LINE - 1);
  const long long vc = LINE * ((rs.nvec + shift + nchunks * LINE - 1) / (nchunks * LINE));
  return Chunk(k, nchunks, vc, rs.nvec, shift);
}
