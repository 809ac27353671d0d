// BatchNorm of y = s * (z + b), z = x @ W^T, as out = ca[n] * (z - cm[n]) + cb[n] (training)
// or out = ca[n] * z + cc[n] (eval, fused into the GEMM epilogue). Training subtracts the
// batch mean before scaling: folding it into cc would cancel catastrophically when the
// column's mean is large against its spread (tiny batches, offset data).
// T: parameter/buffer dtype; A: accumulation type (acc_of<T>). Any pointer among
// bias, gamma (bn weight), beta (bn bias) may be null (0, 1, 0).
#include "common.cuh"
#include "stats.cuh"

// Training: merge the GEMM's per-M-tile (mean, M2, min, max) partials of z (Chan, in a
// fixed order: deterministic) into the coefficients (ca, cm, cb) of the VEC columns from
// col; with ``update``,
// also keep iv = 1/sqrt(var_y + eps) for the backward (where inv is not null) and update
// the running stats like BatchNorm1d: mean/var of y = s*mean(z + b), s^2*var(z);
// running_var takes the unbiased var. The VEC columns' merge chains are independent and
// run side by side: a thread's latency is one column's, not VEC's (bn_train_apply gives a
// thread a 16-byte vector of 16-bit columns: eight chains one after the other took 23 us
// at 64x512 bf16 on an H200, against 3 us for the GEMM). Each column's arithmetic and
// order do not depend on VEC; bn_train_coef spreads a column's tiles over chunks of
// threads (see there).
// The reference forms y = s*(z + b) in T, rounding twice: where that overflows T in some
// row (checked at z's min and max, y being monotonic in z), its batch mean is +-inf (nan
// if both signs overflow) and its variance nan, so every output of the column is nan.
// factor nan means momentum=None: cumulative average 1/(num_batches_tracked + 1)
// (incremented by bn_apply, launched after bn_train_coef has read it).

// The running merge of VEC columns: count (shared) and each column's mean, M2, min, max.
template <typename A, int VEC>
struct ColumnMoments {
  A cnt, mean[VEC], m2[VEC], lo[VEC], hi[VEC];
  __device__ __forceinline__ void clear() {
    cnt = 0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) { mean[e] = m2[e] = 0; lo[e] = infinity<A>(); hi[e] = -infinity<A>(); }
  }
  // Chan: merge b's moments into these (the count is kept once for the VEC columns).
  __device__ __forceinline__ void merge(A nb, const A (&mb)[VEC], const A (&m2b)[VEC],
                                        const A (&lob)[VEC], const A (&hib)[VEC]) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      A n = cnt;
      chan_merge(n, mean[e], m2[e], nb, mb[e], m2b[e]);
      lo[e] = fmin(lo[e], lob[e]);
      hi[e] = fmax(hi[e], hib[e]);
    }
    cnt += nb;
  }
  __device__ __forceinline__ void merge(const ColumnMoments& b) { merge(b.cnt, b.mean, b.m2, b.lo, b.hi); }
};

// Merge the GEMM's per-M-tile partials of tiles [t0, t1) of the VEC columns from col into
// ``m``, in tile order.
template <int ROWS, int VEC, typename A>
__device__ __forceinline__ void
merge_tiles(int col, const A* __restrict__ part, int t0, int t1, int bm, int M, int N,
            ColumnMoments<A, VEC>& m) {
  static_assert(ROWS == PART_ROWS, "merge_tiles: the GEMM's partial statistics are PART_ROWS rows per tile");
  static_assert(VEC >= 1 && 8 % VEC == 0, "merge_tiles: VEC divides 8");
  constexpr int BATCH = 8 / VEC;  // tiles whose loads are issued together: 32 loads in flight
  for (int tb = t0; tb < t1; tb += BATCH) {
    A p[BATCH][4][VEC];  // (mean, M2, min, max) of BATCH tiles: their loads in flight together
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      const long long row = (long long)PART_ROWS * min(tb + i, t1 - 1) * N + col;
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[i][r][e] = part[row + r * N + e];
    }
#pragma unroll
    for (int i = 0; i < BATCH; ++i) {
      if (tb + i >= t1) break;
      m.merge((A)min(bm, M - (tb + i) * bm), p[i][0], p[i][1], p[i][2], p[i][3]);
    }
  }
}

// The coefficients (ca, cm, cb) of the VEC columns from col, from their merged moments m
// of all M rows (see "Training" above).
template <typename T, int VEC, typename A = typename acc_of<T>::type>
__device__ __forceinline__ void
train_coefs(int col, const ColumnMoments<A, VEC>& m, int M, const T* __restrict__ bias,
            const T* __restrict__ scale, const T* __restrict__ gamma, const T* __restrict__ beta,
            T* __restrict__ rmean, T* __restrict__ rvar, const long long* __restrict__ nbt,
            double factor, double eps, bool update, A* __restrict__ inv,
            A (&ca)[VEC], A (&cm)[VEC], A (&cb)[VEC]) {
  const A (&mean)[VEC] = m.mean;
  const A (&m2)[VEC] = m.m2;
  const A (&lo)[VEC] = m.lo;
  const A (&hi)[VEC] = m.hi;
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
    // (s * (s * var): s * s alone underflows from |s| = 1e-19 where y's variance does not)
    const A iv = (A)1 / sqrt(s * (s * var) + (A)eps);  // 1 / std of y
    ca[e] = opt(gamma, n, (A)1) * s * iv;
    cm[e] = mean[e];
    cb[e] = opt(beta, n, (A)0);
    if (!update) continue;
    if (inv) inv[n] = iv;  // saved for the backward
    if (rmean) {
      const A f = isnan(factor) ? (A)1 / (A)(nbt[0] + 1) : (A)factor;
      const A var_y = s * (s * var) * (A)M / (A)(M - 1);
      rmean[n] = from_acc<T>(((A)1 - f) * to_acc(rmean[n]) + f * mean_y);
      rvar[n] = from_acc<T>(((A)1 - f) * to_acc(rvar[n]) + f * var_y);
    }
  }
}

// The coefficients of every column, for bn_apply: a column's tiles merged in chunks of
// threads (ColumnChunk; one chunk merges them all in tile order). One thread per column
// merging every tile took 51.4 us of a 65.5 us forward at 16465x126->14 float32 (515
// tiles) on an H200.
// Grid cdiv(N, THREADS / chunks), block THREADS.
template <typename T, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_train_coef(const typename acc_of<T>::type* __restrict__ part, int mtiles, int chunks, int bm,
              int M, int N, const T* __restrict__ bias, const T* __restrict__ scale,
              const T* __restrict__ gamma, const T* __restrict__ beta,
              T* __restrict__ rmean, T* __restrict__ rvar,
              const long long* __restrict__ nbt, double factor, double eps,
              typename acc_of<T>::type* __restrict__ ca,
              typename acc_of<T>::type* __restrict__ cm,
              typename acc_of<T>::type* __restrict__ cb,
              typename acc_of<T>::type* __restrict__ inv) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_train_coef: THREADS must be whole warps, at most 1024");
  typedef typename acc_of<T>::type A;
  __shared__ ColumnMoments<A, 1> shared[THREADS];
  const ColumnChunk ch(THREADS, chunks, mtiles);
  ColumnMoments<A, 1> m;
  m.clear();
  if (ch.n < N) merge_tiles<ROWS, 1>(ch.n, part, ch.t0, ch.t1, bm, M, N, m);
  if (!combine_chunks<THREADS>(m, shared, chunks) || ch.n >= N) return;
  A a[1], mm[1], b[1];
  train_coefs<T, 1>(ch.n, m, M, bias, scale, gamma, beta, rmean, rvar, nbt, factor, eps, true, inv, a, mm, b);
  ca[ch.n] = a[0]; cm[ch.n] = mm[0]; cb[ch.n] = b[0];
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

// Rows a thread of a row pass loads before it uses any (bn_apply, bn_train_apply:
// stores may alias later loads; bn_column_stats: a two-pass group).
constexpr int ROW_UNROLL = 8;

// out = ca*(z - cm) + cb for VEC consecutive columns from col, rows r0, r0 + step, ...
// below r1 of (M, N) arrays with row stride ldz (out may be z: in place; it is a separate
// array where the backward keeps z), 16-byte vectors when VEC > 1, loading ROW_UNROLL
// rows before storing any (the stores may alias later loads for all the compiler knows,
// so without this each row would wait for the previous one's load).
template <typename T, int VEC, typename A = typename acc_of<T>::type>
__device__ __forceinline__ void
apply_rows(const T* z, T* out, long long ldz, int col, unsigned r0, unsigned r1, unsigned step,
           const A (&fa)[VEC], const A (&fm)[VEC], const A (&fb)[VEC]) {
  for (unsigned r = r0; r < r1; r += ROW_UNROLL * step) {  // (unsigned: RowSpot)
    Vec16<T> v[ROW_UNROLL];
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; ++u) {
      if (r + u * step >= r1) break;
      const T* p = z + (long long)(r + u * step) * ldz + col;
      if (VEC > 1) v[u].u = *reinterpret_cast<const uint4*>(p);
      else v[u].e[0] = *p;
    }
#pragma unroll
    for (int u = 0; u < ROW_UNROLL; ++u) {
      if (r + u * step >= r1) break;
      T* p = out + (long long)(r + u * step) * ldz + col;
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[u].e[e] = from_acc<T>(fa[e] * (to_acc(v[u].e[e]) - fm[e]) + fb[e]);
      if (VEC > 1) *reinterpret_cast<uint4*>(p) = v[u].u;
      else *p = v[u].e[0];
    }
  }
}

// The per-tile column statistics of a C-contiguous (M, N) z made elsewhere (the vendor's
// product), in part's rows as the GEMM epilogue leaves them (mean, M2, min, max: stats.cuh),
// for bn_train_coef / bn_train_apply. A tile is RowSpot's (grid and block as
// bn_apply's); each thread merges its rows in groups of ROW_UNROLL (local_stats, two
// passes over the group in registers, then Chan), and the block's lanes then merge in a
// fixed tree (combine_chunks): deterministic. z is read as stored in T, as the GEMM's
// epilogue rounds its sums. (min and max skip nan: it reaches the mean anyway.)
template <typename T, int VEC, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_column_stats(const T* __restrict__ z, int M, int N, int lanes,
                typename acc_of<T>::type* __restrict__ part) {
  static_assert(VEC == 1 || VEC == Vec16<T>::N, "bn_column_stats: VEC is 1 or one 16-byte vector of T");
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_column_stats: THREADS must be whole warps, at most 1024");
  typedef typename acc_of<T>::type A;
  __shared__ ColumnMoments<A, VEC> shared[THREADS];
  const RowSpot<THREADS, ROWS, VEC> at(lanes, M);
  for (int t = blockIdx.y; t < at.tiles; t += gridDim.y) {  // (uniform: combine_chunks syncs)
    ColumnMoments<A, VEC> m;
    m.clear();
    for (unsigned r = at.r0(t), r1 = at.r1(t); at.col < N && r < r1; r += ROW_UNROLL * lanes) {
      A v[VEC][ROW_UNROLL], cnt, mean[VEC], m2[VEC], lo[VEC], hi[VEC];
      bool valid[ROW_UNROLL];
#pragma unroll
      for (int u = 0; u < ROW_UNROLL; ++u) {
        Vec16<T> x;
        valid[u] = r + u * lanes < r1;
        const T* p = z + (long long)(r + u * lanes) * N + at.col;
        if (valid[u] && VEC > 1) x.u = *reinterpret_cast<const uint4*>(p);
        else if (valid[u]) x.e[0] = *p;
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[e][u] = valid[u] ? to_acc(x.e[e]) : (A)0;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        local_stats(v[e], valid, cnt, mean[e], m2[e]);
        local_range(v[e], valid, lo[e], hi[e]);
      }
      m.merge(cnt, mean, m2, lo, hi);
    }
    if (combine_chunks<THREADS>(m, shared, lanes) && at.col < N) {
      A* row = part + (long long)PART_ROWS * t * N + at.col;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        row[e] = m.mean[e];
        row[N + e] = m.m2[e];
        row[2 * N + e] = m.lo[e];
        row[3 * N + e] = m.hi[e];
      }
    }
  }
}

// apply_rows with the coefficients of arrays ca, cm, cb, each thread owning VEC columns
// for ROWS rows (RowSpot). It also counts the batch: ++num_batches_tracked when nbt is
// not null, after bn_train_coef has read it (a launch of its own would cost a call of host
// time). Grid and block: RowSpot's.
template <typename T, int VEC, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS)
bn_apply(const T* z, T* out, long long ldz, int M, int N, int lanes,
         const typename acc_of<T>::type* __restrict__ ca,
         const typename acc_of<T>::type* __restrict__ cm,
         const typename acc_of<T>::type* __restrict__ cb, long long* __restrict__ nbt) {
  static_assert(VEC == 1 || VEC == Vec16<T>::N, "bn_apply: VEC is 1 or one 16-byte vector of T");
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "bn_apply: THREADS must be whole warps, at most 1024");
  static_assert(ROWS >= 1, "bn_apply: ROWS >= 1");
  typedef typename acc_of<T>::type A;
  if (nbt != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *nbt += 1;
  const RowSpot<THREADS, ROWS, VEC> at(lanes, M);
  if (at.col >= N) return;
  A fa[VEC], fm[VEC], fb[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) { fa[e] = ca[at.col + e]; fm[e] = cm[at.col + e]; fb[e] = cb[at.col + e]; }
  for (int t = blockIdx.y; t < at.tiles; t += gridDim.y)
    apply_rows<T, VEC>(z, out, ldz, at.col, at.r0(t), at.r1(t), lanes, fa, fm, fb);
}

// bn_train_coef and bn_apply in one launch, for a batch of a few M-tiles (gemm_scale_batchnorm.py
// says how many: every row of blocks merges them all again) with a momentum (factor not
// nan: num_batches_tracked is only incremented, never read, so no launch need order the
// two). Every block computes its columns' coefficients; the first row of blocks writes
// them (ca, cm, cb, inv: the backward's) and updates the running stats (its first lane
// of rows: one thread per column). Grid and block as bn_apply's.
template <typename T, int VEC, int THREADS, int ROWS, int PROWS>
__global__ void __launch_bounds__(THREADS)
bn_train_apply(const T* z, T* out, long long ldz, int M, int N, int lanes,
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
  const RowSpot<THREADS, ROWS, VEC> at(lanes, M);
  const int col = at.col;
  if (col >= N) return;
  const bool first = blockIdx.y == 0 && at.lane == 0;
  ColumnMoments<A, VEC> m;
  m.clear();
  merge_tiles<PROWS, VEC>(col, part, 0, mtiles, bm, M, N, m);
  A fa[VEC], fm[VEC], fb[VEC];
  train_coefs<T, VEC>(col, m, M, bias, scale, gamma, beta, rmean, rvar, nbt, factor, eps, first,
                      inv, fa, fm, fb);
  if (first) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) { ca[col + e] = fa[e]; cm[col + e] = fm[e]; cb[col + e] = fb[e]; }
  }
  for (int t = blockIdx.y; t < at.tiles; t += gridDim.y)
    apply_rows<T, VEC>(z, out, ldz, col, at.r0(t), at.r1(t), lanes, fa, fm, fb);
}
