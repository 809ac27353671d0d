// GemmScaleBatchNorm's backward passes over g and z (B = M rows, N columns); the two GEMMs
// that follow (dx = dz @ W, dW = dz^T @ x) are cupykern.gemm's.
// Training mode: with u = z - cm (cm: the batch mean of z), inv = 1/sqrt(var_y + eps),
// w = s*inv (so y-hat = w*u), S1 = sum_m g and S2 = sum_m g*u per column, the gradients are
//   d bn_bias = S1, d bn_weight = w*S2, d scale = gamma*eps*inv^3*S2 (= sum dy*(z + b):
//   sum dy is 0 and 1 - w^2 var_z = eps*inv^2), d gemm bias = sum dz = 0, and
//   dz = w*gamma*(g - S1/M - w^2*S2/M * u), which the two GEMMs take on.
// Eval mode (out = ca*z + cb, ca = c*s with c = gamma*inv, inv = 1/sqrt(running_var +
// eps)): with cm = 0, S2 = sum_m g*z, and S2b = S2 + b*S1,
//   d bn_bias = S1, d bn_weight = inv*(s*S2b - running_mean*S1), d scale = c*S2b,
//   d gemm bias = ca*S1, and dz = ca*g.
// Two ways to run them: up to a few hundred rows one launch (bn_grad_fused), which a small
// training step's host time wants; beyond, three (bn_grad_partials, bn_grad_coef or
// bn_grad_eval_coef, bn_grad_dz or, narrow, bn_grad_dz_rows), which spread the rows over
// the GPU. Vector gradient pointers may be null (not wanted); sums run in a fixed order
// (deterministic).
#include "common.cuh"
#include "stats.cuh"

// g and z of column n at rows r, r + step, ... (8 of them), 16 loads in flight (g has row
// stride ldg, z is contiguous). Rows from r1 on, and z where it is null, read as g = 0 and
// z = m: no term in any sum, and a dz that is not stored.
template <typename T, typename A>
__device__ __forceinline__ void load_rows8(const T* __restrict__ g, long long ldg,
                                           const T* __restrict__ z, int N, int n, unsigned r,
                                           unsigned r1, A m, A (&gv)[8], A (&zv)[8],
                                           unsigned step = 1) {
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const unsigned row = r + u * step;  // (unsigned: below 2**32 where M is near 2**31)
    const bool ok = row < r1;
    gv[u] = ok ? to_acc(g[(long long)row * ldg + n]) : (A)0;
    zv[u] = ok && z ? to_acc(z[(long long)row * N + n]) : m;
  }
}

// S1 += g, S2 += g*(z - m) over rows r0, r0 + step, ... below r1 of column n, in row order.
template <typename T, typename A>
__device__ __forceinline__ void grad_sums(const T* __restrict__ g, long long ldg,
                                          const T* __restrict__ z, int N, int n, unsigned r0,
                                          unsigned r1, A m, A& s1, A& s2, unsigned step = 1) {
  for (unsigned r = r0; r < r1; r += 8 * step) {
    A gv[8], zv[8];
    load_rows8(g, ldg, z, N, n, r, r1, m, gv, zv, step);
#pragma unroll
    for (int u = 0; u < 8; ++u) { s1 += gv[u]; s2 += gv[u] * (zv[u] - m); }
  }
}

// A column's S1, S2 over a run of rows or tiles (merged in combine_chunks' fixed tree).
template <typename A>
struct GradSums {
  A s1, s2;
  __device__ __forceinline__ void merge(const GradSums& b) { s1 += b.s1; s2 += b.s2; }
};

// Training mode: column n's vector gradients from its S1, S2 (d gemm bias is exactly 0), and
// dz's coefficients k = (w*gamma, S1/M, w^2*S2/M).
template <typename T, typename A>
__device__ __forceinline__ void train_grad(int n, A s1, A s2, int M, const T* __restrict__ scale,
                                           const T* __restrict__ gamma, const A* __restrict__ inv,
                                           double eps, T* dscale, T* dgamma, T* dbeta, T* dbias,
                                           A (&k)[3]) {
  const A iv = inv[n], gm = opt(gamma, n, (A)1), w = to_acc(scale[n]) * iv;
  if (dbeta) dbeta[n] = from_acc<T>(s1);
  if (dgamma) dgamma[n] = from_acc<T>(w * s2);
  // (products ordered so that no partial one leaves the range the result is in)
  if (dscale) dscale[n] = from_acc<T>(gm * ((A)eps * (iv * (iv * (iv * s2)))));
  if (dbias) dbias[n] = from_acc<T>((A)0);
  k[0] = w * gm;
  k[1] = s1 / (A)M;
  k[2] = w * (w * s2) / (A)M;
}

// Eval mode: column n's vector gradients from its S1, S2 (= sum g*z) and the forward's ca, inv.
template <typename T, typename A>
__device__ __forceinline__ void eval_grad(int n, A s1, A s2, const T* __restrict__ bias,
                                          const T* __restrict__ scale, const T* __restrict__ gamma,
                                          const T* __restrict__ rmean, const A* __restrict__ ca,
                                          const A* __restrict__ inv, T* dscale, T* dgamma,
                                          T* dbeta, T* dbias) {
  const A iv = inv[n], s2b = s2 + opt(bias, n, (A)0) * s1;
  if (dbeta) dbeta[n] = from_acc<T>(s1);
  if (dgamma) dgamma[n] = from_acc<T>(iv * (to_acc(scale[n]) * s2b - to_acc(rmean[n]) * s1));
  if (dscale) dscale[n] = from_acc<T>(opt(gamma, n, (A)1) * iv * s2b);
  if (dbias) dbias[n] = from_acc<T>(ca[n] * s1);
}

template <typename T, typename A>
__device__ __forceinline__ T dz_of(A k0, A k1, A k2, A m, A g, A z) {
  return from_acc<T>(k0 * (g - k1 - k2 * (z - m)));
}

// ---- one launch: a block owns COLS = 32 columns (a lane each) and every row --------------
// Its WARPS warps take 32-row chunks in turn (warp w: chunks w, w + WARPS, ...). Each sums
// its chunks' S1, S2 in row order; warp 0 adds the warps' sums in warp order, writes the
// vector gradients and dz's coefficients (eval: k = (ca, 0, 0)); then each warp writes its
// chunks of dz (contiguous (M, N)) and, through a 32 x 32 tile in shared memory, of its
// transpose dzt (contiguous (N, M)) in runs of 32 rows; either may be null (not wanted).
// cm: the forward's column means (eval: zeros). Grid cdiv(N, COLS), block COLS * WARPS.
template <typename T, bool TRAIN, int COLS, int WARPS>
__global__ void __launch_bounds__(COLS * WARPS)
bn_grad_fused(const T* __restrict__ g, long long ldg, const T* __restrict__ z, int M, int N,
              const typename acc_of<T>::type* __restrict__ cm, const T* __restrict__ bias,
              const T* __restrict__ scale, const T* __restrict__ gamma,
              const T* __restrict__ rmean, const typename acc_of<T>::type* __restrict__ ca,
              const typename acc_of<T>::type* __restrict__ inv, double eps,
              T* __restrict__ dscale, T* __restrict__ dgamma, T* __restrict__ dbeta,
              T* __restrict__ dbias, T* __restrict__ dz, T* __restrict__ dzt) {
  constexpr int CH = COLS;  // (a warp's lanes: its columns, and the rows of its chunks)
  static_assert(COLS == 32, "bn_grad_fused: COLS is a warp's lanes");
  static_assert(WARPS >= 1 && WARPS <= 32, "bn_grad_fused: 1 to 32 warps");
  static_assert(WARPS * CH * (CH + 1) * sizeof(T) <= 40 * 1024, "bn_grad_fused: the warps' tiles fit static shared memory");
  typedef typename acc_of<T>::type A;
  __shared__ A sums[2][WARPS][CH];
  __shared__ A coef[3][CH];
  __shared__ T tile[WARPS][CH][CH + 1];  // (+1: the transposed reads are conflict-free)
  const int lane = threadIdx.x % CH, w = threadIdx.x / CH;
  const int n0 = blockIdx.x * CH, n = n0 + lane, cols = min(CH, N - n0);
  const bool col = n < N;
  const A m = col ? cm[n] : (A)0;
  A s1 = 0, s2 = 0;
  for (int c = w * CH; col && c < M; c += WARPS * CH) grad_sums(g, ldg, z, N, n, c, min(M, c + CH), m, s1, s2);
  sums[0][w][lane] = s1;
  sums[1][w][lane] = s2;
  __syncthreads();
  if (w == 0) {
    A t1 = 0, t2 = 0, k[3] = {0, 0, 0};
    for (int i = 0; i < WARPS; ++i) { t1 += sums[0][i][lane]; t2 += sums[1][i][lane]; }
    if (col && TRAIN) train_grad(n, t1, t2, M, scale, gamma, inv, eps, dscale, dgamma, dbeta, dbias, k);
    if (col && !TRAIN) {
      eval_grad(n, t1, t2, bias, scale, gamma, rmean, ca, inv, dscale, dgamma, dbeta, dbias);
      k[0] = ca[n];
    }
    coef[0][lane] = k[0];
    coef[1][lane] = k[1];
    coef[2][lane] = k[2];
  }
  __syncthreads();
  const A k0 = coef[0][lane], k1 = coef[1][lane], k2 = coef[2][lane];
  for (int c = w * CH; c < M; c += WARPS * CH) {
    const int len = min(CH, M - c);
    for (int r = 0; col && r < len; r += 8) {
      A gv[8], zv[8];
      load_rows8(g, ldg, TRAIN ? z : nullptr, N, n, c + r, c + len, m, gv, zv);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (r + u < len) {
          const T d = dz_of<T>(k0, k1, k2, m, gv[u], zv[u]);
          if (dz) dz[(long long)(c + r + u) * N + n] = d;
          tile[w][r + u][lane] = d;
        }
      }
    }
    if (!dzt) continue;
    __syncwarp();
    for (int i = 0; i < cols && lane < len; ++i) dzt[(long long)(n0 + i) * M + c + lane] = tile[w][lane][i];
    __syncwarp();
  }
}

// ---- three launches: row tiles over the grid ---------------------------------------------

// Per (tile, column) partial S1, S2 into rows 2*tile, 2*tile + 1 of part (merged by
// bn_grad_coef in a fixed order: deterministic). g has row stride ldg, z is contiguous. A
// tile is RowSpot's (``lanes`` rows side by side where N is narrow, their sums then merged
// in combine_chunks' fixed tree; one column per thread); grid and block RowSpot's.
template <typename T, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_grad_partials(const T* __restrict__ g, long long ldg, const T* __restrict__ z, int M, int N,
                 int lanes, const typename acc_of<T>::type* __restrict__ cm,
                 typename acc_of<T>::type* __restrict__ part) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_grad_partials: THREADS must be whole warps, at most 1024");
  static_assert(ROWS % 8 == 0, "bn_grad_partials: ROWS is a multiple of the 8-row unroll");
  typedef typename acc_of<T>::type A;
  __shared__ GradSums<A> shared[THREADS];
  const RowSpot<THREADS, ROWS, 1> at(lanes, M);
  const int n = at.col;
  const A m = n < N ? cm[n] : (A)0;
  for (int t = blockIdx.y; t < at.tiles; t += gridDim.y) {  // (uniform: combine_chunks syncs)
    GradSums<A> s = {0, 0};
    if (n < N) grad_sums(g, ldg, z, N, n, at.r0(t), at.r1(t), m, s.s1, s.s2, lanes);
    if (combine_chunks<THREADS>(s, shared, lanes) && n < N) {
      part[2LL * t * N + n] = s.s1;
      part[(2LL * t + 1) * N + n] = s.s2;
    }
  }
}

// This thread's column n and its S1, S2 from bn_grad_partials' tiles, added in chunks of
// threads (ColumnChunk, in a fixed order: deterministic; one chunk adds them in tile
// order). Every thread of the block calls it; false where the thread holds no column's
// result. Grid cdiv(N, THREADS / chunks), block THREADS.
template <int THREADS, typename A>
__device__ __forceinline__ bool grad_column(const A* __restrict__ part, int tiles, int chunks,
                                            int N, int& n, A& s1, A& s2) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "grad_column: THREADS must be whole warps, at most 1024");
  __shared__ GradSums<A> shared[THREADS];
  const ColumnChunk ch(THREADS, chunks, tiles);
  GradSums<A> s = {0, 0};
  for (int t = ch.t0; ch.n < N && t < ch.t1; ++t) {
    s.s1 += part[2LL * t * N + ch.n];
    s.s2 += part[(2LL * t + 1) * N + ch.n];
  }
  if (!combine_chunks<THREADS>(s, shared, chunks) || ch.n >= N) return false;
  n = ch.n;
  s1 = s.s1;
  s2 = s.s2;
  return true;
}

// Training mode: merge the partials, write the vector gradients and dz's coefficients k in
// rows 0..2 (N apart).
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
bn_grad_coef(const typename acc_of<T>::type* __restrict__ part, int tiles, int chunks, int M, int N,
             const T* __restrict__ scale, const T* __restrict__ gamma,
             const typename acc_of<T>::type* __restrict__ inv, double eps,
             T* __restrict__ dscale, T* __restrict__ dgamma, T* __restrict__ dbeta,
             T* __restrict__ dbias, typename acc_of<T>::type* __restrict__ k) {
  typedef typename acc_of<T>::type A;
  int n;
  A s1, s2, kn[3];
  if (!grad_column<THREADS>(part, tiles, chunks, N, n, s1, s2)) return;
  train_grad(n, s1, s2, M, scale, gamma, inv, eps, dscale, dgamma, dbeta, dbias, kn);
  k[n] = kn[0];
  k[N + n] = kn[1];
  k[2LL * N + n] = kn[2];
}

// Eval mode: merge the partials (of S1 and S2 = sum g*z) and write the vector gradients.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
bn_grad_eval_coef(const typename acc_of<T>::type* __restrict__ part, int tiles, int chunks, int N,
                  const T* __restrict__ bias, const T* __restrict__ scale,
                  const T* __restrict__ gamma, const T* __restrict__ rmean,
                  const typename acc_of<T>::type* __restrict__ ca,
                  const typename acc_of<T>::type* __restrict__ inv,
                  T* __restrict__ dscale, T* __restrict__ dgamma, T* __restrict__ dbeta,
                  T* __restrict__ dbias) {
  typedef typename acc_of<T>::type A;
  int n;
  A s1, s2;
  if (!grad_column<THREADS>(part, tiles, chunks, N, n, s1, s2)) return;
  eval_grad(n, s1, s2, bias, scale, gamma, rmean, ca, inv, dscale, dgamma, dbeta, dbias);
}

// dz = k0*(g - k1 - k2*(z - cm)) (z null: k0*(g - k1), k2 and cm unread) into a contiguous
// (M, N) dz and/or its transpose, a contiguous (N, M) dzt (either pointer may be null:
// not wanted); g has row stride ldg.
// dzt is what dW = dz^T @ x reads K-major (no transposed copy). Each CH-row chunk of the
// block's (ROWS x THREADS) tile is staged in shared memory, transposed, and written as
// THREADS runs of CH elements of dzt: whole 16-byte vectors where M keeps them aligned.
// Grid and block as bn_grad_partials' at lanes = 1 (N past THREADS / 2 columns; a
// narrower N takes bn_grad_dz_rows).
template <typename T, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_grad_dz(const T* __restrict__ g, long long ldg, const T* __restrict__ z, int M, int N,
           const typename acc_of<T>::type* __restrict__ k,
           const typename acc_of<T>::type* __restrict__ cm, T* __restrict__ dz,
           T* __restrict__ dzt) {
  constexpr int CH = 32;  // rows of a staged chunk: 128-byte runs of float32 dzt
  // 16 bytes of padding per staged column: its 16-byte stores and loads are conflict-free
  constexpr int PAD = 16 / sizeof(T), LD = CH + PAD, V = CH * sizeof(T) / 16;
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_grad_dz: THREADS must be whole warps, at most 1024");
  static_assert(ROWS % CH == 0 && CH % 8 == 0, "bn_grad_dz: ROWS is a multiple of the 32-row chunk");
  static_assert((8 * sizeof(T)) % 16 == 0, "bn_grad_dz: 8 elements are whole 16-byte vectors");
  __shared__ __align__(16) T tile[THREADS * LD];
  typedef typename acc_of<T>::type A;
  const int n0 = blockIdx.x * THREADS, n = n0 + threadIdx.x, cols = min(THREADS, N - n0);
  const bool col = n < N;
  const A k0 = col ? k[n] : (A)0, k1 = col ? k[N + n] : (A)0;
  const A k2 = col && z ? k[2LL * N + n] : (A)0, m = col && z ? cm[n] : (A)0;
  const bool vec = ((long long)M * sizeof(T)) % 16 == 0;  // (chunks start 16-byte aligned)
  // A contiguous span of whole tiles per grid row: one tile each up to MAX_GRID_Y tiles.
  // (A loop over tiles y, y + gridDim.y, ... here took 10% longer at 100000x512 float32.)
  const unsigned tiles = row_tiles(M, ROWS);
  const int span = tiles <= gridDim.y ? ROWS : (int)((tiles + gridDim.y - 1) / gridDim.y * ROWS);
  // (unsigned rows: a row index plus a chunk stays below 2**32 where M is near 2**31)
  const unsigned r0 = (unsigned)min((long long)M, (long long)blockIdx.y * span);
  const unsigned r1 = (unsigned)min((long long)M, (long long)r0 + span);
  for (unsigned c = r0; c < r1; c += CH) {
    const int len = (int)min((unsigned)CH, r1 - c);
    for (unsigned r = c; col && r < c + len; r += 8) {
      A gv[8], zv[8];
      load_rows8(g, ldg, z, N, n, r, r1, m, gv, zv);  // (z null: no term)
      union { T t[8]; uint4 v[8 * sizeof(T) / 16]; } d;
#pragma unroll
      for (int u = 0; u < 8; ++u) d.t[u] = dz_of<T>(k0, k1, k2, m, gv[u], zv[u]);
      if (dz) {
#pragma unroll
        for (int u = 0; u < 8; ++u)
          if (r + u < r1) dz[(long long)(r + u) * N + n] = d.t[u];
      }
      if (dzt) {
        uint4* staged = reinterpret_cast<uint4*>(tile + threadIdx.x * LD + (r - c));
#pragma unroll
        for (int i = 0; i < 8 * (int)sizeof(T) / 16; ++i) staged[i] = d.v[i];
      }
    }
    if (!dzt) continue;  // (uniform: the block's barriers below)
    __syncthreads();
    if (vec && len == CH) {  // consecutive threads: consecutive vectors of a run
      for (int i = threadIdx.x; i < cols * V; i += THREADS)
        reinterpret_cast<uint4*>(dzt + (long long)(n0 + i / V) * M + c)[i % V] =
            reinterpret_cast<const uint4*>(tile + (i / V) * LD)[i % V];
    } else {
      for (int i = threadIdx.x; i < cols * len; i += THREADS)
        dzt[(long long)(n0 + i / len) * M + c + i % len] = tile[(i / len) * LD + i % len];
    }
    __syncthreads();
  }
}

// bn_grad_dz for a narrow N: ``lanes`` rows side by side (RowSpot, as bn_grad_partials),
// dz and dzt stored directly (a warp's threads of one column hold consecutive rows: runs of
// dzt without staging). (bn_grad_dz's one column per thread kept 2 of 128 threads busy at
// N = 2: 550 us at 4194305x3->2 float32 on an H200, eager's whole backward 770.)
template <typename T, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_grad_dz_rows(const T* __restrict__ g, long long ldg, const T* __restrict__ z, int M, int N,
                int lanes, const typename acc_of<T>::type* __restrict__ k,
                const typename acc_of<T>::type* __restrict__ cm, T* __restrict__ dz,
                T* __restrict__ dzt) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_grad_dz_rows: THREADS must be whole warps, at most 1024");
  typedef typename acc_of<T>::type A;
  const RowSpot<THREADS, ROWS, 1> at(lanes, M);
  const int n = at.col;
  if (n >= N) return;
  const A k0 = k[n], k1 = k[N + n], k2 = z ? k[2LL * N + n] : (A)0, m = z ? cm[n] : (A)0;
  for (int t = blockIdx.y; t < at.tiles; t += gridDim.y) {
    for (unsigned r = at.r0(t), r1 = at.r1(t); r < r1; r += 8 * lanes) {
      A gv[8], zv[8];
      load_rows8(g, ldg, z, N, n, r, r1, m, gv, zv, lanes);  // (z null: no term)
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const unsigned row = r + u * lanes;
        if (row >= r1) break;
        const T d = dz_of<T>(k0, k1, k2, m, gv[u], zv[u]);
        if (dz) dz[(long long)row * N + n] = d;
        if (dzt) dzt[(long long)n * M + row] = d;
      }
    }
  }
}
