// gemm.cuh: what the GEMM kernels share (kernels_cu/gemm.cu: the CUDA-core kernel
// and the passes; gemm_mma.cu: mma.sync, sm_80+; gemm_wgmma.cu: Hopper; gemm_dmma.cu:
// float64 on the FP64 tensor cores), and their common contract:
//
// C = epilogue(A @ B^T) with A (M, K) and B (N, K), each K-contiguous (row stride lda/ldb)
// or, in gemm_mma with TA / TB, M- (N-) contiguous: A(m, k) at a[k*lda + m] (backward
// passes: dx = dy @ W, dW = dy^T @ x read their transposes in place).
//
// gemm_mma: tensor cores through mma.sync (sm_80+), 128x128 block tile, 8 warps of
// 64x32, a 4-stage cp.async pipeline of 128-byte K slices, ldmatrix fragment loads.
// One smem layout serves every precision: a 32-byte K step is one m16n8k8 tf32 MMA
// (8 floats) or one m16n8k16 MMA (16 halves), and ldmatrix.x4 of four 8x16-byte
// matrices yields exactly the A/B fragments of either (for 32-bit data each thread
// receives element (row lane/4, word lane%4), the tf32 fragment layout).
//   MODE 0  "highest": 3xTF32, A*B ~ Ab*Bb + Ab*Bs + As*Bb (b = tf32 part, s = rest),
//           with the tensor-core sum promoted into an fp32 register accumulator after
//           every 32-wide K slice (tensor-core accumulation truncates: shared/notes/GEMM.md).
//   MODE 1  "high": TF32 (raw fp32 bits; the tensor core ignores the low 13 bits).
//   MODE 2  "medium": fp32 data rounded to bf16 in registers, bf16 MMA.
//   MODE 3  native float16 / bfloat16 inputs.
// gemm_dmma: float64 through mma.sync's f64 shapes (sm_80, sm_90, sm_100), 128x128 block
// tile, 8 warps of 64x32, a 3-stage ring of 16-deep K slices (cp.async, or register
// gathers for transposed / misaligned operands), 16-byte fragment loads.
// gemm_simple: CUDA-core kernel for float64 on GPUs without FP64 tensor cores, and for
// every dtype below sm_80 (no mma.sync).
//
// Split K (every float32 / float64 kernel, and gemm_wgmma's 16-bit mode): block z of a
// grid with gridDim.z > 1 multiplies the K chunk [z*kchunk, (z+1)*kchunk) and stores its
// raw sum to slab z of c, an M x ldc workspace per slab of the accumulation type (T for
// float32 / float64, float for 16-bit T); splitk_reduce then adds the slabs in slab order
// (deterministic) and applies the epilogue and the statistics. Small grids thus fill
// the GPU (128x1024 @ 1024x512: 4 tiles on 132 SMs). kchunk is a multiple of the
// kernel's K slice (32 floats, 64 halves), which keeps the slices' alignment (gemm_mma
// and gemm_simple never split 16-bit types). Without a split, gridDim.z == 1 and
// kchunk >= K.
//
// Epilogue (all kernels): v = acc; v = alpha ? alpha[n]*v + beta[n] : v + bias[n]
// (each pointer may be null). If `part` is non-null the kernel also writes, for its
// M tile mt and every column n, the (mean, M2, min, max) over the tile's valid rows of the
// sums before the epilogue, rounded to T (so that for 16-bit T they agree with what
// BatchNorm then normalises: a batch of two amplifies any mismatch up to
// 1/sqrt(eps)-fold), in rows PART_ROWS*mt + 0..3 of part (stats.cuh). Within a tile they
// are merged in a fixed order (gemm_mma, gemm_simple: slots by Chan's formula;
// gemm_wgmma: two exact passes down each column), so the statistics are deterministic.
#include "common.cuh"
#include "stats.cuh"

// Threads with col in 0..COLS-1 merge the SLOTS partials of that column in slot order:
// (mean, M2) into rows 0, 1 of the tile's PART_ROWS ...
// LD: the slots' row stride (COLS, or more where padding spreads the slot writes over banks).
template <typename A, int SLOTS, int COLS, int LD = COLS>
__device__ __forceinline__ void merge_slots(const A* s_mean, const A* s_m2, const A* s_cnt,
                                            A* part, int col, int mt, int n0, int N) {
  if (col >= COLS || n0 + col >= N) return;
  A n = 0, mean = 0, m2 = 0;
  for (int s = 0; s < SLOTS; ++s) chan_merge(n, mean, m2, s_cnt[s], s_mean[s * LD + col], s_m2[s * LD + col]);
  part[((long long)PART_ROWS * mt) * N + n0 + col] = mean;
  part[((long long)PART_ROWS * mt + 1) * N + n0 + col] = m2;
}

// ... and (min, max) into rows 2, 3.
template <typename A, int SLOTS, int COLS, int LD = COLS>
__device__ __forceinline__ void merge_range(const A* s_lo, const A* s_hi, A* part, int col,
                                            int mt, int n0, int N) {
  if (col >= COLS || n0 + col >= N) return;
  A lo = infinity<A>(), hi = -infinity<A>();
  for (int s = 0; s < SLOTS; ++s) {
    lo = fmin(lo, s_lo[s * LD + col]);
    hi = fmax(hi, s_hi[s * LD + col]);
  }
  part[((long long)PART_ROWS * mt + 2) * N + n0 + col] = lo;
  part[((long long)PART_ROWS * mt + 3) * N + n0 + col] = hi;
}

template <typename T, typename A>
__device__ __forceinline__ A epilogue(A v, int n, const T* bias, const A* alpha, const A* beta) {
  if (alpha) return alpha[n] * v + beta[n];
  if (bias) return v + to_acc(bias[n]);
  return v;
}

// ---- the epilogue of gemm_mma and gemm_dmma: 8 warps as 2 (M) x 4 (N) warp tiles of
// 64 x 32, each holding 4 x 4 m16n8 fragments acc[i][j][e]: rows 16i + g (e = 0, 1) and
// 16i + g + 8 (e = 2, 3), columns 8j + 2t + (e & 1); g = lane / 4, t = lane % 4.
// c = epilogue(acc) for the block tile at (m0, n0).
template <typename T, typename A>
__device__ __forceinline__ void store_fragments(const A (&acc)[4][4][4], T* __restrict__ c, int M, int N,
                                                long long ldc, int m0, int n0, const T* bias,
                                                const A* alpha, const A* beta) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r0 = m0 + (warp & 1) * 64 + (lane >> 2), c0 = n0 + (warp >> 1) * 32 + 2 * (lane & 3);
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = c0 + j * 8 + e;
      if (col >= N) continue;
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r0 + i * 16 + h * 8;
          if (row < M) c[(long long)row * ldc + col] = from_acc<T>(epilogue(acc[i][j][2 * h + e], col, bias, alpha, beta));
        }
    }
}

__device__ __forceinline__ void store_pair(float* p, float x, float y) { *reinterpret_cast<float2*>(p) = make_float2(x, y); }
__device__ __forceinline__ void store_pair(double* p, double x, double y) { *reinterpret_cast<double2*>(p) = make_double2(x, y); }

// The tile's partial statistics (Epilogue above) of the sums as stored in T, through
// `smem` (free: the caller has drained its pipeline): 16 slots (warp row, g) x BN
// columns, slot rows padded to BN + 8 so that a quarter warp's pair stores hit distinct
// banks, merged in slot order. Needs (2 * 16 * (BN + 8) + 16) * sizeof(A) bytes.
template <typename T, typename A, int BM, int BN>
__device__ __forceinline__ void fragment_statistics(const A (&acc)[4][4][4], unsigned char* smem, A* part,
                                                    int M, int N, int m0, int n0) {
  static_assert(BM == 128 && BN == 128, "fragment_statistics: 2 x 4 warps of 64 x 32");
  constexpr int LD = BN + 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp & 1, wn = warp >> 1;
  const int g = lane >> 2, t = lane & 3, r0 = m0 + wm * 64 + g;
  A* s_mean = reinterpret_cast<A*>(smem);
  A* s_m2 = s_mean + 16 * LD;
  A* s_cnt = s_m2 + 16 * LD;
  const int slot = wm * 8 + g;
  bool valid[8];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) valid[2 * i + h] = r0 + i * 16 + h * 8 < M;
  for (int range = 0; range < 2; ++range) {  // (mean, M2), then (min, max), same slots
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      A n, x[2], y[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        A v[8];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) v[2 * i + h] = to_acc(from_acc<T>(acc[i][j][2 * h + e]));
        if (range) local_range(v, valid, x[e], y[e]);
        else local_stats(v, valid, n, x[e], y[e]);
      }
      const int col = wn * 32 + j * 8 + 2 * t;
      store_pair(s_mean + slot * LD + col, x[0], x[1]);
      store_pair(s_m2 + slot * LD + col, y[0], y[1]);
      if (!range && wn == 0 && t == 0 && j == 0) s_cnt[slot] = n;
    }
    __syncthreads();
    if (range) merge_range<A, 16, BN, LD>(s_mean, s_m2, part, threadIdx.x, m0 / BM, n0, N);
    else merge_slots<A, 16, BN, LD>(s_mean, s_m2, s_cnt, part, threadIdx.x, m0 / BM, n0, N);
    __syncthreads();
  }
}

// This block's K chunk (see Split K above): operands, K and the output slab. (P and Q
// are the kernel's parameter types, __restrict__ included.)
template <bool TA, bool TB, typename P, typename Q>
__device__ __forceinline__ void split_k(P& a, P& b, Q& c, int M, int& K, long long lda, long long ldb,
                                        long long ldc, int kchunk) {
  const long long k0 = (long long)blockIdx.z * kchunk;
  a += TA ? k0 * lda : k0;
  b += TB ? k0 * ldb : k0;
  c += (long long)blockIdx.z * M * ldc;
  K = min((long long)kchunk, K - k0);
}

// ---- PTX wrappers (sm_80+) ---------------------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
// 16-byte async copy; src_bytes = 0 fills the destination with zeros (out of bounds).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

// A transposed float32 slice, ROWS x 32 floats: element (r, k) at g[(k0 + k)*ld + r],
// copied by 4-byte cp.async (asynchronous like the 16-byte path, in any alignment) to
// dst + off(r, k), its place in the K-major smem layout. Thread t of NT: lanes take
// 8 consecutive r x 4 consecutive k, so a warp reads four 32-byte segments and writes
// 32 distinct banks for both layouts used here (rows padded to 144 bytes, or the
// 128-byte swizzle). Out of bounds: zeros.
template <int ROWS, int NT, typename Off>
__device__ __forceinline__ void load_transposed(unsigned dst, const float* __restrict__ g, long long ld,
                                                int rows_left, int k0, int K, int t, Off off) {
  static_assert(NT % 32 == 0 && ROWS % 8 == 0 && ROWS % (NT / 32) == 0,
                "load_transposed: whole warps, each with as many 8 x 4 blocks");
  constexpr int WARPS = NT / 32, RB = ROWS / 8;  // 8 x 4 blocks: RB along r, 8 along k
  const int rl = t & 7, kl = (t >> 3) & 3, w = t >> 5;
#pragma unroll 8
  for (int i = 0; i < RB * 8 / WARPS; ++i) {
    const int blk = w + i * WARPS, r = (blk % RB) * 8 + rl, k = (blk / RB) * 4 + kl;
    const bool ok = r < rows_left && k0 + k < K;
    cp_async4(dst + off(r, k), ok ? g + (long long)(k0 + k) * ld + r : g, ok ? 4 : 0);
  }
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// The cp.async ring of gemm_mma and gemm_dmma: STAGES - 1 K slices in flight ahead of
// the one computed. load(kt) issues slice kt's copies (cp.async, or a register gather),
// store(kt) writes a gathered slice to its stage, compute(kt) reads stage kt % STAGES.
// GATHERED (an operand goes through registers): a gathered slice is stored after the
// compute, into the stage read an iteration ago (free since this iteration's barrier).
template <int STAGES, bool GATHERED, class Load, class Store, class Compute>
__device__ __forceinline__ void ring_mainloop(int ktiles, Load&& load, Store&& store, Compute&& compute) {
  static_assert(STAGES >= 2, "the ring needs a stage in flight beside the one computed");
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ktiles) {
      load(s);
      store(s);
    }
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage kt landed; stage (kt-1)%STAGES is no longer read
    const bool next = kt + STAGES - 1 < ktiles;
    if (next) load(kt + STAGES - 1);
    cp_async_commit();
    compute(kt);
    if (GATHERED && next) store(kt + STAGES - 1);
  }
}

// Grouped raster: GROUP_M M-tiles share each N-tile while it is hot in L2 (every
// tensor-core kernel's order of output tiles).
constexpr int GROUP_M = 16;
template <int BM, int BN>
__device__ __forceinline__ void grouped_tile(int M, int N, int& m0, int& n0, int pid = blockIdx.x) {
  const int mtiles = (M + BM - 1) / BM, ntiles = (N + BN - 1) / BN;
  const int group = pid / (GROUP_M * ntiles);
  const int first_m = group * GROUP_M, gsz = min(mtiles - first_m, GROUP_M);
  m0 = (first_m + (pid % (GROUP_M * ntiles)) % gsz) * BM;
  n0 = ((pid % (GROUP_M * ntiles)) / gsz) * BN;
}
// A float32 rounded to TF32 (to nearest, 10 mantissa bits), as a bit pattern.
__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
// TF32 keeps float32's sign, exponent and top 10 mantissa bits: the low 13 are dropped.
constexpr unsigned TF32_MASK = 0xffffe000u;
// 3xTF32's split of fp32 bits x ~ big + small, both halves rounded to nearest TF32:
// |small| is at most half an ulp of big, so the pair carries ~22 bits and x - big - small
// is ~2^-23 x, and small takes either sign. (With big the raw bits, truncated, every
// small has x's sign: where both operands' are so, the dropped small * small takes
// ~2^-22 of every product the same way.) big is rounded by integer ops, cvt.rna's
// rounding for finite x: a second cvt.rna cost the wgmma kernel 4-7% (H200), these
// nothing measurable. (A NaN stays NaN in small, even where big wraps to 0; values
// within half a TF32 ulp of float32's maximum round to inf, as cvt.rna's do.)
__device__ __forceinline__ void split_tf32(unsigned x, unsigned& big, unsigned& small) {
  big = (x + 0x1000u) & TF32_MASK;  // (+ half the dropped bits' unit: to nearest)
  small = to_tf32(__uint_as_float(x) - __uint_as_float(big));
}

template <typename T> struct is_bf16 { static constexpr bool value = false; };
template <> struct is_bf16<bf16_t> { static constexpr bool value = true; };
