// BatchNorm of y = s * (z + b), z = x @ W^T, as out = ca[n] * (z - cm[n]) + cb[n] (training)
// or out = ca[n] * z + cc[n] (eval, fused into the GEMM epilogue). Training subtracts the
// batch mean before scaling: folding it into cc would cancel catastrophically when the
// column's mean is large against its spread (tiny batches, offset data).
// T: parameter/buffer dtype; A: accumulation type (acc_of<T>). Any pointer among
// bias, gamma (bn weight), beta (bn bias) may be null (0, 1, 0).
#include "common.cuh"
#include "stats.cuh"

template <typename T, typename A>
__device__ __forceinline__ A opt(const T* p, int n, A dflt) { return p ? to_acc(p[n]) : dflt; }

// Training: merge the GEMM's per-M-tile (mean, M2, min, max) partials of z in tile order
// (Chan) into the coefficients (ca, cm, cb) of the VEC columns from col; with ``update``,
// also keep iv = 1/sqrt(var_y + eps) for the backward (where inv is not null) and update
// the running stats like BatchNorm1d: mean/var of y = s*mean(z + b), s^2*var(z);
// running_var takes the unbiased var. The VEC columns' merge chains are independent and
// run side by side: a thread's latency is one column's, not VEC's (bn_train_apply gives a
// thread a 16-byte vector of 16-bit columns: eight chains one after the other took 23 us
// at 64x512 bf16 on an H200, against 3 us for the GEMM). Each column's arithmetic and
// order do not depend on VEC, so bn_train_coef (VEC 1) gives the same bits.
// The reference forms y = s*(z + b) in T, rounding twice: where that overflows T in some
// row (checked at z's min and max, y being monotonic in z), its batch mean is +-inf (nan
// if both signs overflow) and its variance nan, so every output of the column is nan.
// factor nan means momentum=None: cumulative average 1/(num_batches_tracked + 1)
// (incremented by bn_apply, launched after bn_train_coef has read it).
template <typename T, int ROWS, int VEC, typename A = typename acc_of<T>::type>
__device__ __forceinline__ void
train_columns(int col, const A* __restrict__ part, int mtiles, int bm, int M, int N,
              const T* __restrict__ bias, const T* __restrict__ scale,
              const T* __restrict__ gamma, const T* __restrict__ beta,
              T* __restrict__ rmean, T* __restrict__ rvar, const long long* __restrict__ nbt,
              double factor, double eps, bool update, A* __restrict__ inv,
              A (&ca)[VEC], A (&cm)[VEC], A (&cb)[VEC]) {
  static_assert(ROWS == PART_ROWS, "train_columns: the GEMM's partial statistics are PART_ROWS rows per tile");
  static_assert(VEC >= 1 && 8 % VEC == 0, "train_columns: VEC divides 8");
  constexpr int BATCH = 8 / VEC;  // tiles whose loads are issued together: 32 loads in flight
  A cnt = 0, mean[VEC], m2[VEC], lo[VEC], hi[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) { mean[e] = m2[e] = 0; lo[e] = infinity<A>(); hi[e] = -infinity<A>(); }
  for (int t0 = 0; t0 < mtiles; t0 += BATCH) {
    A p[BATCH][4][VEC];  // (mean, M2, min, max) of BATCH tiles: their loads in flight together
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const long long row = (long long)PART_ROWS * min(t0 + i, mtiles - 1) * N + col;
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[i][r][e] = part[row + r * N + e];
    }
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      if (t0 + i >= mtiles) break;
      const A nb = (A)min(bm, M - (t0 + i) * bm);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {  // (chan_merge, the count kept once for the VEC columns)
        A n = cnt;
        chan_merge(n, mean[e], m2[e], nb, p[i][0][e], p[i][1][e]);
        lo[e] = fmin(lo[e], p[i][2][e]);
        hi[e] = fmax(hi[e], p[i][3][e]);
      }
      cnt += nb;
    }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const int n = col + e;
    const A s = to_acc(scale[n]), b = opt(bias, n, (A)0);
    const A y_lo = to_acc(from_acc<T>(s * to_acc(from_acc<T>(lo[e] + b))));
    const A y_hi = to_acc(from_acc<T>(s * to_acc(from_acc<T>(hi[e] + b))));
    const bool up = y_lo == infinity<A>() || y_hi == infinity<A>();
    const bool down = y_lo == -infinity<A>() || y_hi == -infinity<A>();
    A var = m2[e] / (A)M, mean_y = s * (mean[e] + b);
    if (up || down) {
      var = quiet_nan<A>();
      mean_y = up && down ? quiet_nan<A>() : (up ? infinity<A>() : -infinity<A>());
    }
    const A iv = (A)1 / sqrt(s * s * var + (A)eps);  // 1 / std of y
    ca[e] = opt(gamma, n, (A)1) * s * iv;
    cm[e] = mean[e];
    cb[e] = opt(beta, n, (A)0);
    if (!update) continue;
    if (inv) inv[n] = iv;  // saved for the backward
    if (rmean) {
      const A f = isnan(factor) ? (A)1 / (A)(nbt[0] + 1) : (A)factor;
      const A var_y = s * s * var * (A)M / (A)(M - 1);
      rmean[n] = from_acc<T>(((A)1 - f) * to_acc(rmean[n]) + f * mean_y);
      rvar[n] = from_acc<T>(((A)1 - f) * to_acc(rvar[n]) + f * var_y);
    }
  }
}

// The coefficients of every column (train_columns), for bn_apply.
// One thread per column n: grid cdiv(N, THREADS), block THREADS.
template <typename T, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_train_coef(const typename acc_of<T>::type* __restrict__ part, int mtiles, int bm,
              int M, int N, const T* __restrict__ bias, const T* __restrict__ scale,
              const T* __restrict__ gamma, const T* __restrict__ beta,
              T* __restrict__ rmean, T* __restrict__ rvar,
              const long long* __restrict__ nbt, double factor, double eps,
              typename acc_of<T>::type* __restrict__ ca,
              typename acc_of<T>::type* __restrict__ cm,
              typename acc_of<T>::type* __restrict__ cb,
              typename acc_of<T>::type* __restrict__ inv) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_train_coef: THREADS must be whole warps, at most 1024");
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  typedef typename acc_of<T>::type A;
  A a[1], m[1], b[1];
  train_columns<T, ROWS, 1>(n, part, mtiles, bm, M, N, bias, scale, gamma, beta, rmean, rvar, nbt,
                            factor, eps, true, inv, a, m, b);
  ca[n] = a[0]; cm[n] = m[0]; cb[n] = b[0];
}

// Eval: out = g*(s*(z + b) - rm)/sqrt(rv + eps) + beta = ca*z + cb, for the GEMM's
// epilogue, or for bn_apply with cm = 0 (cm and inv = 1/sqrt(rv + eps) not null: where
// the backward keeps z and the coefficients).
// One thread per column n: grid cdiv(N, THREADS), block THREADS.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
bn_eval_coef(int N, const T* __restrict__ bias, const T* __restrict__ scale,
             const T* __restrict__ gamma, const T* __restrict__ beta,
             const T* __restrict__ rmean, const T* __restrict__ rvar, double eps,
             typename acc_of<T>::type* __restrict__ ca, typename acc_of<T>::type* __restrict__ cm,
             typename acc_of<T>::type* __restrict__ cb, typename acc_of<T>::type* __restrict__ inv) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_eval_coef: THREADS must be whole warps, at most 1024");
  typedef typename acc_of<T>::type A;
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const A iv = (A)1 / sqrt(to_acc(rvar[n]) + (A)eps), gi = opt(gamma, n, (A)1) * iv, s = to_acc(scale[n]);
  ca[n] = gi * s;
  if (cm) cm[n] = 0;
  if (inv) inv[n] = iv;
  cb[n] = opt(beta, n, (A)0) + gi * (s * opt(bias, n, (A)0) - to_acc(rmean[n]));
}

// out = ca*(z - cm) + cb for VEC consecutive columns from col, rows [r0, r1) of (M, N)
// arrays with row stride ldz (out may be z: in place; it is a separate array where the
// backward keeps z), 16-byte vectors when VEC > 1, loading UNROLL rows before storing any
// (the stores may alias later loads for all the compiler knows, so without this each
// row would wait for the previous one's load).
template <typename T, int VEC, typename A = typename acc_of<T>::type>
__device__ __forceinline__ void
apply_rows(const T* z, T* out, long long ldz, int col, int r0, int r1,
           const A (&fa)[VEC], const A (&fm)[VEC], const A (&fb)[VEC]) {
  constexpr int UNROLL = 8;
  for (int r = r0; r < r1; r += UNROLL) {
    Vec16<T> v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (r + u >= r1) break;
      const T* p = z + (long long)(r + u) * ldz + col;
      if (VEC > 1) v[u].u = *reinterpret_cast<const uint4*>(p);
      else v[u].e[0] = *p;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (r + u >= r1) break;
      T* p = out + (long long)(r + u) * ldz + col;
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[u].e[e] = from_acc<T>(fa[e] * (to_acc(v[u].e[e]) - fm[e]) + fb[e]);
      if (VEC > 1) *reinterpret_cast<uint4*>(p) = v[u].u;
      else *p = v[u].e[0];
    }
  }
}

// apply_rows with the coefficients of arrays ca, cm, cb, each thread owning VEC columns
// for ROWS rows. It also counts the batch: ++num_batches_tracked when nbt is not null,
// after bn_train_coef has read it (a launch of its own would cost a call of host time).
// Grid (cdiv(cdiv(N, VEC), THREADS), cdiv(M, ROWS)), block THREADS.
template <typename T, int VEC, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_apply(const T* z, T* out, long long ldz, int M, int N,
         const typename acc_of<T>::type* __restrict__ ca,
         const typename acc_of<T>::type* __restrict__ cm,
         const typename acc_of<T>::type* __restrict__ cb, long long* __restrict__ nbt) {
  static_assert(VEC == 1 || VEC == Vec16<T>::N, "bn_apply: VEC is 1 or one 16-byte vector of T");
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_apply: THREADS must be whole warps, at most 1024");
  static_assert(ROWS >= 1, "bn_apply: ROWS >= 1");
  typedef typename acc_of<T>::type A;
  if (nbt != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *nbt += 1;
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (col >= N) return;
  A fa[VEC], fm[VEC], fb[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) { fa[e] = ca[col + e]; fm[e] = cm[col + e]; fb[e] = cb[col + e]; }
  apply_rows<T, VEC>(z, out, ldz, col, blockIdx.y * ROWS, min(M, (blockIdx.y + 1) * ROWS), fa, fm, fb);
}

// bn_train_coef and bn_apply in one launch, for a batch of a few M-tiles (gemm_scale_batchnorm.py
// says how many: every row of blocks merges them all again) with a momentum (factor not
// nan: num_batches_tracked is only incremented, never read, so no launch need order the
// two). Every block computes its columns' coefficients; the first row of blocks writes
// them (ca, cm, cb, inv: the backward's) and updates the running stats.
// Grid and block as bn_apply's.
template <typename T, int VEC, int THREADS, int ROWS, int PROWS>
__global__ void __launch_bounds__(THREADS)
bn_train_apply(const T* z, T* out, long long ldz, int M, int N,
               const typename acc_of<T>::type* __restrict__ part, int mtiles, int bm,
               const T* __restrict__ bias, const T* __restrict__ scale,
               const T* __restrict__ gamma, const T* __restrict__ beta,
               T* __restrict__ rmean, T* __restrict__ rvar, long long* __restrict__ nbt,
               double factor, double eps,
               typename acc_of<T>::type* __restrict__ ca,
               typename acc_of<T>::type* __restrict__ cm,
               typename acc_of<T>::type* __restrict__ cb,
               typename acc_of<T>::type* __restrict__ inv) {
  static_assert(VEC == 1 || VEC == Vec16<T>::N, "bn_train_apply: VEC is 1 or one 16-byte vector of T");
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_train_apply: THREADS must be whole warps, at most 1024");
  static_assert(ROWS >= 1, "bn_train_apply: ROWS >= 1");
  typedef typename acc_of<T>::type A;
  if (nbt != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *nbt += 1;
  const int col = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
  if (col >= N) return;
  const bool first = blockIdx.y == 0;
  A fa[VEC], fm[VEC], fb[VEC];
  train_columns<T, PROWS, VEC>(col, part, mtiles, bm, M, N, bias, scale, gamma, beta, rmean, rvar,
                               nbt, factor, eps, first, inv, fa, fm, fb);
  if (first) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) { ca[col + e] = fa[e]; cm[col + e] = fm[e]; cb[col + e] = fb[e]; }
  }
  apply_rows<T, VEC>(z, out, ldz, col, blockIdx.y * ROWS, min(M, (blockIdx.y + 1) * ROWS), fa, fm, fb);
}

// ---- backward ---------------------------------------------------------------------------
// Training mode: with u = z - cm (cm: the batch mean of z), inv = 1/sqrt(var_y + eps),
// w = s*inv (so y-hat = w*u), S1 = sum_m g and S2 = sum_m g*u per column, the gradients are
//   d bn_bias = S1, d bn_weight = w*S2, d scale = gamma*eps*inv^3*S2 (= sum dy*(z + b):
//   sum dy is 0 and 1 - w^2 var_z = eps*inv^2), d gemm bias = sum dz = 0, and
//   dz = w*gamma*(g - S1/M - w^2*S2/M * u), which the two GEMMs take on.
// Eval mode (out = ca*z + cb, ca = c*s with c = gamma*inv, inv = 1/sqrt(running_var +
// eps)): with cm = 0, S2 = sum_m g*z, and S2b = S2 + b*S1,
//   d bn_bias = S1, d bn_weight = inv*(s*S2b - running_mean*S1), d scale = c*S2b,
//   d gemm bias = ca*S1, and dz = ca*g.

// Per (ROWS-row tile, column) partial S1, S2 into rows 2*tile, 2*tile + 1 of part (merged
// in tile order by bn_grad_coef: deterministic). g has row stride ldg, z is contiguous.
// Grid (cdiv(N, THREADS), cdiv(M, ROWS)), block THREADS; one thread per column.
template <typename T, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_grad_partials(const T* __restrict__ g, long long ldg, const T* __restrict__ z, int M, int N,
                 const typename acc_of<T>::type* __restrict__ cm,
                 typename acc_of<T>::type* __restrict__ part) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_grad_partials: THREADS must be whole warps, at most 1024");
  static_assert(ROWS % 8 == 0, "bn_grad_partials: ROWS is a multiple of the 8-row unroll");
  typedef typename acc_of<T>::type A;
  const int n = blockIdx.x * THREADS + threadIdx.x;
  if (n >= N) return;
  const A m = cm[n];
  A s1 = 0, s2 = 0;
  const int r0 = blockIdx.y * ROWS, r1 = min(M, r0 + ROWS);
  for (int r = r0; r < r1; r += 8) {
    A gv[8], zv[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {  // 16 loads in flight, then the sums in row order
      const bool ok = r + u < r1;
      gv[u] = ok ? to_acc(g[(long long)(r + u) * ldg + n]) : (A)0;
      zv[u] = ok ? to_acc(z[(long long)(r + u) * N + n]) : m;
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) { s1 += gv[u]; s2 += gv[u] * (zv[u] - m); }
  }
  part[2LL * blockIdx.y * N + n] = s1;
  part[(2LL * blockIdx.y + 1) * N + n] = s2;
}

// This thread's column n (one per thread: grid cdiv(N, THREADS), block THREADS) and its
// S1, S2 from bn_grad_partials' tiles, added in tile order (deterministic); false past
// the last column.
template <int THREADS, typename A>
__device__ __forceinline__ bool grad_column(const A* __restrict__ part, int tiles, int N, int& n,
                                            A& s1, A& s2) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "grad_column: THREADS must be whole warps, at most 1024");
  n = blockIdx.x * THREADS + threadIdx.x;
  if (n >= N) return false;
  s1 = 0;
  s2 = 0;
  for (int t = 0; t < tiles; ++t) {
    s1 += part[2LL * t * N + n];
    s2 += part[(2LL * t + 1) * N + n];
  }
  return true;
}

// Training mode: merge the partials, write the vector gradients (each pointer may be
// null: not wanted; d gemm bias is exactly 0) and dz's coefficients k = (w*gamma, S1/M,
// w^2*S2/M) in rows 0..2 (N apart).
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
bn_grad_coef(const typename acc_of<T>::type* __restrict__ part, int tiles, int M, int N,
             const T* __restrict__ scale, const T* __restrict__ gamma,
             const typename acc_of<T>::type* __restrict__ inv, double eps,
             T* __restrict__ dscale, T* __restrict__ dgamma, T* __restrict__ dbeta,
             T* __restrict__ dbias, typename acc_of<T>::type* __restrict__ k) {
  typedef typename acc_of<T>::type A;
  int n;
  A s1, s2;
  if (!grad_column<THREADS>(part, tiles, N, n, s1, s2)) return;
  const A iv = inv[n], gm = opt(gamma, n, (A)1), w = to_acc(scale[n]) * iv;
  if (dbeta) dbeta[n] = from_acc<T>(s1);
  if (dgamma) dgamma[n] = from_acc<T>(w * s2);
  if (dscale) dscale[n] = from_acc<T>(gm * (A)eps * iv * iv * iv * s2);
  if (dbias) dbias[n] = from_acc<T>((A)0);
  k[n] = w * gm;
  k[N + n] = s1 / (A)M;
  k[2LL * N + n] = w * w * s2 / (A)M;
}

// Eval mode: merge the partials (of S1 and S2 = sum g*z) and write the vector gradients
// (each pointer may be null), from the forward's ca and inv.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
bn_grad_eval_coef(const typename acc_of<T>::type* __restrict__ part, int tiles, int N,
                  const T* __restrict__ bias, const T* __restrict__ scale,
                  const T* __restrict__ gamma, const T* __restrict__ rmean,
                  const typename acc_of<T>::type* __restrict__ ca,
                  const typename acc_of<T>::type* __restrict__ inv,
                  T* __restrict__ dscale, T* __restrict__ dgamma, T* __restrict__ dbeta,
                  T* __restrict__ dbias) {
  typedef typename acc_of<T>::type A;
  int n;
  A s1, s2;
  if (!grad_column<THREADS>(part, tiles, N, n, s1, s2)) return;
  const A iv = inv[n], s2b = s2 + opt(bias, n, (A)0) * s1;
  if (dbeta) dbeta[n] = from_acc<T>(s1);
  if (dgamma) dgamma[n] = from_acc<T>(iv * (to_acc(scale[n]) * s2b - to_acc(rmean[n]) * s1));
  if (dscale) dscale[n] = from_acc<T>(opt(gamma, n, (A)1) * iv * s2b);
  if (dbias) dbias[n] = from_acc<T>(ca[n] * s1);
}

// dz = k0*(g - k1 - k2*(z - cm)) (z null: k0*(g - k1), k2 and cm unread) into a contiguous
// (M, N) dz and/or its transpose, a contiguous (N, M) dzt (either pointer may be null:
// not wanted); g has row stride ldg.
// dzt is what dW = dz^T @ x reads K-major (no transposed copy). Each CH-row chunk of the
// block's (ROWS x THREADS) tile is staged in shared memory, transposed, and written as
// THREADS runs of CH elements of dzt: whole 16-byte vectors where M keeps them aligned.
// Grid (cdiv(N, THREADS), cdiv(M, ROWS)), block THREADS; one thread per column.
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
  const int r0 = blockIdx.y * ROWS, r1 = min(M, r0 + ROWS);
  const bool vec = ((long long)M * sizeof(T)) % 16 == 0;  // (chunks start 16-byte aligned)
  for (int c = r0; c < r1; c += CH) {
    const int len = min(CH, r1 - c);
    for (int r = c; col && r < c + len; r += 8) {
      A gv[8], zv[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const bool ok = r + u < r1;
        gv[u] = ok ? to_acc(g[(long long)(r + u) * ldg + n]) : (A)0;
        zv[u] = ok && z ? to_acc(z[(long long)(r + u) * N + n]) : m;  // (z null: no term)
      }
      union { T t[8]; uint4 v[8 * sizeof(T) / 16]; } d;
#pragma unroll
      for (int u = 0; u < 8; ++u) d.t[u] = from_acc<T>(k0 * (gv[u] - k1 - k2 * (zv[u] - m)));
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
