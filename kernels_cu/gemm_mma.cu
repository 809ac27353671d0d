// gemm_mma.cu: the mma.sync tensor-core GEMM (sm_80+). The contract: gemm.cuh.
#include "gemm.cuh"

// ---- mma.sync wrappers (sm_80+) ------------------------------------------------------
__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                        unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <bool BF16>
__device__ __forceinline__ void mma_16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if (BF16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two fp32 (bit patterns) -> packed bf16x2, `lo` in the low half (the smaller K slot).
__device__ __forceinline__ unsigned pack_bf16(unsigned lo, unsigned hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(__uint_as_float(hi)), "f"(__uint_as_float(lo)));
  return r;
}

// 3xTF32 promotion in gemm_mma, with a centred tensor-core sum. mma.sync truncates its
// addends toward zero at the scale of the running sum, so where the products share a
// sign the sum drifts one way (1.9x SGEMM's error at K ~ 3000 on same-sign data). Each K
// slice therefore starts its sum at -h, h = pro * c ~ half the slice's expected sum
// (c = 0.5 / slices so far): the running sum crosses zero mid-slice, so its magnitude
// and drift halve and the drift takes both signs (measured on H100: 25x less bias, 1.35x
// SGEMM's max error instead of 1.9x, for 7% of the kernel's speed). h is recomputed bit-identically when the slice is added to `pro`, clamped
// to a finite value so that an inf/nan in `pro` never meets its own negation.
__device__ __forceinline__ float centre(float pro, float c) {
  return fminf(fmaxf(pro * c, -3.402823466e38f), 3.402823466e38f);
}
__device__ __forceinline__ float centre_scale(int slice) { return slice > 0 ? 0.5f / slice : 0.f; }
// pro += the slice sum held in acc (which started at -centre(pro, c)); acc restarts at
// the next slice's -h.
template <int N>
__device__ __forceinline__ void promote_centred(float (&pro)[N], float (&acc)[N], float c, float c_next) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    pro[i] += acc[i] + centre(pro[i], c);
    acc[i] = -centre(pro[i], c_next);
  }
}

// ---- tensor-core kernel ------------------------------------------------------------
// The launch constants BM, BN, THREADS, STAGES and the dynamic smem size SMEM are
// template parameters of gemm_mma, defined once in Python (gemm.py); the kernel checks
// them against what its warp layout needs. Only derived constants live here.
namespace mma_cfg {
constexpr int KB = 128;                 // bytes of K per row and stage
constexpr int ROW = KB + 16;            // padded smem row: ldmatrix/cp.async conflict-free
template <int BM, int BN> constexpr int TILE = (BM + BN) * ROW;  // bytes per stage
}  // namespace mma_cfg

// Load one BM x KB (resp. BN x KB) slice of A (resp. B) into smem stage `dst`.
// ALIGNED: rows are 16-byte aligned and K is a multiple of a 16-byte chunk, so each
// chunk is wholly in or out of bounds; else element loads with zero padding.
template <typename T, bool ALIGNED, int ROWS, int THREADS>
__device__ __forceinline__ void load_slice(unsigned dst, const T* __restrict__ g, long long ld,
                                           int rows_left, int k0, int K) {
  using namespace mma_cfg;
  constexpr int EPC = 16 / sizeof(T), CHUNKS = ROWS * KB / 16;
  static_assert(CHUNKS % THREADS == 0, "load_slice: every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < CHUNKS / THREADS; ++i) {
    const int c = threadIdx.x + i * THREADS, r = c / (KB / 16), kc = c % (KB / 16);
    const int k = k0 + kc * EPC;
    const unsigned d = dst + r * ROW + kc * 16;
    const T* src = g + (long long)r * ld + k;
    if (ALIGNED) {
      const bool ok = r < rows_left && k < K;
      cp_async16(d, ok ? src : g, ok ? 16 : 0);
    } else {
      Vec16<T> v;
      v.u = make_uint4(0, 0, 0, 0);
      if (r < rows_left)
#pragma unroll
        for (int e = 0; e < EPC; ++e)
          if (k + e < K) v.e[e] = src[e];
      asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(d), "r"(v.u.x), "r"(v.u.y),
                   "r"(v.u.z), "r"(v.u.w));
    }
  }
}

// A transposed (M- or N-contiguous) 16-bit slice: element (r, k) at g[k*ld + r] (no
// 4-byte cp.async can split a pair of halves across rows). Each thread gathers its
// 16-byte chunks into registers (a warp's lanes take consecutive r, so every
// load instruction reads consecutive addresses), and later stores them into the same
// K-major smem layout as load_slice, so the MMA code does not see the layout. Any
// alignment; out-of-bounds elements are zeros.
template <typename T, int ROWS, int THREADS>
struct TransposedSlice {
  static constexpr int EPC = 16 / sizeof(T), CHUNKS = ROWS * mma_cfg::KB / 16;
  static_assert(CHUNKS % THREADS == 0, "TransposedSlice: every thread gathers the same number of chunks");
  Vec16<T> v[CHUNKS / THREADS];
  __device__ __forceinline__ void gather(const T* __restrict__ g, long long ld, int rows_left,
                                         int k0, int K) {
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
      const int c = threadIdx.x + i * THREADS, r = c % ROWS, k = k0 + (c / ROWS) * EPC;
      v[i].u = make_uint4(0, 0, 0, 0);
      if (r < rows_left)
#pragma unroll
        for (int e = 0; e < EPC; ++e)
          if (k + e < K) v[i].e[e] = g[(long long)(k + e) * ld + r];
    }
  }
  __device__ __forceinline__ void store(unsigned dst) const {
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
      const int c = threadIdx.x + i * THREADS;
      const unsigned d = dst + (c % ROWS) * mma_cfg::ROW + (c / ROWS) * 16;
      asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(d), "r"(v[i].u.x), "r"(v[i].u.y),
                   "r"(v[i].u.z), "r"(v[i].u.w));
    }
  }
};

// BM x BN block tile, THREADS threads, STAGES-deep cp.async ring in SMEM bytes of
// dynamic shared memory: SMEM == STAGES * (BM + BN) * (128 + 16). TA / TB: A / B are
// transposed (M- / N-contiguous); ALIGNED then refers to the K-contiguous operand only.
// A transposed 16-bit operand's next slice is gathered into registers before the
// current slice's MMAs and stored to smem after them, so its loads overlap the math.
template <typename T, int MODE, bool ALIGNED, bool TA, bool TB, int BM, int BN, int THREADS,
          int STAGES, int SMEM>
__global__ void __launch_bounds__(THREADS, 1)
gemm_mma(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, int M, int N, int K,
         int kchunk, long long lda, long long ldb, long long ldc, const T* __restrict__ bias,
         const float* __restrict__ alpha, const float* __restrict__ beta, float* __restrict__ part) {
  using namespace mma_cfg;
  constexpr int TILE = mma_cfg::TILE<BM, BN>;
  // The warp layout is fixed: 8 warps as 2 (M) x 4 (N) warp tiles of 64 x 32.
  static_assert(THREADS == 256, "gemm_mma: the warp layout needs THREADS == 256 (8 warps, 2 x 4)");
  static_assert(BM == 128 && BN == 128, "gemm_mma: the 2 x 4 warps of 64 x 32 cover BM == BN == 128");
  static_assert(SMEM == STAGES * TILE, "gemm_mma: SMEM must be STAGES * (BM + BN) * (128 + 16)");
  static_assert((2 * 16 * (BN + 8) + 16) * 4 <= SMEM, "gemm_mma: the statistics slots reuse the ring");
  static_assert(MODE >= 0 && MODE <= 3, "gemm_mma: MODE is 0..3");
  static_assert((MODE == 3) == (sizeof(T) == 2), "gemm_mma: MODE 3 is for 16-bit T, 0..2 for float");
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp & 1, wn = warp >> 1;  // warp tile: rows wm*64.., cols wn*32..
  split_k<TA, TB>(a, b, c, M, K, lda, ldb, ldc, kchunk);

  int m0, n0;
  grouped_tile<BM, BN>(M, N, m0, n0);
  const T* ga = a + (TA ? m0 : (long long)m0 * lda);
  const T* gb = b + (TB ? n0 : (long long)n0 * ldb);

  constexpr int KS = KB / sizeof(T);  // K elements per stage
  const int ktiles = (K + KS - 1) / KS;
  const unsigned s0 = smem_addr(smem);
  // Stage kt: cp.async (or element loads) of the K-contiguous operands; transposed ones
  // by 4-byte cp.async (float) or register gathers that `store` puts in place (16-bit).
  constexpr bool GA = TA && sizeof(T) == 2, GB = TB && sizeof(T) == 2;
  TransposedSlice<T, BM, THREADS> ta;  // (unused unless GA / GB)
  TransposedSlice<T, BN, THREADS> tb;
  const auto padded = [](int r, int k) { return (unsigned)(r * ROW + k * 4); };
  auto load = [&](int kt) {
    const unsigned st = s0 + (kt % STAGES) * TILE;
    if constexpr (GA) ta.gather(ga, lda, M - m0, kt * KS, K);
    else if constexpr (TA) load_transposed<BM, THREADS>(st, (const float*)ga, lda, M - m0, kt * KS, K, tid, padded);
    else load_slice<T, ALIGNED, BM, THREADS>(st, ga, lda, M - m0, kt * KS, K);
    if constexpr (GB) tb.gather(gb, ldb, N - n0, kt * KS, K);
    else if constexpr (TB) load_transposed<BN, THREADS>(st + BM * ROW, (const float*)gb, ldb, N - n0, kt * KS, K, tid, padded);
    else load_slice<T, ALIGNED, BN, THREADS>(st + BM * ROW, gb, ldb, N - n0, kt * KS, K);
  };
  auto store = [&](int kt) {
    const unsigned st = s0 + (kt % STAGES) * TILE;
    if constexpr (GA) ta.store(st);
    if constexpr (GB) tb.store(st + BM * ROW);
  };

  // ldmatrix row addresses (bytes within a stage): A m16 tile i at + i*16*ROW,
  // B pair of n8 tiles p at + p*16*ROW; K step ks at + ks*32.
  const unsigned a_off = (wm * 64 + (lane & 15)) * ROW + (lane >> 4) * 16;
  const unsigned b_off = BM * ROW + (wn * 32 + (lane & 7) + ((lane >> 4) << 3)) * ROW + ((lane >> 3) & 1) * 16;

  float acc[4][4][4], pro[4][4][4];  // tensor-core sums; fp32 promotion target (MODE 0)
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = pro[i][j][e] = 0.f;

  ring_mainloop<STAGES, GA || GB>(ktiles, load, store, [&](int kt) {
    const unsigned st = s0 + (kt % STAGES) * TILE;
    if (MODE == 2) {
      // Two tf32-layout steps (16 floats of K) feed one bf16 m16n8k16 MMA: slots
      // (2t, 2t+1) take k = t, t+4 of step 0 and (2t+8, 2t+9) the same of step 1.
      // Any K permutation is fine as long as A and B use the same one.
#pragma unroll
      for (int ks = 0; ks < KB / 32; ks += 2) {
        unsigned fa[2][4][4], fb[2][4][2], pa[4][4], pb[4][2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int i = 0; i < 4; ++i)
            ldsm_x4(st + a_off + i * 16 * ROW + (ks + h) * 32, fa[h][i][0], fa[h][i][1], fa[h][i][2], fa[h][i][3]);
#pragma unroll
          for (int p = 0; p < 2; ++p)
            ldsm_x4(st + b_off + p * 16 * ROW + (ks + h) * 32, fb[h][2 * p][0], fb[h][2 * p][1],
                    fb[h][2 * p + 1][0], fb[h][2 * p + 1][1]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          pa[i][0] = pack_bf16(fa[0][i][0], fa[0][i][2]);
          pa[i][1] = pack_bf16(fa[0][i][1], fa[0][i][3]);
          pa[i][2] = pack_bf16(fa[1][i][0], fa[1][i][2]);
          pa[i][3] = pack_bf16(fa[1][i][1], fa[1][i][3]);
          pb[i][0] = pack_bf16(fb[0][i][0], fb[0][i][1]);
          pb[i][1] = pack_bf16(fb[1][i][0], fb[1][i][1]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) mma_16<true>(acc[i][j], pa[i], pb[j][0], pb[j][1]);
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < KB / 32; ++ks) {
        unsigned fa[4][4], fb[4][2];
#pragma unroll
        for (int i = 0; i < 4; ++i)
          ldsm_x4(st + a_off + i * 16 * ROW + ks * 32, fa[i][0], fa[i][1], fa[i][2], fa[i][3]);
#pragma unroll
        for (int p = 0; p < 2; ++p)
          ldsm_x4(st + b_off + p * 16 * ROW + ks * 32, fb[2 * p][0], fb[2 * p][1], fb[2 * p + 1][0],
                  fb[2 * p + 1][1]);
        if (MODE == 0) {
          unsigned sa[4][4], sb[4][2];
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) split_tf32(fa[i][e], fa[i][e], sa[i][e]);
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) split_tf32(fb[j][e], fb[j][e], sb[j][e]);
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {  // small products first, then big*big
              mma_tf32(acc[i][j], sa[i], fb[j][0], fb[j][1]);
              mma_tf32(acc[i][j], fa[i], sb[j][0], sb[j][1]);
              mma_tf32(acc[i][j], fa[i], fb[j][0], fb[j][1]);
            }
        } else {
          if (MODE == 1) {  // round to TF32 as cuBLAS does (the tensor core would truncate)
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
              for (int e = 0; e < 4; ++e) fa[i][e] = to_tf32(__uint_as_float(fa[i][e]));
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
              for (int e = 0; e < 2; ++e) fb[j][e] = to_tf32(__uint_as_float(fb[j][e]));
          }
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              if (MODE == 1) mma_tf32(acc[i][j], fa[i], fb[j][0], fb[j][1]);
              else mma_16<is_bf16<T>::value>(acc[i][j], fa[i], fb[j][0], fb[j][1]);
            }
        }
      }
    }
    if (MODE == 0)  // promotion: at most 32 K products ever sum in the tensor core
      promote_centred(reinterpret_cast<float(&)[64]>(pro), reinterpret_cast<float(&)[64]>(acc),
                      centre_scale(kt), centre_scale(kt + 1));
  });
  float (&res)[4][4][4] = MODE == 0 ? pro : acc;
  store_fragments(res, c, M, N, ldc, m0, n0, bias, alpha, beta);
  if (part) {
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's smem is free for the statistics slots
    fragment_statistics<T, float, BM, BN>(res, smem, part, M, N, m0, n0);
  }
}
