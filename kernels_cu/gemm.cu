// gemm.cu: the CUDA-core GEMM (float64, and every dtype below sm_80), split K's
// second pass and the operand copy (transposed or padded rows, any arch). The kernels' contract:
// gemm.cuh.
#include "gemm.cuh"

// Split K's second pass: c = epilogue(sum of the S slabs of ws (M x N each, of type W:
// split K's are of the accumulation type A), in slab order), rounded to T. A block is
// COLS columns (a warp) by THREADS / COLS row groups of ROWS rows each (a tile of BM =
// THREADS / COLS * ROWS rows: many threads with few rows each keep enough loads in
// flight). If `part`, each column's (mean, M2, min, max) over the tile's rows of the sum
// before the epilogue rounded to T, as the GEMM kernels compute them, merged in group
// order. The same pass with W == T, S == 1 and no c gives the statistics of a product
// made elsewhere (the vendor's z of a fused op, read as stored).
template <typename T, typename W, int THREADS, int ROWS, int COLS>
__global__ void __launch_bounds__(THREADS)
splitk_reduce(const W* __restrict__ ws, int S, int M, int N, T* __restrict__ c, long long ldc,
              const T* __restrict__ bias, const typename acc_of<T>::type* __restrict__ alpha,
              const typename acc_of<T>::type* __restrict__ beta, typename acc_of<T>::type* __restrict__ part) {
  typedef typename acc_of<T>::type A;  // (T itself for float32 / float64)
  static_assert(sizeof(W) == sizeof(T) || sizeof(W) == sizeof(A), "splitk_reduce: slabs of T or of A");
  static_assert(COLS == 32, "splitk_reduce: a warp spans the block's columns (coalesced slab rows)");
  static_assert(THREADS % COLS == 0 && THREADS <= 1024 && ROWS >= 1, "splitk_reduce: whole warps, a row or more");
  constexpr int GROUPS = THREADS / COLS;
  __shared__ A s_mean[GROUPS * COLS], s_m2[GROUPS * COLS], s_cnt[GROUPS];
  const int col = threadIdx.x % COLS, grp = threadIdx.x / COLS;
  const int n = blockIdx.x * COLS + col, m0 = blockIdx.y * GROUPS * ROWS + grp * ROWS;
  const long long slab = (long long)M * N;
  A v[ROWS];
  bool valid[ROWS];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    valid[i] = n < N && m0 + i < M;
    v[i] = 0;
  }
  const W* p = ws + (long long)m0 * N + n;
#pragma unroll 4
  for (int z = 0; z < S; ++z, p += slab)  // 4 * ROWS independent loads in flight
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
      if (valid[i]) v[i] += to_acc(p[(long long)i * N]);
  if (c) {
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
      if (valid[i]) c[(long long)(m0 + i) * ldc + n] = from_acc<T>(epilogue(v[i], n, bias, alpha, beta));
  }
  if (!part) return;
#pragma unroll
  for (int i = 0; i < ROWS; ++i) v[i] = to_acc(from_acc<T>(v[i]));  // the sums as stored in T
  for (int range = 0; range < 2; ++range) {  // (mean, M2), then (min, max), same slots
    A cnt, a, b;
    if (range) local_range(v, valid, a, b);
    else local_stats(v, valid, cnt, a, b);
    s_mean[grp * COLS + col] = a;
    s_m2[grp * COLS + col] = b;
    if (!range && col == 0) s_cnt[grp] = max(0, min(ROWS, M - m0));
    __syncthreads();
    if (range) merge_range<A, GROUPS, COLS>(s_mean, s_m2, part, threadIdx.x, blockIdx.y, blockIdx.x * COLS, N);
    else merge_slots<A, GROUPS, COLS>(s_mean, s_m2, s_cnt, part, threadIdx.x, blockIdx.y, blockIdx.x * COLS, N);
    __syncthreads();
  }
}

// ---- CUDA-core kernel (float64) ----------------------------------------------------
// Offset of element (row r, k) of an operand: K-contiguous rows, or transposed (TR).
template <bool TR> __device__ __forceinline__ long long at(int r, int k, long long ld) {
  return TR ? (long long)k * ld + r : (long long)r * ld + k;
}

// TILE x TILE (64x64) tile, THREADS = 16x16 threads, each computes rows ty + 16*i and
// columns tx + 16*j. TA / TB: A / B transposed, as in gemm_mma.
template <typename T, bool TA, bool TB, int TILE, int THREADS>
__global__ void __launch_bounds__(THREADS)
gemm_simple(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c, int M, int N, int K,
            int kchunk, long long lda, long long ldb, long long ldc, const T* __restrict__ bias,
            const typename acc_of<T>::type* __restrict__ alpha,
            const typename acc_of<T>::type* __restrict__ beta, typename acc_of<T>::type* __restrict__ part) {
  static_assert(THREADS == 256, "gemm_simple: the thread mapping is 16 x 16 threads");
  static_assert(TILE == 64, "gemm_simple: 16 x 16 threads of 4 x 4 outputs cover a 64 x 64 tile");
  typedef typename acc_of<T>::type A;
  constexpr int TS = TILE, KT = 16;
  static_assert(4 * THREADS == TS * KT, "gemm_simple: 4 loads per thread fill a TILE x 16 slice");
  __shared__ A sm[2 * KT * (TS + 1)];  // [k][m] tiles of A and B; later the stats slots
  A* sa = sm;
  A* sb = sm + KT * (TS + 1);
  split_k<TA, TB>(a, b, c, M, K, lda, ldb, ldc, kchunk);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  // One block per tile, m-major over a 1-D grid (a grid's y would hold only 65535 tiles of N)
  const int mtiles = (int)(((unsigned)M + TS - 1) / TS), mt = blockIdx.x % mtiles, m0 = mt * TS;
  const int n0 = blockIdx.x / mtiles * TS;
  A acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += KT) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      // Consecutive threads take consecutive k (K-contiguous operand) or rows (transposed).
      const int e = threadIdx.x + THREADS * q;
      const int ra = TA ? e % TS : e / KT, ka = TA ? e / TS : e % KT;
      const int rb = TB ? e % TS : e / KT, kb = TB ? e / TS : e % KT;
      sa[ka * (TS + 1) + ra] = (m0 + ra < M && k0 + ka < K) ? to_acc(a[at<TA>(m0 + ra, k0 + ka, lda)]) : (A)0;
      sb[kb * (TS + 1) + rb] = (n0 + rb < N && k0 + kb < K) ? to_acc(b[at<TB>(n0 + rb, k0 + kb, ldb)]) : (A)0;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < KT; ++k)
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += sa[k * (TS + 1) + ty + 16 * i] * sb[k * (TS + 1) + tx + 16 * j];
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = m0 + ty + 16 * i, col = n0 + tx + 16 * j;
      if (row < M && col < N) c[(long long)row * ldc + col] = from_acc<T>(epilogue(acc[i][j], col, bias, alpha, beta));
    }
  if (part) {  // slots = ty (16), columns = tx + 16*j (64); sm is free after the last sync
    A* s_mean = sm;
    A* s_m2 = sm + 16 * TS;
    A* s_cnt = s_m2 + 16 * TS;
    bool valid[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) valid[i] = m0 + ty + 16 * i < M;
    for (int range = 0; range < 2; ++range) {  // (mean, M2), then (min, max), same slots
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        A v[4], n, a, b;
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = to_acc(from_acc<T>(acc[i][j]));  // as stored in C
        if (range) local_range(v, valid, a, b);
        else local_stats(v, valid, n, a, b);
        s_mean[ty * TS + tx + 16 * j] = a;
        s_m2[ty * TS + tx + 16 * j] = b;
        if (!range && tx == 0 && j == 0) s_cnt[ty] = n;
      }
      __syncthreads();
      if (range) merge_range<A, 16, TS>(s_mean, s_m2, part, threadIdx.x, mt, n0, N);
      else merge_slots<A, 16, TS>(s_mean, s_m2, s_cnt, part, threadIdx.x, mt, n0, N);
      __syncthreads();
    }
  }
}

// ---- strided operand -> K-contiguous copy (rows of a chosen stride) -----------------
// dst (rows, cols) in rows of ldd >= cols elements, from src whose element (r, c) is at
// src[r * sr + c * sc]: a transposed view (sr == 1, sc its column stride: the GEMM's
// transposed-operand copy) or rows (sc == 1, sr their stride: rows that Hopper's TMA
// cannot read in place, float32 rows off 16-byte boundaries or with K % 4 != 0); any
// other strides copy correctly, read along r. Columns cols..ldd-1 of each row are
// written as zeros (gemm_operands.padded_ld: rows padded to 16 bytes for TMA, whose maps
// stop at cols, so that a reader of whole 16-byte chunks finds zeros there too). A TILE
// x TILE block is read along the contiguous side and written along c through smem
// (padded by one element: conflict-free columns either way), so both sides move whole
// 32-element segments; a strided elementwise copy (torch's / CuPy's) runs at a third of
// copy speed. One block per tile of (rows, ldd), tiles r-major over the grid's x; a stack
// of such matrices (gemm.py's stacks) takes blockIdx.y as the matrix, sbs / sbd elements
// apart in src / dst (0, 0 and a grid y of 1 for one matrix).
template <typename T, int TILE, int THREADS>
__global__ void __launch_bounds__(THREADS)
transpose_copy(const T* __restrict__ src, T* __restrict__ dst, long long rows, long long cols, long long sr,
               long long sc, long long ldd, long long sbs, long long sbd) {
  static_assert(TILE == 32, "transpose_copy: one warp spans a tile row");
  static_assert(THREADS % TILE == 0 && TILE % (THREADS / TILE) == 0,
                "transpose_copy: THREADS / TILE warps take every (THREADS / TILE)-th tile row");
  constexpr int STEP = THREADS / TILE;
  __shared__ T tile[TILE][TILE + 1];  // tile[c - c0][r - r0]
  src += blockIdx.y * sbs;
  dst += blockIdx.y * sbd;
  const long long tiles_r = (rows + TILE - 1) / TILE;
  const long long r0 = (long long)(blockIdx.x % tiles_r) * TILE, c0 = (long long)(blockIdx.x / tiles_r) * TILE;
  const int tx = threadIdx.x % TILE, ty = threadIdx.x / TILE;
  if (sc == 1) {  // rows contiguous: a warp reads along c (uniform branch)
#pragma unroll
    for (int i = ty; i < TILE; i += STEP)
      if (r0 + i < rows && c0 + tx < cols) tile[tx][i] = src[(r0 + i) * sr + c0 + tx];
  } else {  // columns contiguous (sr == 1): a warp reads along r
#pragma unroll
    for (int i = ty; i < TILE; i += STEP)
      if (r0 + tx < rows && c0 + i < cols) tile[i][tx] = src[(r0 + tx) * sr + (c0 + i) * sc];
  }
  __syncthreads();
  const T zero = from_acc<T>(0.f);
#pragma unroll
  for (int i = ty; i < TILE; i += STEP)
    if (r0 + i < rows && c0 + tx < ldd) dst[(r0 + i) * ldd + c0 + tx] = c0 + tx < cols ? tile[tx][i] : zero;
}
