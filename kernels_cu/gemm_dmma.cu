// gemm_dmma.cu: float64 on the FP64 tensor cores through mma.sync (DMMA: sm_80, sm_90,
// sm_100). The contract: gemm.cuh.
#include "gemm.cuh"

// d += a @ b over 8 K of a 16 x 8 tile (m16n8k8's fragments: a = A(g, t), A(g+8, t),
// A(g, t+4), A(g+8, t+4); b = B(t, g), B(t+4, g); d = C(g, 2t), C(g, 2t+1), C(g+8, 2t),
// C(g+8, 2t+1); g = lane / 4, t = lane % 4). Hopper has the 16x8 shapes; sm_80 takes
// four m8n8k4 (rows g / g+8, K t / t+4), whose fragments are the same elements.
__device__ __forceinline__ void dmma_k8(double (&d)[4], const double (&a)[4], const double (&b)[2]) {
#if __CUDA_ARCH__ >= 900
  asm("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+d"(d[0]), "+d"(d[1]), "+d"(d[2]), "+d"(d[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
#else
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int q = 0; q < 2; ++q)
      asm("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
          : "+d"(d[2 * h]), "+d"(d[2 * h + 1]) : "d"(a[2 * q + h]), "d"(b[q]));
#endif
}

// One operand's K slice, ROWS x BK doubles, gathered into registers (a warp's loads
// read consecutive addresses) and later stored to its padded smem rows of LD doubles as
// 16-byte K pairs: a transposed (TR: element (r, k) at g[k*ld + r]) or misaligned
// K-contiguous operand, whose loads so overlap the MMAs. Out of bounds: zeros.
template <bool TR, int ROWS, int BK, int LD, int THREADS>
struct Gathered {
  static constexpr int PAIRS = ROWS * BK / 2 / THREADS;
  static_assert(ROWS * BK / 2 % THREADS == 0, "Gathered: every thread gathers the same number of K pairs");
  double2 v[PAIRS];
  __device__ __forceinline__ static void at(int i, int& r, int& kp) {
    const int c = threadIdx.x + i * THREADS;
    r = TR ? c % ROWS : c / (BK / 2);
    kp = TR ? c / ROWS : c % (BK / 2);
  }
  __device__ __forceinline__ void gather(const double* __restrict__ g, long long ld, int rows_left,
                                         int k0, int K) {
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      int r, kp;
      at(i, r, kp);
      const int k = k0 + 2 * kp;
      const bool in = r < rows_left;
      v[i].x = in && k < K ? g[TR ? (long long)k * ld + r : (long long)r * ld + k] : 0.0;
      v[i].y = in && k + 1 < K ? g[TR ? (long long)(k + 1) * ld + r : (long long)r * ld + k + 1] : 0.0;
    }
  }
  __device__ __forceinline__ void store(unsigned dst) const {
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) {
      int r, kp;
      at(i, r, kp);
      asm volatile("st.shared.v2.f64 [%0], {%1,%2};" ::"r"(dst + (r * LD + 2 * kp) * 8), "d"(v[i].x), "d"(v[i].y));
    }
  }
};

// A 16-byte aligned K-contiguous slice by cp.async: K pairs wholly in or out of bounds
// (K even).
template <int ROWS, int BK, int LD, int THREADS>
__device__ __forceinline__ void copy_slice(unsigned dst, const double* __restrict__ g, long long ld,
                                           int rows_left, int k0, int K) {
  static_assert(ROWS * BK / 2 % THREADS == 0, "copy_slice: every thread copies the same number of K pairs");
#pragma unroll
  for (int i = 0; i < ROWS * BK / 2 / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS, r = c / (BK / 2), k = k0 + 2 * (c % (BK / 2));
    const bool ok = r < rows_left && k < K;
    cp_async16(dst + (r * LD + k - k0) * 8, ok ? g + (long long)r * ld + k : g, ok ? 16 : 0);
  }
}

// BM x BN block tile, THREADS threads (8 warps as 2 (M) x 4 (N) warp tiles of 64 x 32),
// STAGES-deep ring of BK-deep K slices in SMEM bytes of dynamic shared memory: rows of
// BK + 8 doubles, so that the 16-byte fragment loads (lanes g, t: K pair t of rows g,
// g+8) hit distinct banks in each quarter warp. A K pair (2t, 2t+1) of an 8-wide K step
// feeds m16n8k8's K slots t and t+4 of A and B alike (any K permutation shared by A and
// B gives the same product). TA / TB / ALIGNED as in gemm_mma: K-contiguous aligned
// operands come by cp.async, the others through registers.
template <bool TA, bool TB, bool ALIGNED, int BM, int BN, int THREADS, int STAGES, int BK, int SMEM>
__global__ void __launch_bounds__(THREADS, 1)
gemm_dmma(const double* __restrict__ a, const double* __restrict__ b, double* __restrict__ c, int M, int N,
          int K, int kchunk, long long lda, long long ldb, long long ldc, const double* __restrict__ bias,
          const double* __restrict__ alpha, const double* __restrict__ beta, double* __restrict__ part) {
  constexpr int LD = BK + 8, TILE = (BM + BN) * LD * 8;  // bytes per stage
  static_assert(THREADS == 256 && BM == 128 && BN == 128, "gemm_dmma: 2 x 4 warps of 64 x 32 cover 128 x 128");
  static_assert(BK % 8 == 0, "gemm_dmma: whole 8-wide K steps");
  static_assert(SMEM == STAGES * TILE, "gemm_dmma: SMEM must be STAGES * (BM + BN) * (BK + 8) * 8");
  static_assert((2 * 16 * (BN + 8) + 16) * 8 <= SMEM, "gemm_dmma: the statistics slots reuse the ring");
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wm = warp & 1, wn = warp >> 1, g = lane >> 2, t = lane & 3;
  split_k<TA, TB>(a, b, c, M, K, lda, ldb, ldc, kchunk);
  int m0, n0;
  grouped_tile<BM, BN>(M, N, m0, n0);
  const double* ga = a + (TA ? m0 : (long long)m0 * lda);
  const double* gb = b + (TB ? n0 : (long long)n0 * ldb);

  constexpr bool GA = TA || !ALIGNED, GB = TB || !ALIGNED;  // through registers
  Gathered<TA, BM, BK, LD, THREADS> ra;  // (unused unless GA / GB)
  Gathered<TB, BN, BK, LD, THREADS> rb;
  const unsigned s0 = smem_addr(smem);
  const int ktiles = (K + BK - 1) / BK;
  auto load = [&](int kt) {
    const unsigned st = s0 + (kt % STAGES) * TILE;
    if constexpr (GA) ra.gather(ga, lda, M - m0, kt * BK, K);
    else copy_slice<BM, BK, LD, THREADS>(st, ga, lda, M - m0, kt * BK, K);
    if constexpr (GB) rb.gather(gb, ldb, N - n0, kt * BK, K);
    else copy_slice<BN, BK, LD, THREADS>(st + BM * LD * 8, gb, ldb, N - n0, kt * BK, K);
  };
  auto store = [&](int kt) {
    const unsigned st = s0 + (kt % STAGES) * TILE;
    if constexpr (GA) ra.store(st);
    if constexpr (GB) rb.store(st + BM * LD * 8);
  };

  double acc[4][4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0;
  // Fragment rows (bytes within a stage): A tile i rows wm*64 + i*16 + g (+8), B tile j
  // rows BM + wn*32 + j*8 + g; K pair t.
  const unsigned a_off = ((wm * 64 + g) * LD + 2 * t) * 8, b_off = ((BM + wn * 32 + g) * LD + 2 * t) * 8;

  ring_mainloop<STAGES, GA || GB>(ktiles, load, store, [&](int kt) {
    const unsigned st = s0 + (kt % STAGES) * TILE;
#pragma unroll
    for (int ks = 0; ks < BK; ks += 8) {
      double fa[4][4], fb[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          asm volatile("ld.shared.v2.f64 {%0,%1}, [%2];" : "=d"(fa[i][h]), "=d"(fa[i][h + 2])
                       : "r"(st + a_off + ((i * 16 + h * 8) * LD + ks) * 8));
#pragma unroll
      for (int j = 0; j < 4; ++j)
        asm volatile("ld.shared.v2.f64 {%0,%1}, [%2];" : "=d"(fb[j][0]), "=d"(fb[j][1])
                     : "r"(st + b_off + (j * 8 * LD + ks) * 8));
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) dmma_k8(acc[i][j], fa[i], fb[j]);
    }
  });

  store_fragments(acc, c, M, N, ldc, m0, n0, bias, alpha, beta);
  if (part) {
    cp_async_wait<0>();
    __syncthreads();  // the ring is free for the statistics slots
    fragment_statistics<double, double, BM, BN>(acc, smem, part, M, N, m0, n0);
  }
}
